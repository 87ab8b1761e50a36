"""User-facing configuration: one frozen dataclass per concern, checked when it is built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Which model to load, in what precision, where.

    ``dtype`` is ``"auto"`` (float32 on the CPU, the checkpoint's dtype on a GPU), ``"float32"``,
    ``"bfloat16"`` or ``"float16"``. ``max_model_len`` caps the context (tokens) below the model's own.
    """

    model: str = "minserve-tiny"
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"EngineConfig.max_model_len must be an integer ≥ 2 or None, got {self.max_model_len!r}")
