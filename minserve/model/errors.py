"""The errors a checkpoint can raise while it is found, read and loaded (safetensors or GGUF alike)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor and what to change."""


class ModelNotFoundError(CheckpointError, FileNotFoundError):
    """The named model is neither embedded, packaged, a local path, nor reachable on the hub or in its cache."""


class TokenizerError(ValueError):
    """A checkpoint whose tokenizer is missing, unreadable, or of a kind minserve cannot build."""
