"""The model's compute backends: the same operations, done by torch or by minserve's Triton kernels.

The model (:mod:`minserve.model.llama`) never computes a normalization, a rotation, an activation or an
attention itself: it asks its backend. Swapping the backend swaps every one of those at once, and nothing
else changes, in the spirit of gpt-fast's swapped modules.

* :class:`TorchBackend` is the reference: plain torch, any device (CPU, CUDA, Apple's MPS).
* :class:`TritonBackend` runs the kernels in ``kernels/`` (imported as ``minserve.kernels``): fused add +
  RMSNorm, rotary in place, SiLU-and-multiply, the KV-cache store, paged prefill attention and split-K
  paged decode attention, which read keys and values through the block table instead of gathering copies
  (from a 16/32-bit cache, or an 8-bit one whose codes they widen in registers).
  It runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (slow: for tests).

``backend="auto"`` (the default) is Triton on a CUDA GPU where Triton is installed, torch everywhere else.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from minserve.model.attention import AttentionMetadata, decode_attention, paged_attention

BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")


@dataclass
class Rope:
    """One step's rotary inputs: token positions and the model's frequencies; cos and sin on demand."""

    positions: torch.Tensor  # [num_tokens]
    inv_freq: torch.Tensor  # [head_dim / 2], float32
    # Kept by hand, not by functools.cached_property: on Python 3.11 and older that takes a lock, which
    # torch.compile cannot trace (a compiled forward would break its graph at every layer).
    _cos_sin: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each ``[num_tokens, 1, head_dim / 2]`` float32: computed once per step, shared by every layer."""
        if self._cos_sin is None:
            angles = self.positions.float()[:, None] * self.inv_freq[None, :]
            self._cos_sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        return self._cos_sin


class TorchBackend:
    """Plain torch: the reference every other backend is tested against."""

    name = "torch"

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, addend: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(h), h)`` with ``h = x + addend`` (or ``x``), normalized in float32."""
        h = x if addend is None else x + addend
        h32 = h.float()
        normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(h.dtype), h

    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate each pair ``(x[i], x[i + head_dim/2])`` of q and k by its token's angle."""
        cos, sin = rope.cos_sin

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.float().chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

        return rotate(q), rotate(k)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store this step's k and v in the cache, then attend (see :func:`paged_attention`); an 8-bit cache
        comes with its per-head ``kv_scales`` (:mod:`minserve.model.kv_quant`).

        A decode step whose tensors were built before the forward (a compiled step, see
        :mod:`minserve.engine.compilation`) attends from them alone (:func:`decode_attention`)."""
        step = meta.step_tensors
        if kv_cache is not None and step is not None and step.all_decode:
            return decode_attention(q, k, v, kv_cache, meta.slot_mapping, meta.block_tables, step.context_lens,
                                    scale, sliding_window, kv_scales)  # fmt: skip
        return paged_attention(q, k, v, kv_cache, meta, scale, sliding_window, kv_scales)


class TritonBackend(TorchBackend):
    """minserve's Triton kernels; what has no kernel (the matmuls) stays torch."""

    name = "triton"

    def __init__(self) -> None:
        from minserve.kernels import decode_attention, kv_store, prefill_attention, rms_norm, rotary, silu_and_mul

        self._decode, self._store = decode_attention.decode_attention, kv_store.store_kv
        self._prefill, self._rms_norm = prefill_attention.prefill_attention, rms_norm.rms_norm
        self._rotary, self._silu_and_mul = rotary.apply_rotary_, silu_and_mul.silu_and_mul

    def rms_norm(self, x, weight, eps, addend=None):
        return self._rms_norm(x, weight, eps, addend)

    def apply_rotary(self, q, k, rope):
        q, k = q.contiguous(), k.contiguous()  # rotated in place: not in the qkv projection's output
        self._rotary(q, k, rope.positions, rope.inv_freq)
        return q, k

    def silu_and_mul(self, gate_up):
        return self._silu_and_mul(gate_up)

    def attention(self, q, k, v, kv_cache, meta, scale, sliding_window, kv_scales=None):
        """Store this step's k and v by kernel, then attend by kernel through the block tables: split-K decode
        when every sequence brings one token, paged prefill otherwise. An 8-bit cache comes with its per-head
        ``kv_scales`` ``[2, num_kv_heads]``: the store writes codes, the attention kernels widen them as they
        read (:mod:`minserve.model.kv_quant` holds the torch side of the same codes)."""
        if kv_cache is None:  # a plain forward with nothing cached (parity tests, perplexity): the reference
            return super().attention(q, k, v, kv_cache, meta, scale, sliding_window)
        self._store(k, v, kv_cache, meta.slot_mapping, kv_scales)
        step = meta.device_tensors(q.device)
        if step.all_decode:
            return self._decode(q, kv_cache, meta.block_tables, step.context_lens, scale, sliding_window,
                                max_context_len=step.max_context_len, kv_scales=kv_scales)  # fmt: skip
        return self._prefill(
            q, kv_cache, meta.block_tables, step.query_starts, step.query_lens, step.context_lens,
            step.max_query_len, scale, sliding_window, kv_scales,
        )  # fmt: skip


def resolve_backend(name: str, device: torch.device) -> TorchBackend:
    """The backend ``name`` stands for on ``device``; raises ``ValueError`` with what to change."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    triton_installed = importlib.util.find_spec("triton") is not None
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_installed else "torch"
    if name == "torch":
        return TorchBackend()
    if not triton_installed:
        raise ValueError("backend='triton' needs the triton package (Linux; pip install triton); use 'torch'")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type != "cuda" and not (device.type == "cpu" and interpreting):
        raise ValueError(
            f"backend='triton' runs on a CUDA GPU, or on the CPU with TRITON_INTERPRET=1 set before triton is "
            f"imported (slow: for tests); the model is on {device}: use backend='torch' or 'auto'"
        )
    return TritonBackend()
