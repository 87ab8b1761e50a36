"""Perplexity: exp of the mean negative log-likelihood a model gives each next token of a text.

The text is tokenized once and cut into consecutive windows of ``window_tokens``; each window is one plain
forward pass (nothing cached), and every token after a window's first is scored given the ones before it
in that window. Windows do not overlap, so the first tokens of each window see little context: this is the
standard non-overlapping estimate, a little pessimistic next to a sliding window, and the same for any two
models compared on the same window, which is what chapter 07 needs.

Lower is better; a model that guesses uniformly over a vocabulary of V tokens scores V.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from minserve.model.llama import LlamaForCausalLM
from minserve.model.tokenizer import Tokenizer

DEFAULT_WINDOW_TOKENS = 512  # tokens per forward pass: the CLI's, the chapters' and docs/models.md's window


class HasModel(Protocol):
    """What perplexity needs of an ``LLM``: its model and its tokenizer."""

    model: LlamaForCausalLM
    tokenizer: Tokenizer


@dataclass(frozen=True)
class PerplexityResult:
    """``perplexity`` = exp(``nll_per_token``); ``scored_tokens`` is how many predictions were scored
    (tokens − windows), over ``windows`` windows of at most ``window_tokens`` tokens."""

    perplexity: float
    nll_per_token: float  # nats
    scored_tokens: int
    windows: int
    window_tokens: int


def perplexity(
    llm: HasModel,
    text: str,
    window_tokens: int = DEFAULT_WINDOW_TOKENS,
    max_tokens: int | None = None,
    progress: bool = False,
) -> PerplexityResult:
    """The perplexity of ``llm``'s model on ``text``, over its first ``max_tokens`` tokens when given.

    Raises ``ValueError`` when the text is shorter than two tokens or the window is outside what the model
    can take (2 … its context length).
    """
    model = llm.model
    limit = model.config.max_position_embeddings
    if not 2 <= window_tokens <= limit:
        raise ValueError(f"window_tokens must be between 2 and the model's context ({limit}), got {window_tokens}")
    token_ids = llm.tokenizer.encode(text)[:max_tokens]
    device = next(model.parameters()).device
    stream = torch.tensor(token_ids, dtype=torch.long, device=device)
    return windowed_perplexity(model.logits_without_cache, stream, window_tokens, progress)


def windowed_perplexity(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    token_ids: torch.Tensor,
    window_tokens: int,
    progress: bool = False,
) -> PerplexityResult:
    """The rule itself, for any model: ``logits_of(window)`` gives ``[len(window), vocab]`` logits for a 1-D
    window of token ids, seen with no cache. The stream is cut into non-overlapping windows of
    ``window_tokens``; each window's tokens after its first are scored given the ones before them."""
    # A last window of one token has nothing to predict: it is left out.
    windows = [w for w in token_ids.split(window_tokens) if len(w) >= 2]
    if not windows:
        raise ValueError("the text is shorter than two tokens: there is nothing to predict")
    total_nll = 0.0
    for window in tqdm(windows, desc="perplexity", unit="window", disable=not progress):
        logits = logits_of(window).float()
        total_nll += F.cross_entropy(logits[:-1], window[1:], reduction="sum").item()
    scored = sum(len(w) - 1 for w in windows)
    nll = total_nll / scored
    return PerplexityResult(math.exp(nll), nll, scored, len(windows), window_tokens)
