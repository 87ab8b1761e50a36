"""Speculative decoding (prompt lookup, a draft model) against the same engine without it, beside the formula.

    python benchmarks/speculative.py --draft minserve-tiny-draft   # minserve-tiny, n-gram and draft, k = 1, 3, 5
    python benchmarks/speculative.py --model smollm2-135m-instruct --tokens 48
    python benchmarks/speculative.py --model smollm2-135m-instruct --tokens 48 --proposers early_exit --draft-layers 6
    python benchmarks/speculative.py --model smollm2-135m-instruct --sweep-draft-layers 4 8 15 22 28
    python benchmarks/speculative.py --json results.json

Two workloads, greedy, ``ignore_eos`` so every request makes exactly ``--tokens`` tokens:

* ``grounded``: the answer repeats its prompt (a function, then its first line again: the model copies the
  rest), where prompt lookup finds its drafts;
* ``open``: short prompts that repeat nothing, where it rarely does.

Each runs at batch 1 (one request at a time) and batch 32 (32 requests in one ``generate``), plainly and
with k = 1, 3, 5 drafts from each proposer (``--proposers``: prompt lookup; a draft model, ``--draft``; the
target's first ``--draft-layers`` layers, ``early_exit``), one after another in this process. A draft's cost
c is the mean seconds of one of its forwards over the mean seconds of one of the plain run's steps, both
timed in the same batch setting (c = 0 for prompt lookup).
Reported per row: the acceptance rate α (drafts kept / drafts run), the tokens one step emitted per
request (measured), the speedup the formula
predicts from α and c (:func:`minserve.capacity.speculation.predicted_speedup`),
and the speedup measured (output tokens/s against the plain run's). Every speculative run is also checked to
give the plain run's tokens, so a speedup never comes from different output.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from minserve import LLM, SamplingParams
from minserve.capacity.speculation import predicted_speedup

FUNCTIONS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n",
    "def read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() for line in f]\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n    else:\n        continue\n",
]
OPENERS = ["def parse(", "import ", "class Config:", "# TODO", "def main():", "from typing import", "x = [", "try:"]


def workloads(batch: int) -> dict[str, list[str]]:
    """``batch`` prompts per workload. Grounded: each function, two blank lines, then its first line again."""
    grounded = [f + "\n\n" + f.splitlines()[0] + "\n" for f in FUNCTIONS]
    return {
        "grounded": [grounded[i % len(grounded)] + "#" * (i // len(grounded)) for i in range(batch)],
        "open": [OPENERS[i % len(OPENERS)] + " " * (i // len(OPENERS)) for i in range(batch)],
    }


def run(llm: LLM, prompts: list[str], params: SamplingParams, batch: int) -> tuple[list[list[int]], float]:
    """Token ids per prompt and the seconds it took, ``batch`` prompts per ``generate``."""
    start = time.perf_counter()
    tokens = []
    for i in range(0, len(prompts), batch):
        tokens += [out.token_ids for out in llm.generate(prompts[i : i + batch], params)]
    return tokens, time.perf_counter() - start


def spec_config(proposer: str, k: int, draft: str | None, draft_layers: int) -> dict:
    """vLLM's ``speculative_config`` for a proposer's name."""
    if proposer == "draft":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    if proposer == "early_exit":
        return {"method": "early_exit", "num_draft_layers": draft_layers, "num_speculative_tokens": k}
    return {"method": "ngram", "num_speculative_tokens": k}


class ForwardTimer:
    """Wraps a model runner's ``execute``: how many forwards it ran and the seconds they took."""

    def __init__(self, runner) -> None:
        self.execute, self.calls, self.seconds = runner.execute, 0, 0.0
        runner.execute = self

    def __call__(self, batch):
        start = time.perf_counter()
        try:
            return self.execute(batch)
        finally:
            self.calls, self.seconds = self.calls + 1, self.seconds + time.perf_counter() - start


def measure(model: str, ks: list[int], num_tokens: int, threads: int, names: list[str], draft: str | None = None,
            draft_layers: int = 1) -> list[dict]:  # fmt: skip
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    plain = LLM(model, num_threads=threads, enable_tracing=False)
    rows = []
    for batch, num_prompts in ((1, 8), (32, 32)):
        for name, prompts in workloads(num_prompts).items():
            run(plain, prompts[:2], params, batch)  # warm-up
            steps = plain.engine.core.num_steps
            reference, plain_s = run(plain, prompts, params, batch)
            plain_step_s = plain_s / (plain.engine.core.num_steps - steps)
            for k, proposer in ((n, p) for n in ks for p in names):
                config = spec_config(proposer, k, draft, draft_layers)
                llm = LLM(model, num_threads=threads, enable_tracing=False, speculative_config=config)
                run(llm, prompts[:2], params, batch)
                core = llm.engine.core
                timer = ForwardTimer(core.proposer.runner) if hasattr(core.proposer, "runner") else None
                drafted, accepted, steps = core.num_draft_tokens, core.num_accepted_tokens, core.num_steps
                tokens, spec_s = run(llm, prompts, params, batch)
                assert tokens == reference, f"{name}, {proposer}, k={k}: speculation changed the greedy output"
                drafted, accepted = core.num_draft_tokens - drafted, core.num_accepted_tokens - accepted
                alpha = accepted / drafted if drafted else 0.0
                cost = timer.seconds / timer.calls / plain_step_s if timer and timer.calls else 0.0
                # Steps a request spent decoding: all its tokens but the first came from decode steps.
                decode_steps_per_request = (core.num_steps - steps) / (len(prompts) / batch) - 1
                rows.append({
                    "batch": batch, "workload": name, "proposer": proposer, "k": k, "acceptance": round(alpha, 3),
                    "tokens_per_step": round((num_tokens - 1) / max(decode_steps_per_request, 1), 2),
                    "draft_cost": round(cost, 3),
                    "predicted_speedup": round(predicted_speedup(alpha, k, draft_cost=cost), 2),
                    "measured_speedup": round(plain_s / spec_s, 2),
                    "plain_tok_s": round(len(prompts) * num_tokens / plain_s, 1),
                    "spec_tok_s": round(len(prompts) * num_tokens / spec_s, 1),
                })  # fmt: skip
                print(_markdown_row(rows[-1]), flush=True)
    return rows


def acceptance_by_exit_layer(model: str, layer_counts: list[int], num_tokens: int, threads: int) -> list[dict]:
    """α of an early-exit draft (k = 3) for each count of the target's first layers, on both workloads
    (two prompts each, batch 2): how deep an untrained exit must be before its guesses agree."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
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


COLUMNS = ("batch", "workload", "proposer", "k", "acceptance", "tokens_per_step", "draft_cost", "predicted_speedup",
           "measured_speedup", "plain_tok_s", "spec_tok_s")  # fmt: skip


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
