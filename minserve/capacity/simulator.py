"""A discrete-event simulator of the engine: the real scheduler and block manager on a virtual clock.

The scheduler (:mod:`minserve.engine.scheduler`) counts steps and never reads a clock, so the same code can run
without a model: every step the simulator admits the requests that have arrived by the virtual clock, calls
``Scheduler.schedule()``, moves the clock forward by what a :class:`StepCostModel` says that batch costs, and
then does the engine's bookkeeping (advance ``num_computed_tokens``, name full blocks, give a token to every
sequence whose prompt is done, finish it at its ``max_tokens``). Admission, chunking, preemption and every
policy are therefore exactly the engine's; only the forward pass is replaced by arithmetic. When nothing is in
flight the clock jumps to the next arrival. A thousand requests take seconds, so a chapter can sweep policies
and arrival rates that would take the engine minutes.

Each request comes out with the engine's :class:`~minserve.engine.outputs.RequestMetrics` (arrival, first
scheduled, every token's time, finish, time spent waiting) and as a :class:`minserve.slo.RequestRecord`, so
the same SLO code summarizes a simulation and a measured run (:func:`summarize`).

**The step-cost model.** A step's time is linear in what the step does::

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
but not free), while the Triton kernel reads each sequence's own blocks only; :func:`calibrate` fits the
terms of the backend it measures (:data:`DEFAULT_TERMS`). ``swapped_blocks`` (blocks copied to or from host
memory by swap preemption) is counted too, but is free unless a coefficient is given: calibration does not
preempt.

The coefficients are fitted by least squares (numpy) on steps measured on the engine (:func:`calibrate`).
Step times span two orders of magnitude (a 2 ms decode of one sequence, a 150 ms prefill of a thousand
tokens), so the fit minimizes *relative* error: an unweighted fit would let the few long steps set every
coefficient, and the short decode steps that make TPOT would come out poorly. On a shared machine some steps
are slowed by other processes; the steps whose residual is far out (3 robust standard deviations) are set
aside and the rest refitted. A coefficient that comes out negative is dropped and the rest refitted.

What the simulator does not model: sampling and stop strings (every request produces exactly its output
length, as with ``ignore_eos``), cancellations, and time spent outside ``engine.step()``.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minserve import slo
from minserve.engine.block_manager import BlockManager
from minserve.engine.detokenizer import IncrementalDetokenizer
from minserve.engine.outputs import RequestMetrics
from minserve.engine.policies import Policy, make_policy
from minserve.engine.sampling_params import SamplingParams
from minserve.engine.scheduler import PREEMPTION_MODES, ScheduledBatch, Scheduler
from minserve.engine.sequence import Sequence as EngineSequence

if TYPE_CHECKING:
    from minserve.engine.engine import LLMEngine
    from minserve.engine.llm import LLM

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
        prefill_tokens = prefill_seqs = pairs = decode_seqs = context = longest = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            computed = seq.num_computed_tokens
            if n == 1:
                decode_seqs += 1
                context += computed + 1
                longest = max(longest, computed + 1)
            elif n > 1:
                prefill_tokens += n
                prefill_seqs += 1
                pairs += n * computed + n * (n + 1) // 2
        swapped = len(getattr(batch, "swap_out", ())) + len(getattr(batch, "swap_in", ()))
        return cls(prefill_tokens, prefill_seqs, pairs, decode_seqs, context, decode_seqs * longest, swapped)

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


# --- configuration and requests ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SimConfig:
    """The engine's scheduling knobs, under :class:`~minserve.config.EngineConfig`'s names.

    ``num_kv_blocks`` defaults to what the engine allocates for ``minserve-tiny`` on a CPU (256 MiB of float32
    KV); :meth:`from_engine` takes an engine's own numbers. ``max_model_len`` ``None`` means no context limit.
    With ``preemption_mode="swap"``, ``num_cpu_blocks`` host blocks hold swapped-out KV (``None``: as many as
    the device has, the engine's default).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    num_kv_blocks: int = 4096
    scheduling_policy: str | Policy = "fcfs"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    preemption_mode: str = "recompute"
    num_cpu_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SimConfig.{name} must be an integer ≥ 1, got {value!r}")
        if self.num_cpu_blocks is not None and (not isinstance(self.num_cpu_blocks, int) or self.num_cpu_blocks < 0):
            raise ValueError(f"SimConfig.num_cpu_blocks must be an integer ≥ 0 or None, got {self.num_cpu_blocks!r}")
        make_policy(self.scheduling_policy)  # an unknown name fails here, not at the first run
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"SimConfig.max_model_len must be an integer ≥ 2 or None, got {self.max_model_len!r}")

    @property
    def host_blocks(self) -> int:
        """Host blocks the block manager gets: none unless swapping, by default as many as the device's."""
        if self.preemption_mode != "swap":
            return 0
        return self.num_kv_blocks if self.num_cpu_blocks is None else self.num_cpu_blocks

    @classmethod
    def from_engine(cls, llm: LLM | LLMEngine, **overrides: Any) -> SimConfig:
        """The configuration an engine runs with (its KV block count and context limit included)."""
        engine = getattr(llm, "engine", llm)
        config = engine.config
        values = dict(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size,
            num_kv_blocks=engine.block_manager.num_blocks,
            scheduling_policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching,
            max_model_len=engine.max_model_len,
            preemption_mode=getattr(config, "preemption_mode", "recompute"),
            num_cpu_blocks=getattr(engine.block_manager, "num_cpu_blocks", 0),
        )
        return cls(**{**values, **overrides})

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if isinstance(self.scheduling_policy, Policy):
            data["scheduling_policy"] = self.scheduling_policy.name
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **overrides: Any) -> SimConfig:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{**{k: v for k, v in data.items() if k in known}, **overrides})


