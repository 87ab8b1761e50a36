"""The roofline: how fast a phase of inference can go on an accelerator, from FLOPs and bytes alone.

An accelerator does at most ``peak`` FLOP/s and moves at most ``bandwidth`` bytes/s between its memory and its
compute units. A piece of work of ``F`` FLOPs that must move ``B`` bytes takes at least

    time ≥ max(F / peak, B / bandwidth)

and which term wins depends on its *arithmetic intensity* ``I = F / B`` (FLOP per byte) against the
accelerator's *ridge point* ``peak / bandwidth``: below it the work is memory-bound, above it compute-bound.
The attainable FLOP/s is ``min(peak, I × bandwidth)``: a roof with a slanted left side.

A dense transformer does about 2 FLOPs per parameter per token (one multiply and one add per weight), so

* **prefill** of ``T`` prompt tokens reads every weight once and does ``2 × params × T`` FLOPs: intensity
  grows with ``T`` and long prompts are compute-bound;
* a **decode step** of a batch of ``B`` sequences reads every weight once *plus each sequence's KV cache* and
  does ``2 × params × B`` FLOPs: in bf16 (2 bytes a weight) the weights' intensity is ``B`` FLOP/byte, so
  decode is memory-bound until ``B`` reaches the *critical batch size* ``peak / bandwidth`` (H100: 989e12 /
  3.35e12 ≈ 295), and the KV reads, which grow with ``B`` too, push that further away.

Assumptions, stated once: one accelerator; dense (not 2:4 sparse) peak FLOP/s in the table's dtype; the
weights are read from memory once per forward pass (no cache holds them); activations are not counted
(they are small against the weights at decode and are kept on chip by fused kernels at prefill); the
logits are computed for the last token of each sequence only, as vLLM and minserve do. These make the
predictions *lower bounds* on time: real kernels reach some fraction of either roof, and a tiny model on a
CPU is dominated by per-operation overhead the roofline does not see.

Units are in the names: ``_s`` seconds, ``_bytes``, ``_flops`` (a count), ``_flops_per_s``,
``_bytes_per_s``, ``_flops_per_byte``, ``_tokens``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Literal

from minserve.capacity.kv import Dtype, ModelLike, dtype_bytes, kv_bytes_per_token, model_config
from minserve.capacity.memory import attention_params, expert_params, mlp_params, router_params
from minserve.model.config import ModelConfig

GB = 10**9


@dataclass(frozen=True)
class Hardware:
    """One accelerator's roofs: dense peak FLOP/s in ``dtype``, memory bandwidth, memory size, and where from."""

    name: str
    peak_flops_per_s: float  # dense (no 2:4 sparsity), in `dtype`
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    dtype: str = "bfloat16"  # the dtype the peak is for (and the dtype measured, for "this machine")
    source: str = ""

    @property
    def ridge_point_flops_per_byte(self) -> float:
        """Arithmetic intensity where the two roofs meet: ``peak / bandwidth``."""
        return ridge_point_flops_per_byte(self)


# Published datasheet numbers, dense bf16 (the sparse figures NVIDIA headlines are twice these).
HARDWARE: dict[str, Hardware] = {
    "H100": Hardware(
        "H100 SXM", 989e12, 3.35e12, 80 * GB, source="NVIDIA H100 datasheet: 1,979 TFLOPS bf16 with sparsity"
    ),
    "H200": Hardware(
        "H200 SXM", 989e12, 4.8e12, 141 * GB, source="NVIDIA H200 datasheet: H100's compute, HBM3e 4.8 TB/s"
    ),
    "A100": Hardware(
        "A100 SXM 80GB", 312e12, 2.039e12, 80 * GB, source="NVIDIA A100 datasheet: 624 TFLOPS bf16 with sparsity"
    ),
    "L4": Hardware("L4", 121e12, 300e9, 24 * GB, source="NVIDIA L4 datasheet: 242 TFLOPS bf16 with sparsity"),
    # HGX B200 datasheet (2024): FP16/BF16 Tensor Core 4.5 PFLOPS per GPU *with sparsity*, so 2.25 PFLOPS
    # dense; 180 GB HBM3e per GPU (1.4 TB per 8-GPU board) at 8 TB/s (a later revision lists 7.7 TB/s). The
    # first announcement said 192 GB; GB200's B200 runs at 2.5 PFLOPS.
    "B200": Hardware("B200 (HGX)", 2.25e15, 8e12, 180 * GB, source="published dense bf16, NVIDIA HGX B200 datasheet"),
    "MI300X": Hardware("MI300X", 1307e12, 5.3e12, 192 * GB, source="AMD MI300X datasheet: 1,307.4 TFLOPS bf16 dense"),
}
THIS_MACHINE = "this"  # the name hardware() measures instead of looking up


