"""Speculative decoding (prompt lookup, a draft model) against the same engine without it, beside the formula.

    python benchmarks/speculative.py --draft minserve-tiny-draft   # minserve-tiny, n-gram and draft, k = 1, 3, 5
    python benchmarks/speculative.py --model smollm2-135m-instruct --tokens 48
    python benchmarks/speculative.py --model smollm2-135m-instruct --tokens 48 --proposers early_exit --draft-layers 6
    python benchmarks/speculative.py --model smollm2-135m-instruct --sweep-draft-layers 4 8 15 22 28
    python benchmarks/speculative.py --json results.json

Two workloads (:func:`minserve.capacity.speculation_runs.workloads`: ``grounded`` prompts that the answer
copies, ``open`` ones it does not), greedy, ``ignore_eos`` so every request makes exactly ``--tokens`` tokens.
Each runs at batch 1 (8 requests, one at a time) and batch 32 (32 requests in one ``generate``), plainly and
with k = 1, 3, 5 drafts from each proposer (``--proposers``: prompt lookup; a draft model, ``--draft``; the
target's first ``--draft-layers`` layers, ``early_exit``), one after another in this process.

Reported per row (:func:`minserve.capacity.speculation_runs.compare`): the acceptance rate α, the draft's
cost c (one draft forward over one plain step, both timed in the run; 0 for prompt lookup), the speedup
:func:`minserve.capacity.speculation.predicted_speedup` expects from them, the verification step's cost v
(in plain steps; the formula takes 1) and the prediction with it, and the speedup measured. Every
speculative run is checked to give the plain run's tokens, so a speedup never comes from different output.
"""

from __future__ import annotations

import argparse
import json
import platform

from minserve import LLM
from minserve.capacity.speculation_runs import compare, greedy, spec_config, timed_run, workloads


def measure(model: str, ks: list[int], num_tokens: int, threads: int, names: list[str], draft: str | None = None,
            draft_layers: int = 1) -> list[dict]:  # fmt: skip
    params = greedy(num_tokens)
    plain = LLM(model, num_threads=threads, enable_tracing=False)
    rows = []
    for batch, num_prompts in ((1, 8), (32, 32)):
        for name, prompts in workloads(num_prompts).items():
            reference = timed_run(plain, prompts, params, batch)
            for k, proposer in ((n, p) for n in ks for p in names):
                config = spec_config(proposer, k, draft, draft_layers)
                llm = LLM(model, num_threads=threads, enable_tracing=False, speculative_config=config)
                point = compare(reference, llm, prompts, params, batch, workload=name, proposer=proposer)
                assert point.same_output, f"{name}, {proposer}, k={k}: speculation changed the greedy output"
                rows.append(point.row())
                print(_markdown_row(rows[-1]), flush=True)
    return rows


def acceptance_by_exit_layer(model: str, layer_counts: list[int], num_tokens: int, threads: int) -> list[dict]:
    """α of an early-exit draft (k = 3) for each count of the target's first layers, on both workloads
    (two prompts each, batch 2): how deep an untrained exit must be before its guesses agree."""
    params = greedy(num_tokens)
    rows = []
    for layers in layer_counts:
        llm = LLM(model, num_threads=threads, enable_tracing=False,
                  speculative_config=spec_config("early_exit", 3, None, layers))  # fmt: skip
        row: dict = {"draft_layers": layers, "of_layers": llm.engine.model_config.num_layers}
        for name, prompts in workloads(2).items():
            core = llm.engine.core
            drafted, accepted = core.num_draft_tokens, core.num_accepted_tokens
            llm.generate(prompts, params)
            row[name] = round((core.num_accepted_tokens - accepted) / max(core.num_draft_tokens - drafted, 1), 3)
        print(row, flush=True)
        rows.append(row)
    return rows


COLUMNS = ("batch", "workload", "proposer", "k", "acceptance", "draft_cost", "predicted_speedup", "verify_cost",
           "predicted_with_verify_cost", "measured_speedup", "plain_tok_s", "spec_tok_s")  # fmt: skip


def _markdown_row(row: dict) -> str:
    return "| " + " | ".join(str(row[c]) for c in COLUMNS) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minserve-tiny")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--proposers",
        nargs="+",
        choices=["ngram", "draft", "early_exit"],
        default=None,
        help="default: ngram, and draft when --draft is given",
    )
    parser.add_argument("--draft", help="the draft model (minserve-tiny-draft for minserve-tiny)")
    parser.add_argument("--draft-layers", type=int, default=1, help="early_exit: the target's layers that draft")
    parser.add_argument(
        "--sweep-draft-layers",
        type=int,
        nargs="+",
        help="only report early_exit's acceptance for each of these layer counts",
    )
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    names = args.proposers or ["ngram"] + (["draft"] if args.draft else [])
    if "draft" in names and not args.draft:
        parser.error("--proposers draft needs --draft MODEL")
    if args.sweep_draft_layers:
        acceptance_by_exit_layer(args.model, args.sweep_draft_layers, args.tokens, args.threads)
        return
    print(f"{args.model}, {args.tokens} tokens per request, {args.threads} thread(s), {platform.processor()}")
    print("| " + " | ".join(COLUMNS) + " |\n|" + " --- |" * len(COLUMNS))
    rows = measure(args.model, args.k, args.tokens, args.threads, names, args.draft, args.draft_layers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "draft": args.draft, "draft_layers": args.draft_layers,
                       "tokens": args.tokens, "threads": args.threads, "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
