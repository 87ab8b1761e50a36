"""The simulator's step-cost model: how long a step takes, from what it runs, fitted on the engine.

A step's time is linear in what the step does::

    step_s = base
           + prefill_tokens          × (prompt tokens run this step: projections and MLP per token)
           + prefill_attention_pairs × (query-key pairs of those prompt chunks: causal attention over the context)
           + decode_seqs             × (sequences running one token: a row of every matmul, sampling, bookkeeping)
           + decode_context_tokens   × (keys and values the decode sequences attend to, summed)
          [+ decode_padded_kv_tokens × (decode sequences × the longest of their contexts)]

``base`` is what every step pays whatever it holds: hundreds of small operations launched, scheduling,
tensors built. Prompt tokens and decode rows cost differently because a prompt chunk's tokens share one
sequence's overheads and their attention is another code path (causal attention per sequence, against one
query per sequence batched together). The last term is the torch reference backend's: it gathers every decode
sequence's blocks into one tensor padded to the longest context (padding reads block 0 again and again, cheap
but not free), while the Triton kernel reads each sequence's own blocks only; calibration fits the terms of
the backend it measures (:data:`DEFAULT_TERMS`). ``swapped_blocks`` (blocks copied to or from host memory by
swap preemption) is counted too, but is free unless a coefficient is given: calibration does not preempt.

The coefficients are fitted by least squares (numpy) on steps measured on the engine
(:mod:`minserve.capacity.calibration`). Step times span two orders of magnitude (a 2 ms decode of one
sequence, a 150 ms prefill of a thousand tokens), so the fit minimizes *relative* error: an unweighted fit
would let the few long steps set every coefficient, and the short decode steps that make TPOT would come out
poorly. On a shared machine some steps are slowed by other processes; the steps whose residual is far out (3
robust standard deviations) are set aside and the rest refitted. A coefficient that comes out negative is
dropped and the rest refitted.

:class:`CostModelExecutor` is the engine core's executor in a simulation: it runs no model, moves the
virtual clock forward by the step's cost, and gives every sequence whose prompt is done one token.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from minserve.engine.batch import ScheduledBatch
from minserve.engine.clocks import VirtualClock
from minserve.engine.sampler import Sample
from minserve.engine.step_report import ScheduledSeq

COST_FORMAT = "minserve-step-cost/1"
FEATURES = (
    "prefill_tokens",
    "prefill_seqs",
    "prefill_attention_pairs",
    "decode_seqs",
    "decode_context_tokens",
    "decode_padded_kv_tokens",
    "swapped_blocks",
)
_COMMON_TERMS = ("base", "prefill_tokens", "prefill_attention_pairs", "decode_seqs", "decode_context_tokens")
# The terms calibrate() fits, by backend: the torch reference's decode attention also pays for its padding.
DEFAULT_TERMS: dict[str, tuple[str, ...]] = {
    "torch": (*_COMMON_TERMS, "decode_padded_kv_tokens"),
    "triton": _COMMON_TERMS,
}


# --- what a step does ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepFeatures:
    """What one step runs, in the units the cost model charges for. Counted right after ``schedule()``, before
    the step advances any sequence.

    A sequence running exactly one token counts as a decode (the attention code batches every one-query
    sequence together, whether or not its prompt is done); one running more is a prompt chunk. A chunk of
    ``n`` tokens after ``c`` computed ones attends to ``n·c + n(n+1)/2`` query-key pairs; a decode after ``c``
    computed tokens reads ``c + 1`` keys.
    """

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_attention_pairs: int = 0
    decode_seqs: int = 0
    decode_context_tokens: int = 0  # Σ keys read by the decode sequences
    decode_padded_kv_tokens: int = 0  # decode sequences × the longest of their contexts
    swapped_blocks: int = 0  # KV blocks copied to or from host memory before the forward pass

    @classmethod
    def of(cls, batch: ScheduledBatch) -> StepFeatures:
        """The features of a batch the scheduler just returned (its sequences not yet advanced)."""
        scheduled = [ScheduledSeq.of(seq, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        return cls.of_scheduled(scheduled, len(batch.swap_out) + len(batch.swap_in))

    @classmethod
    def of_scheduled(cls, scheduled: Sequence[ScheduledSeq], swapped_blocks: int = 0) -> StepFeatures:
        """The features of a step from what it scheduled (as an engine core's :class:`StepReport` has it)."""
        prefill_tokens = prefill_seqs = pairs = decode_seqs = context = longest = 0
        for entry in scheduled:
            n, computed = entry.num_new_tokens, entry.num_computed_tokens
            if n == 1:
                decode_seqs += 1
                context += computed + 1
                longest = max(longest, computed + 1)
            elif n > 1:
                prefill_tokens += n
                prefill_seqs += 1
                pairs += n * computed + n * (n + 1) // 2
        return cls(prefill_tokens, prefill_seqs, pairs, decode_seqs, context, decode_seqs * longest, swapped_blocks)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class StepSample:
    """One measured step: what it ran and how long ``engine.step()`` took, seconds."""

    features: StepFeatures
    time_s: float


# --- the cost model -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCostModel:
    """Step time as a linear function of :class:`StepFeatures`: ``base + Σ coefficient × feature``, seconds.

    ``coefficients`` maps ``"base"`` (seconds per step) and any of :data:`FEATURES` (seconds per unit) to a
    value; a feature not named costs nothing. ``info`` says where the numbers came from (the engine measured,
    the fit's errors); :meth:`save` and :meth:`load` keep both in JSON.

    >>> model = StepCostModel({"base": 0.002, "prefill_tokens": 1e-4, "decode_seqs": 3e-4})
    >>> round(model.step_time_s(StepFeatures(prefill_tokens=100, prefill_seqs=1, decode_seqs=4)), 6)
    0.0132
    """

    coefficients: Mapping[str, float]
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - {"base", *FEATURES}
        if unknown:
            raise ValueError(f"unknown cost terms {sorted(unknown)}; terms are 'base' and {list(FEATURES)}")
        for name, value in self.coefficients.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"cost coefficient {name!r} must be a finite number ≥ 0, got {value!r}")
        object.__setattr__(self, "coefficients", {k: float(v) for k, v in self.coefficients.items()})

    def step_time_s(self, features: StepFeatures) -> float:
        """Seconds one step with these features takes; a step that runs nothing takes none."""
        if features.num_tokens == 0:
            return 0.0
        c = self.coefficients
        return c.get("base", 0.0) + sum(value * getattr(features, name) for name, value in c.items() if name != "base")

    def batch_time_s(self, batch: ScheduledBatch) -> float:
        """Seconds the step running ``batch`` takes (call before the batch's sequences are advanced)."""
        return self.step_time_s(StepFeatures.of(batch))

    # --- fitting --------------------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        samples: Sequence[StepSample],
        terms: Sequence[str] = DEFAULT_TERMS["torch"],
        info: Mapping[str, Any] | None = None,
        outlier_mads: float | None = 3.0,
    ) -> StepCostModel:
        """Least squares on measured steps, minimizing relative error, every coefficient ≥ 0.

        With ``outlier_mads``, steps whose relative residual lies more than that many robust standard
        deviations (1.4826 × the median absolute deviation) from the median are set aside and the rest
        refitted, twice: on a shared machine a step that another process slowed down is not the engine's cost.
        The fit's errors (on every step, set aside or not) go into ``info["fit"]``.
        """
        terms = list(dict.fromkeys(terms))
        unknown = set(terms) - {"base", *FEATURES}
        if unknown:
            raise ValueError(f"unknown cost terms {sorted(unknown)}; terms are 'base' and {list(FEATURES)}")
        samples = [s for s in samples if s.features.num_tokens > 0]
        if len(samples) < len(terms):
            raise ValueError(f"{len(samples)} measured steps cannot fit {len(terms)} terms; measure more steps")
        y = np.array([s.time_s for s in samples], dtype=float)
        if not (y > 0).all():
            raise ValueError("every measured step time must be positive")
        x = np.array([[1.0 if t == "base" else getattr(s.features, t) for t in terms] for s in samples], dtype=float)
        keep = np.ones(len(y), dtype=bool)
        for _ in range(3 if outlier_mads is not None else 1):
            coef = _nonnegative_lstsq(x[keep] / y[keep, None], np.ones(int(keep.sum())))  # Σ ((pred − y) / y)²
            residual = (x @ coef - y) / y
            if outlier_mads is None:
                break
            center = np.median(residual[keep])
            spread = 1.4826 * np.median(np.abs(residual[keep] - center))
            if spread == 0:
                break
            candidate = np.abs(residual - center) <= outlier_mads * spread
            if candidate.sum() < len(terms):
                break
            keep = candidate
        predicted = x @ coef
        relative = np.abs(predicted - y) / y
        fit_info = {
            "samples": len(samples),
            "set_aside": int((~keep).sum()),
            "terms": terms,
            "median_relative_error": float(np.median(relative)),
            "p90_relative_error": float(np.percentile(relative, 90)),
            "r2": float(1 - ((predicted - y) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-30)),
            "measured_total_s": float(y.sum()),
            "predicted_total_s": float(predicted.sum()),
        }
        return cls(dict(zip(terms, coef.tolist())), {**(info or {}), "fit": fit_info})

    # --- JSON -----------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"format": COST_FORMAT, "coefficients": dict(self.coefficients), "info": dict(self.info)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepCostModel:
        if data.get("format") != COST_FORMAT or "coefficients" not in data:
            raise ValueError(f"not a step-cost file: expected format {COST_FORMAT!r} with 'coefficients'")
        return cls(data["coefficients"], data.get("info", {}))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no step-cost file at {path}; make one with `minserve plan calibrate --out`")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not JSON: {error}") from None
        return cls.from_dict(data)

    def describe(self) -> str:
        """One line per term, in readable units."""
        units = {"base": "ms per step", "prefill_tokens": "µs per prompt token",
                 "prefill_seqs": "µs per prompt chunk", "prefill_attention_pairs": "ns per query-key pair",
                 "decode_seqs": "µs per decode sequence", "decode_context_tokens": "ns per context token read",
                 "decode_padded_kv_tokens": "ns per padded context token read",
                 "swapped_blocks": "µs per block swapped"}  # fmt: skip
        scale = {"ms": 1e3, "µs": 1e6, "ns": 1e9}
        lines = []
        for name, value in self.coefficients.items():
            unit = units[name]
            lines.append(f"  {name:<26}{value * scale[unit.split()[0]]:>10.4g} {unit}")
        return "\n".join(lines)


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient ≥ 0: drop the most negative term and refit until none is."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return coef


