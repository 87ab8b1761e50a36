"""What to speculate with, in vLLM's shape: ``LLM(model, speculative_config={...})``.

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"method": "draft_model", "model": "minserve-tiny-draft", "num_speculative_tokens": 3}
    {"method": "early_exit", "num_draft_layers": 8, "num_speculative_tokens": 3}   # the target's first layers

Every mistake is reported with what to change: an unknown method or key, a count below one, a lookup window
whose minimum is above its maximum, a draft method without its model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "early_exit")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``num_speculative_tokens`` (k) drafts per step; the n-gram proposer matches suffixes of
    ``prompt_lookup_min`` … ``prompt_lookup_max`` tokens; the draft-model proposer runs ``model``; the
    early-exit proposer runs the target's first ``num_draft_layers`` layers and its head."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    num_draft_layers: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a whole number ≥ 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                f"({self.prompt_lookup_max}); lower the first or raise the second"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config: method "draft_model" needs "model", e.g. "minserve-tiny-draft"')
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f'speculative_config: method "{self.method}" uses no model of its own; drop "model" '
                             'or use "draft_model"')  # fmt: skip
        if self.method == "early_exit":
            layers = self.num_draft_layers
            if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
                raise ValueError(
                    f'speculative_config: method "early_exit" needs "num_draft_layers", a whole number ≥ 1 '
                    f"(how many of the target's first layers draft), got {layers!r}"
                )
        elif self.num_draft_layers is not None:
            raise ValueError('speculative_config: "num_draft_layers" belongs to method "early_exit"')

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> SpeculativeConfig:
        """The config from vLLM's dict; unknown keys are an error (a typo must not turn speculation off)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; the keys are {sorted(known)}")
        missing = [name for name in ("method", "num_speculative_tokens") if name not in options]
        if missing:
            raise ValueError(f"speculative_config: {missing} must be given")
        return cls(**options)
