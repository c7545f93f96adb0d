"""One-shot all-reduce (sum) over the GPUs of one host, as a Mosaic GPU kernel.

For the small activations a tensor-parallel decode step reduces after each row-split
projection ([T, hidden] in bf16: 8 KiB at T = 1, 512 KiB at T = 64), where XLA's NCCL
all-reduce costs 15-20 us of kernel time a call plus the hand-off to its own stream
(bench/NOTES.md, Sharding).

Contract (`all_reduce_sum`): called per device inside `jax.shard_map` over the mesh axis
`axis_name` of n devices, all driven by one process. x: any shape, bf16 / f16 / f32, a
size that is a multiple of one tile (128 lanes x 16 bytes: 1024 bf16 elements) and at
most `Workspace.capacity` bytes. peers: [n, 2] uint32, the device address of every
device's workspace as (low, high) words (`Workspace.peers`, the same on every device).
Returns the sum of every device's x, same shape and dtype, summed in float32 in device
order 0 .. n-1 and rounded once, so every device gets the same bits.

The workspace (`Workspace`): one buffer a device, allocated once and kept by the caller
for as long as it runs steps, written only by this kernel (through raw addresses: XLA
does not see it, so it neither copies it nor hands its memory to anything else). Layout
(bytes): flags [BLOCKS, n + 1] uint32 (flags[b, d]: the last epoch CTA b of device d
announced here; flags[b, n]: CTA b's own call counter), padded to a multiple of 256, then
stage [2, n, capacity] bytes (stage[s, d]: device d's x, in its own dtype, of the calls
whose epoch & 1 == s; calls of any dtype share it, a tile being 2 KiB in each). Peers
reach it through the GPUs' peer access (one process: unified addresses), so the kernel
needs no collective metadata from XLA: no barrier kernel, no exchange of addresses a run,
and it runs inside the step's CUDA graph like any kernel.

Algorithm (push, one shot):
- A grid of `BLOCKS` CTAs (one warpgroup each), the same count for every call; CTA b takes
  tiles b, b + BLOCKS, ... of x read flat, so in every call on every device a tile
  belongs to the same CTA.
- CTA b numbers its calls: epoch e = its counter + 1 (uint32, wrapping: the stage is e & 1,
  and "flag >= e" is the signed difference flag - e >= 0, right across the wrap). Every
  device runs the same sequence of calls, so CTA b's counters stay equal across devices.
  (A program that fails on some devices only would leave them apart: the runner then
  replaces the workspace.)
- CTA b loads all its tiles of x into registers (every load issued before the first
  store: the step is latency-bound, not bandwidth-bound), then stores each into
  stage[e & 1, me] of every device (its own included): plain 16-byte stores over NVLink.
- After a warpgroup barrier one thread stores e into flags[b, me] of every device
  (release, system scope), then spins (acquire) until its own flags[b, d] >= e for every
  d: the n rows of its tiles have arrived.
- It loads the n rows of all its tiles, sums them in device order in float32, stores y,
  and counter = e.
Why two stages: a device can be at most one call ahead of a peer's CTA b (its call e + 1
cannot end before the peer's CTA b has pushed its call-(e + 1) rows, which that CTA does
after reading its call-e rows), so call e + 1 writes the stage call e may still read.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, scf
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

LANES = 128  # one warpgroup
LANE_BYTES = 16  # one vector load or store a lane
BLOCKS = 32  # CTAs of every call (fixed: a tile keeps its CTA, see the module doc)
FLAGS_BYTES = 256  # the stage starts at a multiple of this past the flags
CAPACITY_UNIT = 16384  # a workspace's capacity is a whole number of these bytes


def capacity_for(message_bytes: int) -> int:
    """The workspace capacity that holds messages of up to `message_bytes`."""
    return max(1, -(-message_bytes // CAPACITY_UNIT)) * CAPACITY_UNIT


def tile_elements(dtype) -> int:
    """Elements in one tile of x: 128 lanes x 16 bytes."""
    return LANES * LANE_BYTES // jnp.dtype(dtype).itemsize


def flags_bytes(n: int) -> int:
    """Bytes before the stage in a workspace of n devices: the flags, padded."""
    return -(-BLOCKS * (n + 1) * 4 // FLAGS_BYTES) * FLAGS_BYTES


@dataclasses.dataclass(frozen=True)
class Workspace:
    """Every device's all-reduce buffer, and their addresses.

    buffers: per device (in the mesh's device order) [flags + 2 * n * capacity] uint8,
      zeros at first; keep them alive while steps run. peers: [n, 2] uint32 replicated
      over the mesh, the device address of each buffer as (low, high) words (pass it into
      a step as an argument: the addresses are this process's, so they must not be
      compiled into a cached program)."""

    buffers: tuple[jax.Array, ...]
    peers: jax.Array
    capacity: int  # bytes of one device's x a call may reduce


def make_workspace(mesh, capacity: int) -> Workspace:
    """Allocates the workspace for all-reduces over every device of `mesh` (its devices in
    order are the reduction's 0 .. n-1) of messages up to `capacity` bytes (a positive
    multiple of 16 KiB). Needs GPUs of this process with peer access to each other."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if capacity <= 0 or capacity % CAPACITY_UNIT:
        raise ValueError(f"make_workspace: capacity {capacity}: expected a positive multiple "
                         f"of {CAPACITY_UNIT} bytes (`capacity_for`)")
    devices = list(mesh.devices.flat)
    n = len(devices)
    per_device = flags_bytes(n) + 2 * n * capacity
    # Zeros on every device before any kernel runs: a kernel's first pushes and flags land
    # in the peers' buffers, which must not be zeroed after them.
    buffers = jax.block_until_ready(
        tuple(jax.device_put(np.zeros(per_device, np.uint8), d) for d in devices))
    # [n, 2] uint32 (low, high words): int64 arrays need jax's x64 mode.
    table = np.array([b.unsafe_buffer_pointer() for b in buffers], np.uint64)
    table = np.stack([table & 0xFFFFFFFF, table >> 32], axis=1).astype(np.uint32)
    peers = jax.block_until_ready(jax.device_put(table, NamedSharding(mesh, P())))
    return Workspace(buffers, peers, capacity)


def supports(x_shape, dtype, capacity: int) -> bool:
    """Whether `all_reduce_sum` takes an x of this shape and dtype."""
    size = math.prod(x_shape)
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                 jnp.dtype(jnp.float32))
            and size % tile_elements(dtype) == 0
            and 0 < size * jnp.dtype(dtype).itemsize <= capacity)


