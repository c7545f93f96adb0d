"""The engine's sizes where the caller gives none: one table, shared by `LLM`, `jaxinfer
serve`, `jaxinfer bench` and `jaxinfer plan` (their options default to None, resolved here).

  max_num_seqs            sequences in one step (vLLM's max_num_seqs)
  max_num_batched_tokens  tokens in one step: prompt chunks and decodes (chunked prefill)
  decode_steps            decode steps per host round trip when every request decodes

On GPUs and TPUs: 256 sequences (vLLM's) and 2048 tokens a step, decoding one step per
host round trip. Measured (Llama-3-8B shape, 512 requests of <= 256 + 256 tokens,
`jaxinfer bench throughput`; bench/NOTES.md, Serving engine decode loop): on an H100, 2048,
4096 and 8192 tokens a step (vLLM's on large GPUs) gave 14,396, 14,430 and 14,524 output
tokens/s in one lease, and 2048 against 8192 14,806 against 14,953 in another (1.01x),
within the spread between leases; 8192's programs compile in ~12 s each against a few, and
its prompt steps (~170 ms) stall every decode ~3x longer. On an H200, before the overlapped
steps, 8 decode steps a round trip gave 11,556 against 10,586, but streams tokens 8 at a
time, holds new requests back up to 8 steps and adds 9 programs to the warm-up's 14. The
Llama-3-8B shape fits one H100 80GB at these sizes with room for its KV cache
(bench/NOTES.md, Memory planning).
On the CPU: 64 sequences and 2048 tokens: two cores run no more at once any faster.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int
    decode_steps: int


ACCELERATOR_DEFAULTS = EngineDefaults(max_num_seqs=256, max_num_batched_tokens=2048,
                                      decode_steps=1)
CPU_DEFAULTS = EngineDefaults(max_num_seqs=64, max_num_batched_tokens=2048, decode_steps=1)


def engine_defaults(platform: str) -> EngineDefaults:
    """The defaults on a platform ("cpu", "gpu", "tpu", as `jax.Device.platform` names it)."""
    return CPU_DEFAULTS if platform == "cpu" else ACCELERATOR_DEFAULTS


def describe(field: str) -> str:
    """A help text's default clause for one field, e.g. "default 256 on GPU / TPU, 64 on
    CPU"."""
    gpu, cpu = getattr(ACCELERATOR_DEFAULTS, field), getattr(CPU_DEFAULTS, field)
    if gpu == cpu:
        return f"default {gpu}"
    return f"default {gpu} on GPU / TPU, {cpu} on CPU"
