"""Incremental detokenization for streamed responses: O(window) work per token, not O(n).

Decoding the whole generation again on every step makes a long stream quadratic in its length.
:class:`IncrementalDecoder` keeps two offsets into the generated ids (the approach of vLLM's and
Hugging Face's text streamers, written here for our tokenizer calls):

* ``prefix``: where the context window starts; text before it is final;
* ``read``:   the ids up to here are already part of ``text``.

Per push of new ids, with ``w = ids[prefix:]`` and ``r = ids[prefix:read]``::

    new_text = decode(w)[len(decode(r)):]

Both decodes start at the same token, so a tokenizer's word-initial space rule or a byte-level
merge is handled identically in both and only the new characters remain. When ``new_text`` ends
in U+FFFD (a multi-byte character cut between tokens) nothing is released and the offsets stay,
so the next push decodes the completed character. Otherwise ``prefix`` moves to ``read`` and
``read`` to the end, so the window stays a few tokens long. The concatenated text equals
``decode(ids)`` for byte-level BPE tokenizers (tested on SmolLM2's, multi-byte characters included).
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decodes(Protocol):
    """The one tokenizer call used: ``decode(ids, skip_special_tokens=...)``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDecoder:
    """Text of a growing id sequence, extended per push in time proportional to the push."""

    def __init__(self, tokenizer: Decodes, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _pending(self) -> str:
        """``decode(ids[prefix:])[len(decode(ids[prefix:read])):]``: the characters after ``read``."""
        window = self._decode(self.ids[self._prefix:])
        return window[len(self._decode(self.ids[self._prefix:self._read])):]

    def _release(self, new_text: str, prefix: int) -> str:
        self.text += new_text
        self._prefix, self._read = prefix, len(self.ids)
        return new_text

    def push(self, new_ids: list[int]) -> str:
        """Append ``new_ids``; return the characters this push made final (possibly ``""``)."""
        self.ids.extend(new_ids)
        new_text = self._pending()
        if not new_text or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # wait for the rest of a cut multi-byte character
        return self._release(new_text, self._read)

    def flush(self) -> str:
        """At the end of the sequence: release whatever is pending, replacement characters included."""
        if self._read == len(self.ids):
            return ""
        return self._release(self._pending(), len(self.ids))
