"""4-bit weights (fp4 e2m1, int4) upcast in registers on Hopper, shared by the Mosaic matmul
kernels, read as words of codes as XLA packs them: 32-bit words of eight in mma.sync's
operand layout (int4 and fp4, `words32_mma`, below), or 16-bit words of four (fp4 under
wgmma: code 4j + i in nibble i of word j), each nibble a bf16 made with integer ops,
already in wgmma's A layout.

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
- int4 (two's complement; 32-bit words only): the code xor 8 as the low mantissa bits of
  128.0 (bf16 0x4300, whose mantissa step is 1) is 136 + v; subtracting 136 leaves v
  exactly.
- 32-bit words: two codes a 32-bit op, the same bit moves on both halves of a register.
"""

from __future__ import annotations

import jax
import jax.experimental.mosaic.gpu as mgpu
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, vector

from jaxinfer.ops.quant import chunk_order

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
                 layout=plgpu.Layout.WGMMA, dtype=jnp.bfloat16) -> jax.Array:
    """The scale array [rows, W] (dtype) of a piece holding `groups` groups, in `layout`
    (the words' own): load_scale(j) -> group j's float32 scales [rows] (in
    layout.reduce(1)), times 2^exp, each over its word columns."""
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
    words_per_group = shape[1] // groups
    out = None
    for j in reversed(range(groups)):
        s = load_scale(j)
        s = (s * jnp.float32(2.0 ** exp) if exp else s).astype(dtype)
        # (the cast names the broadcast's layout where no consumer hints it)
        s = plgpu.layout_cast(lax.broadcast_in_dim(s, shape, [0]), layout)
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


# --- 4-bit codes as 32-bit words in mma.sync's operand layout ------------------------------
#
# A [64, 8] tile of uint32 words (eight codes each, code 8c + i in nibble i of word c) loaded
# in MMA_LHS(uint32) gives a thread the words (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4):
# the four registers of an m16n8k16 bf16 A operand sit at the same rows and column halves.
# A shift and a mask bring nibbles (j, j + 4) of a word to the low bits of its two 16-bit
# halves, so chunk j of a tile takes pair j of each of the four words, two codes an
# instruction: no relayout, no 16-bit packing. Chunk j's column L = 8h + 2t + e is word
# column t + 4h, nibble j + 4e: K element 32h + 8t + 4e + j of the tile, and x is permuted
# to match (`chunk_order`), or int4 weights are stored in that order at load
# (`QuantizedWeight.k_order`) and x is not. int4 pairs become bf16 by CUTLASS's bias trick
# (above, on both halves); fp4 pairs by moving the sign and (e1 e0 m) bits as above, then a
# bf16x2 multiply by the word's group scale (groups hold whole words: 8 divides 16 and 32).
WORD32_CODES = 8  # codes per 32-bit word
WORD32_TILE = 64  # K elements per [64, 8]-word tile: four k16 chunks


def takes_words32(kind: str, x_dtype, piece: int) -> bool:
    """Whether weights of this kind ('int4', 'fp4', ...), against x of x_dtype, in pieces of
    `piece` K elements, can be read as 32-bit words (`words32_mma`): 4-bit codes, bf16 x
    (the pairs are made as bf16), pieces of whole [64, 8]-word tiles."""
    return kind in ("int4", "fp4") and x_dtype == jnp.bfloat16 and piece % WORD32_TILE == 0


