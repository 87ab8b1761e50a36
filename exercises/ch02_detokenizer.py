"""Chapter 02 exercise: an incremental detokenizer for streaming.

Fill in every function below (replace ``raise NotImplementedError``), then grade yourself:

    minserve grade ch02

A server streams text while the model is still generating, one token at a time. Decoding each token on its
own is wrong: a byte-level BPE token can end in the middle of a UTF-8 character ("é" is 2 bytes, "中" 3, "😀"
4), and decoding half a character gives U+FFFD, the replacement character "�". Decoding *all* tokens again
after each new one is right but costs O(n) per token, O(n²) per answer.

Your detokenizer decodes a short window of recent tokens instead, and holds text back while it ends in "�".
Try it on the embedded tokenizer:

    from minserve.model.loader import ASSETS_DIR
    from minserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(ASSETS_DIR / "minserve-tiny")
    ids = tokenizer.encode("naïve 😀", add_special_tokens=False)
    [tokenizer.decode([i]) for i in ids]  # some tokens are half a character: '�'

Use only ``tokenizer.decode(ids, skip_special_tokens=...)``; the tests wrap it to count what you decode.
Besides the tokenizer you are handed, use only the standard library: the grader refuses a file that imports
anything else (minserve's own detokenizer included).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

REPLACEMENT_CHARACTER = "\ufffd"  # what decode() gives for bytes that are not (yet) a whole character


def is_incomplete(text: str) -> bool:
    """True when ``text`` ends in U+FFFD, the sign that its last character's bytes are not all there yet."""
    raise NotImplementedError


class IncrementalDetokenizer:
    """Turns token ids into text one token at a time; ``text`` is everything released so far.

    Invariants, after any number of ``add`` calls and one ``flush``:

    - ``text == tokenizer.decode(all ids so far, skip_special_tokens)``;
    - no value ``add`` returns ends in U+FFFD (hold it back until the character is complete);
    - each ``add`` decodes a bounded window of recent tokens, never all of them.

    Hint: keep two offsets into your list of ids. ``read_offset``: tokens before it are already in ``text``.
    ``prefix_offset``: where the window you decode starts, a few tokens before ``read_offset`` (the tokens
    released last time), so that decode sees each new token in context. The new text is
    ``decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])`` (compare lengths).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        raise NotImplementedError  # set up your list of ids and your two offsets

    def add(self, token_id: int) -> str:
        """Take one token; return the text it completes (``""`` while a character is still incomplete)."""
        raise NotImplementedError

    def flush(self) -> str:
        """At the end of the stream: release whatever is held back, complete or not (maybe ``""``)."""
        raise NotImplementedError


def stream_text(tokenizer, token_ids: Iterable[int], skip_special_tokens: bool = True) -> Iterator[str]:
    """Yield the non-empty text deltas of a token stream; they join to ``tokenizer.decode(all ids)``.

    Use your :class:`IncrementalDetokenizer`: ``add`` each id, yield what it returns (skip empty strings),
    and finish with what ``flush`` returns.
    """
    raise NotImplementedError