@dataclass(frozen=True)
class SimRequest:
    """One request for the simulator: when it arrives (seconds on the virtual clock), its prompt's token ids,
    how many tokens it produces, and the engine's per-request options (``deadline_s``: seconds after arrival).
    :func:`make_requests` builds them from lengths alone."""

    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_tokens: int
    priority: int = 0
    deadline_s: float | None = None
    request_id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if not isinstance(self.output_tokens, int) or self.output_tokens < 1:
            raise ValueError(f"output_tokens must be an integer ≥ 1, got {self.output_tokens!r}")
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"arrival_s must be a finite number ≥ 0, got {self.arrival_s!r}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be a positive number of seconds, got {self.deadline_s!r}")

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def poisson_arrivals(num_requests: int, rate_rps: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Arrival times in seconds, the first at 0: Poisson at ``rate_rps`` (gamma gaps when ``burstiness`` ≠ 1).

    The same timetable as :func:`minserve.bench.arrivals.timetable` for the same arguments (the layers
    contract keeps ``capacity`` and ``bench`` apart, so it is repeated here). ``math.inf``: all at once.
    """
    if num_requests <= 0:
        return []
    if not rate_rps > 0 or not burstiness > 0:
        raise ValueError(f"need rate_rps > 0 and burstiness > 0, got {rate_rps!r}, {burstiness!r}")
    if math.isinf(rate_rps):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / rate_rps / burstiness, size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def make_requests(
    arrivals_s: Sequence[float],
    prompt_lengths: Sequence[int] | int,
    output_lengths: Sequence[int] | int,
    vocab_size: int = 2048,
    seed: int = 0,
    priorities: Sequence[int] | None = None,
    deadlines_s: Sequence[float | None] | float | None = None,
    shared_prefix_tokens: int = 0,
) -> list[SimRequest]:
    """Requests with seeded random prompts (token ids in ``[1, vocab_size)``, so no two share a cached block
    unless ``shared_prefix_tokens`` gives them all the same first tokens). Lengths are one per request or one
    for all."""
    n = len(arrivals_s)
    prompts_n = _per_request(prompt_lengths, n, "prompt_lengths")
    outputs_n = _per_request(output_lengths, n, "output_lengths")
    priorities = _per_request(priorities if priorities is not None else 0, n, "priorities")
    deadlines = _per_request(deadlines_s, n, "deadlines_s")
    rng = np.random.default_rng(seed)
    prefix = rng.integers(1, vocab_size, size=shared_prefix_tokens).tolist()
    requests = []
    for i in range(n):
        own = max(prompts_n[i] - shared_prefix_tokens, 0)
        ids = (prefix + rng.integers(1, vocab_size, size=own).tolist())[: max(prompts_n[i], 1)]
        requests.append(SimRequest(arrivals_s[i], tuple(ids), outputs_n[i], priorities[i], deadlines[i], str(i)))
    return requests


def sample_lengths(spec: str, n: int, seed: int = 0, max_len: int = 1 << 20) -> list[int]:
    """``n`` lengths in tokens from a spec as ``minserve bench`` writes it: ``"256"`` (fixed),
    ``"uniform:256:128"`` (integers 256 ± 128) or ``"lognormal:256:128"`` (mean 256, sd 128); clipped to
    ``[1, max_len]``."""
    parts = spec.split(":")
    try:
        kind, mean, spread = ("fixed", float(parts[0]), 0.0) if len(parts) == 1 else (parts[0], *map(float, parts[1:]))
    except (TypeError, ValueError):
        raise ValueError(f"length spec {spec!r}: expected N, uniform:MEAN:SPREAD or lognormal:MEAN:SD") from None
    if kind not in ("fixed", "uniform", "lognormal") or len(parts) not in (1, 3):
        raise ValueError(f"length spec {spec!r}: expected N, uniform:MEAN:SPREAD or lognormal:MEAN:SD")
    if mean < 1 or spread < 0:
        raise ValueError(f"length spec {spec!r}: need mean ≥ 1 and spread ≥ 0 tokens")
    rng = np.random.default_rng(seed)
    if kind == "fixed":
        values = np.full(n, mean)
    elif kind == "uniform":
        values = rng.uniform(mean - spread, mean + spread, size=n)
    else:
        sigma = math.sqrt(math.log1p((spread / mean) ** 2))
        values = rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, size=n)
    return np.clip(np.round(values), 1, max_len).astype(int).tolist()


def _per_request(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != n:
            raise ValueError(f"{name}: {len(value)} values for {n} requests")
        return list(value)
    return [value] * n


# --- results ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimulatedRequest:
    """One request after the simulation: its timestamps (the engine's :class:`RequestMetrics`) and how it ended."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str  # "length" (produced what it asked for, or reached max_model_len) or "deadline"
    metrics: RequestMetrics
    num_preemptions: int
    num_cached_tokens: int
    priority: int = 0

    @property
    def record(self) -> slo.RequestRecord:
        status = "ok" if self.finish_reason == "length" else "failed"
        return slo.record_from_metrics(self.metrics, status, self.prompt_tokens, self.request_id)


@dataclass(frozen=True)
class StepRecord:
    """One simulated step: when it began on the virtual clock, how long it took, and what it ran."""

    start_s: float
    duration_s: float
    features: StepFeatures
    num_running: int  # after this step's scheduling
    num_waiting: int  # waiting or swapped out, after this step's scheduling
    num_preempted: int  # by this step's scheduling


@dataclass
class SimResult:
    """A finished simulation: every request, every step, and the totals."""

    requests: list[SimulatedRequest]
    steps: list[StepRecord]
    config: SimConfig
    num_preemptions: int
    end_s: float  # the virtual clock when the last request finished
    wall_s: float  # real seconds the simulation took

    @property
    def records(self) -> list[slo.RequestRecord]:
        """Every request as :mod:`minserve.slo` sees it (a request stopped at its deadline is ``failed``)."""
        return [r.record for r in self.requests]

    def summary(self, slo_target: slo.SLO | None = None) -> dict[str, float]:
        """:func:`summarize` of the records, plus steps and preemptions."""
        return summarize(self.records, slo_target) | {
            "steps": len(self.steps),
            "preemptions": self.num_preemptions,
            "virtual_s": self.end_s,
            "wall_s": self.wall_s,
        }


def summarize(records: Sequence[slo.RequestRecord], slo_target: slo.SLO | None = None) -> dict[str, float]:
    """The numbers a run is compared on, from :mod:`minserve.slo`: TTFT, TPOT, ITL and E2E percentiles (ms),
    request and output-token throughput over the measured window, and goodput and attainment under an SLO.
    The same function summarizes a simulation and a measured engine run."""
    out: dict[str, float] = {"requests": len(records), "ok": sum(r.ok for r in records)}
    for metric, quantiles in (("ttft", (50, 90, 99)), ("tpot", (50, 90, 99)), ("itl", (50, 99)), ("e2e", (50, 90))):
        values = slo.metric_values_s(records, metric)
        out[f"{metric}_mean_ms"] = sum(values) / len(values) * 1e3 if values else math.nan
        for q in quantiles:
            out[f"{metric}_p{q}_ms"] = slo.percentile(values, q) * 1e3
    out["throughput_rps"] = slo.request_throughput_rps(records)
    out["output_tokens_per_s"] = slo.token_throughput_tps(records)
    if slo_target is not None:
        out["goodput_rps"] = slo.goodput_rps(records, slo_target)
        out["attainment"] = slo.attainment(records, slo_target)["all"]
    return out


# --- the simulator ---------------------------------------------------------------------------------------


class _NoText:
    """A tokenizer that decodes nothing: the simulator never detokenizes."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""


StepCallback = Callable[[StepRecord, ScheduledBatch], None]


class Simulator:
    """Runs requests through the real :class:`Scheduler` and :class:`BlockManager` on a virtual clock.

    >>> cost = StepCostModel({"base": 0.01, "prefill_tokens": 0.001, "decode_seqs": 0.002})
    >>> result = Simulator(cost).run([SimRequest(0.0, tuple(range(1, 101)), output_tokens=3)])
    >>> r = result.records[0]
    >>> round(r.ttft_s, 6), round(r.tpot_s, 6)   # prefill step 0.01 + 100 × 0.001; decode step 0.01 + 0.002
    (0.11, 0.012)

    Each :meth:`run` builds a fresh scheduler and block manager, so runs are independent, and returns the
    requests in arrival order. ``on_step`` is called after every step with its :class:`StepRecord` and the
    scheduler's batch (before the batch's sequences were advanced: read it, do not keep it).
    """

    def __init__(self, cost_model: StepCostModel, config: SimConfig | None = None, next_token: int = 0) -> None:
        self.cost_model = cost_model
        self.config = config or SimConfig()
        self.next_token = next_token  # the token every step "samples": its value matters only to block hashes
        self.block_manager: BlockManager | None = None  # the last run's, for inspection
        self.scheduler: Scheduler | None = None

    def run(self, requests: Iterable[SimRequest], on_step: StepCallback | None = None) -> SimResult:
        wall_start = time.perf_counter()
        config = self.config
        pending = sorted(requests, key=lambda r: r.arrival_s)  # stable: ties keep their given order
        for request in pending:
            self._check_fits(request)
        has_deadlines = any(request.deadline_s is not None for request in pending)
        self.block_manager = block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching, config.host_blocks
        )
        self.scheduler = scheduler = Scheduler(
            block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode,
        )
        live: dict[int, tuple[EngineSequence, SimRequest]] = {}  # id(seq) → (seq, request)
        done: list[tuple[int, SimulatedRequest]] = []  # (arrival index, result)
        steps: list[StepRecord] = []
        arrival_index = itertools.count()
        next_arrival = 0
        clock = pending[0].arrival_s if pending else 0.0
        stalled = 0
        while next_arrival < len(pending) or scheduler.has_unfinished():
            while next_arrival < len(pending) and pending[next_arrival].arrival_s <= clock:
                request = pending[next_arrival]
                seq = self._sequence(request, next(arrival_index))
                live[id(seq)] = (seq, request)
                scheduler.add(seq)
                next_arrival += 1
            if not scheduler.has_unfinished():
                clock = pending[next_arrival].arrival_s  # idle: jump to the next arrival
                continue
            if has_deadlines:  # the engine's deadline check, at the start of the step
                for seq, request in list(live.values()):
                    if seq.deadline_s is not None and clock > seq.deadline_s:
                        done.append(self._finish(seq, request, "deadline", clock, live))
            batch = scheduler.schedule()
            for seq in batch.preempted:
                seq.waiting_since_s = clock
            for seq in batch.admitted:
                seq.metrics.waiting_s += clock - seq.waiting_since_s
            if not batch:
                stalled += 1
                if stalled > 2:  # a preemption left nothing runnable twice over: only an arrival can help
                    if next_arrival == len(pending):
                        raise RuntimeError("the scheduler makes no progress and no request is left to arrive")
                    clock = max(clock, pending[next_arrival].arrival_s)
                continue
            stalled = 0
            features = StepFeatures.of(batch)
            duration = self.cost_model.step_time_s(features)
            end = clock + duration
            waiting = len(scheduler.waiting) + len(scheduler.swapped)
            step = StepRecord(clock, duration, features, len(scheduler.running), waiting, len(batch.preempted))
            steps.append(step)
            if on_step is not None:
                on_step(step, batch)
            for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
                if seq.metrics.first_scheduled_time_s is None:
                    seq.metrics.first_scheduled_time_s = clock
                if scheduler.complete(seq, num_new):  # the prompt (or a recompute) is done: a token
                    seq.output_token_ids.append(self.next_token)
                    seq.metrics.token_times_s.append(end)
                    full = len(seq.output_token_ids) >= seq.params.max_tokens
                    if full or (config.max_model_len is not None and seq.num_tokens >= config.max_model_len):
                        done.append(self._finish(seq, live[id(seq)][1], "length", end, live))
            clock = end
        results = [result for _, result in sorted(done, key=lambda item: item[0])]  # in arrival order
        return SimResult(results, steps, config, scheduler.num_preemptions, clock, time.perf_counter() - wall_start)

    def _check_fits(self, request: SimRequest) -> None:
        """The engine's refusals: a prompt with no room to generate, or bigger than the whole KV cache."""
        config, n = self.config, request.prompt_tokens
        if config.max_model_len is not None and n >= config.max_model_len:
            raise ValueError(f"request {request.request_id}: {n} prompt tokens reach max_model_len")
        needed = n + request.output_tokens
        if config.max_model_len is not None:
            needed = min(needed, config.max_model_len)
        if needed > config.num_kv_blocks * config.block_size:
            raise ValueError(
                f"request {request.request_id}: {needed} tokens are more than the whole KV cache holds "
                f"({config.num_kv_blocks} blocks of {config.block_size})"
            )

    @staticmethod
    def _sequence(request: SimRequest, arrival_index: int) -> EngineSequence:
        arrival = request.arrival_s
        return EngineSequence(
            request_id=request.request_id if request.request_id is not None else str(arrival_index),
            prompt=None,
            prompt_token_ids=list(request.prompt_token_ids),
            params=SamplingParams(max_tokens=request.output_tokens, ignore_eos=True),
            metrics=RequestMetrics(arrival_time_s=arrival),
            detokenizer=IncrementalDetokenizer(_NoText()),
            arrival_index=arrival_index,
            priority=request.priority,
            deadline_s=None if request.deadline_s is None else arrival + request.deadline_s,
            waiting_since_s=arrival,
        )

    def _finish(
        self, seq: EngineSequence, request: SimRequest, reason: str, now: float, live: dict[int, Any]
    ) -> tuple[int, SimulatedRequest]:
        assert self.scheduler is not None
        if seq in self.scheduler.waiting or seq in self.scheduler.swapped:  # ends while waiting: that counts too
            seq.metrics.waiting_s += now - seq.waiting_since_s
        seq.metrics.finish_time_s = now
        self.scheduler.finish(seq)
        del live[id(seq)]
        return seq.arrival_index, SimulatedRequest(
            request_id=seq.request_id,
            prompt_tokens=len(seq.prompt_token_ids),
            output_tokens=len(seq.output_token_ids),
            finish_reason=reason,
            metrics=seq.metrics,
            num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.num_cached_tokens,
            priority=request.priority,
        )


def simulate(
    requests: Iterable[SimRequest], cost_model: StepCostModel, config: SimConfig | None = None, **knobs: Any
) -> SimResult:
    """Run ``requests`` through a fresh :class:`Simulator`; ``knobs`` are :class:`SimConfig` fields."""
    if knobs:
        config = SimConfig(**{**(config or SimConfig()).__dict__, **knobs})
    return Simulator(cost_model, config).run(requests)


__all__ = [
    "DEFAULT_TERMS",
    "FEATURES",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "SimulatedRequest",
    "Simulator",
    "StepCostModel",
    "StepFeatures",
    "StepRecord",
    "StepSample",
    "make_requests",
    "poisson_arrivals",
    "sample_lengths",
    "simulate",
    "summarize",
]