def hardware(name: str) -> Hardware:
    """A table entry by short or full name, any case (``"h100"``, ``"H100 SXM"``); ``"this"`` measures this
    machine with :func:`measure_this_machine`. An unknown name raises ``ValueError`` naming the choices."""
    if name.strip().lower() == THIS_MACHINE:
        return measure_this_machine()
    for key, entry in HARDWARE.items():
        if name.strip().lower() in (key.lower(), entry.name.lower()):
            return entry
    raise ValueError(f"unknown GPU {name!r}; choose one of: {', '.join([*HARDWARE, THIS_MACHINE])}")


# --- the roofline itself ------------------------------------------------------------------------------------


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOP per byte moved to or from memory: how much work each byte fetched pays for."""
    if bytes_moved <= 0:
        raise ValueError(f"bytes_moved must be positive, got {bytes_moved}")
    return flops / bytes_moved


def ridge_point_flops_per_byte(hw: Hardware) -> float:
    """``peak / bandwidth``: work below this intensity is memory-bound, above it compute-bound."""
    return hw.peak_flops_per_s / hw.memory_bandwidth_bytes_per_s


def critical_batch_size(hw: Hardware, weight_dtype: Dtype | None = None) -> float:
    """Decode batch at which reading the weights once stops being the bottleneck (KV reads ignored).

    A decode step of batch ``B`` does ``2 × B`` FLOPs per weight and reads each weight's bytes once, so its
    intensity is ``2B / bytes per weight``; it reaches the ridge point at ``B = ridge × bytes per weight / 2``.
    In bf16 that is the ridge point itself: H100 989e12 / 3.35e12 ≈ 295, H200 989e12 / 4.8e12 ≈ 206.
    ``weight_dtype`` defaults to the hardware's own dtype.
    """
    return ridge_point_flops_per_byte(hw) * dtype_bytes(weight_dtype or hw.dtype) / 2


def attainable_flops_per_s(hw: Hardware, intensity_flops_per_byte: float) -> float:
    """The roof: ``min(peak, intensity × bandwidth)`` FLOP/s."""
    return min(hw.peak_flops_per_s, intensity_flops_per_byte * hw.memory_bandwidth_bytes_per_s)


def attention_intensity_flops_per_byte(
    query_tokens: int, context_tokens: int, dtype: Dtype = "bfloat16", queries_per_kv: int = 1
) -> float:
    """Intensity of attention of ``query_tokens`` queries over ``context_tokens`` keys, per K/V head.

    Per KV head of width ``d`` with ``g`` query heads sharing it: ``QKᵀ`` and ``PV`` do ``4·g·d·S·T`` FLOPs
    (S keys, T queries); the kernel reads K and V (``2·S·d`` elements) and Q and writes the output
    (``2·g·T·d``). So ``I = (2 / bytes) · g·S·T / (S + g·T)``, which in 16-bit multi-head attention is the
    textbook ``S·T / (S + T)``. It is below ``min(S, T)``: decode (``T = 1``) has intensity ≈ 1 whatever the
    context and whatever the batch, because every sequence reads its *own* KV cache; only prefill (``T ≈ S``,
    intensity ≈ S/2) makes attention compute-bound. Grouped-query attention raises decode's to ≈ ``g``.
    """
    if query_tokens <= 0 or context_tokens <= 0 or queries_per_kv <= 0:
        raise ValueError("query_tokens, context_tokens and queries_per_kv must be positive")
    g, s, t = queries_per_kv, context_tokens, query_tokens
    return 2 / dtype_bytes(dtype) * g * s * t / (s + g * t)


# --- FLOPs and bytes of a forward pass ----------------------------------------------------------------------


def layer_matmul_params(config: ModelConfig, layer: int = 0) -> int:
    """Weights one token multiplies by in decoder layer ``layer``: q, k, v, o and gate, up, down (with any
    biases); in a mixture-of-experts layer, the router and the ``num_experts_per_tok`` experts it chose."""
    if layer in config.moe_layers:
        return attention_params(config) + router_params(config) + config.num_experts_per_tok * expert_params(config)
    return attention_params(config) + mlp_params(config)


def experts_touched(config: ModelConfig, tokens: int) -> float:
    """Experts of one sparse layer that at least one of ``tokens`` tokens is routed to, expected under uniform
    routing: ``E · (1 − (1 − k/E)^tokens)``. One token reads k experts' weights; a large batch reads them all,
    which is why a mixture of experts is cheap to decode alone and costs its full size in bytes at scale."""
    experts, top_k = config.num_experts, config.num_experts_per_tok
    return experts * (1 - (1 - top_k / experts) ** tokens)


def decoder_matmul_params(config: ModelConfig) -> int:
    """Weights one token multiplies by through every decoder layer (its own experts only, in a sparse layer)."""
    return sum(layer_matmul_params(config, layer) for layer in range(config.num_layers))


def decoder_read_params(config: ModelConfig, tokens: int | None = None) -> float:
    """Weights a forward pass of ``tokens`` tokens reads from the decoder layers, each once: every matrix of a
    dense layer; of a sparse one, the router and the experts some token was routed to (``None``: all of them)."""
    total = 0.0
    for layer in range(config.num_layers):
        if layer in config.moe_layers:
            experts = config.num_experts if tokens is None else experts_touched(config, tokens)
            total += attention_params(config) + router_params(config) + experts * expert_params(config)
        else:
            total += attention_params(config) + mlp_params(config)
    return total


def lm_head_params(config: ModelConfig) -> int:
    """The LM head, hidden → vocabulary (the embedding matrix itself when the two are tied)."""
    return config.vocab_size * config.hidden_size


def flops_per_token(model: ModelLike) -> int:
    """Matmul FLOPs of one token through the whole model, attention scores excluded: 2 × multiplied weights.

    This is the "≈ 2 × params" rule, made exact: the embedding is looked up, not multiplied, so an untied
    embedding adds parameters but no FLOPs (Llama-3-8B: 2 × 7.5e9, against 2 × 8.03e9 parameters).
    """
    config = model_config(model)
    return 2 * (decoder_matmul_params(config) + lm_head_params(config))


def weights_read_bytes(model: ModelLike, dtype: Dtype = "bfloat16", tokens: int | None = None) -> int:
    """Bytes of weights one forward pass of ``tokens`` tokens reads: every layer's matrices and the LM head,
    each once (a mixture of experts: only the experts the tokens are routed to, :func:`experts_touched`;
    ``tokens=None`` counts them all).

    Norm vectors are left out (a few kilobytes), and so is an untied embedding table: only the rows of the
    batch's tokens are read from it.
    """
    config = model_config(model)
    return round((decoder_read_params(config, tokens) + lm_head_params(config)) * dtype_bytes(dtype))


def attended_keys(query_tokens: int, context_tokens: int, sliding_window_tokens: int | None = None) -> int:
    """Query-key pairs when the last ``query_tokens`` of a ``context_tokens`` sequence attend causally.

    The i-th new token (``i = 1 … T``) sees ``P + i`` keys, ``P = context − T`` cached before it, or at most
    the sliding window. Without a window: ``P·T + T(T + 1)/2``.
    """
    if not 0 <= query_tokens <= context_tokens:
        raise ValueError(f"need 0 ≤ query_tokens ≤ context_tokens, got {query_tokens}, {context_tokens}")

    def visible(n: int) -> int:  # Σ_{k=1..n} min(k, window)
        w = sliding_window_tokens
        return n * (n + 1) // 2 if w is None or n <= w else w * (w + 1) // 2 + (n - w) * w

    return visible(context_tokens) - visible(context_tokens - query_tokens)


def attention_flops(model: ModelLike, query_tokens: int, context_tokens: int) -> int:
    """Attention-score FLOPs (``QKᵀ`` and ``PV``, 2 FLOPs a multiply-add each) of one sequence, all layers:
    ``4 × heads × head_dim × query-key pairs × layers``."""
    config = model_config(model)
    pairs = attended_keys(query_tokens, context_tokens, config.sliding_window)
    return 4 * config.num_heads * config.head_dim * pairs * config.num_layers


def prefill_flops(model: ModelLike, prompt_tokens: int, batch: int = 1) -> int:
    """FLOPs of prefilling ``batch`` prompts of ``prompt_tokens``: matmuls for every token through the layers,
    the LM head for the last token only (the only one sampled), and causal attention over the prompt."""
    config = model_config(model)
    layers = 2 * decoder_matmul_params(config) * prompt_tokens
    head = 2 * lm_head_params(config) if prompt_tokens else 0
    return batch * (layers + head + attention_flops(config, prompt_tokens, prompt_tokens))


def prefill_bytes(
    model: ModelLike, prompt_tokens: int, dtype: Dtype = "bfloat16", batch: int = 1, kv_dtype: Dtype | None = None
) -> int:
    """Bytes a prefill moves: the weights once, and the K/V of every prompt token written to the cache."""
    config = model_config(model)
    kv = batch * prompt_tokens * kv_bytes_per_token(config, kv_dtype or dtype)
    return weights_read_bytes(config, dtype, tokens=batch * prompt_tokens) + kv


def decode_flops(model: ModelLike, batch: int, context_tokens: int) -> int:
    """FLOPs of one decode step: ``batch`` new tokens through every matmul and the LM head, each attending to
    ``context_tokens`` keys (its own included)."""
    config = model_config(model)
    return batch * (flops_per_token(config) + attention_flops(config, 1, context_tokens))


def decode_bytes(
    model: ModelLike, batch: int, context_tokens: int, dtype: Dtype = "bfloat16", kv_dtype: Dtype | None = None
) -> int:
    """Bytes one decode step moves: the weights once for the whole batch, plus every sequence's own KV cache
    (``context_tokens`` tokens each, the new token's K/V among them). Only the weights are shared."""
    config = model_config(model)
    kv = batch * context_tokens * kv_bytes_per_token(config, kv_dtype or dtype)
    return weights_read_bytes(config, dtype, tokens=batch) + kv


# --- predictions --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """The roofline's verdict on one piece of work on one accelerator."""

    flops: float
    bytes: float
    compute_s: float  # flops / peak
    memory_s: float  # bytes / bandwidth

    @property
    def time_s(self) -> float:
        """The lower bound on time: whichever roof binds."""
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> Literal["compute", "memory"]:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def intensity_flops_per_byte(self) -> float:
        return arithmetic_intensity(self.flops, self.bytes)


def predict(flops: float, bytes_moved: float, hw: Hardware) -> Prediction:
    """Time of ``flops`` FLOPs moving ``bytes_moved`` bytes at ``hw``'s roofs."""
    return Prediction(flops, bytes_moved, flops / hw.peak_flops_per_s, bytes_moved / hw.memory_bandwidth_bytes_per_s)


def predict_prefill(
    model: ModelLike,
    prompt_tokens: int,
    hw: Hardware,
    dtype: Dtype | None = None,
    batch: int = 1,
    kv_dtype: Dtype | None = None,
) -> Prediction:
    """Roofline prediction for prefilling ``batch`` prompts of ``prompt_tokens`` in one pass on ``hw``.
    ``dtype`` (of the weights) defaults to the hardware's own; ``kv_dtype`` to ``dtype``."""
    config, dtype = model_config(model), dtype or hw.dtype
    flops = prefill_flops(config, prompt_tokens, batch)
    return predict(flops, prefill_bytes(config, prompt_tokens, dtype, batch, kv_dtype), hw)


def predict_decode(
    model: ModelLike,
    batch: int,
    context_tokens: int,
    hw: Hardware,
    dtype: Dtype | None = None,
    kv_dtype: Dtype | None = None,
) -> Prediction:
    """Roofline prediction for one decode step of ``batch`` sequences of ``context_tokens`` each on ``hw``."""
    config, dtype = model_config(model), dtype or hw.dtype
    flops = decode_flops(config, batch, context_tokens)
    return predict(flops, decode_bytes(config, batch, context_tokens, dtype, kv_dtype), hw)


def prefill_time_s(
    model: ModelLike, prompt_tokens: int, hw: Hardware, dtype: Dtype | None = None, batch: int = 1
) -> float:
    """Predicted seconds to prefill (a lower bound): ``max(FLOPs / peak, bytes / bandwidth)``."""
    return predict_prefill(model, prompt_tokens, hw, dtype, batch).time_s


def decode_step_time_s(
    model: ModelLike, batch: int, context_tokens: int, hw: Hardware, dtype: Dtype | None = None
) -> float:
    """Predicted seconds per decode step (a lower bound); each of the ``batch`` sequences gets one token."""
    return predict_decode(model, batch, context_tokens, hw, dtype).time_s


# --- this machine, measured ---------------------------------------------------------------------------------


def measure_this_machine(
    copy_mib: int = 256, matmul_size: int = 1024, repeats: int = 5, device: str = "cpu", dtype: str = "float32"
) -> Hardware:
    """This machine's roofs, measured by a short probe (well under a second on a 2-core CPU at the defaults).

    Bandwidth: copy a ``copy_mib`` MiB tensor into another (bytes moved = read + write = 2 × its size, as
    STREAM's "copy" counts them). FLOP/s: multiply two ``matmul_size``² matrices (``2n³`` FLOPs). Each is
    run once to warm up, then ``repeats`` times; the best run counts, since the question is what the machine
    *can* do. Source and destination together (512 MiB at the default) must outgrow the last-level cache,
    or the probe measures the cache (server CPUs have L3 caches of hundreds of MiB). Smaller sizes (for a
    test) give noisier numbers. ``dtype`` is what the matmul runs in (recorded on the result).
    """
    import torch  # here, not at the top: the rest of this module is arithmetic

    if copy_mib <= 0 or matmul_size <= 0 or repeats <= 0:
        raise ValueError("copy_mib, matmul_size and repeats must be positive")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype (try 'float32' or 'bfloat16')")
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def best_s(fn) -> float:
        fn()
        sync()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return min(times)

    elements = copy_mib * 2**20 // torch.tensor([], dtype=torch_dtype).element_size()
    src = torch.ones(elements, dtype=torch_dtype, device=dev)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * src.element_size() / best_s(lambda: dst.copy_(src))
    a = torch.randn(matmul_size, matmul_size, device=dev).to(torch_dtype)
    b = torch.randn(matmul_size, matmul_size, device=dev).to(torch_dtype)
    flops = 2 * matmul_size**3 / best_s(lambda: a @ b)
    if dev.type == "cuda":
        memory, name = torch.cuda.get_device_properties(dev).total_memory, torch.cuda.get_device_name(dev)
    else:
        memory, name = _physical_memory_bytes(), f"this machine (CPU, {torch.get_num_threads()} threads)"
    return Hardware(
        name=name,
        peak_flops_per_s=flops,
        memory_bandwidth_bytes_per_s=bandwidth,
        memory_bytes=memory,
        dtype=dtype,
        source=f"measured: best of {repeats}, {copy_mib} MiB copy, {matmul_size}² {dtype} matmul on {device}",
    )


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        return 0


def measure_read_bandwidth(read_mib: int = 256, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s a streaming *read* reaches on this machine with torch's current thread count: the best of
    ``repeats`` sums over a ``read_mib`` MiB float32 tensor (after one warm-up), bytes read ÷ seconds.

    A decode step reads its weights and writes almost nothing, so this, not :func:`measure_this_machine`'s
    copy (a read and a write of every byte), is the roof a weight read runs into. The tensor must outgrow the
    last-level cache, or the probe measures the cache. Set the engine's thread count first: one core
    streams less than all of them.
    """
    import torch

    if read_mib <= 0 or repeats <= 0:
        raise ValueError("read_mib and repeats must be positive")
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    data = torch.ones(read_mib * 2**20 // 4, dtype=torch.float32, device=dev)
    data.sum()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        sync()
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best
