"""Multi-process (multi-host) runs on JAX's own runtime (`jax.distributed`).

Every process loads the same model onto one global mesh and runs the same jitted steps.
Process 0 owns the engine (scheduler, HTTP server) and, before each step, broadcasts
what the step runs: a fixed-size header (kind, decode steps, the inputs' shapes), then the
step's inputs packed in one int32 vector (`PackedLayout`). The other processes loop in
`ModelRunner.follow` until process 0 sends END (when it exits). On one process every
function here is a no-op.
"""

from __future__ import annotations

import atexit
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.engine.packing import PackedLayout
from jaxinfer.errors import JaxinferError

END, SAMPLE, LOGITS = 0, 1, 2
_MAX_LEAVES = 32  # a step's inputs have ~21 arrays, none with more than 2 dims


def initialize(coordinator: str | None, num_processes: int | None,
               process_id: int | None):
    """Joins the job (`jax.distributed.initialize`) when a coordinator is given, by
    argument or as JAXINFER_COORDINATOR / JAXINFER_NUM_PROCESSES / JAXINFER_PROCESS_ID.
    Must run before anything touches the devices."""
    env = os.environ
    coordinator = coordinator or env.get("JAXINFER_COORDINATOR")
    if not coordinator:
        return
    try:
        num_processes = int(num_processes or env["JAXINFER_NUM_PROCESSES"])
        process_id = int(process_id if process_id is not None else env["JAXINFER_PROCESS_ID"])
    except (KeyError, ValueError):
        raise JaxinferError("--coordinator needs --num-processes and --process-id (or "
                            "JAXINFER_NUM_PROCESSES and JAXINFER_PROCESS_ID)") from None
    if not 0 <= process_id < num_processes:
        raise JaxinferError(f"--process-id {process_id}: expected 0 .. {num_processes - 1}")
    # CPU processes need a collectives backend to talk to each other (GPUs use NCCL).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
    if process_id == 0:
        atexit.register(end)  # runs before jax.distributed's own shutdown (LIFO)


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def _header(kind: int, leaves, num_steps: int, with_logprobs: bool) -> np.ndarray:
    header = np.zeros(3 + 2 * _MAX_LEAVES, np.int32)
    header[:3] = kind, num_steps, with_logprobs
    for i, leaf in enumerate(leaves):
        shape = np.shape(leaf)
        header[3 + 2 * i: 3 + 2 * i + len(shape)] = shape
    return header


def lead(kind: int, inputs=None, num_steps: int = 1, with_logprobs: bool = False):
    """Process 0: tells the others which step to run next, and its inputs."""
    if not is_multiprocess():
        return
    leaves = jax.tree.leaves(inputs)
    multihost_utils.broadcast_one_to_all(_header(kind, leaves, num_steps, with_logprobs))
    if leaves:
        multihost_utils.broadcast_one_to_all(PackedLayout.pack(inputs))


def follow(template):
    """Other processes: waits for process 0's next step. Returns None at END, else
    (kind, inputs shaped like `template` (a pytree of numpy arrays), num_steps,
    with_logprobs)."""
    leaves, treedef = jax.tree.flatten(template)
    header = np.asarray(multihost_utils.broadcast_one_to_all(
        np.zeros(3 + 2 * _MAX_LEAVES, np.int32)))
    kind, num_steps, with_logprobs = (int(v) for v in header[:3])
    if kind == END:
        return None
    # The template's dtypes at the leader's shapes.
    layout = PackedLayout(treedef, tuple(
        (tuple(int(n) for n in header[3 + 2 * i: 3 + 2 * i + np.ndim(a)]),
         np.asarray(a).dtype.name) for i, a in enumerate(leaves)))
    words = multihost_utils.broadcast_one_to_all(np.zeros(layout.size, np.int32))
    return kind, layout.unpack(np.asarray(words)), num_steps, bool(with_logprobs)


def end():
    """Process 0: releases the other processes from `ModelRunner.follow`."""
    if is_multiprocess() and is_leader():
        lead(END)


def to_global(inputs, mesh):
    """Host inputs (numpy, the same on every process) as arrays replicated over the mesh."""
    if not is_multiprocess():
        return inputs  # jit places numpy arguments itself
    replicated = NamedSharding(mesh, P())
    return jax.tree.map(lambda a: jax.make_array_from_process_local_data(replicated, a),
                        inputs)


def host_value(x: jax.Array) -> np.ndarray:
    """A replicated array's value on this host."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))
