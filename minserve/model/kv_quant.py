"""An 8-bit KV cache: keys and values stored as int8 or fp8 codes, with one scale per layer and KV head.

A token's keys and values are what a long context is made of (chapter 04), so their bytes decide how many
tokens fit: 8 bits instead of 16 hold twice the tokens, instead of 32 four times. The cache keeps its
shape, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, in a one-byte dtype, and each layer has a
``[2, num_kv_heads]`` float32 tensor of scales (keys' row 0, values' row 1): the stored code times its
head's scale is the value.

The scales are *static*: measured once, when the engine starts, by running a calibration text through the
model and taking each head's largest magnitude (:func:`calibrate_kv_scales`), with headroom for inputs
that reach further. Static scales need no extra bytes per token, so the capacity is exactly the 2× or 4×;
a value beyond a head's range is clipped to it. (vLLM's fp8 cache takes per-layer scales the same way.)

* ``int8``: symmetric, 127 levels each side: the headroom costs resolution;
* ``fp8`` (e4m3): 3 mantissa bits, a relative step of 2⁻³ everywhere in its range, so small values keep
  their precision and a head's few large channels cost the others nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

FP8_E4M3 = getattr(torch, "float8_e4m3fn", None)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "int8": torch.int8, "fp8": FP8_E4M3}
CODE_MAX = {torch.int8: 127.0} | ({FP8_E4M3: 448.0} if FP8_E4M3 is not None else {})
HEADROOM = 1.5  # scales cover 1.5 × the largest magnitude seen in calibration
CALIBRATION_TOKENS = 512


def calibration_text() -> str:
    """What the scales are measured on: the source of Python's ``json`` package, prose docstrings and code
    (on every machine with Python; not the held-out text the quality measurements score)."""
    import inspect
    import json.decoder
    import json.encoder

    return "\n".join(inspect.getsource(module) for module in (json, json.decoder, json.encoder))


def check_kv_cache_dtype(name: str) -> None:
    """Raise ``ValueError`` naming the choices unless ``name`` is one of :data:`KV_CACHE_DTYPES`."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: the model's own for ``"auto"``, else int8 or float8_e4m3fn."""
    check_kv_cache_dtype(name)
    dtype = KV_CACHE_DTYPES[name]
    if name == "fp8" and dtype is None:
        raise ValueError(f"kv_cache_dtype='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks")
    return model_dtype if dtype is None else dtype


def is_quantized(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype in CODE_MAX


def quantize_kv(x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[tokens, heads, head_dim]`` values → codes of ``dtype``, with ``scales[h]`` per head; clipped."""
    limit = CODE_MAX[dtype]
    scaled = (x.float() / scales[None, :, None]).clamp(-limit, limit)
    return scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes ``[..., heads, head_dim]`` → values of ``dtype``, the head axis second from last."""
    return (codes.to(torch.float32) * scales[..., None]).to(dtype)


def calibrate_kv_scales(
    model: nn.Module, token_ids: torch.Tensor, dtype: torch.dtype, headroom: float = HEADROOM
) -> list[torch.Tensor]:
    """Per layer, ``[2, num_kv_heads]`` scales for a cache of ``dtype``: each head's largest |key| and
    |value| on ``token_ids`` (:func:`kv_absmax`), times ``headroom``, mapped to the largest code."""
    return [largest.clamp(min=1e-6) * headroom / CODE_MAX[dtype] for largest in kv_absmax(model, token_ids)]


def kv_absmax(model: nn.Module, token_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, ``[2, num_kv_heads]``: the largest |key| and |value| each head produces on ``token_ids``,
    from one plain forward (nothing cached)."""
    with _recording_attention(model) as seen:
        model.logits_without_cache(token_ids)
    return seen


@contextmanager
def _recording_attention(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """While inside, every layer's attention call appends its keys' and values' per-head largest magnitude,
    ``[2, num_kv_heads]``, in layer order: the backend is swapped for one that looks, then computes."""
    seen: list[torch.Tensor] = []
    inner = model.backend
    recording = _RecordingBackend(inner, seen)
    model.set_backend(recording)
    try:
        yield seen
    finally:
        model.set_backend(inner)


class _RecordingBackend:
    """The model's own backend, with a look at every layer's k and v on the way into attention."""

    def __init__(self, inner, seen: list[torch.Tensor]) -> None:
        self.inner, self.seen = inner, seen

    def __getattr__(self, name: str):  # norms, rotary, activations, the name: the inner backend's own
        return getattr(self.inner, name)

    def attention(self, q, k, v, kv_cache, meta, scale, sliding_window, kv_scales=None):
        self.seen.append(torch.stack([k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))]).float())
        return self.inner.attention(q, k, v, kv_cache, meta, scale, sliding_window, kv_scales)
