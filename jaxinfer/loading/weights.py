"""Weight counting: a model's parameters and their bytes, in all and as one forward step
reads them.

A forward step over T tokens reads every parameter once, except:
  - MoE expert stacks (a path through `experts`): only the experts its tokens are routed to,
    expected share 1 - (1 - k/E)^T under uniform routing (k/E for one token);
  - an input embedding table not tied to the LM head: a lookup reads one row per token.
    A tied table is read whole, as the LM head's weight.
Bytes count 4-bit values (int4, float4_e2m1fn) at half a byte, as packed in device memory;
quantization scales and offsets are bytes read but not weights counted.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

EMBEDDING = ("embed", "embedding")  # the input embedding table's parameter path
_HALF_BYTE = (jnp.dtype(jnp.int4), jnp.dtype(jnp.float4_e2m1fn))
_NOT_WEIGHTS = ("weight_scale", "weight_offset")


def expert_fraction(num_experts: int, experts_per_token: int, tokens: float) -> float:
    """Expected share of a MoE layer's E experts that `tokens` tokens hit, each choosing k
    of them uniformly: 1 - (1 - k/E)^tokens (k/E for one token); 1.0 for a dense model
    (num_experts 0)."""
    if not num_experts:
        return 1.0
    return 1.0 - (1.0 - experts_per_token / num_experts) ** tokens


@dataclasses.dataclass(frozen=True)
class StepReads:
    """A model's parameter bytes by how a forward step reads them. Plain numbers, so that
    the server publishes them (`jaxinfer_model_step_reads_*` gauges) and `jaxinfer bench
    serve` rebuilds this from them."""

    fixed_bytes: int  # read once per step whatever its tokens (the LM head included)
    expert_bytes: int  # every expert stack in full; a step reads the share it hits
    embedding_row_bytes: int  # one row of an untied input embedding; 0 when tied
    num_experts: int  # 0 for a dense model
    experts_per_token: int
    vocab_size: int

    def streamed_bytes(self, tokens: float) -> float:
        """Bytes one step over `tokens` tokens reads whatever its tokens are: every
        parameter but the embedding rows, the experts at the share that many tokens hit."""
        share = expert_fraction(self.num_experts, self.experts_per_token, tokens)
        return self.fixed_bytes + self.expert_bytes * share

    def step_bytes(self, tokens: float) -> float:
        """Bytes one forward step over `tokens` tokens reads: `streamed_bytes` plus one
        embedding row per token (at most the whole table)."""
        return (self.streamed_bytes(tokens)
                + min(tokens, self.vocab_size) * self.embedding_row_bytes)

    def as_info(self) -> dict[str, int]:
        """{'step_reads_<field>': value}: the server's model-info gauges."""
        return {f"step_reads_{k}": v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_info(cls, info: dict[str, float]) -> StepReads:
        """The inverse of `as_info` (extra keys ignored; gauges arrive as floats)."""
        return cls(**{f.name: int(info[f"step_reads_{f.name}"])
                      for f in dataclasses.fields(cls)})


def _nbytes(v) -> int:
    return v.size // 2 if v.dtype in _HALF_BYTE else v.size * v.dtype.itemsize


def _params(model):
    """(path, variable) of every parameter; works on abstract models (nnx.eval_shape)."""
    return nnx.state(model, nnx.Param).flat_state()


def _tied(model) -> bool:
    return model.config.tie_word_embeddings


def weight_count(model) -> int:
    """Number of weights, float or quantized (quantization scales / offsets not counted)."""
    return sum(v.size for path, v in _params(model) if path[-1] not in _NOT_WEIGHTS)


def active_weight_count(model) -> int:
    """The weights one token multiplies (2 FLOPs each): MoE expert stacks at k of E, and
    not an untied input embedding (a lookup multiplies nothing; a tied table counts once,
    as the LM head)."""
    c = model.config
    share = expert_fraction(c.num_experts, c.num_experts_per_tok, 1)
    total = 0.0
    for path, v in _params(model):
        if path[-1] in _NOT_WEIGHTS or (tuple(path) == EMBEDDING and not _tied(model)):
            continue
        total += v.size * (share if "experts" in path else 1.0)
    return round(total)


def weight_bytes(model) -> int:
    """Bytes of every parameter, as stored on the device (the model's size)."""
    return sum(_nbytes(v) for _, v in _params(model))


def step_reads(model) -> StepReads:
    """The model's parameter bytes split by how a step reads them (see StepReads)."""
    fixed = experts = row = 0
    for path, v in _params(model):
        if "experts" in path:
            experts += _nbytes(v)
        elif tuple(path) == EMBEDDING and not _tied(model):
            row = _nbytes(v) // v.shape[0]
        else:
            fixed += _nbytes(v)
    c = model.config
    return StepReads(fixed_bytes=fixed, expert_bytes=experts, embedding_row_bytes=row,
                     num_experts=c.num_experts, experts_per_token=c.num_experts_per_tok,
                     vocab_size=c.vocab_size)


def step_weight_bytes(model, tokens: int) -> int:
    """Bytes of parameters one forward step over `tokens` tokens reads (module docstring)."""
    return round(step_reads(model).step_bytes(tokens))
