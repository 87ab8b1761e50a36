"""Admission checks: a request's prompt as token ids, refused early if it could never run.

The offline engine and the server's front end both use this, so a request is judged the same way wherever it
enters. It needs only the tokenizer and three numbers, never the model, so a process that does not hold the
model (the HTTP server, when the engine core runs in a process of its own) can check requests itself.
"""

from __future__ import annotations

from minserve.engine.sampling_params import SamplingParams
from minserve.model.tokenizer import Tokenizer

Prompt = str | list[int]


class InputProcessor:
    """Tokenizes and checks prompts against the context length and the KV cache's size (both in tokens)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, kv_capacity_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens

    def encode(self, prompt: Prompt, index: int | None = None) -> list[int]:
        """Token ids of a prompt, checked. ``index`` only makes the error message point at the prompt."""
        where = "prompt" if index is None else f"prompt {index}"
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"{where}: token ids must be integers in [0, {self.vocab_size})")
        if not ids:
            raise ValueError(f"{where}: the prompt is empty")
        return ids

    def check_fits(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request that could never run: too long for the context, or for the whole KV cache."""
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens leave no room to generate within the context of {self.max_model_len} "
                "tokens; shorten the prompt"
            )
        needed = min(n + params.max_tokens, self.max_model_len)
        if needed > self.kv_capacity_tokens:
            raise ValueError(
                f"max_tokens: prompt ({n}) + max_tokens ({params.max_tokens}) = {needed} tokens is more than the "
                f"whole KV cache holds ({self.kv_capacity_tokens} tokens); lower max_tokens or give the cache more "
                "memory"
            )
