"""A program's host inputs as one int32 vector: one transfer (or one broadcast) where each
array would take its own."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each array of a program's inputs (a step's `StepInputs`, a draw's sampling
    inputs) lies in one int32 vector, which the host sends to the device in one transfer
    (`pack`) and the program slices back apart (`unpack`): with a transfer per array (~25
    of them) the dispatch of a step at 256 decodes took 3.0-3.3 ms of the host's time,
    1.9-2.9 with one. A multi-host job's leader broadcasts the same vector to the other
    processes. float32 arrays travel as their bits, bool ones as 0 / 1, the rest must be
    int32. Static (a jit argument): the tree and each leaf's shape and dtype."""

    treedef: jax.tree_util.PyTreeDef
    leaves: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype name) in tree order

    @staticmethod
    def of(inputs) -> PackedLayout:
        leaves, treedef = jax.tree.flatten(inputs)
        return PackedLayout(treedef, tuple((np.shape(a), np.asarray(a).dtype.name)
                                           for a in leaves))

    @property
    def size(self) -> int:
        """The vector's length."""
        return sum(int(np.prod(shape)) for shape, _ in self.leaves)

    @staticmethod
    def pack(inputs) -> np.ndarray:
        """Host-side: the inputs' arrays as one int32 vector (in tree order, which `of`'s
        layout of them follows)."""
        return np.concatenate([
            (a.view(np.int32) if a.dtype == np.float32 else a.astype(np.int32, copy=False))
            .ravel() for a in map(np.asarray, jax.tree.leaves(inputs))])

    def unpack(self, words):
        """The inputs back from `pack`'s vector: jax arrays in a program, numpy arrays on the
        host (from a numpy vector)."""
        host = isinstance(words, np.ndarray)
        out, start = [], 0
        for shape, dtype in self.leaves:
            size = int(np.prod(shape))
            a = words[start:start + size].reshape(shape)
            start += size
            if dtype == "float32":
                a = a.view(np.float32) if host else jax.lax.bitcast_convert_type(a, jnp.float32)
            elif dtype == "bool":
                a = a != 0
            out.append(a)
        return jax.tree.unflatten(self.treedef, out)
