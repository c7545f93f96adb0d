"""What every op registry is made of: implementations in preference order, one `pick`.

An op (ragged paged attention, linear, grouped matmul) has a contract module (its
signature, layouts, weight formats and pure-JAX reference) and a registry module that
lists its implementations, most preferred first. Each `Implementation` says which calls it
takes through `supports(call)`, which returns None or, in words, why not: the hardware it
needs, the dtypes and shapes it takes, and the tuned size limits where another
implementation is faster. `Registry.pick` returns the first that supports a call, so the
rules that choose between implementations live in the registry entries and nowhere else.
A kernel's own tile or configuration choice stays in the kernel.

`implementation="name"` forces one (tests and benchmarks): it runs whatever `supports`
says (kernels run in interpret mode off their hardware).

Batch-invariant mode (`batch_invariant_mode()`, set while a step traces): `pick` takes only
implementations marked `batch_invariant`, whose result for a row (a token) does not depend
on the other rows of the call, nor on how many there are: a request's numbers are then the
same whatever shares its batch (vLLM's and SGLang's batch-invariant inference).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


class KernelModule:
    """A kernel module imported on first use (`kernel.attr`): a registry names its kernels
    without importing them, so a platform whose entries all decline on the hardware check
    never imports the GPU and TPU lowerings (on the CPU, 0.3 s of every command's start).
    A registry's `supports` must check the platform before it touches the module.
    `platform` is the `jaxinfer.ops.platform.platform()` the kernel compiles on; `requires`
    names a jax module the kernel needs that a jax may lack (then `module()` is None)."""

    def __init__(self, name: str, platform: str, requires: str | None = None):
        self.name, self.platform, self.requires = name, platform, requires
        _KERNEL_MODULES.append(self)

    def module(self):
        """The kernel's module, or None where the jax module it `requires` is missing."""
        try:
            return importlib.import_module(self.name)
        except ModuleNotFoundError as error:
            if self.requires is None or error.name != self.requires:
                raise
            return None

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self.name), attr)


_KERNEL_MODULES: list[KernelModule] = []


def kernel_modules() -> tuple[KernelModule, ...]:
    """Every `KernelModule` the registries imported so far name (`jaxinfer.ops.kernels`
    imports them all)."""
    return tuple(_KERNEL_MODULES)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of an op.

    name      what `implementation=` calls it
    fn        the function, with the op's signature (see its registry module)
    supports  call -> None if it takes the call, else why not (one line)
    fuses     neighbouring work it does itself (e.g. ("qk_norm", "rope") for the attention
              kernel that applies the q/k prologue), which callers then need not run: a
              tuple, or call -> tuple where that depends on the call
    batch_invariant  each row's result is independent of the call's other rows and of
              their number (the only ones `pick` takes in batch-invariant mode)
    """

    name: str
    fn: Callable
    supports: Callable[[Any], str | None]
    fuses: tuple[str, ...] | Callable[[Any], tuple[str, ...]] = ()
    batch_invariant: bool = False

    def fused(self, call) -> tuple[str, ...]:
        """The neighbouring work this implementation does itself for `call`."""
        return self.fuses(call) if callable(self.fuses) else self.fuses


class Registry:
    """An op's implementations in preference order; the last must take every call."""

    def __init__(self, op: str, implementations: Sequence[Implementation]):
        self.op = op
        self.implementations = tuple(implementations)
        self.by_name = {impl.name: impl for impl in self.implementations}
        if len(self.by_name) != len(self.implementations):
            raise ValueError(f"{op}: two implementations share a name")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.by_name)

    def __getitem__(self, name: str) -> Implementation:
        try:
            return self.by_name[name]
        except KeyError:
            raise ValueError(f"{self.op} implementation {name!r}: expected one of "
                             f"{self.names}") from None

    def reasons(self, call) -> dict[str, str | None]:
        """Each implementation's answer for `call`: None (supported) or why not."""
        return {impl.name: impl.supports(call) for impl in self.implementations}

    def pick(self, call, implementation: str | None = None) -> Implementation:
        """The forced `implementation`, else the first implementation that supports `call`
        (in batch-invariant mode, the first batch-invariant one)."""
        if implementation is not None:
            return self[implementation]
        invariant = batch_invariant()
        for impl in self.implementations:
            if (impl.batch_invariant or not invariant) and impl.supports(call) is None:
                return impl
        mode = " in batch-invariant mode" if invariant else ""
        raise ValueError(f"{self.op}: no implementation takes this call{mode}: "
                         f"{self.reasons(call)}")