# MLIR helpers, run inside `plgpu.inline_mgpu` bodies (per thread of the warpgroup).

def _i32(v: int):
    return mgpu.utils.c(v, ir.IntegerType.get_signless(32))


def _scalar(fa) -> ir.Value:
    """The i32 value of a scalar argument of an inline_mgpu body."""
    return fa.registers.item()


def _address(peers_ref, device, byte_offset) -> ir.Value:
    """A generic pointer to `byte_offset` (i32) bytes into `device`'s workspace."""
    i64 = ir.IntegerType.get_signless(64)
    index = ir.IndexType.get()
    row = (mgpu.utils.c(device, index) if isinstance(device, int)
           else arith.index_cast(index, device))
    low, high = (arith.extui(i64, memref.load(peers_ref, [row, mgpu.utils.c(k, index)]))
                 for k in (0, 1))
    base = arith.ori(low, arith.shli(high, mgpu.utils.c(32, i64)))
    address = arith.addi(base, arith.extui(i64, byte_offset))
    return llvm.inttoptr(llvm.PointerType.get(), address)


def _flag(peers_ref, device, n: int, block, slot) -> ir.Value:
    """Address of flags[block, slot] in `device`'s workspace (slot n: the counter)."""
    offset = arith.muli(arith.addi(arith.muli(block, _i32(n + 1)), slot), _i32(4))
    return _address(peers_ref, device, offset)


