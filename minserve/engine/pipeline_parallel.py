"""Pipeline parallelism in the engine: ``pipeline_parallel_size`` processes, each running a stage of the
model's layers, and each step's batch split into micro-batches so that the stages work at once.

The processes are the engine's group of ranks (:mod:`.workers`); rank ``s`` is stage ``s``
(:mod:`minserve.parallel.pipeline` says which layers it holds). Rank 0, the engine's own, is stage 0: it
schedules and samples as with one process, and sends each step's inputs (ids, positions, block tables,
the rows to sample) to every stage. Then each stage splits the step alike, into ``m`` micro-batches of whole
sequences with about equal tokens, and runs them in order, passing hidden states on point to point:

    rank 0 = stage 0 (engine)                     rank 1 = stage 1 (the last)
    schedule, broadcast the step ───────────────▶ receive it
    micro-batch 1: embed, layers 0–1 ─hidden─▶    micro-batch 1: layers 2–3, norm, head
    micro-batch 2: embed, layers 0–1 ─hidden─▶    micro-batch 2: layers 2–3, norm, head
    sample ◀──────────── logits of the rows to sample, per micro-batch ─────┘

A send does not wait for the receiver (``isend``), so stage 0 starts micro-batch 2 while stage 1 works on
micro-batch 1 (GPipe's schedule, within one step). A step cannot overlap the next: the next step's inputs
are the tokens this one samples. Each stage records when each micro-batch's work began and ended
(``time.perf_counter``, one system-wide monotonic clock, so the ranks' times compare);
:meth:`PipelineRunner.pipeline_stats` gathers the timelines and measures the bubble.

Preemption's swaps and a failed request's cleared blocks go to every stage: each holds its own layers' cache.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from minserve.config import EngineConfig
from minserve.engine import model_setup
from minserve.engine.model_runner import ModelRunner
from minserve.engine.workers import ParallelGroup, ParallelRunner, receive_cache_shape
from minserve.model.attention import AttentionMetadata
from minserve.parallel.pipeline import PipelineStats, Span, StepTimeline, keep_stage

TIMELINE_STEPS = 10_000  # steps whose timelines each stage keeps (the oldest are dropped)


def start(config: EngineConfig, device: torch.device) -> ParallelGroup:
    """Spawn stages 1 … p−1 and join them as rank 0, stage 0."""
    return ParallelGroup.start(config, device, PipelineRunner, stage_worker, "pipeline parallelism")


@dataclass(frozen=True)
class PipelineStage:
    """Where a rank stands in the pipeline: stage ``index`` of ``num_stages``, splitting each step into
    ``num_micro_batches``."""

    index: int
    num_stages: int
    num_micro_batches: int

    @classmethod
    def of(cls, config: EngineConfig, rank: int) -> PipelineStage:
        """Rank ``rank``'s stage; ``num_micro_batches`` is one per stage unless the config says otherwise."""
        size = config.parallel.pipeline_parallel_size
        return cls(rank, size, config.parallel.num_micro_batches or size)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def next_rank(self) -> int:
        """Where this stage's output goes: the next stage's hidden states, or from the last, rank 0's logits."""
        return (self.index + 1) % self.num_stages


def cut_to_stage(model: nn.Module, scales: list[torch.Tensor] | None, stage: int, num_stages: int):
    """Cut ``model`` down to ``stage`` (:func:`~minserve.parallel.pipeline.keep_stage`) and return its layers'
    share of an 8-bit cache's ``scales`` (measured before, on the whole model), or None."""
    kept = keep_stage(model, stage, num_stages)
    return None if scales is None else scales[kept.start : kept.stop]


def stage_worker(rank: int, world_size: int, config: EngineConfig, device: torch.device) -> StageRunner:
    """A worker rank's runner: the whole model built and calibrated as on rank 0, then cut to its stage,
    with a KV cache of rank 0's block count for its own layers. (So each rank holds the whole model for a
    moment while it starts: reading only its stage's tensors from the checkpoint is left to do.)"""
    loaded = model_setup.load(config, device)
    scales = cut_to_stage(loaded.model, loaded.kv_scales, rank, world_size)
    return StageRunner(loaded.model, receive_cache_shape(), scales, stage=PipelineStage.of(config, rank))


# --- micro-batches ---------------------------------------------------------------------------------------------


