"""Chapter 10's injected failures and output quality: what the load tester counted, checked against the server.

Two failures are injected on the server's side of the wire and one on the client's:

* **429** — a server started with a small ``--max-waiting-requests`` refuses what its queue cannot hold;
* **timeouts** — a client with a short ``timeout_s`` gives up on requests that wait too long (the server
  must then abort them and hand their KV blocks back);

and every one must be counted: by kind in the summary's ``errors``, against availability and goodput, and
the same number in the server's own metrics. A load tester that drops failed requests, or files them as
ok, fails :func:`failure_problems`.

Quality is measured, not read: :func:`output_agreement` lays each answer served under load beside the
offline engine's greedy answer to the same prompt. Greedy decoding is a function of the prompt alone, so a
server that batches, queues and caches correctly serves the same text; one that mixes up sequences' KV or
positions does not. Functions return ``[]`` when their claim holds, else one sentence per broken part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from minserve import slo
from minserve.bench.workload import BenchRequest
from minserve.lab.checks import require
from minserve.lab.loadtest_tables import server_finished

# A refusal costs no model work: its latency is under this fraction of an admitted request's median E2E.
REFUSAL_FAST_FRACTION = 0.2
# A timed-out request ends this soon after its ``timeout_s`` (the client's event loop and the hang-up).
TIMEOUT_SLACK_S = 0.5
# Served answers that must equal the offline engine's, character for character. Not 1.0: a batched step adds
# each row's floats in a different order than a step of one sequence does (the matmul and attention kernels
# pick their blocking by the batch's shape), so logits differ in the last bits; where the two best logits of
# a greedy step are within that difference, the argmax can flip and the answer diverges from there on. An
# engine built from batch-invariant kernels (Thinking Machines, "Defeating Nondeterminism in LLM Inference",
# 2025) gives bit-identical rows whatever the batch, and there the right threshold is 1.0. A server that mixes
# up sequences' KV blocks or positions gets most answers wrong, far below this.
AGREEMENT_MIN = 0.95


def failure_table(summaries: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Per run: the client's count by status and error kind beside the server's, availability and goodput."""
    rows = []
    for s in summaries:
        verdict = s.get("verdict", {})
        reasons = server_finished(s)
        rows.append(
            {
                "run": s["label"],
                "sent": s["requests"],
                "ok": s["ok"],
                **{f"client {kind}": n for kind, n in sorted(s.get("errors", {}).items())},
                "server refused": rejected(s),
                "server stop+length": reasons.get("stop", 0) + reasons.get("length", 0),
                "server abort": reasons.get("abort", 0),
                "availability": verdict.get("availability"),
                "goodput req/s": s.get("goodput_rps"),
                "verdict": ("PASS" if verdict["passed"] else "FAIL") if verdict else "-",
            }
        )
    return pd.DataFrame(rows).set_index("run").fillna(0).round(3)


def rejected(summary: Mapping[str, Any], reason: str = "queue_full") -> int:
    """Requests the server refused before its engine for ``reason``, as its ``requests_rejected`` counter says."""
    return round(summary.get("server", {}).get(f'requests_rejected_total{{reason="{reason}"}}', 0.0))


