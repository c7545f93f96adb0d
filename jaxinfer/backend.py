"""Which implementation of a kernel op runs here: the one place the op dispatchers ask.

Every op with kernels (`jaxinfer.attention.ragged_paged_attention`,
`jaxinfer.quantized_matmul.quantized_matmul`) has the same three implementations:
a pure-JAX reference, a Pallas TPU kernel and a Hopper Mosaic GPU kernel. Off
their hardware the kernels run in interpret mode (tests), with the parameters
below. Attention also has its Pallas kernel's GPU (Triton) lowering, which its
dispatcher picks on Hopper for one-token steps (`jaxinfer.attention`).
"""

from __future__ import annotations

import jax

IMPLEMENTATIONS = ("reference", "pallas_tpu", "mosaic_gpu")


def default_implementation(platform: str | None = None) -> str:
    """The implementation ops use on a platform (default: jax's default backend).

    The Mosaic GPU kernels are built on Hopper's wgmma (sm_90); other GPUs (older ones,
    and Blackwell, whose tensor cores use tcgen05) and the CPU use the reference.
    """
    platform = platform or jax.default_backend()
    if platform == "tpu":
        return "pallas_tpu"
    if platform in ("gpu", "cuda"):
        cc = str(getattr(jax.devices("gpu")[0], "compute_capability", "0"))
        if cc.split(".")[0] == "9":
            return "mosaic_gpu"
    return "reference"


def mosaic_interpret_params():
    """Mosaic GPU interpret mode when there is no GPU (CPU tests); None compiles."""
    if jax.default_backend() == "gpu":
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def tpu_interpret_params():
    """Pallas TPU interpret mode (TPU semantics: DMAs, semaphores) off TPU; False compiles."""
    if jax.default_backend() == "tpu":
        return False
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.InterpretParams()