_BATCH_INVARIANT = contextvars.ContextVar("jaxinfer_batch_invariant", default=False)


def batch_invariant() -> bool:
    """Whether ops trace in batch-invariant mode (`batch_invariant_mode`)."""
    return _BATCH_INVARIANT.get()


# Rows per block of a batch-invariant computation (`by_row_blocks`), by platform. XLA picks
# a dot's algorithm by its shape: XLA:CPU reduces a row in another order for one row, 2-32
# and 64 rows; on an H100, XLA's GEMMs for 8B-model projections gave a row other bits from
# 128 or 256 rows on, autotuned or not (a tile or split-K chosen by M), while blocks of 256
# rows (cuBLAS, untuned: `invariant_compiler_options`) gave the same bits at 8 to 2048
# rows (bench/NOTES.md, Batch invariance). Small blocks on the CPU keep its loops
# cheap; on accelerators a decode batch of up to 256 sequences is one block.
INVARIANT_ROWS = {"cpu": 16}
INVARIANT_ROWS_ACCELERATOR = 256


def invariant_rows() -> int:
    """Rows per block of a batch-invariant computation on this platform."""
    from jaxinfer.ops.platform import platform  # at call time, as the registries ask it

    return INVARIANT_ROWS.get(platform(), INVARIANT_ROWS_ACCELERATOR)


def invariant_compiler_options(device_platform: str) -> dict[str, int | bool]:
    """XLA options for a batch-invariant step. Everywhere: every bf16 operation rounds to
    bf16 (no excess precision), as XLA otherwise keeps some intermediates in float32
    depending on how it fused them, which differs between programs. On GPUs also cuBLAS
    for every GEMM, with its heuristic's algorithm for the shape (no autotuning): the
    autotuner's timing-based choice could differ between two programs' (or two processes')
    blocks of the same shape, and XLA's untuned Triton GEMM fusions ran 10x slower than
    cuBLAS (bench/NOTES.md, Batch invariance). device_platform: a jax device's ("gpu",
    "cpu", "tpu")."""
    options: dict[str, int | bool] = {"xla_allow_excess_precision": False}
    if device_platform == "gpu":
        options |= {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}
    return options


def by_row_blocks(fn, *arrays):
    """fn over blocks of `invariant_rows()` rows, one block after another (a loop: XLA cannot
    merge the blocks back into one computation), the last one padded with zeros: each
    row's result then comes from the same code, of the same shapes, whatever the number of
    rows. arrays: [..., F_i] with the same leading dimensions (the rows); fn takes blocks
    [R, F_i] and returns [R, N] -> [..., N]."""
    block = invariant_rows()
    lead = arrays[0].shape[:-1]
    flat = [a.reshape(-1, a.shape[-1]) for a in arrays]
    m = flat[0].shape[0]
    pad = -m % block
    blocks = [jnp.pad(a, ((0, pad), (0, 0))).reshape(-1, block, a.shape[-1]) for a in flat]
    # Barriers around each block's work: XLA drops a loop of one trip, after which the
    # block's work could fuse with its neighbours (and compile to other code) in a program of
    # one block but not in one of several; on an H100 a decode token of the 8B shape then
    # came out otherwise in a step of 2048 tokens than alone (bench/NOTES.md, Batch
    # invariance).
    barrier = jax.lax.optimization_barrier
    out = jax.lax.map(lambda b: barrier(fn(*barrier(b))), blocks)
    return out.reshape(-1, out.shape[-1])[:m].reshape(*lead, out.shape[-1])


def row_local(fn, *arrays):
    """fn(*arrays) for an fn whose output rows each depend on the same row of its inputs only
    (a reduction within a row, a sum over a few slots); in batch-invariant mode over fixed
    blocks of rows (`by_row_blocks`), so that its reduction order cannot follow the row
    count. Plain elementwise work needs none: on the H100 / H200, RoPE and the MLP's
    activation in blocks gave the 8B's logits the same bits as without (bench/NOTES.md,
    Batch invariance). arrays: [..., F_i] with the same leading dimensions; fn maps
    [R, F_i] blocks to [R, N]."""
    return by_row_blocks(fn, *arrays) if batch_invariant() else fn(*arrays)


@contextlib.contextmanager
def batch_invariant_mode(on: bool = True):
    """Ops traced inside pick batch-invariant implementations only (if on). A context
    variable: set it on the thread that traces."""
    token = _BATCH_INVARIANT.set(on)
    try:
        yield
    finally:
        _BATCH_INVARIANT.reset(token)
