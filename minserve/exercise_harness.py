"""What the graded tests of chapters 05, 07 and 08 run a learner's piece on: the real engine and its simulator.

Public and hidden tests (``exercises/tests/``, an instructor's ``exercises/solutions/hidden/``) share these
helpers, so a hidden test differs from a public one only in its shapes, seeds and workloads.

Chapter 05: a learner's scheduler takes the engine's place. :func:`scheduler_plugged` makes every
:class:`~minserve.engine.core.EngineCore` built inside it construct the learner's class, with the arguments
the engine's own :class:`~minserve.engine.scheduler.Scheduler` gets (block manager, ``max_num_seqs``,
``max_num_batched_tokens``, ``policy=``, ``enable_chunked_prefill=``, ``preemption_mode=``). Both the offline
:class:`~minserve.LLM` (which builds its core when constructed) and the
:class:`~minserve.capacity.simulator.Simulator` (which builds one per run) then run it unchanged. Passing
the engine's own ``Scheduler`` gives the reference run.

Chapter 07: :func:`replace_linear_weights` puts a learner's quantize/dequantize round trip into every
linear layer of a loaded model, and :func:`agreement_with_float` measures the result against the float
model with chapter 07's own measures (:mod:`minserve.quality.agreement`).

Chapter 08: a learner's proposer and verifier take the engine's place. :func:`speculation_plugged` makes an
engine built with a ``speculative_config`` ask ``factory(k)`` for its drafts (every call checked against the
proposer's contract) and verify every draft with the learner's batched ``verify``, greedy rows included (a
greedy row is a one-hot target, and a correct verifier then keeps a draft exactly when it is the argmax).
:func:`engine_run` runs prompts through the real engine with or without them; :func:`verify_rows` and
:func:`tokens_at` run the verifier alone on many rows of synthetic distributions at once.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from minserve import slo
from minserve.capacity.cost_model import StepCost
from minserve.capacity.simulator import SimRequest, SimResult, Simulator
from minserve.config import SchedulerConfig
from minserve.engine import core as engine_core
from minserve.engine import engine as engine_module
from minserve.engine.core import EngineCore
from minserve.engine.detokenizer import IncrementalDetokenizer
from minserve.engine.llm import LLM
from minserve.engine.outputs import RequestMetrics
from minserve.engine.sampling_params import SamplingParams
from minserve.engine.scheduler import Scheduler
from minserve.engine.sequence import Sequence as EngineSequence
from minserve.engine.speculative import verifier as engine_verifier
from minserve.engine.speculative.rejection import Verdict
from minserve.engine.step_report import StepReport
from minserve.quality.agreement import Agreement, next_token_agreement
from minserve.quality.held_out import held_out_text

SchedulerFactory = Callable[..., Any]  # called as the engine calls Scheduler(block_manager, seqs, tokens, …)
REFERENCE_SCHEDULER: SchedulerFactory = Scheduler

# --- chapter 05: a scheduler in the engine's place -----------------------------------------------------------


@contextmanager
def scheduler_plugged(factory: SchedulerFactory) -> Iterator[None]:
    """Inside the block, every engine core built constructs ``factory(...)`` as its scheduler."""
    if not hasattr(engine_core, "Scheduler"):
        raise RuntimeError("minserve.engine.core no longer builds its scheduler by the name Scheduler")
    with mock.patch.object(engine_core, "Scheduler", factory):
        yield


def invariant_checker(core: EngineCore, counts: dict[str, int]) -> Callable[[StepReport], None]:
    """A step observer that checks the block manager's invariants after every step (``AssertionError`` on a
    leaked, double-freed or double-owned block) and counts the steps checked in ``counts["steps"]``."""

    def check(report: StepReport) -> None:
        core.block_manager.check_invariants(core.requests.values())  # the requests still in flight
        counts["steps"] = counts.get("steps", 0) + 1

    return check


def simulate(
    factory: SchedulerFactory,
    cost: StepCost,
    config: SchedulerConfig,
    requests: Sequence[SimRequest],
    check_blocks: bool = True,
    on_step: Callable[[Any, StepReport], None] | None = None,
) -> SimResult:
    """Run ``requests`` through the simulator with ``factory``'s scheduler, on the virtual clock (no wall
    time is read). With ``check_blocks``, the block manager's invariants hold after every step, and at the
    end every block is free again (nothing leaked)."""
    simulator = Simulator(cost, config)
    counts: dict[str, int] = {}
    max_steps = 4 * sum(r.prompt_tokens + r.output_tokens for r in requests) + 1000  # one token a step, twice

    def observe(step: Any, report: StepReport) -> None:
        counts["all"] = counts.get("all", 0) + 1
        assert counts["all"] <= max_steps, f"no end in sight after {max_steps} steps: is a request stuck?"
        if check_blocks:
            invariant_checker(simulator.core, counts)(report)
        if on_step is not None:
            on_step(step, report)

    with scheduler_plugged(factory):
        result = simulator.run(requests, on_step=observe)
    if check_blocks:
        simulator.core.block_manager.check_invariants([])
        held = simulator.core.block_manager.num_used_blocks
        assert held == 0, f"{held} KV blocks are still held after every request finished"
    return result


def greedy_tokens(
    factory: SchedulerFactory, prompts: Sequence[str], max_tokens: int, **llm_options: Any
) -> tuple[list[list[int]], int]:
    """Greedy token ids per prompt from the real engine (the embedded model) with ``factory``'s scheduler,
    the block manager's invariants checked after every step; and the number of preemptions."""
    with scheduler_plugged(factory):
        llm = LLM(**llm_options)
    core = llm.engine.core
    counts: dict[str, int] = {}
    core.observers.append(invariant_checker(core, counts))
    _limit_steps(core.scheduler, max_steps=10 * len(prompts) * max_tokens + 1000)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = [list(output.token_ids) for output in llm.generate(list(prompts), params)]
    assert core.block_manager.num_used_blocks == 0, "KV blocks are still held after every request finished"
    return tokens, core.scheduler.num_preemptions


