"""What the load tester sends: prompts of a target length, output lengths, shared prefixes, cancellations.

Everything here is seeded and deterministic: the same :class:`WorkloadSpec` gives the same requests, byte for
byte, so two runs (or two servers) are measured on the same work. The lengths are drawn by
:func:`minserve.workload.request_lengths`, as the simulator draws them from the same specs and seed.

Prompt lengths are in the server's tokens when the load tester is given the model's tokenizer: the text is
cut to the longest run of corpus pieces that encodes to at most the target. Without one they are in *corpus
tokens* (a piece is a word with its leading whitespace), which for this Python-like text runs about 2.5
times fewer than the embedded model's BPE tokens. Either way, the server's own count
(``usage.prompt_tokens``) is what the records keep; the target only shapes the workload.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from minserve.workload import LengthDist, parse_length, request_lengths

__all__ = ["BenchRequest", "LengthDist", "WorkloadSpec", "build_requests", "parse_length"]

# A few lines of ordinary Python: prompts built from them look like the code the embedded model was trained on.
CORPUS_LINES: tuple[str, ...] = (
    "def read_config(path):",
    "    with open(path) as handle:",
    "        return json.load(handle)",
    "class Stack:",
    "    def __init__(self):",
    "        self.items = []",
    "    def push(self, item):",
    "        self.items.append(item)",
    "    def pop(self):",
    "        return self.items.pop()",
    "for index, value in enumerate(values):",
    "    if value is None:",
    "        continue",
    "    total += value * weights[index]",
    "import os",
    "import sys",
    "from collections import defaultdict",
    "def fibonacci(n):",
    "    a, b = 0, 1",
    "    for _ in range(n):",
    "        a, b = b, a + b",
    "    return a",
    "result = [x for x in items if x > threshold]",
    "counts = defaultdict(int)",
    "while queue:",
    "    node = queue.pop(0)",
    "    queue.extend(graph[node])",
    "try:",
    "    value = int(text)",
    "except ValueError:",
    "    value = 0",
    "print(f'{name}: {value}')",
)

_PIECE = re.compile(r"\s*\S+")  # one piece = optional whitespace + a run of non-space characters


@dataclass(frozen=True)
class BenchRequest:
    """One request to send. ``cancel_after_chunks``: the client hangs up after this many content chunks.

    ``prompt`` is text, or token ids (the completions endpoint takes both) to send a workload exactly as
    another benchmark tokenized it.
    """

    index: int
    prompt: str | list[int]
    max_tokens: int
    prompt_len_target: int = 0  # corpus tokens; 0 when the prompt came from a file
    shares_prefix: bool = False
    cancel_after_chunks: int | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """The whole workload: how many requests, their lengths, the shared prefix and the injected cancellations.

    ``shared_prefix_fraction`` of the requests start with the same ``shared_prefix_len``-token prefix (to
    pressure the server's prefix cache); ``cancel_fraction`` of them are cancelled after
    ``cancel_after_chunks`` content chunks (to inject client failures). ``dataset``: a JSONL file of
    ``{"prompt": ..., "max_tokens": ...}`` used instead of generated prompts, in order, cycled if short.
    """

    num_requests: int = 100
    prompt_len: LengthDist = LengthDist("fixed", 128)
    output_len: LengthDist = LengthDist("fixed", 64)
    shared_prefix_fraction: float = 0.0
    shared_prefix_len: int = 0
    cancel_fraction: float = 0.0
    cancel_after_chunks: int = 4
    dataset: Path | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("shared_prefix_fraction", "cancel_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.num_requests < 1 or self.shared_prefix_len < 0 or self.cancel_after_chunks < 1:
            raise ValueError("need num_requests ≥ 1, shared_prefix_len ≥ 0 and cancel_after_chunks ≥ 1")


def corpus_pieces(rng: random.Random, num_tokens: int) -> list[str]:
    """``num_tokens`` corpus pieces from randomly chosen lines (each line starts a new line of text)."""
    pieces: list[str] = []
    while len(pieces) < num_tokens:
        line = rng.choice(CORPUS_LINES)
        line_pieces = _PIECE.findall(line)
        line_pieces[0] = "\n" + line_pieces[0] if pieces else line_pieces[0]
        pieces.extend(line_pieces)
    return pieces[:num_tokens]


def corpus_text(rng: random.Random, num_tokens: int) -> str:
    """Python-like text of ``num_tokens`` corpus tokens."""
    return "".join(corpus_pieces(rng, num_tokens))


def count_corpus_tokens(text: str) -> int:
    """How many corpus tokens (pieces) ``text`` holds: the unit the length targets are stated in."""
    return len(_PIECE.findall(text))


def fit_to_tokens(pieces: list[str], target: int, count_tokens: Callable[[str], int]) -> str:
    """The longest prefix of ``pieces``, joined, that has at most ``target`` tokens (at least one piece).

    Binary search: a longer run of pieces never has fewer tokens, so ``count_tokens`` is called about
    log2(len(pieces)) times.
    """
    low, high = 1, len(pieces)  # invariant: pieces[:low] fits (or low == 1), pieces[:high + 1] does not
    while low < high:
        middle = (low + high + 1) // 2
        if count_tokens("".join(pieces[:middle])) <= target:
            low = middle
        else:
            high = middle - 1
    return "".join(pieces[:low])


def sized_text(rng: random.Random, num_tokens: int, count_tokens: Callable[[str], int] | None) -> str:
    """Corpus text of ``num_tokens`` tokens: the server's tokens with ``count_tokens``, else corpus pieces."""
    pieces = corpus_pieces(rng, num_tokens)  # a piece is at least one token: enough to cut from
    return "".join(pieces) if count_tokens is None else fit_to_tokens(pieces, num_tokens, count_tokens)


def build_requests(spec: WorkloadSpec, count_tokens: Callable[[str], int] | None = None) -> list[BenchRequest]:
    """The workload's requests, in send order. Deterministic in ``spec`` (seed included) and the tokenizer.

    ``count_tokens`` (text → the server's token count) makes prompt lengths exact in the server's tokens.
    """
    rng = random.Random(spec.seed)
    # Separate streams, so that turning on cancellation does not change the prompts (and vice versa).
    cancel_rng, prefix_rng = random.Random(rng.random()), random.Random(rng.random())
    prefix_rng_text = random.Random(rng.random())
    prefix = sized_text(prefix_rng_text, spec.shared_prefix_len, count_tokens) if spec.shared_prefix_len else ""
    file_rows = _read_dataset(spec.dataset) if spec.dataset else None
    lengths = request_lengths(spec.prompt_len, spec.output_len, spec.num_requests, spec.seed)  # as the simulator's
    requests = []
    for index, (target, max_tokens) in enumerate(lengths):
        cancel = spec.cancel_after_chunks if cancel_rng.random() < spec.cancel_fraction else None
        if file_rows is not None:
            prompt, max_tokens = file_rows[index % len(file_rows)]
            requests.append(BenchRequest(index, prompt, max_tokens, cancel_after_chunks=cancel))
            continue
        shares = bool(prefix) and prefix_rng.random() < spec.shared_prefix_fraction
        # A request with the prefix keeps its target length, but always has at least one token of its own.
        own_len = max(1, target - spec.shared_prefix_len) if shares else target
        prompt = (prefix + "\n" if shares else "") + sized_text(rng, own_len, count_tokens)
        requests.append(BenchRequest(index, prompt, max_tokens, target, shares, cancel))
    return requests


def _read_dataset(path: Path) -> list[tuple[str, int]]:
    """(prompt, max_tokens) rows of a JSONL file; blank lines are skipped."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("max_tokens"), int):
            raise ValueError(f"{path}:{number}: each line needs a string 'prompt' and an integer 'max_tokens'")
        rows.append((row["prompt"], row["max_tokens"]))
    if not rows:
        raise ValueError(f"{path}: no requests in the file")
    return rows
