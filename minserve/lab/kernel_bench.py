"""Chapter 03's kernels: each one against its torch reference on tiny inputs, and their GPU benchmarks.

Every file in ``kernels/`` holds a Triton kernel, the torch reference it replaces and a ``benchmark()``
that times both on a CUDA GPU (:func:`minserve.kernels._common.compare`). Without a GPU the kernels still
run, under Triton's interpreter (``TRITON_INTERPRET=1``, one program at a time in numpy): fine for
checking them on tiny shapes, meaningless for speed. :func:`kernel_correctness` runs that check;
:func:`recorded_benchmarks` reads what ``benchmarks/gpu_check.py`` recorded on a GPU, if anything was
(``benchmarks/results/gpu-check*.json``), and otherwise says so in one line per kernel.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from minserve.kernels import decode_attention, kv_store, prefill_attention, rms_norm, rotary, silu_and_mul

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
KERNELS = {  # name → module (its benchmark() entry and what the benchmark's rate is measured in)
    "rms_norm": rms_norm,
    "rotary": rotary,
    "silu_and_mul": silu_and_mul,
    "kv_store": kv_store,
    "prefill_attention": prefill_attention,
    "decode_attention": decode_attention,
}
TOLERANCE = 1e-4  # float32, as tests/test_kernels.py states it (1e-5 there; a little room for any CPU's libm)


def _paged(lens: list[int], block_size: int, kv_heads: int, head_dim: int, device: str, seed: int):
    """A random paged cache whose blocks are scattered, and each sequence's block table (as the tests do)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    cache = torch.randn(2, sum(need) + 2, block_size, kv_heads, head_dim, generator=g)
    order = torch.randperm(sum(need) + 2, generator=g)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int64)
    taken = 0
    for i, n in enumerate(need):
        tables[i, :n], taken = order[taken : taken + n], taken + n
    return cache.to(device), tables.to(device)


def _cases(device: str) -> dict[str, tuple[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]]:
    """Per kernel: the tiny shape, and a function returning (kernel output, reference output)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device)

    def norm():
        x, addend, w = rand(5, 40), rand(5, 40), rand(40)
        return rms_norm.rms_norm(x, w, 1e-5, addend)[0], rms_norm.reference(x, w, 1e-5, addend)[0]

    def rope():
        q, k, pos = rand(9, 4, 16), rand(9, 2, 16), torch.tensor([0, 1, 2, 7, 100, 101, 2047, 5, 3], device=device)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2, device=device).float() / 16)
        expected = rotary.reference(q, k, pos, inv_freq)[0]
        rotary.apply_rotary_(q, k, pos, inv_freq)
        return q, expected

    def silu():
        x = rand(3, 80)
        return silu_and_mul.silu_and_mul(x), silu_and_mul.reference(x)

    def store():
        cache, expected = (torch.zeros(2, 6, 4, 2, 16, device=device) for _ in range(2))
        key, value, slots = rand(7, 2, 16), rand(7, 2, 16), torch.tensor([3, 0, 23, -1, 7, 8, 12], device=device)
        kv_store.store_kv(key, value, cache, slots)
        kv_store.reference(key, value, expected, slots)
        return cache, expected

    def prefill():
        qlens, clens = [5, 20, 1], [5, 37, 9]
        cache, tables = _paged(clens, 8, 2, 16, device, 1)
        q = rand(sum(qlens), 4, 16)
        starts = torch.tensor([0, 5, 25], device=device)
        args = (q, cache, tables, starts, torch.tensor(qlens, device=device), torch.tensor(clens, device=device))
        return prefill_attention.prefill_attention(*args, max(qlens), 0.25), prefill_attention.reference(*args, 0.25)

    def decode():
        lens = [1, 9, 40]
        cache, tables = _paged(lens, 8, 2, 16, device, 2)
        q, context = rand(3, 4, 16), torch.tensor(lens, device=device)
        out = decode_attention.decode_attention(q, cache, tables, context, 0.25)
        return out, decode_attention.reference(q, cache, tables, context, 0.25)

    return {
        "rms_norm": ("5 tokens × 40, with the residual", norm),
        "rotary": ("9 tokens, 4 q / 2 k heads × 16", rope),
        "silu_and_mul": ("3 tokens × 2·40", silu),
        "kv_store": ("7 tokens into 6 blocks of 4, one slot -1", store),
        "prefill_attention": ("3 sequences, 26 new of 51 tokens, blocks of 8", prefill),
        "decode_attention": ("3 sequences, contexts 1, 9, 40, blocks of 8", decode),
    }


def kernel_correctness(device: str | None = None) -> pd.DataFrame:
    """Each kernel against its reference on a tiny float32 input (under the interpreter on a CPU, so a few
    seconds in all): the shape, the largest absolute difference, and whether it is within :data:`TOLERANCE`."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name, (shape, run) in _cases(device).items():
        out, expected = run()
        diff = (out.float() - expected.float()).abs().max().item()
        rows.append({"kernel": name, "tiny input": shape, "max |kernel − reference|": diff, "ok": diff <= TOLERANCE})
    return pd.DataFrame(rows).set_index("kernel")


def benchmark_shapes() -> pd.DataFrame:
    """What each kernel's ``benchmark()`` measures on a GPU: its default shape (the arguments it takes)."""
    rows = []
    for name, module in KERNELS.items():
        params = inspect.signature(module.benchmark).parameters.values()
        shape = ", ".join(f"{p.name}={_short(p.default)}" for p in params)
        rows.append({"kernel": name, "benchmark() shape": shape})
    return pd.DataFrame(rows).set_index("kernel")


def _short(value: object) -> str:
    return str(value).removeprefix("torch.")


def recorded_benchmarks(results_dir: Path = RESULTS_DIR) -> tuple[pd.DataFrame, str]:
    """Every kernel row of every ``gpu-check*.json`` that ``benchmarks/gpu_check.py`` saved, and a sentence
    saying where they come from, or that none were ever recorded (then the table is empty)."""
    files = sorted(results_dir.glob("gpu-check*.json")) + sorted(results_dir.glob("gpu_check*.json"))
    rows = []
    for path in files:
        report = json.loads(path.read_text())
        gpu = report.get("environment", {}).get("gpu", "?")
        for row in report.get("kernels", []):
            rows.append({"file": path.name, "gpu": gpu, **row})
    if not rows:
        return pd.DataFrame(), (
            f"No GPU benchmark of the kernels has been recorded: {results_dir.name}/ holds no gpu-check*.json. "
            "Run `bash benchmarks/gpu_check.sh` on a CUDA machine to measure them."
        )
    return pd.DataFrame(rows), f"{len(rows)} kernel measurements from {', '.join(p.name for p in files)}"