def failure_problems(summary: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], sent: int) -> list[str]:
    """Is every request of one run counted, by the client and by the server alike? ``[]`` when it is.

    ``sent`` is the length of the workload (known before the run, not read from its records). The claims:
    a record for every request; every failure has a kind, and ``http_429`` as many as the server refused;
    every request the server admitted ended there exactly once, completed or aborted; every one the
    client gave up on before its first token was aborted (it still needed its whole prefill and decode, far
    longer than the server takes to notice a hang-up); availability is ok over sent, so a failure fails the
    verdict; goodput counts only ok requests.

    Requests the client gave up on mid-answer are not held to an abort: one whose last tokens were already
    on their way when the client's timer ran out is counted completed by the server and timed out by the
    client, and how many do so depends on how busy the machine is, not on whether the server is right.
    """
    problems = []
    errors = dict(summary.get("errors", {}))
    if len(rows) != sent or summary["requests"] != sent:
        problems.append(f"{sent} sent, {len(rows)} records, {summary['requests']} in the summary")
    if sum(errors.values()) != summary["failed"]:
        problems.append(f"{summary['failed']} failed but {sum(errors.values())} with a kind: {errors}")
    if errors.get("http_429", 0) != rejected(summary):
        problems.append(f"client saw {errors.get('http_429', 0)} 429s, the server refused {rejected(summary)}")
    reasons = server_finished(summary)
    completed, aborted = reasons.get("stop", 0) + reasons.get("length", 0), reasons.get("abort", 0)
    gave_up = errors.get("timeout", 0) + summary["cancelled"]
    if completed + aborted != summary["ok"] + gave_up:
        problems.append(f"client: {summary['ok']} ok and {gave_up} given up on; server: {completed} completed and "
                        f"{aborted} aborted")  # fmt: skip
    waiting = len(given_up_waiting(rows))
    if completed < summary["ok"] or aborted < waiting:
        problems.append(f"the server completed {completed} and aborted {aborted}; the client had {summary['ok']} ok "
                        f"and gave up on {gave_up}, {waiting} of them before their first token")  # fmt: skip
    verdict = summary.get("verdict", {})
    judged = sent - summary["cancelled"]
    if verdict and abs(verdict["availability"] - summary["ok"] / judged) > 1e-9:
        problems.append(f"availability {verdict['availability']:.3f}, but {summary['ok']} of {judged} were ok")
    if verdict and summary["failed"] and verdict["passed"]:
        problems.append("requests failed and the verdict still passed")
    if summary.get("goodput_rps", 0) * summary["duration_s"] > summary["ok"] + 1e-9:
        problems.append("goodput counts more requests than were ok")
    return problems


