"""Which hardware this process runs on, and the interpret modes kernels use off it.

The op registries (`jaxinfer.ops.*_registry`) ask `platform()` in their implementations'
`supports` predicates; kernels ask for their interpret parameters, so that on the CPU
(tests) they run in interpret mode with the semantics of their hardware.
"""

from __future__ import annotations

import functools

import jax


@functools.cache
def platform() -> str:
    """"hopper" (NVIDIA sm_90: what the Mosaic GPU kernels are built for, on wgmma), "gpu"
    (other NVIDIA GPUs: older ones, and Blackwell, whose tensor cores use tcgen05), "tpu" or
    "cpu", for jax's default backend."""
    backend = jax.default_backend()
    if backend == "tpu":
        return "tpu"
    if backend in ("gpu", "cuda"):
        cc = str(getattr(jax.devices("gpu")[0], "compute_capability", "0"))
        return "hopper" if cc.split(".")[0] == "9" else "gpu"
    return "cpu"


def needs(kind: str) -> str | None:
    """For `supports` predicates: None on platform `kind`, else why not."""
    here = platform()
    return None if here == kind else f"needs {kind}, this is {here}"


def gpu_sm_count(default: int) -> int:
    """The GPU's SM count, for kernels that size a grid to it; `default` where there is no
    GPU (interpret mode) or it does not say."""
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or default) if dev.platform == "gpu" else default


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