def _wait_for_epoch(address, epoch):
    """One thread of the warpgroup spins until the flag at `address` has reached `epoch`
    (the signed difference flag - epoch >= 0, so it holds across the uint32 wrap), then an
    acquire fence (system scope) and a warpgroup barrier."""
    i32 = ir.IntegerType.get_signless(32)
    with mgpu.utils.single_thread(scope=mgpu.utils.ThreadSubset.WARPGROUP):
        while_op = scf.WhileOp([i32], [epoch])
        before = while_op.before.blocks.append(i32)
        with ir.InsertionPoint.at_block_begin(before):
            [wanted] = before.arguments
            flag = mgpu.utils.inline_ptx("ld.relaxed.sys.global.b32 $0, [$1];", address,
                                         result_types=i32, has_side_effects=True)
            behind = arith.cmpi(arith.CmpIPredicate.slt, arith.subi(flag, wanted), _i32(0))
            scf.condition(behind, [wanted])
        after = while_op.after.blocks.append(i32)
        with ir.InsertionPoint.at_block_begin(after):
            scf.yield_(after.arguments)
        mgpu.utils.inline_ptx("fence.acquire.sys;", has_side_effects=True)
    mgpu.utils.warpgroup_barrier()


def _load_u32(address) -> ir.Value:
    """A uint32 this device wrote (the CTA's counter, stored by its previous call)."""
    return mgpu.utils.inline_ptx("ld.relaxed.gpu.global.u32 $0, [$1];", address,
                                 result_types=ir.IntegerType.get_signless(32),
                                 has_side_effects=True)