def _limit_steps(scheduler: Any, max_steps: int) -> None:
    """Make ``scheduler.schedule`` raise ``AssertionError`` past ``max_steps`` calls: a scheduler that makes no
    progress (a request that never gets its blocks back, say) fails its test instead of running forever."""
    schedule, calls = scheduler.schedule, [0]

    def limited() -> Any:
        calls[0] += 1
        assert calls[0] <= max_steps, f"no end in sight after {max_steps} steps: is a request stuck?"
        return schedule()

    scheduler.schedule = limited


def p99_itl_s(result: SimResult, request_ids: Sequence[str] | None = None) -> float:
    """The 99th percentile of inter-token latency, seconds of virtual time, over the requests named (all)."""
    wanted = None if request_ids is None else set(request_ids)
    gaps = [gap for r in result.requests if wanted is None or r.request_id in wanted for gap in r.record.itl_s]
    return slo.percentile(gaps, 99)


def goodput_rps(result: SimResult, target: slo.SLO) -> float:
    """Requests per second of virtual time that met ``target``."""
    return slo.goodput_rps(result.records, target)


# --- chapter 07: a quantizer in every linear layer -------------------------------------------------------------

RoundTrip = Callable[[torch.Tensor], torch.Tensor]  # a float weight [out, in] → its dequantized float32 copy


def replace_linear_weights(llm: LLM, round_trip: RoundTrip) -> int:
    """Put ``round_trip(weight)`` in place of the weight of every ``nn.Linear`` of ``llm``'s decoder layers
    (attention and MLP projections); returns how many were replaced. The embedding, the norms and the output
    head stay float: the engine keeps its head at 8 bits under every scheme, and here it is tied to the
    embedding."""
    replaced = 0
    with torch.no_grad():
        for name, module in llm.engine.model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.split(".")[-1] != "lm_head":
                new = round_trip(module.weight.detach().clone()).to(module.weight.dtype)
                if new.shape != module.weight.shape:
                    raise ValueError(f"the round trip changed a weight's shape {tuple(module.weight.shape)}")
                module.weight.copy_(new)
                replaced += 1
    return replaced


