"""A step's memory peak, measured before the KV cache is planned (vLLM's profile run).

What a step needs beyond the weights and the KV pages is what XLA's buffer assignment gives
its program: temporaries (activations, logits, the sampler's copies, GEMM workspaces) and
outputs. `profile_step_memory` compiles the largest programs an engine can run (the most
tokens, the widest page table; the multi-step decode of every sequence slot) for a probe
runner whose KV pool holds one longest sequence, and reads their analyses
(`CompiledSteps.memory`). A program's temporaries do not depend on the pool's size: the
pages are a donated argument, read and written in place by page index (tests/test_plan.py
checks it). The figures are kept beside the executable cache, keyed like its programs, so
a restart of the same configuration plans the same pool without compiling the probe.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.engine.compiled_steps import ProgramMemory, StepShape
from jaxinfer.engine.runner import ModelRunner


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """The probe's result: the program that needs the most, and its bytes per device."""

    shape: StepShape
    memory: ProgramMemory
    inputs_bytes: int = 0  # arguments that live only for this program (a draw's logits)

    @property
    def bytes(self) -> int:
        return self.memory.total + self.inputs_bytes


def probe_shapes(runner: ModelRunner, max_num_seqs: int, max_num_batched_tokens: int,
                 decode_steps: int) -> list[StepShape]:
    """The largest programs of each kind the engine can run: a batch of
    max_num_batched_tokens (with logprobs, whose top-k copies of the logits a plain batch
    lacks) at the widest page table, with decode_steps > 1 the multi-step decode of every
    sequence slot (its draw with the filters), and the draw of every slot (its input logits
    counted), all with logprobs."""
    max_len = runner.max_pages_per_seq * runner.page_size
    shapes = runner.warmup_shapes(max_num_seqs, max_num_batched_tokens, decode_steps, max_len)
    def size(s):  # filtered: the multi-step loop's draw sorts
        return s.num_tokens, s.pages_per_seq, s.filtered

    samples = [s for s in shapes if s.kind == "sample"]
    steps = sorted({s.num_steps for s in samples})  # one- and multi-step batches
    largest = [max((s for s in samples if s.num_steps == n), key=size) for n in steps]
    draws = [s for s in shapes if s.kind == "draw"]
    if draws:
        largest.append(max(draws, key=lambda s: (s.num_seqs, s.filtered)))  # the sort's
    return [dataclasses.replace(s, with_logprobs=True) for s in largest]


def profile_step_memory(model, mesh, *, page_size: int, max_model_len: int, max_num_seqs: int,
                        max_num_batched_tokens: int, decode_steps: int, kv_dtype,
                        batch_invariant: bool = False) -> StepMemory:
    """The largest of `probe_shapes`' needs for `model` (a `Decoder`, loaded or abstract) on
    `mesh`, as the runner of these settings would run it."""
    pages = -(-max_model_len // page_size)
    probe = ModelRunner(model, pages, page_size, max_model_len, mesh, max_num_seqs, kv_dtype,
                        batch_invariant=batch_invariant)
    vocab = model.config.vocab_size
    results = [StepMemory(s, probe.steps.memory(s),
                          s.num_seqs * vocab * 4 if s.kind == "draw" else 0)
               for s in probe_shapes(probe, max_num_seqs, max_num_batched_tokens, decode_steps)]
    return max(results, key=lambda r: r.bytes)