@dataclass
class MicroBatch:
    """Some whole sequences of a step: their flat ids (or hidden states) and positions, their attention
    metadata, and the rows (within the micro-batch) to compute logits for."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


def micro_batch_ranges(query_lens: list[int], num_micro_batches: int) -> list[range]:
    """Split sequences (``query_lens``: their new tokens this step) into at most ``num_micro_batches``
    contiguous, non-empty ranges, each cut where the running token count is nearest its even share."""
    count = min(num_micro_batches, len(query_lens))
    prefix = list(itertools.accumulate(query_lens, initial=0))
    cuts = [0]
    for k in range(1, count):
        lowest, highest = cuts[-1] + 1, len(query_lens) - (count - k)  # leave a sequence for each range to come
        share = k * prefix[-1] / count
        cuts.append(min(range(lowest, highest + 1), key=lambda i: abs(prefix[i] - share)))
    cuts.append(len(query_lens))
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def split_micro_batches(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rows: list[int], count: int
) -> list[MicroBatch]:
    """The step's flat batch as micro-batches of whole sequences (:func:`micro_batch_ranges`), in order: their
    tokens end to end are the step's, and their rows (shifted) are ``rows``."""
    starts = list(itertools.accumulate(meta.query_lens, initial=0))
    batches = []
    for seqs in micro_batch_ranges(meta.query_lens, count):
        first, end = starts[seqs.start], starts[seqs.stop]
        part = AttentionMetadata(
            query_lens=meta.query_lens[seqs.start : seqs.stop],
            context_lens=meta.context_lens[seqs.start : seqs.stop],
            slot_mapping=meta.slot_mapping[first:end],
            block_tables=meta.block_tables[seqs.start : seqs.stop],
        )
        mine = [row - first for row in rows if first <= row < end]
        batches.append(MicroBatch(input_ids[first:end], positions[first:end], part, mine))
    return batches


# --- the runners -----------------------------------------------------------------------------------------------


class StageRunner(ModelRunner):
    """A stage's runner (on every rank): its layers' KV cache, and each step's forward micro-batch by
    micro-batch, received from the stage before and sent to the one after."""

    def __init__(self, *args: Any, stage: PipelineStage) -> None:
        super().__init__(*args)
        self.stage = stage
        self.timelines: deque[list[Span]] = deque(maxlen=TIMELINE_STEPS)

    def logits(self, input_ids, positions, meta, rows):
        """This stage's part of the step; on stage 0 (rank 0) the logits of ``rows``, from the last stage."""
        stage, hidden_size = self.stage, self.model.config.hidden_size
        batches = split_micro_batches(input_ids, positions, meta, rows, stage.num_micro_batches)
        # Every receive is posted now, so that each micro-batch's hidden states land as soon as they are sent.
        inbox = [_Incoming((mb.num_tokens, hidden_size), self.dtype, self.device, stage.index - 1, i)
                 for i, mb in enumerate(batches)] if not stage.is_first else []  # fmt: skip
        outbox, spans = [], []
        for i, mb in enumerate(batches):
            x = mb.input_ids if stage.is_first else inbox[i].wait()
            start_s = time.perf_counter()
            out = self._forward(x, mb)
            spans.append((start_s, self._now()))
            if out is not None:  # sent without waiting: the next micro-batch starts now
                outbox.append((dist.isend(out, stage.next_rank, tag=i), out))
        for work, _ in outbox:
            work.wait()
        self.timelines.append(spans)
        if not stage.is_first:
            return None
        # Posted only now: on NCCL a receive queued before the sends above would hold them up (one stream).
        vocab = self.model.config.vocab_size
        incoming = [_Incoming((len(mb.rows), vocab), torch.float32, self.device, stage.num_stages - 1, i)
                    for i, mb in enumerate(batches) if mb.rows]  # fmt: skip
        return torch.cat([logits.wait() for logits in incoming]) if incoming else None

    def _forward(self, x: torch.Tensor, mb: MicroBatch) -> torch.Tensor | None:
        """This stage's layers over one micro-batch: hidden states to send on, or on the last stage the
        logits of its rows (None if it has none)."""
        hidden = self.model(x, mb.positions, mb.meta)
        if not self.stage.is_last:
            return hidden
        return self.model.compute_logits(hidden[torch.tensor(mb.rows, device=self.device)]) if mb.rows else None

    def _now(self) -> float:
        if self.device.type == "cuda":  # the work queued on the GPU counts as this span's
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def timeline(self, reset: bool = False) -> list[list[Span]]:
        """This stage's micro-batch spans of each step kept, oldest first; ``reset`` forgets them."""
        steps = list(self.timelines)
        if reset:
            self.timelines.clear()
        return steps


class PipelineRunner(ParallelRunner, StageRunner):
    """Rank 0's runner, stage 0: each command is sent to every stage (:class:`ParallelRunner`), then this
    stage's part runs (:class:`StageRunner`), and the logits come back from the last stage to be sampled."""

    def __init__(self, group: ParallelGroup, *args: Any) -> None:
        super().__init__(group, *args, stage=PipelineStage.of(group.config, 0))

    def pipeline_stats(self, reset: bool = False) -> PipelineStats:
        """Every stage's timeline of the steps kept, and the bubble they show; ``reset`` starts afresh."""
        per_rank = self.group.gather("timeline", self.timeline(reset), reset)
        return PipelineStats([StepTimeline(list(stages)) for stages in zip(*per_rank)])


class _Incoming:
    """A tensor being received from rank ``source`` (``irecv``): :meth:`wait` gives it once it is here."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, source: int, tag: int):
        self.tensor = torch.empty(shape, dtype=dtype, device=device)
        self.work = dist.irecv(self.tensor, source, tag=tag)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.tensor


__all__ = ["MicroBatch", "PipelineRunner", "PipelineStage", "StageRunner", "micro_batch_ranges", "start"]
