"""`jaxinfer.ops.linear` against a float64 oracle: the dot (several rows, or one row of few
features) and the one-row multiply-reduce, with a bias and a folded norm's row scale."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops.linear import ONE_ROW_REDUCE_MIN_K, linear


@pytest.mark.parametrize("rows,k", [(1, ONE_ROW_REDUCE_MIN_K + 64), (1, 576), (3, 1088)])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "bias+row_scale"])
def test_linear_matches_oracle(rows, k, extras):
    rng = np.random.default_rng()
    n = 96
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32)  # cast to bf16 inside
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32) if extras else None
    scale = jnp.asarray(np.exp(rng.standard_normal((rows, 1))), jnp.float32) if extras \
        else None
    y = jax.jit(linear)(x, w, bias, scale)
    assert y.dtype == jnp.bfloat16 and y.shape == (rows, n)
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(w.astype(jnp.bfloat16), np.float64)
    want = x64 @ w64.T
    mag = np.abs(x64) @ np.abs(w64).T
    if extras:
        want = want * np.asarray(scale, np.float64) + np.asarray(bias, np.float64)
        mag = mag * np.asarray(scale, np.float64) + np.abs(np.asarray(bias, np.float64))
    # float32 accumulation, at most two bf16 roundings (the product, then the output)
    allowance = 2 * 2.0 ** -8 * mag + 1e-6
    np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - want), allowance)
    # The one-row form is the multiply-reduce; every other product is a dot.
    jaxpr = str(jax.make_jaxpr(linear)(x, w))
    assert ("dot_general" in jaxpr) == (rows > 1 or k < ONE_ROW_REDUCE_MIN_K)
