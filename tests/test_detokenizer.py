"""Incremental detokenization on the embedded byte-level BPE tokenizer: exact, and never half a character."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.engine.detokenizer import REPLACEMENT_CHARACTER, IncrementalDetokenizer
from minserve.model.loader import ASSETS_DIR
from minserve.model.tokenizer import Tokenizer

TOKENIZER = Tokenizer(ASSETS_DIR / "minserve-tiny")


class CountingTokenizer:
    """Records how many tokens each decode call is given, to check the work per token is bounded."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def decode(self, token_ids, skip_special_tokens=True):
        self.lengths.append(len(token_ids))
        return TOKENIZER.decode(token_ids, skip_special_tokens=skip_special_tokens)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=60))
def test_deltas_concatenate_to_the_full_decode_and_hold_no_broken_character(text):
    ids = TOKENIZER.encode(text)
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    deltas = [detokenizer.add(token) for token in ids]
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == TOKENIZER.decode(ids) == text
    if REPLACEMENT_CHARACTER not in text:
        assert all(REPLACEMENT_CHARACTER not in delta for delta in deltas)


def test_multibyte_characters_split_across_tokens_are_held_back():
    text = "🤖 日本語 naïve"
    ids = TOKENIZER.encode(text)
    assert len(ids) > len(text.split())  # the byte-level vocabulary splits these characters
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    deltas = [detokenizer.add(token) for token in ids]
    assert "" in deltas  # at least one token completed no character
    assert "".join(deltas) + detokenizer.flush() == text


def test_work_per_token_is_bounded():
    counting = CountingTokenizer()
    detokenizer = IncrementalDetokenizer(counting)
    for token in TOKENIZER.encode("def f(x):\n    return x * 2\n" * 40):
        detokenizer.add(token)
    assert max(counting.lengths) <= 8  # a short window, never the whole output