def words32(values: jax.Array) -> jax.Array:
    """4-bit values [..., K] -> uint32 words [..., K / 8] (XLA's packing: no data moves)."""
    *lead, k = values.shape
    return lax.bitcast_convert_type(values.reshape(*lead, k // WORD32_CODES, WORD32_CODES),
                                    jnp.uint32)


def _codes_as_values(words, fp4: bool):
    """uint32 words [rows, W] -> float32 values [rows, 8 W] in K order (interpret mode)."""
    codes = jnp.stack([(words >> (4 * i)) & 0xF for i in range(WORD32_CODES)], axis=-1)
    codes = codes.astype(jnp.int32).reshape(words.shape[0], -1)
    if not fp4:
        return ((codes ^ 8) - 8).astype(jnp.float32)
    e = (codes >> 1) & 3
    magnitude = jnp.where(e == 0, 0.5 * (codes & 1),
                          (1.0 + 0.5 * (codes & 1)) * jnp.exp2((e - 1).astype(jnp.float32)))
    return jnp.where(codes & 8, -magnitude, magnitude).astype(jnp.float32)


def words32_mma(acc, words, x_tiles, interpret: bool, scales=None):
    """acc [64, n] float32 + (4-bit words [64, P / 8] uint32) @ x_tiles^T -> acc, where
    x_tiles is [P, n] bf16 (x's piece, permuted by `chunk_order`, transposed) in MMA_RHS.
    scales None: int4 codes; else fp4 codes and each word's group scale times 2^SCALE_EXP
    (float32 [64, P / 8], in MMA_LHS(float32) like the words), the products then carrying
    2^-SUM_EXP. On the GPU words come in MMA_LHS(uint32) and acc in MMA_ACC (bf16's).
    Interpret mode (no inline_mgpu there) decodes the codes in the chunks' order and takes
    a dot."""
    rows, num_words = words.shape
    fp4 = scales is not None
    if interpret:
        values = _codes_as_values(words, fp4)
        if fp4:
            per_code = jnp.repeat(scales.astype(jnp.bfloat16).astype(jnp.float32),
                                  WORD32_CODES, axis=1)
            values = values * per_code * jnp.float32(2.0 ** -126)
        return acc + jnp.dot(chunk_order(values), x_tiles.astype(jnp.float32))
    bf16_lhs = plgpu.Layout.MMA_LHS(jnp.bfloat16)
    arg_types = (plgpu.Layout.MMA_ACC(jnp.bfloat16), plgpu.Layout.MMA_LHS(jnp.uint32),
                 plgpu.Layout.MMA_RHS(jnp.bfloat16))
    if fp4:
        arg_types += (plgpu.Layout.MMA_LHS(jnp.float32),)

    @plgpu.inline_mgpu(
        arg_types=arg_types,
        return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32,
                                           layout=plgpu.Layout.MMA_ACC(jnp.bfloat16)))
    def run(ctx, acc_fa, words_fa, x_fa, *scales_fa):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        bf16 = ir.BF16Type.get()
        pair_ty = ir.VectorType.get((2,), bf16)
        lhs = bf16_lhs.to_mgpu()
        bias = vector.broadcast(pair_ty, arith.constant(bf16, 136.0))

        def const(v):
            return arith.constant(i32, v)

        def as_pair(bits):
            return mgpu.utils.bitcast(bits, pair_ty)

        for q in range(num_words // 8):  # [64, 8]-word tiles
            cols = slice(8 * q, 8 * q + 8)
            regs = [mgpu.utils.bitcast(r, i32) for r in words_fa[:, cols].registers.flatten()]
            if fp4:
                pair_scales = [
                    vector.broadcast(pair_ty, arith.truncf(bf16, vector.extract(
                        r, dynamic_position=[],
                        static_position=ir.DenseI64ArrayAttr.get([0]))))
                    for r in scales_fa[0][:, cols].registers.flatten()]
            for j in range(4):
                pairs = []
                for n, r in enumerate(regs):
                    shifted = arith.shrui(r, const(4 * j)) if j else r
                    if fp4:  # sign (bit 3) to bit 15, e1 e0 m (bits 2..0) to bits 8..6
                        sign = arith.andi(arith.shli(shifted, const(12)), const(0x80008000))
                        rest = arith.andi(arith.shli(shifted, const(6)), const(0x01C001C0))
                        pairs.append(arith.mulf(as_pair(arith.ori(sign, rest)),
                                                pair_scales[n]))
                    else:  # 128 + (v xor 8) - 136
                        code = arith.andi(shifted, const(0x000F000F))
                        pairs.append(arith.subf(as_pair(arith.xori(code, const(0x43084308))),
                                                bias))
                a = mgpu.FragmentedArray(
                    _registers=np.asarray(pairs, dtype=object).reshape(
                        lhs.registers_shape((rows, 16))),
                    _layout=lhs, _is_signed=None)
                k0 = WORD32_TILE * q + 16 * j
                acc_fa = mgpu.mma(acc_fa, a, x_fa[k0:k0 + 16])
        return acc_fa

    return run(acc, words, x_tiles, *([scales] if fp4 else []))
