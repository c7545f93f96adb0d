"""4-bit weights (fp4 e2m1, int4) upcast in registers on Hopper, shared by the Mosaic matmul
kernels, read as 16-bit words of four codes as XLA packs them (code 4j + i in nibble i of
word j): each nibble becomes a bf16 with integer ops, already in wgmma's A layout.

- A piece of P K elements is [rows, P / 4] words; nibble i's [rows, P / 4] array is
  wgmma's A for the piece's elements 4c + i, so x is passed permuted to match
  (`x_word_blocks`: [K / W, M, W] for W = P / 4 words a piece, block 4 p + i holding
  piece p's columns 4c + i).
- A word's four codes share a group (groups are multiples of 4), so one scale array a
  piece serves all four nibbles: the piece's groups selected by word column
  (`group_scales`).
- fp4 (Hopper has no e2m1 conversion; Mosaic's are Blackwell-only): the code's sign (its
  bit 3) goes to bit 15 and (e1 e0 m) to bits 8..6, which reads as the code's value *
  2^-126 exactly (e2m1's 0.5 lands on a bf16 subnormal). The scales carry 2^SCALE_EXP, so
  that the bf16 products stay normal for any scale in (2^-117, 2^9) (both formats' scales
  are exact in bf16), and the sums take the remaining 2^SUM_EXP.
- int4 (two's complement): the code xor 8 as the low mantissa bits of 128.0 (bf16
  0x4300, whose mantissa step is 1) is 136 + v; subtracting 136 leaves v exactly.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

PER_WORD = 4  # 4-bit codes per 16-bit word
PIECE = 64  # fp4's K elements per piece: 16 words a row, one k16 wgmma per nibble
WORDS = PIECE // PER_WORD
SCALE_EXP = 118  # folded into the fp4 group scales
SUM_EXP = 126 - SCALE_EXP  # what fp4's partial sums are multiplied by


def words(values: jax.Array) -> jax.Array:
    """4-bit values [..., K] -> uint16 words [..., K / 4] (XLA's packing: no data moves)."""
    *lead, k = values.shape
    return lax.bitcast_convert_type(values.reshape(*lead, k // PER_WORD, PER_WORD), jnp.uint16)


def x_word_blocks(x: jax.Array, piece: int = PIECE) -> jax.Array:
    """x [M, K] -> [K / W, M, W], W = piece / 4: block 4 p + i holds piece p's columns
    4c + i."""
    m, k = x.shape
    w = piece // PER_WORD
    return x.reshape(m, k // piece, w, PER_WORD).transpose(1, 3, 0, 2).reshape(k // w, m, w)


def group_scales(load_scale, groups: int, shape: tuple[int, int], exp: int = SCALE_EXP,
                 layout=plgpu.Layout.WGMMA) -> jax.Array:
    """The bf16 scale array [rows, W] of a piece holding `groups` groups, in `layout` (the
    words' own): load_scale(j) -> group j's float32 scales [rows] (in layout.reduce(1)),
    times 2^exp, each over its word columns."""
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
    words_per_group = shape[1] // groups
    out = None
    for j in reversed(range(groups)):
        s = load_scale(j)
        s = (s * jnp.float32(2.0 ** exp) if exp else s).astype(jnp.bfloat16)
        s = lax.broadcast_in_dim(s, shape, [0])
        out = s if out is None else jnp.where(cols < (j + 1) * words_per_group, s, out)
    return out


def _shift(v, n: int):
    """v << n (n > 0) or v >> -n (logical)."""
    return v << n if n > 0 else (v >> -n if n < 0 else v)


def nibble_weights(word_array, i: int, scales, interpret: bool):
    """fp4: nibble i of uint16 words [rows, W] times `scales` (bf16, from `group_scales`)
    -> bf16 weights * 2^-SUM_EXP (the GPU multiplies the subnormal exactly)."""
    sign = _shift(word_array, 12 - 4 * i) & jnp.uint16(0x8000)
    rest = _shift(word_array, 6 - 4 * i) & jnp.uint16(0x01C0)
    bits = lax.bitcast_convert_type(sign | rest, jnp.bfloat16)
    if not interpret:
        return bits * scales
    # XLA:CPU flushes subnormal operands to zero: the host takes e2m1's subnormals (0 and
    # 0.5, exponent bits 0) from the mantissa bit itself.
    half = jnp.where(sign > 0, -0.5, 0.5) * (rest >> 6).astype(jnp.float32)
    value = jnp.where(rest >= 0x0080, bits.astype(jnp.float32) * jnp.float32(2.0 ** 126), half)
    return (value * scales.astype(jnp.float32) * jnp.float32(2.0 ** -126)).astype(jnp.bfloat16)


def int4_nibble_weights(word_array, i: int, scales=None):
    """int4: nibble i of uint16 words [rows, W] -> bf16 values (times `scales`, bf16 from
    `group_scales(..., exp=0)`, if given)."""
    code = _shift(word_array, -4 * i) & jnp.uint16(0x000F)
    biased = lax.bitcast_convert_type((code ^ jnp.uint16(0x0008)) | jnp.uint16(0x4300),
                                      jnp.bfloat16)
    w = biased - jnp.bfloat16(136)
    return w if scales is None else w * scales