# --- the cost model as an executor ------------------------------------------------------------------------


class StepCost(Protocol):
    """What the simulator asks of a cost model: the seconds a step takes. :class:`StepCostModel` (fitted on the
    engine) is one; :class:`~minserve.capacity.roofline_cost.RooflineStepCost` (a GPU's FLOPs and bytes) another."""

    def step_time_s(self, features: StepFeatures) -> float: ...

    def batch_time_s(self, batch: ScheduledBatch) -> float: ...


class CostModelExecutor:
    """The engine core's executor in a simulation: no model, only time.

    ``execute`` moves ``clock`` forward by what the batch costs and gives each sequence whose prompt (or
    recompute) this step completes one token, ``next_token`` (its value matters only to block hashes). Swaps
    cost what the model's ``swapped_blocks`` term says, charged with the step.
    """

    def __init__(self, cost_model: StepCost, clock: VirtualClock, next_token: int = 0) -> None:
        self.cost_model, self.clock, self.next_token = cost_model, clock, next_token

    def execute(self, batch: ScheduledBatch) -> list[list[Sample] | None]:
        self.clock.advance(self.cost_model.batch_time_s(batch))
        token = [Sample(self.next_token)]
        return [token if samples else None for samples in batch.samples]

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Nothing to copy: the swapped blocks are counted in the step's features instead."""

    def clear(self, block_ids: list[int]) -> None:
        """Nothing to clear: a simulation holds no keys or values."""
