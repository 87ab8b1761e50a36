"""Token ids → text, one token at a time, without ever emitting half a character.

A byte-level BPE token can end in the middle of a UTF-8 character ("é" is two bytes, an emoji four), and
decoding such a prefix gives the replacement character U+FFFD. So each new token is decoded together with a
few tokens before it (from ``prefix_offset``), and text is released only when it no longer ends in U+FFFD.
Decoding a short window instead of the whole output keeps the work per token bounded; starting the window
a little before the new tokens keeps tokenizers that drop a leading space (SentencePiece) right.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHARACTER = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Accumulates ``text`` as tokens arrive. ``add`` returns the newly completed text (maybe empty)."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # the window to decode starts here
        self.read_offset = 0  # tokens before this are already in `text`
        self.text = ""

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        before = self._decode(self.prefix_offset, self.read_offset)
        window = self._decode(self.prefix_offset, len(self.token_ids))
        if len(window) <= len(before) or window.endswith(REPLACEMENT_CHARACTER):
            return ""  # an incomplete character (or nothing printable) so far: wait for more tokens
        delta = window[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: release whatever is held back, complete or not."""
        before = self._decode(self.prefix_offset, self.read_offset)
        delta = self._decode(self.prefix_offset, len(self.token_ids))[len(before) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)
