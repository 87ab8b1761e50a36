"""Speculative decoding measured: the same prompts through the engine without it and with it, side by side.

Two workloads for a base model, each a list of prompts (:func:`workloads`):

* ``grounded``: a function, two blank lines, then its first line again, so the answer copies its prompt
  and prompt lookup finds its drafts there;
* ``open``: short openers that repeat nothing, where it must find them in what the model writes.

and one for a chat model, :func:`edit_requests`: "rename this function" or "add a docstring" to a short
piece of code, the edit that prompt lookup was made for (the answer is mostly the code again). Its prompts
come from a seed, so one seed's requests can measure α and another's can be predicted from it.

A run (:func:`timed_run`) sends ``batch`` prompts per ``generate`` and keeps their tokens, its seconds and
the engine steps it took. :func:`compare` lays a speculative run beside the plain one of the same prompts:
the acceptance rate α (drafts kept / drafts run), the draft's cost c (the mean seconds of one draft forward
over one plain step, timed in the run), the speedup :func:`~minserve.capacity.speculation.predicted_speedup`
expects from them, and the speedup measured (the plain run's seconds over the speculative run's). Beside
them, what the formula assumes away: v, a verification step's seconds (drafting aside) over a plain step's,
and the speedup it predicts with the measured v in place of 1. It also
says whether the tokens were the plain run's: a speedup from different output would be no speedup.

``benchmarks/speculative.py`` and chapter 08 both measure through this module.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from minserve.capacity.speculation import predicted_speedup
from minserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minserve.engine.llm import LLM
    from minserve.trace import TraceEvent

FUNCTIONS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n",
    "def read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() for line in f]\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n    else:\n        continue\n",
]
OPENERS = ["def parse(", "import ", "class Config:", "# TODO", "def main():", "from typing import", "x = [", "try:"]


def workloads(num_prompts: int) -> dict[str, list[str]]:
    """``num_prompts`` prompts per workload, all different (a suffix of ``#`` or spaces past the first round)."""
    grounded = [f + "\n\n" + f.splitlines()[0] + "\n" for f in FUNCTIONS]
    return {
        "grounded": [grounded[i % len(grounded)] + "#" * (i // len(grounded)) for i in range(num_prompts)],
        "open": [OPENERS[i % len(OPENERS)] + " " * (i // len(OPENERS)) for i in range(num_prompts)],
    }


_EDITED_CODE = (
    "def {name}({arg}, {limit}):\n    total = 0\n    for item in {arg}:\n        if item > {limit}:\n"
    "            total += item\n    return total\n",
    "def {name}({arg}):\n    result = []\n    for line in {arg}:\n        line = line.strip()\n        if line:\n"
    "            result.append(line)\n    return result\n",
    "def {name}({arg}, {limit}={number}):\n    values = sorted({arg})\n    return values[:{limit}]\n",
)
_VERBS = ("count", "collect", "pick", "keep", "gather", "select", "store", "fetch")
_NOUNS = ("items", "lines", "values", "rows", "words", "scores", "prices", "nodes")


ChatEncoder = Callable[[list[dict[str, str]]], list[int]]


def edit_requests(encode_chat: ChatEncoder, num_prompts: int, seed: int) -> list[list[int]]:
    """``num_prompts`` chat requests (token ids, through ``encode_chat``, e.g. ``LLM.encode_chat``), each asking
    to rename a short function or to add a docstring to it, with names and numbers drawn from ``seed``."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_prompts):
        verb, arg = rng.choice(_VERBS), rng.choice(_NOUNS)
        name = f"{verb}_{arg}"
        code = _EDITED_CODE[i % len(_EDITED_CODE)].format(
            name=name, arg=arg, limit=rng.choice(("limit", "bound", "k", "top")), number=rng.randint(2, 9)
        )
        ask = (f"Rename `{name}` to `{rng.choice(_VERBS)}_{rng.choice(('all', 'them', 'data'))}` in this code."
               if i % 2 == 0 else "Add a docstring to this function.")  # fmt: skip
        message = f"{ask} Reply with the code only.\n\n```python\n{code}```"
        requests.append(encode_chat([{"role": "user", "content": message}]))
    return requests


def acceptance_rate(llm: LLM, prompts: list, params: SamplingParams) -> float:
    """α on ``prompts``, generated together by the speculative ``llm``: drafts kept over drafts run."""
    before = _draft_counts(llm.engine.core)
    llm.generate(prompts, params)
    alpha = _acceptance_since(llm.engine.core, before)
    if alpha is None:
        raise ValueError("no draft was run on these prompts: α is undefined")
    return alpha


def _draft_counts(core: Any) -> tuple[int, int]:
    """The drafts an engine core has run and kept since it started."""
    return core.num_draft_tokens, core.num_accepted_tokens


def _acceptance_since(core: Any, before: tuple[int, int]) -> float | None:
    """α over the drafts run since ``before`` (:func:`_draft_counts`); ``None`` where none were run."""
    drafted, accepted = (now - then for now, then in zip(_draft_counts(core), before))
    return accepted / drafted if drafted else None


def greedy(num_tokens: int) -> SamplingParams:
    """Exactly ``num_tokens`` greedy tokens a request (``ignore_eos``), so every run does the same work."""
    return SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)


def spec_config(proposer: str, k: int, draft: str | None = None, draft_layers: int = 1) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for a proposer's short name: ``ngram``, ``draft`` or ``early_exit``."""
    if proposer == "draft":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    if proposer == "early_exit":
        return {"method": "early_exit", "num_draft_layers": draft_layers, "num_speculative_tokens": k}
    if proposer == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    raise ValueError(f"proposer must be ngram, draft or early_exit, got {proposer!r}")


@dataclass(frozen=True)
class TimedRun:
    """Token ids per prompt, the seconds the run took, and the engine steps it took."""

    tokens: list[list[int]]
    seconds: float
    steps: int

    @property
    def step_s(self) -> float:
        return self.seconds / max(self.steps, 1)


def timed_run(
    llm: LLM, prompts: list, params: SamplingParams, batch: int, warm_up: bool = True, rounds: int = 1
) -> TimedRun:
    """``prompts``, ``batch`` per ``generate``, after a warm-up on the first two (first calls pay for
    allocation and lazy initialisation, not for the work); with ``rounds`` > 1, the fastest of that many runs
    (on a shared machine another process only ever slows a run down)."""
    if warm_up:
        _generate(llm, prompts[:2], params, batch)
    runs = []
    for _ in range(rounds):
        steps = llm.engine.core.num_steps
        start = time.perf_counter()
        tokens = _generate(llm, prompts, params, batch)
        runs.append(TimedRun(tokens, time.perf_counter() - start, llm.engine.core.num_steps - steps))
    return min(runs, key=lambda run: run.seconds)


def _generate(llm: LLM, prompts: list[str], params: SamplingParams, batch: int) -> list[list[int]]:
    tokens: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        tokens += [out.token_ids for out in llm.generate(prompts[i : i + batch], params)]
    return tokens


@dataclass(frozen=True)
class SpeculationPoint:
    """One speculative run beside the plain run of the same prompts. Speedups are plain seconds over
    speculative seconds (above 1: faster); ``draft_cost`` is c, in plain steps (0: nothing ran to draft)."""

    workload: str
    batch: int
    proposer: str
    k: int
    acceptance: float
    draft_cost: float
    predicted_speedup: float
    verify_cost: float
    predicted_with_verify_cost: float
    measured_speedup: float
    plain_tok_s: float
    spec_tok_s: float
    same_output: bool

    def row(self) -> dict[str, Any]:
        return asdict(self)


class ForwardTimer:
    """Wraps a model runner's ``execute`` to count its forwards and the seconds they took."""

    def __init__(self, runner: Any) -> None:
        self._execute: Callable = runner.execute
        self.calls, self.seconds = 0, 0.0
        runner.execute = self

    def __call__(self, batch: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._execute(batch)
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - start

    @property
    def forward_s(self) -> float:
        return self.seconds / self.calls if self.calls else 0.0


def compare(
    plain: TimedRun,
    llm: LLM,
    prompts: list,
    params: SamplingParams,
    batch: int,
    *,
    workload: str,
    proposer: str,
    rounds: int = 1,
) -> SpeculationPoint:
    """Run ``prompts`` through the speculative ``llm`` as ``plain`` ran them (the fastest of ``rounds`` runs),
    and lay the two side by side."""
    core = llm.engine.core
    k = core.proposer.num_speculative_tokens
    _generate(llm, prompts[:2], params, batch)  # warm-up, as the plain run had
    runner = getattr(core.proposer, "runner", None)  # a draft model's, or none for prompt lookup
    timer = ForwardTimer(runner) if runner is not None else None
    before = _draft_counts(core)
    spec = timed_run(llm, prompts, params, batch, warm_up=False, rounds=rounds)
    if runner is not None:
        runner.execute = timer._execute  # type: ignore[union-attr]
    alpha = _acceptance_since(core, before)
    alpha = 0.0 if alpha is None else alpha
    cost = timer.forward_s / plain.step_s if timer else 0.0
    draft_s = timer.seconds / rounds if timer else 0.0  # a round's drafting, on average
    verify_s = (spec.seconds - draft_s) / max(spec.steps, 1)
    v = verify_s / plain.step_s
    num_tokens = sum(len(t) for t in plain.tokens)
    return SpeculationPoint(
        workload=workload, batch=batch, proposer=proposer, k=k, acceptance=round(alpha, 3),
        draft_cost=round(cost, 3), predicted_speedup=round(predicted_speedup(alpha, k, draft_cost=cost), 3),
        verify_cost=round(v, 3), predicted_with_verify_cost=round(predicted_speedup(alpha, k, cost, v), 3),
        measured_speedup=round(plain.seconds / spec.seconds, 3), plain_tok_s=round(num_tokens / plain.seconds, 1),
        spec_tok_s=round(num_tokens / spec.seconds, 1), same_output=spec.tokens == plain.tokens,
    )  # fmt: skip


def acceptance_by_position(events: Iterable[TraceEvent], k: int) -> list[float | None]:
    """For draft positions 1 … k: the share of drafts kept among those the verifier reached (every draft
    before it kept), from the engine's traced decode steps (``drafted`` and ``accepted`` in their args).
    ``None`` where no step reached that position. The formula assumes one α for every position."""
    reached, kept = [0] * k, [0] * k
    for event in events:
        drafted, accepted = event.args.get("drafted"), event.args.get("accepted")
        if event.name != "decode" or not drafted:
            continue
        for position in range(min(drafted, accepted + 1)):  # reached: all before it were kept
            reached[position] += 1
            kept[position] += position < accepted
    return [kept[i] / reached[i] if reached[i] else None for i in range(k)]
