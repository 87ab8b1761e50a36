"""Speculative decoding (prompt lookup, a draft model) against the same engine without it, beside the formula.

    python benchmarks/speculative.py --draft minserve-tiny-draft   # minserve-tiny, n-gram and draft, k = 1, 3, 5
    python benchmarks/speculative.py --model smollm2-135m-instruct --tokens 48
    python benchmarks/speculative.py --json results.json

Two workloads, greedy, ``ignore_eos`` so every request makes exactly ``--tokens`` tokens:

* ``grounded``: the answer repeats its prompt (a function, then its first line again: the model copies the
  rest), where prompt lookup finds its drafts;
* ``open``: short prompts that repeat nothing, where it rarely does.

Each runs at batch 1 (one request at a time) and batch 32 (32 requests in one ``generate``), plainly and
with k = 1, 3, 5 drafts from each proposer (prompt lookup; with ``--draft``, a draft model too), one after
another in this process. A draft's cost c is its plain decode step over the target's, timed at batch 1.
Reported per row: the acceptance rate α (drafts kept / drafts run), the tokens one step emitted per
request (measured), the speedup the formula
predicts from α and c (:func:`minserve.capacity.speculation.predicted_speedup`; c = 0 for prompt lookup),
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


def proposers(draft: str | None, k: int) -> dict[str, dict]:
    """The speculative configs to compare, by name."""
    configs = {"ngram": {"method": "ngram", "num_speculative_tokens": k}}
    if draft:
        configs["draft"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    return configs


def draft_cost(target: LLM, draft: str | None, num_tokens: int, threads: int) -> float:
    """c: the draft's decode step over the ``target``'s, each timed plainly at batch 1 (0 without a draft)."""
    if not draft:
        return 0.0
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    prompts = workloads(4)["open"]
    step_s = []
    for llm in (target, LLM(draft, num_threads=threads, enable_tracing=False)):
        run(llm, prompts[:1], params, 1)
        step_s.append(run(llm, prompts, params, 1)[1])
    return step_s[1] / step_s[0]


def measure(model: str, ks: list[int], num_tokens: int, threads: int, draft: str | None = None) -> list[dict]:
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    plain = LLM(model, num_threads=threads, enable_tracing=False)
    cost = {"ngram": 0.0, "draft": draft_cost(plain, draft, num_tokens, threads)}
    rows = []
    for batch, num_prompts in ((1, 8), (32, 32)):
        for name, prompts in workloads(num_prompts).items():
            run(plain, prompts[:2], params, batch)  # warm-up
            reference, plain_s = run(plain, prompts, params, batch)
            for k, (proposer, spec_config) in ((n, p) for n in ks for p in proposers(draft, n).items()):
                llm = LLM(model, num_threads=threads, enable_tracing=False, speculative_config=spec_config)
                run(llm, prompts[:2], params, batch)
                core = llm.engine.core
                drafted, accepted, steps = core.num_draft_tokens, core.num_accepted_tokens, core.num_steps
                tokens, spec_s = run(llm, prompts, params, batch)
                assert tokens == reference, f"{name}, k={k}: speculation changed the greedy output"
                drafted, accepted = core.num_draft_tokens - drafted, core.num_accepted_tokens - accepted
                alpha = accepted / drafted if drafted else 0.0
                # Steps a request spent decoding: all its tokens but the first came from decode steps.
                decode_steps_per_request = (core.num_steps - steps) / (len(prompts) / batch) - 1
                rows.append({
                    "batch": batch, "workload": name, "proposer": proposer, "k": k, "acceptance": round(alpha, 3),
                    "tokens_per_step": round((num_tokens - 1) / max(decode_steps_per_request, 1), 2),
                    "draft_cost": round(cost[proposer], 3),
                    "predicted_speedup": round(predicted_speedup(alpha, k, draft_cost=cost[proposer]), 2),
                    "measured_speedup": round(plain_s / spec_s, 2),
                    "plain_tok_s": round(len(prompts) * num_tokens / plain_s, 1),
                    "spec_tok_s": round(len(prompts) * num_tokens / spec_s, 1),
                })  # fmt: skip
                print(_markdown_row(rows[-1]), flush=True)
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
    parser.add_argument("--draft", help="a draft model to compare too (minserve-tiny-draft for minserve-tiny)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    print(f"{args.model}, {args.tokens} tokens per request, {args.threads} thread(s), {platform.processor()}")
    print("| " + " | ".join(COLUMNS) + " |\n|" + " --- |" * len(COLUMNS))
    rows = measure(args.model, args.k, args.tokens, args.threads, args.draft)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "draft": args.draft, "tokens": args.tokens, "threads": args.threads,
                       "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
