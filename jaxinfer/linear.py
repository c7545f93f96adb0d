"""The one linear-layer entry point: y = x @ W^T (+ b).

Weights are stored (N, K) = (out_features, in_features), K-major: the layout of
HF checkpoints, and the one 8-bit tensor-core operands need (they cannot be
transposed on the fly). The quantized-weight kernels plug in here.
"""

import jax
import jax.numpy as jnp


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ weight [N, K]^T -> [..., N] in x.dtype (f32 accumulation)."""
    y = jax.lax.dot_general(
        x, weight.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