def given_up_waiting(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows the client gave up on (a timeout or a hang-up) before any token of the answer had arrived."""
    return [row for row in rows if (row.get("error") == "timeout" or row["status"] == "cancelled")
            and not row["chunk_times_s"]]  # fmt: skip


def refusal_problems(rows: Sequence[Mapping[str, Any]], fast_fraction: float = REFUSAL_FAST_FRACTION) -> list[str]:
    """Under a small queue limit, some requests are refused with 429, and fast: their median within
    ``fast_fraction`` of an ok request's median E2E. ``[]`` when both hold.

    The median, not the slowest: a refusal costs no model work, but one that arrives while the front end's
    thread waits on the engine (a step holding the interpreter) waits with it, and on a fast machine, where
    an ok request takes 160 ms, one such refusal took 120 ms. A server that queued requests before refusing
    them would make every refusal slow, and fail."""
    refused = [row["end_s"] - row["sent_s"] for row in rows if row.get("error") == "http_429"]
    served = [row["end_s"] - row["sent_s"] for row in rows if row["status"] == "ok"]
    if not refused:
        return ["no request was refused: the queue limit was never reached (or 429s went uncounted)"]
    if not served:
        return ["every request was refused"]
    refusal, typical = slo.percentile(refused, 50), slo.percentile(served, 50)
    if refusal > fast_fraction * typical:
        return [f"the median 429 took {refusal * 1e3:.0f} ms, over {fast_fraction} of an ok E2E "
                f"({typical * 1e3:.0f} ms)"]  # fmt: skip
    return []


def timeout_problems(
    rows: Sequence[Mapping[str, Any]], timeout_s: float, slack_s: float = TIMEOUT_SLACK_S
) -> list[str]:
    """Under a client ``timeout_s``: some requests time out, at least one while it still waited for its first
    token (so the server's abort of a waiting request is tried), each at its deadline (within ``slack_s``),
    and no ok one outlives it."""
    spans = [(row["end_s"] - row["sent_s"], row) for row in rows]
    timed_out = [span for span, row in spans if row.get("error") == "timeout"]
    problems = [] if timed_out else ["no request timed out"]
    if timed_out and not given_up_waiting(rows):
        problems.append("no request timed out before its first token: every timeout came mid-answer")
    early_or_late = [s for s in timed_out if not timeout_s - 1e-3 <= s <= timeout_s + slack_s]
    if early_or_late:
        problems.append(f"{len(early_or_late)} timed out away from {timeout_s} s: {sorted(early_or_late)[:3]}")
    too_long = [span for span, row in spans if row["status"] == "ok" and span > timeout_s + slack_s]
    if too_long:
        problems.append(f"{len(too_long)} ok requests took longer than the {timeout_s} s timeout")
    return problems


def offline_greedy_texts(requests: Sequence[BenchRequest], model: str = "minserve-tiny") -> list[str]:
    """Each request's greedy answer (exactly ``max_tokens`` tokens) from the offline engine, one sequence per
    step and one thread, so nothing it shares with another request can touch its answer."""
    from minserve.engine.llm import LLM  # loads a model: only when asked
    from minserve.engine.sampling_params import SamplingParams

    llm = LLM(model, max_num_seqs=1, num_threads=1)  # one thread, as the chapter's server runs
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests]
    return [output.text for output in llm.generate([r.prompt for r in requests], params)]


def output_agreement(rows: Sequence[Mapping[str, Any]], offline: Sequence[str]) -> pd.DataFrame:
    """Per ok row (in order, one offline text each): tokens, whether the served text equals the offline one,
    and where they first differ (characters; ``-1`` when equal)."""
    ok = [row for row in rows if row["status"] == "ok"]
    if len(ok) != len(offline):
        raise ValueError(f"{len(ok)} ok rows but {len(offline)} offline texts")
    out = []
    for row, text in zip(ok, offline):
        served = row["text"]
        first = next((i for i, (a, b) in enumerate(zip(served, text)) if a != b), min(len(served), len(text)))
        out.append({"index": row["index"], "tokens": row["output_tokens"], "equal": served == text,
                    "first difference": -1 if served == text else first})  # fmt: skip
    return pd.DataFrame(out, columns=["index", "tokens", "equal", "first difference"]).set_index("index")


def quality_problems(agreement: pd.DataFrame, at_least: float = AGREEMENT_MIN) -> list[str]:
    """At least ``at_least`` of the answers served under load equal the offline engine's (see
    :data:`AGREEMENT_MIN` for why not all of them)."""
    if agreement.empty:
        return ["no ok answer to compare"]
    share = agreement["equal"].mean()
    if share < at_least:
        return [f"only {share:.0%} of the served answers equal the offline engine's (need {at_least:.0%})"]
    return []


def check_failures_counted(
    result_rows_sent: Sequence[tuple[Mapping[str, Any], Sequence[Mapping[str, Any]], int]],
) -> None:
    """:func:`failure_problems` on each (summary, rows, sent) as a check: raises with every broken part."""
    problems = [f"{s['label']}: {p}" for s, rows, sent in result_rows_sent for p in failure_problems(s, rows, sent)]
    require(not problems, "; ".join(problems))


def check_refusals_fast(rows: Sequence[Mapping[str, Any]], fast_fraction: float) -> None:
    """:func:`refusal_problems` as a check."""
    problems = refusal_problems(rows, fast_fraction)
    require(not problems, "; ".join(problems))


def check_timeouts_enforced(rows: Sequence[Mapping[str, Any]], timeout_s: float, slack_s: float) -> None:
    """:func:`timeout_problems` as a check."""
    problems = timeout_problems(rows, timeout_s, slack_s)
    require(not problems, "; ".join(problems))


def check_answers_agree(agreement: pd.DataFrame, at_least: float) -> float:
    """:func:`quality_problems` as a check. Returns the share of served answers equal to the offline ones."""
    problems = quality_problems(agreement, at_least)
    require(not problems, "; ".join(problems))
    return float(agreement["equal"].mean())