@functools.partial(jax.jit, static_argnames=("axis_name", "capacity"))
def all_reduce_sum(x: jax.Array, peers: jax.Array, *, axis_name: str,
                   capacity: int) -> jax.Array:
    """Sum of x over the devices of mesh axis `axis_name` (inside shard_map); see the module
    doc for the contract. peers: `Workspace.peers`; capacity: `Workspace.capacity`."""
    n = lax.axis_size(axis_name)
    if peers.shape != (n, 2):
        raise ValueError(f"all_reduce_sum: peers {peers.shape}: expected ({n}, 2), one "
                         f"address a device of {axis_name!r}")
    if not supports(x.shape, x.dtype, capacity):
        raise ValueError(f"all_reduce_sum: x {x.shape} {x.dtype}: needs bf16 / f16 / f32, a "
                         f"size that is a multiple of {tile_elements(x.dtype)} and at most "
                         f"{capacity} bytes")
    size = math.prod(x.shape)
    dtype = jnp.dtype(x.dtype)
    tile = tile_elements(dtype)
    tile_bytes = LANES * LANE_BYTES
    tiles = size // tile
    per_cta = -(-tiles // BLOCKS)  # tiles b, b + BLOCKS, ... of CTA b
    guarded = tiles % BLOCKS != 0  # some CTAs have one tile fewer
    vec = LANE_BYTES // dtype.itemsize
    layout = plgpu.Layout.WG_STRIDED((tile,), vec_size=vec)
    scalar = plgpu.Layout.WG_SPLAT

    def tile_ref(peers_ref, device, byte_offset):
        ty = ir.MemRefType.get((tile,), mgpu.utils.dtype_to_ir_type(dtype))
        return mgpu.utils.ptr_as_memref(_address(peers_ref, device, byte_offset), ty)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), scalar, scalar),
                       return_type=plgpu.ShapeDtypeStruct((), jnp.int32, scalar))
    def read_epoch(ctx, peers_ref, me, block):
        """This CTA's epoch: its counter + 1."""
        del ctx
        count = _load_u32(_flag(peers_ref, _scalar(me), n, _scalar(block), _i32(n)))
        return mgpu.FragmentedArray.splat(arith.addi(count, _i32(1)), (), is_signed=True)

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType(), scalar))
    def push(ctx, value, peers_ref, offset):
        """value -> `offset` bytes into every device's workspace."""
        del ctx
        for d in range(n):
            value.store_untiled(tile_ref(peers_ref, d, _scalar(offset)))

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), scalar, scalar, scalar))
    def announce_and_wait(ctx, peers_ref, me, block, epoch):
        """flags[b, me] = e on every device, then wait for flags[b, d] >= e here."""
        del ctx
        me, block, epoch = _scalar(me), _scalar(block), _scalar(epoch)
        mgpu.utils.warpgroup_barrier()  # every thread's pushes are issued
        with mgpu.utils.single_thread(scope=mgpu.utils.ThreadSubset.WARPGROUP):
            for d in range(n):
                mgpu.utils.inline_ptx("st.release.sys.global.u32 [$0], $1;",
                                      _flag(peers_ref, d, n, block, me), epoch,
                                      has_side_effects=True)
        for d in range(n):
            _wait_for_epoch(_flag(peers_ref, me, n, block, _i32(d)), epoch)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), scalar, scalar),
                       return_type=plgpu.ShapeDtypeStruct((tile,), jnp.float32, layout))
    def gather_sum(ctx, peers_ref, me, offset):
        """The sum over d of the tile `offset` bytes into row d of this device's stage, in
        float32, in device order."""
        del ctx
        me, offset = _scalar(me), _scalar(offset)
        rows = [mgpu.FragmentedArray.load_strided(
            tile_ref(peers_ref, me, arith.addi(offset, _i32(d * capacity))), vec_size=vec)
            for d in range(n)]  # every load issued before the first add
        acc = rows[0].astype(ir.F32Type.get())
        for row in rows[1:]:
            acc = acc + row.astype(ir.F32Type.get())
        return acc

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), scalar, scalar, scalar))
    def advance(ctx, peers_ref, me, block, epoch):
        """counter = e (after every thread has read it)."""
        del ctx
        me, block, epoch = _scalar(me), _scalar(block), _scalar(epoch)
        mgpu.utils.warpgroup_barrier()
        with mgpu.utils.single_thread(scope=mgpu.utils.ThreadSubset.WARPGROUP):
            mgpu.utils.inline_ptx("st.relaxed.gpu.global.u32 [$0], $1;",
                                  _flag(peers_ref, me, n, block, _i32(n)), epoch,
                                  has_side_effects=True)

    def kernel(x_ref, peers_ref, me_ref, y_ref):
        me = me_ref[0]
        b = lax.axis_index("blocks").astype(jnp.int32)
        epoch = read_epoch(peers_ref, me, b)
        # Byte offset of stage[e & 1, 0, 0] in a workspace.
        stage = flags_bytes(n) + (epoch & 1) * (n * capacity)
        # This CTA's tiles; past the last one (guarded) it reads the last tile again (x,
        # then another CTA's stage rows: harmless, it stores neither).
        ts = [b + k * BLOCKS for k in range(per_cta)]
        valid = [t < tiles for t in ts]
        ts = [jnp.minimum(t, tiles - 1) for t in ts] if guarded else ts
        values = [plgpu.layout_cast(x_ref[pl.ds(t * tile, tile)], layout) for t in ts]
        for t, ok, value in zip(ts, valid, values, strict=True):
            store = functools.partial(push, value, peers_ref,
                                      stage + me * capacity + t * tile_bytes)
            if guarded:
                pl.when(ok)(store)
            else:
                store()
        announce_and_wait(peers_ref, me, b, epoch)
        sums = [gather_sum(peers_ref, me, stage + t * tile_bytes) for t in ts]
        for t, ok, acc in zip(ts, valid, sums, strict=True):
            def write(t=t, acc=acc):
                y_ref[pl.ds(t * tile, tile)] = acc.astype(y_ref.dtype)

            if guarded:
                pl.when(ok)(write)
            else:
                write()
        advance(peers_ref, me, b, epoch)

    y = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((size,), dtype),
        grid=(BLOCKS,),
        grid_names=("blocks",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x.reshape(size), peers, lax.axis_index(axis_name).astype(jnp.int32).reshape(1))
    return y.reshape(x.shape)
