"""Chapter 02's hidden tests (``minserve grade ch02 --hidden``): the public tests' properties with another
tokenizer (SmolLM2's 49,152-token byte-level BPE, read from the GGUF file that ships with the course), other
scripts and a longer stream, so a detokenizer fitted to the tiny model's vocabulary does not pass these.
Instructors only: this file sits under ``exercises/solutions/``, which the learner's copy never holds.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve.model.loader import resolve_model_path
from minserve.model.tokenizer import Tokenizer

FFFD = "\ufffd"
PROPERTY = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Scripts the public tests do not use: Devanagari, Thai, Arabic, Greek, emoji with skin tones and joiners.
OTHER_CHARACTERS = "नमस्ते दुनिया สวัสดีครับ مرحبا بالعالم Καλημέρα 👍🏽👩‍👩‍👧‍👦🇫🇷 ok\n"


@functools.cache
def _smollm2() -> Tokenizer:
    return Tokenizer(resolve_model_path("smollm2-135m-instruct"))


class _Counting:
    """A tokenizer that records how many ids each ``decode`` call was given."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(token_ids))
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


@pytest.mark.points(3)
@PROPERTY
@given(text=st.text(alphabet=st.sampled_from(OTHER_CHARACTERS), min_size=1, max_size=60))
def test_another_vocabulary_and_other_scripts(exercise, text):
    """SmolLM2's tokenizer on Devanagari, Thai, Arabic, Greek and joined emoji: the deltas join to decode(all
    ids) and none holds a U+FFFD."""
    tokenizer = _smollm2()
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = list(exercise.stream_text(tokenizer, ids))
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any(FFFD in d for d in deltas)


@pytest.mark.points(2)
def test_a_long_stream_in_another_vocabulary_stays_bounded(exercise):
    """Over 2,000 tokens of SmolLM2's, no decode() call gets more than 16 ids and the total stays linear."""
    tokenizer = _smollm2()
    ids = tokenizer.encode(OTHER_CHARACTERS * 40, add_special_tokens=False)
    assert len(ids) > 2000
    counting = _Counting(tokenizer)
    detokenizer = exercise.IncrementalDetokenizer(counting)
    deltas = [detokenizer.add(i) for i in ids] + [detokenizer.flush()]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert max(counting.lengths) <= 16 and sum(counting.lengths) <= 20 * len(ids)


@pytest.mark.points(1)
def test_special_tokens_of_another_vocabulary(exercise):
    """SmolLM2's end of turn (<|im_end|>) is dropped by default and kept with skip_special_tokens=False."""
    tokenizer = _smollm2()
    ids = [*tokenizer.encode("done", add_special_tokens=False), tokenizer.eos_token_id]
    assert "".join(exercise.stream_text(tokenizer, ids)) == "done"
    assert "".join(exercise.stream_text(tokenizer, ids, skip_special_tokens=False)) == "done" + tokenizer.eos_token
