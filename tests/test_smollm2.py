"""Real SmolLM2-135M-Instruct GGUF, converted by us, vs transformers loading the same GGUF."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams

from .conftest import TEXT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ours(smollm2_converted):
    return LLM(smollm2_converted)


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=smollm2_gguf.name)
    tok = AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, dtype=torch.float32, **kw)
    return tok, model.eval()


def test_tokenizer_and_chat_template_match_hf(ours, hf):
    tok, _ = hf
    assert ours.tokenizer.encode(TEXT) == tok(TEXT).input_ids
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.tokenizer.apply_chat_template(messages) == tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_top1_agreement_with_hf(ours, hf):
    import torch

    _, model = hf
    ids = ours.tokenizer.encode(TEXT)
    assert len(ids) >= 300
    logits = ours.logits([ids])[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    agreement = float(np.mean(logits.argmax(-1) == ref.argmax(-1)))
    print(f"top-1 agreement over {len(ids)} tokens: {agreement:.4f}; "
          f"max |logit diff| {np.abs(logits - ref).max():.2e}")
    assert agreement >= 0.99


def test_capital_of_france(ours):
    out = ours.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    assert out[0].text.startswith(" Paris")
