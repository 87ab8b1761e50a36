"""The parallelism planner (chapter 06): which ways of splitting a model over ``n`` GPUs fit, and how fast
each decodes.

A **layout** splits the GPUs three ways, ``TP × PP × DP = n``:

* **tensor parallel** (TP, :mod:`minserve.parallel.sharding`): every layer's matrices are cut across ``t``
  GPUs; each reads ``1 / t`` of the weights and KV cache per step, and the slices meet in two all-reduces of
  ``[tokens, hidden]`` per layer (after attention, after the MLP), one after the embedding and an all-gather
  of the logits;
* **pipeline parallel** (PP): the layers are cut into ``p`` consecutive stages, each on its own GPUs; a
  stage hands its ``[tokens, hidden]`` activations to the next. A batch split into ``m`` micro-batches
  keeps stages busy at once, but the first micro-batch must fill the pipe and the last drain it: with equal
  stages, a step takes ``(m + p − 1)`` stage times, of which ``(p − 1) / (m + p − 1)`` is the *bubble*;
* **data parallel** (DP): ``d`` independent replicas, each with its own batch behind a router: throughput
  times ``d``, latency unchanged.

Expert parallelism (MoE layers' experts spread over GPUs, tokens exchanged all-to-all) needs MoE presets,
which :mod:`minserve.capacity.presets` does not have; the chapter covers it in prose.

Per GPU, a decode step of ``b`` sequences costs the roofline's ``max(compute, memory)`` on that GPU's share
of the FLOPs and bytes (:func:`minserve.capacity.roofline.predict`, on a model of the stage's layers), plus
the collectives (:mod:`minserve.capacity.interconnect`), which this model does not overlap with compute
(minserve's and gpt-fast's all-reduces block; overlapping them is an optimisation some engines make). The
pipeline flushes every step, since each sequence's next token needs its last one: a step is the time the
first micro-batch takes through every stage plus ``m − 1`` times the slowest stage's. Every sequence gets
one token a step, so the step time *is* the time per output token.

Assumptions, stated once: the roofline's (weights read once per micro-batch per GPU, activations not
counted); layers split as the engine splits them, as evenly as they go;
the embedding on the first stage, the head on the last (a tied head on both when ``p > 1``); norms
replicated on every tensor-parallel rank, biases counted as split; KV memory without block rounding; one
link for every collective and hand-off; the sampled tokens' way back to the first stage not counted (a few
bytes a sequence where the last stage samples). The batch is *per replica*.

Units: ``_bytes``, ``_s`` (seconds), ``_tokens``; ``tokens_per_s`` is generated tokens per second.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal

from minserve.capacity import roofline
from minserve.capacity.interconnect import Interconnect, ring_all_gather_s, ring_all_reduce_s, send_s
from minserve.capacity.kv import Dtype, ModelLike, dtype_bytes, kv_bytes_per_token, model_config
from minserve.capacity.memory import DEFAULT_GPU_MEMORY_UTILIZATION, decoder_params
from minserve.capacity.roofline import Hardware
from minserve.model.config import ModelConfig
from minserve.parallel.pipeline import check_pipeline_parallel, stage_layers
from minserve.parallel.sharding import check_tensor_parallel

Term = Literal["compute", "memory", "communication", "pipeline bubble"]


@dataclass(frozen=True)
class Layout:
    """How ``gpus = TP × PP × DP`` GPUs split the work (vLLM's names for the three sizes)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if min(self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size) < 1:
            raise ValueError(f"every parallel size must be at least 1, got {self}")

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def name(self) -> str:
        """``"TP4×PP2"``: the sizes above 1 (``"1 GPU"`` when none is)."""
        sizes = {"TP": self.tensor_parallel_size, "PP": self.pipeline_parallel_size, "DP": self.data_parallel_size}
        return "×".join(f"{kind}{size}" for kind, size in sizes.items() if size > 1) or "1 GPU"

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``"TP4xPP2"``, ``"tp4×pp2×dp1"`` or ``"1 GPU"`` → a :class:`Layout` (a missing size is 1)."""
        parts = [part for part in re.split(r"[x×*]", text.strip().lower().replace(" ", "")) if part]
        sizes = {"tp": 1, "pp": 1, "dp": 1}
        for part in parts if parts != ["1gpu"] else []:
            match = re.fullmatch(r"(tp|pp|dp)(\d+)", part)
            if match is None:
                raise ValueError(f"layout {text!r}: write it like TP4xPP2xDP1 (TP, PP and DP sizes)")
            sizes[match.group(1)] = int(match.group(2))
        return cls(sizes["tp"], sizes["pp"], sizes["dp"])


def layouts(model: ModelLike, gpus: int) -> list[Layout]:
    """Every layout of exactly ``gpus`` GPUs whose tensor-parallel size splits the model's heads, KV heads and
    MLP evenly (:func:`minserve.parallel.check_tensor_parallel`) and whose stages each hold a layer, most
    tensor parallelism first."""
    config = model_config(model)
    if gpus < 1:
        raise ValueError(f"the number of GPUs must be at least 1, got {gpus}")
    refused = _tensor_parallel_refusals(config, gpus)
    found = []
    for tp in _divisors(gpus):
        if tp in refused:
            continue
        for pp in _divisors(gpus // tp):
            if pp <= config.num_layers:
                found.append(Layout(tp, pp, gpus // tp // pp))
    return sorted(found, key=lambda layout: (-layout.tensor_parallel_size, -layout.pipeline_parallel_size))


def left_out(model: ModelLike, gpus: int) -> list[str]:
    """Why each tensor-parallel size that divides ``gpus`` is missing from :func:`layouts`, one line each."""
    refused = _tensor_parallel_refusals(model_config(model), gpus)
    return [f"TP{tp}: {why}" for tp, why in refused.items()]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tensor_parallel_refusals(config: ModelConfig, gpus: int) -> dict[int, str]:
    """Each tensor-parallel size dividing ``gpus`` that cannot split the model, with the reason the engine gives."""
    refused = {}
    for tp in _divisors(gpus):
        try:
            check_tensor_parallel(config, tp)
        except ValueError as error:
            refused[tp] = str(error)
    return refused


# --- stages: what one GPU holds and does ----------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """A pipeline stage: ``layers`` consecutive decoder layers, the embedding if ``first``, the head if ``last``."""

    layers: int
    first: bool = True
    last: bool = True


def pipeline_stages(model: ModelLike, pipeline_parallel_size: int) -> list[Stage]:
    """The layers cut into ``pipeline_parallel_size`` stages as the engine cuts them
    (:func:`minserve.parallel.pipeline.stage_layers`: as evenly as they go, earlier stages one more); one
    stage, the whole model, without pipelining."""
    config = model_config(model)
    p = pipeline_parallel_size
    check_pipeline_parallel(config, p)
    sizes = [len(stage_layers(config.num_layers, p, s)) for s in range(p)]
    return [Stage(layers, first=s == 0, last=s == p - 1) for s, layers in enumerate(sizes)]


def _vocab_rows(config: ModelConfig, tensor_parallel_size: int) -> int:
    """Rows of the embedding (or head) one rank keeps: ``ceil(vocab / t)``, as the sharded model pads them."""
    return -(-config.vocab_size // tensor_parallel_size)


def stage_params_per_gpu(model: ModelLike, stage: Stage, tensor_parallel_size: int = 1) -> int:
    """Parameters one GPU of ``stage`` keeps, its ``1 / t`` of every matrix and a whole copy of every norm.
    Invariant: one stage on one GPU is :func:`minserve.capacity.memory.estimate_params` exactly."""
    config, t = model_config(model), tensor_parallel_size
    # The decoder's average layer (exact unless a mixture of experts mixes dense and sparse layers).
    matrices = decoder_params(config) - 2 * config.hidden_size * config.num_layers
    per_layer = matrices // (config.num_layers * t) + 2 * config.hidden_size
    table = _vocab_rows(config, t) * config.hidden_size
    embedding = table if stage.first else 0
    head = table if stage.last and not (config.tie_word_embeddings and stage.first) else 0
    final_norm = config.hidden_size if stage.last else 0
    return stage.layers * per_layer + embedding + head + final_norm


def stage_kv_bytes_per_token(model: ModelLike, stage: Stage, tensor_parallel_size: int = 1,
                             kv_dtype: Dtype = "bfloat16") -> int:  # fmt: skip
    """KV bytes one token takes on one GPU of ``stage``: its layers, its ``1 / t`` of the KV heads."""
    config = model_config(model)
    return kv_bytes_per_token(dataclasses.replace(config, num_layers=stage.layers), kv_dtype) // tensor_parallel_size


def stage_decode(model: ModelLike, stage: Stage, batch: int, context_tokens: int, hw: Hardware,
                 tensor_parallel_size: int = 1, dtype: Dtype | None = None,
                 kv_dtype: Dtype | None = None) -> roofline.Prediction:  # fmt: skip
    """The roofline on one GPU's share of a decode step of ``batch`` sequences through ``stage``.

    A stage is a model of ``stage.layers`` layers; the head's FLOPs and bytes (a model of no layers) count
    on the last stage only. Tensor parallelism splits both evenly over its ``t`` GPUs.
    """
    config = model_config(model)

    def work(layers: int) -> tuple[int, int]:
        part = dataclasses.replace(config, num_layers=layers)
        flops = roofline.decode_flops(part, batch, context_tokens)
        return flops, roofline.decode_bytes(part, batch, context_tokens, dtype or hw.dtype, kv_dtype)

    flops, bytes_moved = work(stage.layers)
    if not stage.last:
        head_flops, head_bytes = work(0)
        flops, bytes_moved = flops - head_flops, bytes_moved - head_bytes
    return roofline.predict(flops / tensor_parallel_size, bytes_moved / tensor_parallel_size, hw)


# --- what tensor parallelism sends ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CollectiveBytes:
    """What one rank puts into collectives in one forward pass, as :class:`minserve.parallel.Traffic` counts
    it: each call's input tensor, in bytes."""

    all_reduce_bytes: int = 0
    all_reduce_calls: int = 0
    all_gather_bytes: int = 0
    all_gather_calls: int = 0


def tensor_parallel_traffic(model: ModelLike, tokens: int, tensor_parallel_size: int, dtype: Dtype = "bfloat16",
                            logit_rows: int | None = None, stage: Stage | None = None) -> CollectiveBytes:  # fmt: skip
    """One rank's collectives in a forward pass of ``tokens`` tokens through ``stage`` (default: the whole
    model), activations in ``dtype``: two all-reduces of ``[tokens, hidden]`` a layer, one more after the
    embedding lookup, and an all-gather of the logits' ``[logit_rows, ceil(vocab / t)]`` slice (``logit_rows``
    defaults to ``tokens``; at decode it is the batch, one row a sequence). None on one rank.

    So a whole model's all-reduces carry ``(2 × layers + 1) × tokens × hidden × bytes``.
    """
    config = model_config(model)
    stage = stage or Stage(config.num_layers)
    if tensor_parallel_size == 1 or tokens == 0:
        return CollectiveBytes()
    element = dtype_bytes(dtype)
    calls = 2 * stage.layers + (1 if stage.first else 0)
    rows = tokens if logit_rows is None else logit_rows
    gathers = 1 if stage.last else 0
    return CollectiveBytes(
        all_reduce_bytes=calls * tokens * config.hidden_size * element,
        all_reduce_calls=calls,
        all_gather_bytes=gathers * rows * _vocab_rows(config, tensor_parallel_size) * element,
        all_gather_calls=gathers,
    )


def stage_communication_s(model: ModelLike, stage: Stage, batch: int, tensor_parallel_size: int,
                          link: Interconnect, dtype: Dtype = "bfloat16") -> float:  # fmt: skip
    """Seconds one GPU of ``stage`` spends in collectives and hand-offs for a decode micro-batch of ``batch``:
    the tensor-parallel all-reduces and all-gather (ring model), and the send of ``[batch, hidden]`` to the next
    stage unless this is the last."""
    config, t = model_config(model), tensor_parallel_size
    traffic = tensor_parallel_traffic(config, batch, t, dtype, batch, stage)
    seconds = 0.0
    if traffic.all_reduce_calls:
        each = traffic.all_reduce_bytes / traffic.all_reduce_calls
        seconds += traffic.all_reduce_calls * ring_all_reduce_s(each, t, link)
    if traffic.all_gather_calls:
        each = traffic.all_gather_bytes / traffic.all_gather_calls
        seconds += traffic.all_gather_calls * ring_all_gather_s(each, t, link)
    if not stage.last:
        seconds += send_s(batch * config.hidden_size * dtype_bytes(dtype), link)
    return seconds


# --- one layout, planned ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutPlan:
    """One layout's verdict at one batch (per replica) and context: memory per GPU, and a decode step's time.

    The step's time is ``work_s + communication_s + bubble_s`` (:attr:`step_s`), taken on the slowest stage:
    its roofline time (``max(compute_s, memory_s)``) and its collectives, each summed over the step's
    micro-batches, and the bubble, the time the pipe fills and drains around them.
    """

    layout: Layout
    batch: int
    context_tokens: int
    micro_batches: int
    fits: bool
    weights_bytes_per_gpu: int  # the largest stage's, on each of its GPUs
    kv_bytes_per_token_per_gpu: int  # likewise
    kv_tokens_per_gpu: int  # KV tokens the fullest GPU has room for beside its weights
    compute_s: float
    memory_s: float
    communication_s: float
    bubble_s: float
    all_reduce_bytes_per_step: int  # one GPU of the slowest stage, all micro-batches

    @property
    def work_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def step_s(self) -> float:
        """Seconds a decode step takes, which is the time between a sequence's tokens."""
        return self.work_s + self.communication_s + self.bubble_s

    @property
    def tokens_per_s_per_replica(self) -> float:
        return self.batch / self.step_s

    @property
    def tokens_per_s(self) -> float:
        """All replicas together: ``DP × batch / step``."""
        return self.layout.data_parallel_size * self.tokens_per_s_per_replica

    @property
    def dominant(self) -> Term:
        """The largest of the step's terms: the roof that binds (``compute`` or ``memory``), ``communication``
        or ``pipeline bubble``."""
        terms: dict[Term, float] = {
            "compute" if self.compute_s >= self.memory_s else "memory": self.work_s,
            "communication": self.communication_s,
            "pipeline bubble": self.bubble_s,
        }
        return max(terms, key=terms.__getitem__)


def plan_layout(
    model: ModelLike,
    layout: Layout,
    hw: Hardware,
    link: Interconnect,
    batch: int,
    context_tokens: int,
    dtype: Dtype | None = None,
    kv_dtype: Dtype | None = None,
    micro_batches: int | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> LayoutPlan:
    """Plan ``layout`` for a decode step of ``batch`` sequences (per replica) of ``context_tokens`` each.

    ``micro_batches`` (default: as many as stages, at most the batch) split each replica's batch for the
    pipeline; the largest, ``ceil(batch / m)``, sets every stage's pace. ``dtype`` defaults to the hardware's,
    ``kv_dtype`` to ``dtype``; activations travel in ``dtype``.
    """
    config = model_config(model)
    if batch < 1 or context_tokens < 1:
        raise ValueError(f"batch and context_tokens must be positive, got {batch} and {context_tokens}")
    check_tensor_parallel(config, layout.tensor_parallel_size)
    dtype = dtype or hw.dtype
    kv_dtype = kv_dtype or dtype
    t, p = layout.tensor_parallel_size, layout.pipeline_parallel_size
    m = min(batch, p) if micro_batches is None else micro_batches
    if not 1 <= m <= batch:
        raise ValueError(f"micro_batches must be 1 … batch ({batch}), got {m}")
    micro = -(-batch // m)
    stages = pipeline_stages(config, p)
    usable = int(hw.memory_bytes * gpu_memory_utilization)

    weights = [stage_params_per_gpu(config, s, t) * dtype_bytes(dtype) for s in stages]
    kv_per_token = [stage_kv_bytes_per_token(config, s, t, kv_dtype) for s in stages]
    room = [max(usable - w, 0) // kv for w, kv in zip(weights, kv_per_token)]

    works = [stage_decode(config, s, micro, context_tokens, hw, t, dtype, kv_dtype) for s in stages]
    comms = [stage_communication_s(config, s, micro, t, link, dtype) for s in stages]
    times = [w.time_s + c for w, c in zip(works, comms)]
    slowest = max(range(p), key=times.__getitem__)
    step = sum(times) + (m - 1) * times[slowest]  # the first micro-batch through, then one per slowest stage
    traffic = tensor_parallel_traffic(config, micro, t, dtype, micro, stages[slowest])
    return LayoutPlan(
        layout=layout,
        batch=batch,
        context_tokens=context_tokens,
        micro_batches=m,
        fits=max(weights) <= usable and batch * context_tokens <= min(room),
        weights_bytes_per_gpu=max(weights),
        kv_bytes_per_token_per_gpu=max(kv_per_token),
        kv_tokens_per_gpu=min(room),
        compute_s=m * works[slowest].compute_s,
        memory_s=m * works[slowest].memory_s,
        communication_s=m * comms[slowest],
        bubble_s=step - m * times[slowest],
        all_reduce_bytes_per_step=m * traffic.all_reduce_bytes,
    )


def plan_parallel(
    model: ModelLike,
    hw: Hardware,
    gpus: int,
    link: Interconnect,
    batch: int,
    context_tokens: int,
    dtype: Dtype | None = None,
    kv_dtype: Dtype | None = None,
    micro_batches: int | None = None,
) -> list[LayoutPlan]:
    """Every layout of ``gpus`` GPUs (:func:`layouts`) planned at one batch per replica and context."""
    return [
        plan_layout(model, layout, hw, link, batch, context_tokens, dtype, kv_dtype, micro_batches)
        for layout in layouts(model, gpus)
    ]
