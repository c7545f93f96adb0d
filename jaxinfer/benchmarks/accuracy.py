"""What quantization costs in accuracy: perplexity of a text and agreement of logits with a
reference run (`bench/perplexity.py`, the SmolLM2 tests)."""

from __future__ import annotations

import numpy as np


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ids[1:], each under the logits [len(ids), V] of
    the position before it (float64 log-softmax)."""
    x = np.asarray(logits[:-1], np.float64)
    m = x.max(-1, keepdims=True)
    log_z = (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[:, 0]
    nll = log_z - x[np.arange(len(ids) - 1), ids[1:]]
    return float(np.exp(nll.mean()))


def agreement(logits: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """How close logits [T, V] are to a reference run's: the share of positions with the same
    top-1 token, and the largest and mean |logit difference|."""
    diff = np.abs(np.asarray(logits, np.float64) - np.asarray(ref, np.float64))
    return {"top1": float(np.mean(logits.argmax(-1) == ref.argmax(-1))),
            "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean())}