def agreement_with_float(
    reference: LLM, candidate: LLM, num_tokens: int = 512, window_tokens: int = 256, offset_tokens: int = 0
) -> Agreement:
    """KL (nats per token) and top-1 agreement of ``candidate`` against ``reference`` on ``num_tokens`` tokens
    of the held-out text, from ``offset_tokens`` on, in windows of ``window_tokens``."""
    ids = reference.tokenizer.encode(held_out_text())[offset_tokens : offset_tokens + num_tokens]
    stream = torch.tensor(ids)
    return next_token_agreement(
        reference.engine.model.logits_without_cache, candidate.engine.model.logits_without_cache, stream, window_tokens
    )


# --- chapter 08: a proposer and a verifier in the engine's place ---------------------------------------------


class _NoText:
    """A tokenizer that decodes to nothing: a proposer reads token ids, never text."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""


def bytes_held_then_left(propose: Callable[[], object], release: Callable[[], object]) -> tuple[int, int]:
    """Python memory (bytes, by ``tracemalloc``) that ``propose()`` allocated and kept, and how much of it
    is still held after ``release()``: what a proposer that forgets its sequences gives back."""
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        propose()
        held = tracemalloc.get_traced_memory()[0] - baseline
        release()
        return held, tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()


def stand_in_sequence(request_id: str, token_ids: Sequence[int]) -> EngineSequence:
    """A decoding sequence as the engine holds it, for calling a proposer outside the engine: its prompt is
    ``token_ids``; append to ``seq.output_token_ids`` to play the tokens a step kept."""
    return EngineSequence(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=list(token_ids),
        params=SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True),
        metrics=RequestMetrics(arrival_time_s=0.0),
        detokenizer=IncrementalDetokenizer(_NoText()),
    )


PLACEHOLDER = -1  # what a verifier's output row holds past the tokens it emits (vLLM's placeholder id)
ProposerFactory = Callable[[int], Any]  # called with k; returns an object with the engine's Proposer interface
# verify(draft_tokens [B, k], draft_probs [B, k, V], target_probs [B, k + 1, V], generator) → tokens [B, k + 1]
BatchedVerify = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator | None], torch.Tensor]


def check_proposals(drafts: Any, num_tokens: Sequence[int], vocab_size: int) -> None:
    """``AssertionError`` unless ``drafts`` keeps the proposer's contract for a call asked ``num_tokens``: one
    list per sequence, at most as many token ids as asked (none where 0 was asked), each in the vocabulary."""
    assert isinstance(drafts, list), f"propose returned a {type(drafts).__name__}, not a list of lists"
    assert len(drafts) == len(num_tokens), f"{len(drafts)} proposals for {len(num_tokens)} sequences"
    for i, (draft, wanted) in enumerate(zip(drafts, num_tokens)):
        assert isinstance(draft, list), f"proposal {i} is a {type(draft).__name__}, not a list"
        assert len(draft) <= wanted, f"proposal {i} has {len(draft)} tokens; at most {wanted} were asked for"
        for token in draft:
            ok = isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab_size
            assert ok, f"proposal {i} holds {token!r}, not a token id in 0 … {vocab_size - 1}"


class CheckedProposer:
    """A learner's proposer as the engine core sees it, its contract checked on every call
    (:func:`check_proposals`, and the sequences' tokens left as they were)."""

    def __init__(self, proposer: Any, num_speculative_tokens: int, vocab_size: int) -> None:
        said = getattr(proposer, "num_speculative_tokens", None)
        assert said == num_speculative_tokens, (
            f"the proposer was built for k = {num_speculative_tokens} but its num_speculative_tokens is {said!r}"
        )
        self.proposer, self.num_speculative_tokens, self.vocab_size = proposer, num_speculative_tokens, vocab_size

    def propose(self, seqs: list[EngineSequence], num_tokens: list[int]) -> list[list[int]]:
        before = [seq.num_tokens for seq in seqs]
        drafts = self.proposer.propose(list(seqs), list(num_tokens))  # copies: the core's lists stay its own
        check_proposals(drafts, num_tokens, self.vocab_size)
        assert [seq.num_tokens for seq in seqs] == before, "propose changed a sequence's tokens"
        return [list(draft) for draft in drafts]

    def release(self, seq: EngineSequence) -> None:
        self.proposer.release(seq)


def emitted_counts(out: Any, drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How many tokens each row of a verifier's ``out`` emits, after checking its layout against the
    ``drafts`` ``[B, k]`` it was given: ``out`` is an integer tensor ``[B, k + 1]``, and each row holds the
    drafts it kept, in order, then one token of the vocabulary, then :data:`PLACEHOLDER` to the end
    (``AssertionError`` naming the first row that does not)."""
    batch, k = drafts.shape
    assert isinstance(out, torch.Tensor), f"verify returned a {type(out).__name__}, not a tensor"
    assert tuple(out.shape) == (batch, k + 1), f"verify returned shape {tuple(out.shape)}, not {(batch, k + 1)}"
    assert not out.is_floating_point() and out.dtype != torch.bool, f"verify returned {out.dtype}, not integers"
    out, drafts = out.detach().to("cpu", torch.long), drafts.to("cpu", torch.long)
    positions = torch.arange(k + 1)
    emitted = out != PLACEHOLDER
    count = emitted.sum(dim=1)
    _all_rows(count >= 1, out, drafts, "emits no token")
    _all_rows((emitted == (positions < count[:, None])).all(dim=1), out, drafts, "has a placeholder before a token")
    kept = (out[:, :k] == drafts) | (positions[:k] >= count[:, None] - 1)
    _all_rows(kept.all(dim=1), out, drafts, "does not start with the drafts it kept, in order")
    last = out.gather(1, (count - 1)[:, None]).squeeze(1)
    _all_rows((last >= 0) & (last < vocab_size), out, drafts, f"emits a token outside 0 … {vocab_size - 1}")
    return count


def _all_rows(ok: torch.Tensor, out: torch.Tensor, drafts: torch.Tensor, fault: str) -> None:
    bad = (~ok).nonzero()
    if len(bad):
        row = int(bad[0])
        raise AssertionError(
            f"row {row} of verify's output, {out[row].tolist()}, {fault} (drafts {drafts[row].tolist()})"
        )


def verify_rows(
    verify: BatchedVerify, draft_probs: torch.Tensor, target_probs: torch.Tensor, num_rows: int, seed: int
) -> torch.Tensor:
    """``verify`` on ``num_rows`` rows at once, its output's layout checked (:func:`emitted_counts`).

    ``draft_probs`` ``[k, V]`` and ``target_probs`` ``[k + 1, V]`` are the same in every row, or given per row
    (``[num_rows, k, V]``, ``[num_rows, k + 1, V]``); each row's drafts are drawn from its draft
    distributions with a generator seeded ``seed``, and ``verify`` gets its own generator, seeded ``seed + 1``.
    """
    q = draft_probs.expand(num_rows, *draft_probs.shape[-2:]).contiguous()
    p = target_probs.expand(num_rows, *target_probs.shape[-2:]).contiguous()
    k, vocab = q.shape[1], q.shape[2]
    drafting = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=drafting).reshape(num_rows, k)
    out = verify(drafts, q, p, torch.Generator().manual_seed(seed + 1))
    emitted_counts(out, drafts, vocab)
    return out


def tokens_at(out: torch.Tensor, position: int, vocab_size: int) -> list[int]:
    """Counts per token id of what the rows of a verifier's output emitted at ``position``, over the rows
    that emitted that many tokens (a correct verifier's are a sample of the target's row ``position``)."""
    column = out[:, position].to(torch.long)
    return torch.bincount(column[column != PLACEHOLDER], minlength=vocab_size).tolist()


def _one_hot(token_ids: torch.Tensor, vocab_size: int, like: torch.Tensor | None = None) -> torch.Tensor:
    dtype = torch.float32 if like is None else like.dtype
    return torch.nn.functional.one_hot(token_ids, vocab_size).to(dtype)


def _engine_verifiers(verify: BatchedVerify, errors: list[Exception]) -> tuple[Callable, Callable]:
    """The engine's ``verify`` and ``verify_greedy`` (:mod:`minserve.engine.speculative.rejection`), one row
    each, done by the learner's batched ``verify``. The engine's n-gram rows have a one-hot draft
    distribution; a greedy row is a one-hot target at the argmax. The core contains a failure in a step to
    the requests of that batch, so the first one is also kept in ``errors`` for the test to raise."""

    def one_row(draft_tokens: Sequence[int], draft_probs: Any, target_probs: torch.Tensor, generator: Any) -> Verdict:
        try:
            drafts = torch.tensor([list(draft_tokens)], dtype=torch.long, device=target_probs.device)
            vocab = target_probs.shape[-1]
            q = _one_hot(drafts, vocab, target_probs) if draft_probs is None else draft_probs[None]
            out = verify(drafts, q, target_probs[None], generator)
            count = int(emitted_counts(out, drafts, vocab)[0])
            tokens = [int(t) for t in out[0, :count]]
        except Exception as error:
            errors.append(error)
            raise
        return Verdict(tokens, count - 1)

    def greedy_row(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> Verdict:
        vocab = max([*draft_tokens, *target_argmax]) + 1  # any vocabulary that holds them: rows are one-hot
        return one_row(draft_tokens, None, _one_hot(torch.tensor(list(target_argmax)), vocab), None)

    return one_row, greedy_row


@contextmanager
def speculation_plugged(factory: ProposerFactory, verify: BatchedVerify | None = None) -> Iterator[list[Exception]]:
    """Inside the block, an engine built with an n-gram ``speculative_config`` asks ``factory(k)`` for drafts
    (through a :class:`CheckedProposer`), and, with a ``verify``, verifies them with it instead of the
    engine's own verifier. Yields the list where a failure of ``verify`` inside a step is kept."""
    if not hasattr(engine_module, "make_proposer") or not hasattr(engine_verifier, "verify_greedy"):
        raise RuntimeError("minserve.engine no longer builds its proposer and verifier by the names used here")
    errors: list[Exception] = []

    def make_proposer(config: Any, target: Any, **runner_options: Any) -> CheckedProposer:
        k = config.num_speculative_tokens
        return CheckedProposer(factory(k), k, target.config.vocab_size)

    with ExitStack() as patches:
        patches.enter_context(mock.patch.object(engine_module, "make_proposer", make_proposer))
        if verify is not None:
            one_row, greedy_row = _engine_verifiers(verify, errors)
            patches.enter_context(mock.patch.object(engine_verifier, "verify", one_row))
            patches.enter_context(mock.patch.object(engine_verifier, "verify_greedy", greedy_row))
        yield errors


@dataclass(frozen=True)
class SpeculativeRun:
    """One run of the real engine: the token ids per prompt, the drafts proposed and kept, the preemptions."""

    tokens: list[list[int]]
    num_draft_tokens: int
    num_accepted_tokens: int
    num_preemptions: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Drafts kept per draft proposed (0 with none proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def saved_share(self) -> float:
        """The share of output tokens that came from kept drafts: each is a decode step its request skipped."""
        return self.num_accepted_tokens / max(1, sum(len(t) for t in self.tokens))


def engine_run(
    prompts: Sequence[str],
    max_tokens: int,
    factory: ProposerFactory | None = None,
    verify: BatchedVerify | None = None,
    k: int = 3,
    temperature: float = 0.0,
    **llm_options: Any,
) -> SpeculativeRun:
    """Tokens per prompt from the real engine (the embedded model), greedy by default (else sampled at
    ``temperature``, each request seeded by its place in ``prompts``): plain decoding without a ``factory``;
    with one, speculative decoding with ``factory(k)``'s drafts, verified by ``verify`` (the engine's own
    verifier without one). Every request must end by its length and leave no KV block held."""
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    if factory is None:
        llm = LLM(**llm_options)
        outputs, errors = llm.generate(list(prompts), params), []
    else:
        with speculation_plugged(factory, verify) as errors:
            llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": k}, **llm_options)
            outputs = llm.generate(list(prompts), params)
    if errors:
        raise errors[0]  # the learner's verifier failed inside a step: its own error says why
    for output in outputs:
        assert output.finish_reason == "length", f"a request ended {output.finish_reason}: {output.error}"
    assert llm.stats()["kv_blocks_used"] == 0, "KV blocks are still held after every request finished"
    core = llm.engine.core
    tokens = [list(o.token_ids) for o in outputs]
    return SpeculativeRun(tokens, core.num_draft_tokens, core.num_accepted_tokens, core.scheduler.num_preemptions)
