"""Perplexity on the held-out text: a trained model beats chance and the same text reversed."""

import math

import pytest
import torch

from minserve import LLM
from minserve.quality import held_out_text, perplexity


@pytest.fixture(scope="module")
def llm():
    return LLM("minserve-tiny", dtype="float32", device="cpu")


def test_held_out_text_is_stable_english():
    text = held_out_text()
    assert len(text) > 100_000 and text == held_out_text()
    assert held_out_text(1000) == text[:1000]
    assert "statement" in text  # the language reference's prose, not code


def test_trained_model_beats_uniform_and_its_scrambled_self(llm):
    text = held_out_text(4000)
    trained = perplexity(llm, text, window_tokens=128)
    assert trained.perplexity < llm.tokenizer.vocab_size / 4  # far better than uniform guessing
    assert math.isclose(trained.perplexity, math.exp(trained.nll_per_token))
    # The same text with its words in reverse order: a model that uses context must find it less likely.
    scrambled = " ".join(reversed(text.split()))
    assert perplexity(llm, scrambled, window_tokens=128).perplexity > trained.perplexity * 1.2


def test_every_token_after_a_windows_first_is_scored(llm):
    text = held_out_text(2000)
    tokens = len(llm.tokenizer.encode(text))
    result = perplexity(llm, text, window_tokens=64)
    full, rest = divmod(tokens, 64)
    windows = full + (rest >= 2)  # a last window of one token has nothing to predict
    assert (result.windows, result.scored_tokens) == (windows, full * 63 + max(rest - 1, 0))
    assert perplexity(llm, text, window_tokens=64, max_tokens=100).scored_tokens == 63 + 35


def test_a_model_with_random_weights_is_near_uniform(llm):
    state = {k: v.clone() for k, v in llm.model.state_dict().items()}
    try:
        with torch.no_grad():
            for p in llm.model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.02)  # matrices: small random weights
                else:
                    p.fill_(1.0)  # norm scales: identity
        noisy = perplexity(llm, held_out_text(2000), window_tokens=64)
        assert noisy.perplexity > llm.tokenizer.vocab_size / 3
    finally:
        llm.model.load_state_dict(state)


def test_bad_inputs_say_what_to_change(llm):
    with pytest.raises(ValueError, match="shorter than two tokens"):
        perplexity(llm, "")
    with pytest.raises(ValueError, match="window_tokens"):
        perplexity(llm, "hello world", window_tokens=1)


def test_the_cli_reports_perplexity(capsys):
    from minserve.cli import main

    assert main(["perplexity", "--model", "minserve-tiny", "--max-tokens", "300", "--window-tokens", "100"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["perplexity", "--model", "minserve-tiny", "--window-tokens", "1"]) == 2  # a clear error, no traceback
