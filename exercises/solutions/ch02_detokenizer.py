"""Chapter 02 exercise, reference solutions (instructors: ``minserve grade ch02 --solutions``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

REPLACEMENT_CHARACTER = "\ufffd"


def is_incomplete(text: str) -> bool:
    """True when ``text`` ends in U+FFFD, the sign that its last character's bytes are not all there yet."""
    return text.endswith(REPLACEMENT_CHARACTER)


class IncrementalDetokenizer:
    """Turns token ids into text one token at a time; ``text`` is everything released so far."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # the decoding window starts here: a little context before the new tokens
        self.read_offset = 0  # tokens before this are already in `text`
        self.text = ""

    def add(self, token_id: int) -> str:
        """Take one token; return the text it completes (``""`` while a character is still incomplete)."""
        self.token_ids.append(token_id)
        before = self._decode(self.prefix_offset, self.read_offset)
        window = self._decode(self.prefix_offset, len(self.token_ids))
        if len(window) <= len(before) or is_incomplete(window):
            return ""
        return self._release(window[len(before) :])

    def flush(self) -> str:
        """At the end of the stream: release whatever is held back, complete or not."""
        before = self._decode(self.prefix_offset, self.read_offset)
        return self._release(self._decode(self.prefix_offset, len(self.token_ids))[len(before) :])

    def _release(self, delta: str) -> str:
        # The tokens just released become the next window's context: the window never grows past them.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)


def stream_text(tokenizer, token_ids: Iterable[int], skip_special_tokens: bool = True) -> Iterator[str]:
    """Yield the non-empty text deltas of a token stream; they join to ``tokenizer.decode(all ids)``."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    for token_id in token_ids:
        if delta := detokenizer.add(token_id):
            yield delta
    if tail := detokenizer.flush():
        yield tail
