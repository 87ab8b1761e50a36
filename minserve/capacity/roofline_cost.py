"""A step's cost from the roofline: the simulator on a GPU nobody has calibrated.

:class:`~minserve.capacity.cost_model.StepCostModel` is fitted on steps measured on this machine. For a GPU
from the roofline's table there is nothing to measure, but there is the roofline: a step that does ``F``
FLOPs and moves ``B`` bytes takes at least ``max(F / peak, B / bandwidth)``. :class:`RooflineStepCost` prices
each step the scheduler builds that way, from what it runs (:class:`~minserve.capacity.cost_model.StepFeatures`),
so the same simulator, scheduler and SLO code plan a GPU and this machine alike.

For a step of prompt chunks and decodes (``N`` tokens in all, ``S`` sequences, ``A`` query-key pairs)::

    FLOPs = 2 × (weights one token multiplies by) × N      the matmuls
          + 2 × (LM head) × S                              the logits: each sequence's last token only
          + 4 × heads × head_dim × layers × A              attention scores and their weighted sum
    bytes = the weights read once (the experts the N tokens reach, in a mixture of experts)
          + KV bytes per token × (prompt tokens written + context tokens the decodes read)

which is :func:`~minserve.capacity.roofline.predict_prefill` for one prompt alone and
:func:`~minserve.capacity.roofline.predict_decode` for a batch of decodes alone, exactly (a test holds it to
both). A mixed step shares one read of the weights between its prompt tokens and its decodes: what makes
chunked prefill cheap on a GPU.

Like every roofline number it is a lower bound on time, so the capacity it gives is an upper bound: real
kernels reach a fraction of either roof, and every step pays launch and scheduling overhead. One knob says
how much: ``step_overhead_s``, added to every step (a few milliseconds without CUDA graphs).
"""

from __future__ import annotations

import functools
from typing import Any

from minserve.capacity.cost_model import StepFeatures
from minserve.capacity.kv import Dtype, ModelLike, kv_bytes_per_token, model_config
from minserve.capacity.roofline import (
    Hardware,
    Prediction,
    attention_flops,
    decoder_matmul_params,
    lm_head_params,
    predict,
    weights_read_bytes,
)
from minserve.engine.batch import ScheduledBatch


class RooflineStepCost:
    """Seconds a step takes on ``hw``: the roofline's ``max(FLOPs / peak, bytes / bandwidth)`` of what the step
    runs, plus ``step_overhead_s``. A drop-in for :class:`~minserve.capacity.cost_model.StepCostModel` in the
    simulator (both are a :class:`~minserve.capacity.cost_model.StepCost`).

    ``dtype`` (of the weights) defaults to the hardware's own, ``kv_dtype`` to ``dtype``. A step that runs
    nothing takes no time, as with the fitted model.
    """

    def __init__(
        self,
        model: ModelLike,
        hw: Hardware,
        dtype: Dtype | None = None,
        kv_dtype: Dtype | None = None,
        step_overhead_s: float = 0.0,
    ) -> None:
        if not step_overhead_s >= 0:
            raise ValueError(f"step_overhead_s must be ≥ 0 seconds, got {step_overhead_s!r}")
        self.config, self.hw = model_config(model), hw
        self.dtype = dtype or hw.dtype
        self.kv_dtype = kv_dtype or self.dtype
        self.step_overhead_s = step_overhead_s
        self._matmul_params = decoder_matmul_params(self.config)
        self._head_params = lm_head_params(self.config)
        self._flops_per_pair = attention_flops(self.config, 1, 1)  # one query attending to one key, all layers
        self._kv_bytes_per_token = kv_bytes_per_token(self.config, self.kv_dtype)
        # Dense models read the same weights whatever the batch; a mixture of experts reads the experts the
        # batch's tokens reach. Cached per token count: the layer loop need not run at every simulated step.
        self._weights_bytes = functools.lru_cache(maxsize=4096)(
            functools.partial(weights_read_bytes, self.config, self.dtype)
        )

    @property
    def info(self) -> dict[str, Any]:
        """Where the numbers come from, as a calibrated model's ``info`` says it."""
        return {
            "source": "roofline",
            "hardware": self.hw.name,
            "dtype": str(self.dtype),
            "kv_dtype": str(self.kv_dtype),
            "step_overhead_s": self.step_overhead_s,
        }

    def flops(self, features: StepFeatures) -> float:
        """FLOPs of a step: matmuls for every token, the LM head for each sequence's last, attention pairs."""
        sequences = features.prefill_seqs + features.decode_seqs
        pairs = features.prefill_attention_pairs + features.decode_context_tokens
        return (
            2 * self._matmul_params * features.num_tokens
            + 2 * self._head_params * sequences
            + (self._flops_per_pair * pairs)
        )

    def bytes(self, features: StepFeatures) -> float:
        """Bytes a step moves: the weights once, the prompt tokens' K/V written, the decodes' contexts read."""
        kv_tokens = features.prefill_tokens + features.decode_context_tokens
        return self._weights_bytes(tokens=features.num_tokens) + self._kv_bytes_per_token * kv_tokens

    def predict(self, features: StepFeatures) -> Prediction:
        """The roofline's verdict on one step: FLOPs, bytes, and the time at each roof."""
        return predict(self.flops(features), self.bytes(features), self.hw)

    def step_time_s(self, features: StepFeatures) -> float:
        """Seconds one step with these features takes: the binding roof's time plus the per-step overhead."""
        if features.num_tokens == 0:
            return 0.0
        return self.predict(features).time_s + self.step_overhead_s

    def batch_time_s(self, batch: ScheduledBatch) -> float:
        """Seconds the step running ``batch`` takes (call before the batch's sequences are advanced)."""
        return self.step_time_s(StepFeatures.of(batch))

    def describe(self) -> str:
        """One line: the hardware's roofs and the overhead."""
        return (
            f"  roofline of {self.hw.name}: {self.hw.peak_flops_per_s / 1e12:.4g} TFLOP/s dense {self.hw.dtype}, "
            f"{self.hw.memory_bandwidth_bytes_per_s / 1e12:.4g} TB/s; weights {self.dtype}, KV {self.kv_dtype}; "
            f"{self.step_overhead_s * 1e3:g} ms overhead a step"
        )
