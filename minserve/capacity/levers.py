"""Latency levers, one at a time: the same requests through the engine with one feature and without it.

A :class:`Lever` row names the phase it works on, the quantity compared (lower is better), the value
without and with the lever, and whether the output tokens were the same (a lever that changes the output
is not a latency lever). :func:`prefix_reuse` measures the prefix cache on requests that share a long
prefix, a system prompt as chat products have: it works on prefill, so it shows in TTFT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from minserve.engine.sampling_params import SamplingParams
from minserve.measure.prompts import random_prompts

if TYPE_CHECKING:
    from minserve.engine.llm import LLM
    from minserve.engine.outputs import RequestOutput


@dataclass(frozen=True)
class Lever:
    """One lever measured alone. ``ratio`` is without / with: above 1, the lever helped."""

    lever: str
    phase: str
    quantity: str
    without: float
    with_lever: float
    same_output: bool
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.without / self.with_lever if self.with_lever else float("inf")

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": round(self.ratio, 2)}


def shared_prefix_prompts(
    num_prompts: int, prefix_tokens: int, own_tokens: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """Token-id prompts: one shared random prefix of ``prefix_tokens``, then ``own_tokens`` of each one's own
    (:func:`minserve.measure.prompts.random_prompts`)."""
    return random_prompts([prefix_tokens + own_tokens] * num_prompts, vocab_size, seed, prefix_tokens)


def one_at_a_time(llm: LLM, prompts: Sequence[list[int]], params: SamplingParams) -> list[RequestOutput]:
    """Each prompt alone, in order, as a chat product's users send them: the later ones may reuse the
    earlier ones' cached blocks, never their batch."""
    return [llm.generate([prompt], params)[0] for prompt in prompts]


@dataclass(frozen=True)
class PhaseSplit:
    """Where a workload's mean request spent its latency: prefill (its TTFT) and decode (the rest)."""

    requests: int
    prefill_s: float
    decode_s: float

    @property
    def prefill_share(self) -> float:
        return self.prefill_s / (self.prefill_s + self.decode_s)

    @property
    def dominant(self) -> str:
        return "prefill" if self.prefill_s > self.decode_s else "decode"


def phase_split(outputs: Sequence[RequestOutput]) -> PhaseSplit:
    """The profile a lever is chosen by: mean TTFT as prefill, mean E2E − TTFT as decode (seconds)."""
    prefill = [o.metrics.ttft_s or 0.0 for o in outputs]
    decode = [(o.metrics.e2e_s or 0.0) - p for o, p in zip(outputs, prefill)]
    return PhaseSplit(len(outputs), sum(prefill) / len(outputs), sum(decode) / len(outputs))


def mean_ttft_s(outputs: Sequence[RequestOutput]) -> float:
    return sum(o.metrics.ttft_s or 0.0 for o in outputs) / len(outputs)


def prefix_reuse_runs(
    with_cache: LLM, without_cache: LLM, prompts: Sequence[list[int]], num_tokens: int
) -> dict[str, list[RequestOutput]]:
    """``prompts`` sent one at a time, with the prefix cache (``"with"``) and without (``"without"``), after
    one warm-up request each, which also fills the cache with the shared prefix, as an earlier user would
    have."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    runs = {}
    for label, llm in (("with", with_cache), ("without", without_cache)):
        one_at_a_time(llm, prompts[:1], params)
        runs[label] = one_at_a_time(llm, prompts[1:], params)
    return runs


def prefix_reuse_lever(runs: dict[str, list[RequestOutput]]) -> Lever:
    """The prefix cache as a lever: mean TTFT without and with it (:func:`prefix_reuse_runs`)."""
    cached = sum(o.num_cached_tokens for o in runs["with"]) / len(runs["with"])
    prompt_tokens = len(runs["with"][0].prompt_token_ids)
    return Lever(
        "prefix reuse", "prefill", "mean TTFT (s)", mean_ttft_s(runs["without"]), mean_ttft_s(runs["with"]),
        [o.token_ids for o in runs["with"]] == [o.token_ids for o in runs["without"]],
        f"{cached:.0f} of {prompt_tokens} prompt tokens cached per request",
    )  # fmt: skip


def prefix_reuse(with_cache: LLM, without_cache: LLM, prompts: Sequence[list[int]], num_tokens: int) -> Lever:
    """:func:`prefix_reuse_runs`, read as a :class:`Lever`."""
    return prefix_reuse_lever(prefix_reuse_runs(with_cache, without_cache, prompts, num_tokens))


def mean_e2e_s(outputs: Sequence[RequestOutput]) -> float:
    return sum(o.metrics.e2e_s or 0.0 for o in outputs) / len(outputs)


def amdahl_speedup(phase_share: float, phase_speedup: float) -> float:
    """Amdahl's law: a request whose ``phase_share`` of latency gets ``phase_speedup``× faster, and the rest
    not at all, gets ``1 / ((1 − share) + share / speedup)``× faster end to end; at most ``1 / (1 − share)``."""
    if not 0 <= phase_share <= 1 or phase_speedup <= 0:
        raise ValueError(f"need 0 ≤ phase_share ≤ 1 and phase_speedup > 0, got {phase_share} and {phase_speedup}")
    return 1 / ((1 - phase_share) + phase_share / phase_speedup)
