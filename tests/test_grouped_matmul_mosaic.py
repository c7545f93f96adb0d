"""Checks specific to the Mosaic GPU grouped matmul (`mosaic/grouped_matmul.py`): the work
item table, and configs that the shared cases (test_grouped_matmul.py) do not reach: group
starts off the 8-row grid, experts spanning several row windows, several items per CTA
(the ring running on across items), every B width, two consumers, two K pieces a step.

On the CPU the kernel runs in interpret mode (shapes kept small: ~1-3 s a case); the same
cases run natively under `pytest -m gpu`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.mosaic.grouped_matmul import (
    MIN_WIDTH,
    NUM_SMS,
    SMEM_BYTES,
    Config,
    _row_item,
    build_items,
    build_row_items,
    choose_config,
    grouped_matmul_mgpu,
    row_items,
    smem_bytes,
)
from jaxinfer.ops.grouped_matmul import grouped_matmul_reference
from jaxinfer.ops.quant import quantize

gpu = pytest.mark.gpu

# (name, M, E, N, K, group sizes, config)
CASES = [
    # Group starts off the 8-row grid, one CTA: every item runs through one ring.
    ("unaligned_one_cta", 40, 5, 128, 128, [3, 9, 1, 14, 6],
     Config(max_rows=16, compute_wgs=1, k_pieces=1, num_stages=3, num_ctas=1)),
    # An expert over several windows, widths 8..32, a zero tail, two consumers.
    ("windows_and_tail", 72, 3, 128, 128, [45, 0, 20],
     Config(max_rows=32, compute_wgs=2, k_pieces=1, num_stages=2, num_ctas=2)),
    # Two K pieces per step, fewer ring slots than steps, M below max_rows (padded x).
    # A group's short last window joined to the one before (width max_rows + last_extra),
    # and one that stays its own (9 rows > last_extra).
    ("last_window_extra", 80, 4, 128, 128, [36, 0, 21, 17],
     Config(max_rows=16, compute_wgs=2, k_pieces=1, num_stages=3, num_ctas=2, last_extra=8)),
    ("pieces_small_m", 12, 4, 128, 256, [0, 5, 7, 0],
     Config(max_rows=16, compute_wgs=1, k_pieces=2, num_stages=2, num_ctas=3)),
    # The two consumers split K (`split_k`), partial sums handed over in shared memory.
    ("split_k_tail", 40, 5, 128, 256, [3, 9, 1, 14, 6],
     Config(max_rows=16, compute_wgs=2, k_pieces=2, num_stages=3, num_ctas=2, split_k=True)),
    # Per-row items (M <= max_rows, M <= E): unaligned starts, empty experts, a zero
    # tail, two consumers, rows that start no group (their items skipped between live ones).
    ("row_items_tail", 20, 24, 128, 128, [3, 0, 0, 5, 1, 0, 4, 0, 2, 0, 0, 2] + [0] * 12,
     Config(max_rows=32, compute_wgs=2, k_pieces=1, num_stages=2, num_ctas=3)),
]
# silu(gate) * up in the epilogue (per-row items only): two consumers, each streaming a
# gate and an up box per piece, two K pieces a step; and on the item-table path, where
# the activation runs after the kernel.
SWIGLU_CASES = [
    ("swiglu_row_items", 20, 24, 256, 256, [3, 0, 0, 5, 1, 0, 4, 0, 2, 0, 0, 2] + [0] * 12,
     Config(max_rows=32, compute_wgs=2, k_pieces=2, num_stages=2, num_ctas=3)),
    ("swiglu_one_row", 1, 8, 128, 128, [0, 0, 0, 1, 0, 0, 0, 0],
     Config(max_rows=8, compute_wgs=1, k_pieces=1, num_stages=2, num_ctas=2)),
    ("swiglu_item_table", 40, 5, 128, 128, [3, 9, 1, 14, 6],
     Config(max_rows=16, compute_wgs=1, k_pieces=1, num_stages=3, num_ctas=2)),
]

# Group sizes in multiples of 8 rows (`groups_aligned`: the MoE layer's prefill layout), so
# the kernel stores its tiles through the swizzled buffer: windows over several B widths
# with a joined last window, an empty expert and a zero tail; and x's last window sliding
# back (M below the widest width).
ALIGNED_CASES = [
    ("aligned_windows_tail", 104, 5, 128, 128, [40, 0, 24, 8, 16],
     Config(max_rows=16, compute_wgs=2, k_pieces=1, num_stages=3, num_ctas=2, last_extra=8)),
    ("aligned_one_cta", 64, 3, 128, 256, [16, 32, 8],
     Config(max_rows=32, compute_wgs=1, k_pieces=2, num_stages=2, num_ctas=1)),
]


# Quantized experts (symmetric int8 / int4): per-channel scales on the accumulators and
# group-wise scales per piece (pieces of 128 K columns, or 64 for groups of 64), on both
# item tables, with two consumers, two pieces a step, the fused swiglu epilogue (gate and
# up boxes with their own scales) and the aligned store.
QUANT_CASES = [
    # (two N blocks of two consumers each: every per-channel scale row's index)
    ("int8_channel_windows", 72, 3, 256, 128, [45, 0, 20],
     Config(max_rows=32, compute_wgs=2, k_pieces=1, num_stages=2, num_ctas=2), "int8", {}),
    ("int8_channel_swiglu_two_blocks", 10, 12, 512, 128, [3, 0, 0, 2, 1, 0, 1, 0, 0, 0, 0, 1],
     Config(max_rows=32, compute_wgs=2, k_pieces=1, num_stages=2, num_ctas=3), "int8",
     dict(swiglu=True)),
    ("int4_g64_pieces", 12, 4, 128, 256, [0, 5, 7, 0],
     Config(max_rows=16, compute_wgs=1, k_pieces=2, num_stages=2, num_ctas=3), "int4:g64", {}),
    ("int8_g128_swiglu_rows", 10, 12, 256, 256, [3, 0, 0, 2, 1, 0, 1, 0, 0, 0, 0, 1],
     Config(max_rows=32, compute_wgs=2, k_pieces=1, num_stages=2, num_ctas=3), "int8:g128",
     dict(swiglu=True)),
    ("int4_channel_swiglu_one_row", 1, 8, 128, 128, [0, 0, 0, 1, 0, 0, 0, 0],
     Config(max_rows=8, compute_wgs=1, k_pieces=1, num_stages=2, num_ctas=2), "int4",
     dict(swiglu=True)),
    ("int8_g64_aligned", 104, 5, 128, 128, [40, 0, 24, 8, 16],
     Config(max_rows=16, compute_wgs=2, k_pieces=1, num_stages=3, num_ctas=2, last_extra=8),
     "int8:g64", dict(groups_aligned=True)),
    # Consumers splitting K (quantized decode's default): item table with a zero tail and
    # several widths; per-row items with the fused swiglu (gate and up partial sums).
    ("int8_split_k_windows_tail", 72, 3, 128, 512, [45, 0, 20],
     Config(max_rows=32, compute_wgs=2, k_pieces=2, num_stages=3, num_ctas=2, split_k=True),
     "int8", {}),
    ("int4_g64_split_k_swiglu_rows", 10, 12, 256, 256, [3, 0, 0, 2, 1, 0, 1, 0, 0, 0, 0, 1],
     Config(max_rows=32, compute_wgs=2, k_pieces=2, num_stages=2, num_ctas=3, split_k=True),
     "int4:g64", dict(swiglu=True)),
    # Wide token tiles (the prefill widths, up to 128 + 32 and 256), where a register A
    # operand left in flight gave wrong sums on the GPU.
    ("int8_wide_windows", 320, 2, 128, 128, [150, 100],
     Config(max_rows=128, compute_wgs=2, k_pieces=1, num_stages=2, num_ctas=2, last_extra=32),
     "int8", {}),
    ("int4_g128_aligned_256", 512, 2, 128, 256, [264, 248],
     Config(max_rows=256, compute_wgs=1, k_pieces=1, num_stages=2, num_ctas=2), "int4:g128",
     dict(groups_aligned=True)),
    # fp4 streamed as words and upcast in registers (`nibble_words`): two (MXFP4) or
    # four (NVFP4) scale groups a piece; split K on per-row items, the fused swiglu, wide
    # windows of the item table.
    ("mxfp4_split_k_rows", 10, 12, 256, 256, [3, 0, 0, 2, 1, 0, 1, 0, 0, 0, 0, 1],
     Config(max_rows=32, compute_wgs=2, k_pieces=2, num_stages=2, num_ctas=3, split_k=True),
     "mxfp4", {}),
    ("nvfp4_swiglu_rows", 10, 12, 256, 128, [3, 0, 0, 2, 1, 0, 1, 0, 0, 0, 0, 1],
     Config(max_rows=32, compute_wgs=2, k_pieces=1, num_stages=2, num_ctas=3), "nvfp4",
     dict(swiglu=True)),
    ("nvfp4_wide_windows", 320, 2, 128, 128, [150, 100],
     Config(max_rows=128, compute_wgs=2, k_pieces=1, num_stages=2, num_ctas=2, last_extra=32),
     "nvfp4", {}),
    # 4-bit codes as 32-bit words under mma.sync (`Config.words32`): fp4 on split K with
    # the fused swiglu, int4 per channel on the item table, int4 g128 on per-row items.
    ("mxfp4_words32_split_k_swiglu_rows", 10, 12, 256, 256, [3, 0, 0, 2, 1, 0, 1, 0, 0, 0, 0, 1],
     Config(max_rows=32, compute_wgs=2, k_pieces=2, num_stages=2, num_ctas=3, split_k=True,
            words32=True), "mxfp4", dict(swiglu=True)),
    ("nvfp4_words32_windows", 72, 3, 128, 128, [45, 0, 20],
     Config(max_rows=32, compute_wgs=2, k_pieces=1, num_stages=2, num_ctas=2, words32=True),
     "nvfp4", {}),
    ("int4_words32_windows_tail", 72, 3, 128, 256, [45, 0, 20],
     Config(max_rows=32, compute_wgs=2, k_pieces=1, num_stages=2, num_ctas=2, words32=True),
     "int4", {}),
    ("int4_g128_words32_rows", 10, 12, 128, 256, [3, 0, 0, 2, 1, 0, 1, 0, 0, 0, 0, 1],
     Config(max_rows=16, compute_wgs=1, k_pieces=1, num_stages=2, num_ctas=3, words32=True),
     "int4:g128", {}),
    # ... without the register hand-over (`Config.share_sm`: two CTAs an SM on a GPU).
    ("mxfp4_words32_share_sm_rows", 10, 12, 256, 256, [3, 0, 0, 2, 1, 0, 1, 0, 0, 0, 0, 1],
     Config(max_rows=16, compute_wgs=2, k_pieces=2, num_stages=2, num_ctas=4, words32=True,
            share_sm=True), "mxfp4", {}),
]


def run_case(m, e, n, k, sizes, cfg, platform, swiglu=False, groups_aligned=False, fmt=None):
    rng = np.random.default_rng(0)
    with jax.default_device(jax.devices(platform)[0]):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = rng.standard_normal((e, n, k)) * 0.05 + rng.standard_normal((e, n, 1)) * 0.02
        w = quantize(w, fmt) if fmt else jnp.asarray(w, jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        got = np.asarray(grouped_matmul_mgpu(x, w, gs, swiglu=swiglu, config=cfg,
                                             groups_aligned=groups_aligned)
                         .astype(jnp.float32))
        want = np.asarray(grouped_matmul_reference(x, w, gs, swiglu=swiglu)
                          .astype(jnp.float32))
        if row_items(m, e, cfg):  # the per-row table passed in (group sizes unread): same
            table = build_row_items(gs, m)
            passed = grouped_matmul_mgpu(x, w, jnp.zeros_like(gs), table, swiglu=swiglu,
                                         config=cfg)
            np.testing.assert_array_equal(np.asarray(passed.astype(jnp.float32)), got)
    assert got.shape == (m, n // 2 if swiglu else n)
    assert np.isfinite(got).all(), "unwritten output rows"
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
    assert (got[sum(sizes):] == 0).all(), "rows past the groups must be exact zeros"


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("name,m,e,n,k,sizes,cfg", CASES, ids=[c[0] for c in CASES])
def test_configs_match_reference(name, m, e, n, k, sizes, cfg, platform):
    run_case(m, e, n, k, sizes, cfg, platform)


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("name,m,e,n,k,sizes,cfg", SWIGLU_CASES,
                         ids=[c[0] for c in SWIGLU_CASES])
def test_swiglu_matches_reference(name, m, e, n, k, sizes, cfg, platform):
    run_case(m, e, n, k, sizes, cfg, platform, swiglu=True)


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("name,m,e,n,k,sizes,cfg", ALIGNED_CASES,
                         ids=[c[0] for c in ALIGNED_CASES])
def test_aligned_groups_match_reference(name, m, e, n, k, sizes, cfg, platform):
    run_case(m, e, n, k, sizes, cfg, platform, groups_aligned=True)


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("name,m,e,n,k,sizes,cfg,fmt,options", QUANT_CASES,
                         ids=[c[0] for c in QUANT_CASES])
def test_quantized_experts_match_reference(name, m, e, n, k, sizes, cfg, fmt, options,
                                           platform):
    run_case(m, e, n, k, sizes, cfg, platform, fmt=fmt, **options)


def _check_items(sizes, m, max_rows, last_extra=0):
    """The table: windows on the 8-row grid and inside x, each row of each N block in
    exactly one item of its own group (the tail as group E), and the item's rows fit its
    B width from the window start."""
    e, n_blocks = len(sizes), 3
    cfg = Config(max_rows=max_rows, last_extra=last_extra)
    padded_m = max(-(-m // MIN_WIDTH) * MIN_WIDTH, cfg.max_width)
    items, count = build_items(jnp.asarray(sizes, jnp.int32), m, padded_m, n_blocks, cfg)
    items, count = np.asarray(items), int(np.asarray(count)[0])
    owner = np.repeat(np.arange(e + 1), sizes + [m - sum(sizes)])
    seen = np.zeros((m, n_blocks), int)
    for grp, n_block, row_start, rows, width, load_start in items[:, :count].T:
        w = cfg.widths[width]
        assert rows >= 1 and (owner[row_start:row_start + rows] == grp).all()
        if grp < e:
            assert load_start % MIN_WIDTH == 0 and load_start + w <= padded_m
            assert load_start <= row_start and row_start + rows <= load_start + w
        seen[row_start:row_start + rows, n_block] += 1
    assert (seen == 1).all()
    assert count <= items.shape[1]


@pytest.mark.parametrize("sizes", [[3, 9, 1, 14, 6], [0, 0, 33, 0, 0], [8, 8, 8, 8, 0],
                                   [1, 0, 2, 0, 40]])
@pytest.mark.parametrize("max_rows,last_extra", [(8, 0), (16, 0), (32, 0), (16, 8), (32, 8)])
def test_items_cover_each_row_once(sizes, max_rows, last_extra):
    _check_items(sizes, 48, max_rows, last_extra)


@pytest.mark.parametrize("m", [1, 2, 8, 16, 24])
@pytest.mark.parametrize("max_rows", [8, 16])
def test_items_fit_the_table_when_rows_are_fewer_than_experts(m, max_rows):
    """A decode step has fewer rows than experts (M = tokens x k < E); the table is sized
    for min(E, M) non-empty groups. Random spreads of the rows over 64 experts, including
    one row per expert and groups that start just before an 8-row boundary (two windows
    for two rows), must still fit it."""
    rng = np.random.default_rng(m * 100 + max_rows)
    spreads = [[1] * m + [0] * (64 - m), [0, 7] + [2] * ((m - 7) // 2) if m >= 9 else [m]]
    for _ in range(30):
        live = rng.integers(0, m + 1)
        groups = rng.multinomial(live, rng.dirichlet(np.ones(64) * 0.3))
        spreads.append(groups.tolist())
    for sizes in spreads:
        sizes = (list(sizes) + [0] * 64)[:64]
        _check_items(sizes, m, max_rows)


def _check_row_items(sizes, m, max_rows):
    """The per-row table: a row is an item iff it is the first row of a group (the tail as
    group E), and the item then holds that whole group, inside one window on the 8-row
    grid."""
    e = len(sizes)
    cfg = Config(max_rows=max_rows)
    padded_m = max(-(-m // MIN_WIDTH) * MIN_WIDTH, max_rows)
    owner = np.repeat(np.arange(e + 1), sizes + [m - sum(sizes)])
    table = build_row_items(jnp.asarray(sizes, jnp.int32), m)
    np.testing.assert_array_equal(np.asarray(table.group), owner)
    seen = np.zeros(m, int)
    for r in range(m):
        grp, row_start, rows, width, load_start = (
            int(v) for v in _row_item(table, jnp.int32(r), e, padded_m, cfg))
        if grp == e + 1:
            assert r > 0 and owner[r] == owner[r - 1], f"row {r} starts group {owner[r]}"
            continue
        assert row_start == r and rows >= 1 and (owner[r:r + rows] == grp).all()
        assert r + rows == m or owner[r + rows] != grp
        if grp < e:
            w = cfg.widths[width]
            assert load_start % MIN_WIDTH == 0 and load_start + w <= padded_m
            assert load_start <= r and r + rows <= load_start + w
            assert width == 0 or r + rows > load_start + cfg.widths[width - 1]
        seen[r:r + rows] += 1
    assert (seen == 1).all()


@pytest.mark.parametrize("m,max_rows", [(1, 8), (8, 8), (12, 16), (30, 32), (64, 64)])
def test_row_items_cover_each_row_once(m, max_rows):
    rng = np.random.default_rng(m)
    spreads = [[m] + [0] * 63, [0] * 63 + [m], [1] * m + [0] * (64 - m), [0] * 64]
    for _ in range(30):
        groups = rng.multinomial(rng.integers(0, m + 1), rng.dirichlet(np.ones(64) * 0.3))
        spreads.append(groups.tolist())
    for sizes in spreads:
        _check_row_items((list(sizes) + [0] * 64)[:64], m, max_rows)


def test_row_items_only_where_rows_are_few():
    """Decode steps with no more rows than experts take the per-row table; Mixtral's
    8-token step (16 rows, 8 experts) keeps the item table (see `row_items`)."""
    for m, e, n, k, want in [(8, 128, 1536, 2048, True), (64, 128, 2048, 768, True),
                             (2, 8, 28672, 4096, True), (16, 8, 28672, 4096, False),
                             (512, 128, 1536, 2048, False)]:
        cfg = choose_config(m, e, n, k)
        assert row_items(m, e, cfg) == want, (m, e)


def test_words32_leave_the_row_table_where_most_experts_hold_a_row():
    """32-bit-word experts: gpt-oss's 8-token step (32 rows, 32 experts) takes 16-row
    windows from the item table, not 32-row ones from the per-row table, two CTAs an SM;
    Qwen3's (64 rows, 128 experts) keeps the table; wgmma's tiles keep it for both."""
    for m, e, n, k, piece, table in [(32, 32, 5760, 2880, 64, False),
                                     (64, 128, 1536, 2048, 128, True)]:
        for words32 in (False, True):
            cfg = choose_config(m, e, n, k, weight_bits=4, grouped=True, piece=piece,
                                words32=words32)
            assert row_items(m, e, cfg) == (table or not words32), (m, e, words32)
            assert cfg.words32 == words32
        assert table or (cfg.max_rows == 16 and cfg.share_sm)


def test_choose_config_fits_shared_memory():
    for m, e, n, k in [(8, 128, 1536, 2048), (512, 128, 2048, 768), (32768, 128, 1536, 2048),
                       (2, 8, 28672, 4096), (8192, 8, 4096, 14336)]:
        cfg = choose_config(m, e, n, k)
        assert n % cfg.block_n == 0 and k % (64 * cfg.k_pieces) == 0
        assert smem_bytes(cfg) <= SMEM_BYTES and cfg.num_stages >= 2
    # Quantized experts (pieces of 128 K columns, their scales in the ring for groups),
    # with and without the fused swiglu; consumers split K where one would own each block.
    for (m, e, n, k), bits, swiglu in itertools.product(
            [(8, 128, 1536, 2048), (8, 128, 2048, 768), (64, 8, 28672, 4096),
             (32768, 128, 1536, 2048)], (8, 4), (False, True)):
        cfg = choose_config(m, e, n, k, swiglu=swiglu, weight_bits=bits, grouped=True,
                            piece=128)
        halves = 2 if swiglu and row_items(m, e, cfg) else 1
        assert n % (halves * cfg.block_n) == 0 and k % (128 * cfg.k_pieces) == 0
        assert smem_bytes(cfg, 2, halves, bits, True, False, 128) <= SMEM_BYTES
        assert cfg.num_stages >= 2
        assert cfg.split_k == (m == 8)  # decode sizes: one consumer's worth of N blocks
        assert not cfg.words32  # only where the experts can be read as 32-bit words
        words32 = choose_config(m, e, n, k, swiglu=swiglu, weight_bits=bits, grouped=True,
                                piece=128, words32=True)
        assert words32.words32 == (words32.max_width <= 128)
        # Narrow tiles with no more rows than experts: two CTAs an SM, each ring in half
        # (where three slots fit: 4-bit boxes).
        narrow = words32.words32 and words32.max_width <= 16 and m <= e
        assert (words32.share_sm <= narrow) and (bits == 8 or words32.share_sm == narrow)
        room = SMEM_BYTES // 2 - 1024 if words32.share_sm else SMEM_BYTES
        assert smem_bytes(words32, 2, halves, bits, True, False, 128) <= room
        if words32.share_sm:
            assert words32.num_ctas == 2 * NUM_SMS and words32.num_stages >= 3
        else:
            assert dataclasses.replace(words32, words32=False) == cfg
    # 2 KB boxes (4-bit, 64 columns): pieces a step up to 16 KB of weights, a divisor of
    # K's pieces (gpt-oss: 45), as many as leave three ring slots in half the shared
    # memory (two CTAs an SM).
    for n, k, want in [(5760, 2880, 5), (2880, 2880, 9)]:
        cfg = choose_config(4, 32, n, k, weight_bits=4, grouped=2, piece=64, words32=True)
        assert cfg.k_pieces == want and cfg.num_stages >= 3 and not cfg.split_k
        assert cfg.share_sm and smem_bytes(cfg, 2, 1, 4, 2, False, 64) <= SMEM_BYTES // 2
    cfg = choose_config(8, 128, 1536, 2048, swiglu=True, weight_bits=4, grouped=True,
                        piece=128)
    assert cfg.k_pieces == 2 and cfg.split_k
    # Interpret mode's upcast buffers at 256-row tiles: max_rows halves until they fit.
    for m, e, n, k in [(262144, 128, 1536, 2048), (8192, 8, 4096, 14336)]:
        for bits in (8, 4):
            cfg = choose_config(m, e, n, k, weight_bits=bits, grouped=True, interpret=True,
                                piece=128)
            assert smem_bytes(cfg, 2, 1, bits, True, True, 128) <= SMEM_BYTES
            assert cfg.max_rows < 256 and cfg.last_extra < cfg.max_rows


@pytest.mark.parametrize("fmt,m,words32", [("int4:g128", 10, False), ("mxfp4", 10, False),
                                          ("nvfp4", 300, False), ("mxfp4", 10, True),
                                          ("int4", 300, True), ("int4:g128", 10, True),
                                          ("mxfp4", 10, "share_sm")])
def test_kernel_lowers_for_hopper(monkeypatch, fmt, m, words32):
    """The compiled (not interpreted) kernel lowers for a CUDA device from the CPU, per-row
    items (10 rows of 12 experts) and the item table (300), with wgmma or as 32-bit words
    under mma.sync (also without the register hand-over): every op it uses has a Mosaic GPU
    lowering in its register layout. Compiling it needs a GPU."""
    from jaxinfer.mosaic import grouped_matmul as kernel
    monkeypatch.setattr(kernel, "mosaic_interpret_params", lambda: None)
    w = quantize(np.random.default_rng().standard_normal((12, 256, 256)), fmt)
    x = jax.ShapeDtypeStruct((m, 256), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((12,), jnp.int32)
    kernel.grouped_matmul_mgpu.clear_cache()  # traced here without interpret mode
    try:
        config = (dataclasses.replace(kernel.choose_config(
            m, 12, 256, 256, 132, weight_bits=4, grouped=fmt != "int4",
            piece=kernel.piece_cols(w, 256)), words32=True, share_sm=words32 == "share_sm")
            if words32 else None)
        lowered = jax.jit(functools.partial(kernel.grouped_matmul_mgpu, config=config)).trace(
            x, w, sizes).lower(lowering_platforms=("cuda",))
    finally:
        kernel.grouped_matmul_mgpu.clear_cache()
    assert "mosaic_gpu" in lowered.as_text()
