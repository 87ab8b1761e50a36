"""Pipeline parallelism's model side: which decoder layers each stage holds, a model cut down to its stage,
and the bubble, predicted by ``(p − 1) / (m + p − 1)`` and measured from each stage's timeline.

A pipeline of ``p`` stages cuts the model between decoder layers. Stage ``s`` holds a contiguous range of
them, as even as possible (the first ``L mod p`` stages one layer more); stage 0 also holds the token
embedding, the last stage the final norm and the head. What travels from one stage to the next is the
residual stream, ``[tokens, hidden]``. The model file does not change (as with tensor parallelism): a
stage's model keeps only its layers, and the parts it lacks are swapped for an identity (a later stage's
"embedding" passes the previous stage's hidden states through, an earlier stage's final norm leaves the
residual stream as it is) or dropped (the head of every stage but the last). Each stage caches keys and
values for its own layers only, so a rank's KV bytes per token are about ``1 / p`` of the model's.

**The bubble.** One step's batch is split into ``m`` micro-batches. Stage ``s`` can start micro-batch ``i``
only once stage ``s − 1`` has finished it, so the stages fill up one after another and drain the same way:

    stage 0   [1][2][3][4]
    stage 1      [1][2][3][4]            m = 4 micro-batches, p = 2 stages
              └── step: (m + p − 1) t ──┘

With every micro-batch taking ``t`` on every stage, a step takes ``(m + p − 1) t`` and each stage is busy
``m t`` of it: a fraction ``(p − 1) / (m + p − 1)`` of the stages' time is idle (GPipe's bubble). More
micro-batches shrink it, but each is smaller, and a small batch uses a device less well. Measured, the
bubble of a step is the stages' idle time inside the step's span (from the first micro-batch's start on
stage 0 to the last one's end on the last stage) over ``p`` times that span; uneven stages and the time
the hidden states take to travel show up in it, as they do in a real pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from minserve.model.config import ModelConfig

Span = tuple[float, float]  # (start_s, end_s) of one micro-batch's work on one stage, time.perf_counter seconds


def check_pipeline_parallel(config: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` unless ``size`` stages can each hold at least one of ``config``'s layers."""
    if not 1 <= size <= config.num_layers:
        raise ValueError(
            f"pipeline_parallel_size={size} does not fit a model of {config.num_layers} layers: each stage needs "
            f"at least one layer, so use 1 … {config.num_layers}"
        )


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The decoder layers stage ``stage`` of ``num_stages`` holds: contiguous, the first ``num_layers mod
    num_stages`` stages one more than the rest (30 layers in 4 stages: 8, 8, 7, 7)."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def keep_stage(model: nn.Module, stage: int, num_stages: int) -> range:
    """Cut ``model`` down to stage ``stage`` of ``num_stages``, in place (see the module docstring), and
    return the layers it kept. Its ``config`` stays the whole model's."""
    check_pipeline_parallel(model.config, num_stages)
    kept = stage_layers(model.config.num_layers, num_stages, stage)
    model.layers = nn.ModuleList(model.layers[i] for i in kept)
    if stage > 0:
        model.embed_tokens = nn.Identity()  # its input is the previous stage's hidden states
    if stage < num_stages - 1:
        model.norm = nn.Identity()  # the residual stream goes on to the next stage as it is
        model.lm_head = None  # (a tied head's weight stays with the embedding, on stage 0)
    return kept


def predicted_bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """``(p − 1) / (m + p − 1)``: the idle share of ``p`` equal stages' time in a step of ``m`` equal
    micro-batches (0 for one stage; 1/2 for two stages and one micro-batch)."""
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"need p ≥ 1 stages and m ≥ 1 micro-batches, got p={num_stages}, m={num_micro_batches}")
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


@dataclass(frozen=True)
class StepTimeline:
    """One step of a pipeline: ``spans[s]`` are stage ``s``'s micro-batch spans, in micro-batch order."""

    spans: Sequence[Sequence[Span]]

    @property
    def num_stages(self) -> int:
        return len(self.spans)

    @property
    def num_micro_batches(self) -> int:
        return len(self.spans[0])

    @property
    def span_s(self) -> float:
        """From the first micro-batch's start on any stage to the last one's end on any stage."""
        return max(end for stage in self.spans for _, end in stage) - min(start for stage in self.spans
                                                                          for start, _ in stage)  # fmt: skip

    @property
    def busy_s(self) -> float:
        """Seconds of work, summed over the stages."""
        return sum(end - start for stage in self.spans for start, end in stage)

    @property
    def idle_s(self) -> float:
        """Seconds the stages sat idle inside the step's span, summed over the stages."""
        return self.num_stages * self.span_s - self.busy_s

    @property
    def bubble_fraction(self) -> float:
        return self.idle_s / (self.num_stages * self.span_s) if self.span_s > 0 else 0.0

    @property
    def predicted_bubble_fraction(self) -> float:
        return predicted_bubble_fraction(self.num_stages, self.num_micro_batches)


@dataclass(frozen=True)
class PipelineStats:
    """The timelines of a run's steps, and its bubble measured and predicted.

    Both are weighted by each step's span, so long steps count for more: the measured bubble is all the
    idle stage-seconds over all the stage-seconds, the predicted one the formula for each step's own number
    of micro-batches (a step with fewer sequences than ``m`` has fewer), averaged with the same weights.
    """

    steps: Sequence[StepTimeline]

    @property
    def bubble_fraction(self) -> float:
        capacity_s = sum(step.num_stages * step.span_s for step in self.steps)
        return sum(step.idle_s for step in self.steps) / capacity_s if capacity_s > 0 else 0.0

    @property
    def predicted_bubble_fraction(self) -> float:
        total_s = sum(step.span_s for step in self.steps)
        weighted = sum(step.predicted_bubble_fraction * step.span_s for step in self.steps)
        return weighted / total_s if total_s > 0 else 0.0

    @property
    def mean_micro_batches(self) -> float:
        return sum(step.num_micro_batches for step in self.steps) / len(self.steps) if self.steps else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"num_steps": len(self.steps), "mean_micro_batches": self.mean_micro_batches,
                "bubble_fraction": self.bubble_fraction,
                "predicted_bubble_fraction": self.predicted_bubble_fraction}  # fmt: skip
