"""Incremental detokenisation: deltas add up to the full text, never split a character,
and keep the space a SentencePiece decoder would strip at the start of a decode."""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from jaxinfer.loading.tokenizer import IncrementalDecoder, Tokenizer


def test_sentencepiece_leading_space_is_kept():
    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4, ".": 5, "▁caf": 6,
             "é": 7}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    t = Tokenizer(tok)
    assert t.decode([4, 5]) == "Paris."  # what a plain decode of the output alone gives
    d = IncrementalDecoder(t, [1, 2, 3])
    assert [d.push([x]) for x in [4, 5, 6, 7]] == [" Paris", ".", " caf", "é"]
    assert IncrementalDecoder(t, [1, 2, 3]).text_of([4, 5, 6, 7]) == " Paris. café"


def test_byte_level_multibyte_characters_are_never_split(hf_models):
    t = Tokenizer.from_dir(hf_models["llama"])
    text = " printing 🖨️ für Gutenberg — 活字印刷 ok"
    ids = t.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # the rare characters fall apart into byte tokens
    d = IncrementalDecoder(t, t.encode("The", add_special_tokens=False))
    deltas = [d.push([i]) for i in ids] + [d.flush()]
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == t.decode(ids) == text
