"""Graded tests for chapter 02 (``minserve grade ch02``). Each test's docstring is the hint a learner sees.

The tokenizer is the embedded model's byte-level BPE: with a vocabulary of 2048 it splits most non-ASCII
characters across several tokens, which is exactly what a streaming detokenizer has to survive. The
property tests draw random Unicode text with hypothesis; the cost test counts decoded tokens through a
wrapper instead of timing anything.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve.model.loader import ASSETS_DIR
from minserve.model.tokenizer import Tokenizer

TOKENIZER = Tokenizer(ASSETS_DIR / "minserve-tiny")
FFFD = "\ufffd"
# Characters the tiny vocabulary splits into 2–4 byte tokens, mixed with ASCII so tokens straddle them.
HARD_CHARACTERS = "中文字符日本語のテキスト한국어😀🎉🚀👍🏽éüñøß€…—“”ab c\n"
PROPERTY = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
texts = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters=FFFD), max_size=40),
    st.text(alphabet=st.sampled_from(HARD_CHARACTERS), min_size=1, max_size=40),
)


class CountingTokenizer:
    """The real tokenizer, recording how many ids each ``decode`` call was given."""

    def __init__(self) -> None:
        self.decoded_lengths: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(token_ids))
        return TOKENIZER.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def _deltas(exercise, ids: list[int], tokenizer=TOKENIZER) -> list[str]:
    detokenizer = exercise.IncrementalDetokenizer(tokenizer)
    return [detokenizer.add(i) for i in ids] + [detokenizer.flush()]


@pytest.mark.points(1)
def test_is_incomplete(exercise):
    """Text is incomplete when it ends in U+FFFD ('\\ufffd'); a U+FFFD earlier in the text does not count."""
    assert exercise.is_incomplete("abc" + FFFD)
    assert not exercise.is_incomplete("abc")
    assert not exercise.is_incomplete(FFFD + "abc")
    assert not exercise.is_incomplete("")


@pytest.mark.points(1)
def test_ascii_streams_one_token_at_a_time(exercise):
    """ASCII tokens are whole characters: each add() returns its token's text straight away, none is held."""
    ids = _ids("hello world, stream me")
    deltas = _deltas(exercise, ids)
    assert deltas[:-1] == [TOKENIZER.decode([i]) for i in ids]
    assert deltas[-1] == ""  # nothing was held back, so flush() has nothing left


@pytest.mark.points(2)
def test_an_emoji_is_held_back_until_complete(exercise):
    """😀 is four bytes in four tokens: add() returns "" until the last one, then the whole emoji, no '�'."""
    ids = _ids("😀")
    assert len(ids) == 4 and TOKENIZER.decode(ids[:1]) == FFFD  # the setup: a split character
    assert _deltas(exercise, ids) == ["", "", "", "😀", ""]


@pytest.mark.points(2)
def test_cjk_split_across_tokens(exercise):
    """Each CJK character is 3 bytes, and tokens straddle characters: no delta may end in '�'."""
    text = "中文字符 and 日本語のテキスト"
    deltas = _deltas(exercise, _ids(text))
    assert "".join(deltas) == text
    assert not any(d.endswith(FFFD) for d in deltas)


@pytest.mark.points(1)
def test_text_accumulates(exercise):
    """``text`` holds everything released so far, so after flush() it equals decode(all ids)."""
    ids = _ids("naïve café ☕ done")
    detokenizer = exercise.IncrementalDetokenizer(TOKENIZER)
    for i in ids:
        detokenizer.add(i)
    detokenizer.flush()
    assert detokenizer.text == TOKENIZER.decode(ids)


@pytest.mark.points(2)
def test_flush_releases_a_half_character_at_the_end(exercise):
    """A stream can stop mid-character (max_tokens, cancellation): flush() releases the rest, '�' included."""
    ids = _ids("ok 😀")[:-2]  # the emoji's last two byte tokens never arrive
    deltas = _deltas(exercise, ids)
    assert "".join(deltas) == TOKENIZER.decode(ids) == "ok " + FFFD
    assert not any(d.endswith(FFFD) for d in deltas[:-1])


@pytest.mark.points(1)
def test_special_tokens_follow_skip_special_tokens(exercise):
    """Pass skip_special_tokens on to decode(): end-of-text is dropped by default and kept when asked."""
    ids = [*_ids("bye"), TOKENIZER.eos_token_id]
    assert "".join(exercise.stream_text(TOKENIZER, ids)) == "bye"
    assert "".join(exercise.stream_text(TOKENIZER, ids, skip_special_tokens=False)) == "bye" + TOKENIZER.eos_token


@pytest.mark.points(2)
def test_stream_text_is_a_lazy_stream_of_non_empty_deltas(exercise):
    """stream_text must yield as tokens arrive (a generator, not a list built at the end), and never yield ""."""
    ids = _ids("first words, then a long tail of more words " * 4)
    consumed = []

    def arriving():
        for i in ids:
            consumed.append(i)
            yield i

    stream = exercise.stream_text(TOKENIZER, arriving())
    assert next(stream) == TOKENIZER.decode(ids[:1]) and len(consumed) == 1
    rest = list(stream)
    assert "" not in rest and TOKENIZER.decode(ids[:1]) + "".join(rest) == TOKENIZER.decode(ids)


@pytest.mark.points(4)
@PROPERTY
@given(text=texts)
def test_deltas_join_to_the_decoded_text(exercise, text):
    """For any text, the deltas joined must equal decode(all ids), and no delta may end in half a character."""
    ids = _ids(text)
    deltas = list(exercise.stream_text(TOKENIZER, ids))
    assert "".join(deltas) == TOKENIZER.decode(ids)
    assert not any(FFFD in d for d in deltas)  # the text had no U+FFFD, so none may appear, even mid-stream


@pytest.mark.points(2)
@PROPERTY
@given(ids=st.lists(st.integers(0, 2047), max_size=30))
def test_any_token_ids_join_to_the_decoded_text(exercise, ids):
    """Even for random token ids (invalid bytes included) the deltas must join to decode(all ids)."""
    assert "".join(exercise.stream_text(TOKENIZER, ids)) == TOKENIZER.decode(ids)


@pytest.mark.points(3)
def test_work_per_token_is_bounded(exercise):
    """Decode only a short window of recent tokens (from prefix_offset), never the whole output again."""
    text = "Streaming 中文 and emoji 😀🎉 and plain words, over and over. " * 12
    ids = _ids(text)
    assert len(ids) > 400
    counting = CountingTokenizer()
    assert "".join(_deltas(exercise, ids, counting)) == TOKENIZER.decode(ids)
    assert max(counting.decoded_lengths) <= 16, "some decode() call was given more than 16 ids"
    assert sum(counting.decoded_lengths) <= 20 * len(ids), "decoding cost grows faster than the output"
