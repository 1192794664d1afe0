"""Incremental detokenization (``cluster/detokenize.py``): the streamed text equals one full decode.

SmolLM2's byte-level BPE tokenizer over texts with multi-byte characters (emoji, CJK, accents)
that its vocabulary splits across tokens, pushed one id at a time and in uneven chunks; the word
tokenizer of the serving tests (whose decode joins words with spaces). Also: each push decodes
only a short window (the work per token does not grow with the length), and a cut character is
held back until it completes, never streamed as U+FFFD.
"""

from __future__ import annotations

import pytest

from cluster.detokenize import REPLACEMENT_CHAR, IncrementalDecoder
from tests.test_serve import word_tokenizer

TEXTS = [
    "def add(a, b):\n    return a + b  # sum\n",
    "Crème brûlée, naïve café — ½ of 3½ ≠ 2.",
    "Emoji: 🚀🔥 and family 👨‍👩‍👧 done.",
    "中文测试：推测解码很快。日本語もテスト。",
    "  leading spaces,\ttabs\n\nand blank lines  ",
]


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from speculation import assets

    return AutoTokenizer.from_pretrained(str(assets.resolve_model_dir("smollm2-135m")))


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(smol_tokenizer, text, chunk):
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    dec = IncrementalDecoder(smol_tokenizer)
    pieces = [dec.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(dec.flush())
    assert "".join(pieces) == dec.text == smol_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_cut_character_is_held_back_until_complete(smol_tokenizer):
    ids = smol_tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1, "the test needs a character split over several tokens"
    dec = IncrementalDecoder(smol_tokenizer)
    assert [dec.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.push(ids[-1:]) == "🚀"


def test_flush_releases_an_incomplete_tail(smol_tokenizer):
    ids = smol_tokenizer.encode("ok 🚀", add_special_tokens=False)
    dec = IncrementalDecoder(smol_tokenizer)
    for i in ids[:-1]:
        dec.push([i])
    assert dec.text == "ok"  # the cut emoji is held back
    assert dec.flush().endswith(REPLACEMENT_CHAR)  # the stream ended inside a character: shown as U+FFFD
    assert dec.text == smol_tokenizer.decode(ids[:-1])


def test_special_tokens_are_skipped(smol_tokenizer):
    eos = smol_tokenizer.eos_token_id
    ids = smol_tokenizer.encode("hello world", add_special_tokens=False)
    dec = IncrementalDecoder(smol_tokenizer)
    for i in [*ids[:1], eos, *ids[1:]]:
        dec.push([i])
    assert dec.text == "hello world"


def test_work_per_token_does_not_grow_with_length(smol_tokenizer):
    tok = CountingTokenizer(smol_tokenizer)
    ids = smol_tokenizer.encode(" ".join(TEXTS) * 8, add_special_tokens=False)
    assert len(ids) > 500
    dec = IncrementalDecoder(tok)
    for i in ids:
        dec.push([i])
    assert dec.text == smol_tokenizer.decode(ids)
    assert max(tok.lengths) <= 16, max(tok.lengths)  # a short window, not the whole sequence


def test_word_tokenizer_stream_equals_full_decode():
    tok = word_tokenizer()
    ids = [3, 17, 5, 63, 0, 9, 9, 41]
    dec = IncrementalDecoder(tok)
    streamed = "".join(dec.push([i]) for i in ids) + dec.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=True)
