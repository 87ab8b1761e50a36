"""Weight formats side by side on SmolLM2-135M-Instruct: kernels, decode speed, and quality.

    python benchmarks/quantization.py                                  # all three parts (~10 minutes here)
    python benchmarks/quantization.py --parts kernels
    python benchmarks/quantization.py --json benchmarks/results/quantization-cpu-DATE.json

1. ``kernels``: each of SmolLM2's linear shapes, one call of each format's matmul (the modules of
   :mod:`minserve.quant.linear`, as the engine calls them) against float32 and bfloat16 ``F.linear``, at 1
   and 32 rows: why a format is fast or slow on this CPU, below the engine.
2. ``decode``: the engine in each format (and llama.cpp on the GGUF file as stored, Q4_1, when
   ``llama-cpp-python`` is installed: ``make bench-llamacpp``): single-stream decode tokens/s (one chat
   request, as ``benchmarks/vs_llamacpp.py`` runs it), 32 requests decoding together, offline throughput
   (vs_llamacpp's 64 requests of mixed lengths, all at once; llama.cpp one after another), the bytes of
   weights a decode step reads, and the roofline's prediction for one stream (this machine's copy bandwidth over
   those bytes). Every side runs in a process of its own, one after another.
3. ``quality``: :func:`minserve.quality.quantized.compare_formats` on both models: perplexity on the
   held-out text, KL divergence and top-1 agreement against float32, greedy tokens until the first
   difference.

The "float32" SmolLM2 is the GGUF file's Q4_1 blocks dequantized at load, so its int4 rows re-quantize
weights that were 4-bit already: int4 in groups of 32 lands on Q4_1's own grid, groups of 64 do not.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llamacpp import MODEL, minserve_options, run_side

FORMATS = ("fp32", "bf16", "int8", "int4-g32", "int4-g64", "int4-awq-g64", "fp8", "kv-int8", "int4+kv-int8",
           "int4+compile")  # fmt: skip
QUALITY_FORMATS = ("int8", "int4-g32", "int4-g64", "int4-awq-g32", "int4-awq-g64", "fp8", "kv-int8", "kv-fp8",
                   "int4+kv-int8")  # fmt: skip
KV_BUDGET_BYTES = 256 * 2**20  # the CPU's default KV memory: how many tokens each KV format holds in it
SHAPES = {  # SmolLM2-135M's linear layers, (out, in), and how many a forward pass has
    "qkv_proj": ((960, 576), 30),
    "o_proj": ((576, 576), 30),
    "gate_up_proj": ((3072, 576), 30),
    "down_proj": ((576, 1536), 30),
    "lm_head": ((49152, 576), 1),
}
BATCH_REQUESTS, BATCH_TOKENS = 32, 48
HERE = Path(__file__).resolve().parent


# --- part 1: kernels --------------------------------------------------------------------------------------


def run_kernels(repeats: int) -> list[dict]:
    from minserve.capacity.format_kernels import time_kernels

    table = time_kernels({name: shape for name, (shape, _) in SHAPES.items()}, repeats=repeats)
    counts = [SHAPES[name][1] for name in table["layer"]]
    return table.assign(count=counts).to_dict(orient="records")


def print_kernels(rows: list[dict]) -> None:
    sides = [k for k in rows[0] if k not in ("layer", "shape", "count", "batch")]
    print("\n1. one matmul, µs (median), and a forward pass's matmuls in ms (each shape × its count)\n")
    print(f"{'layer':<14}{'shape':>11}{'batch':>6}" + "".join(f"{s:>15}" for s in sides))
    for r in rows:
        print(f"{r['layer']:<14}{r['shape']:>11}{r['batch']:>6}" + "".join(f"{r[s]:>15,.1f}" for s in sides))
    for batch in (1, 32):
        totals = {s: sum(r[s] * r["count"] for r in rows if r["batch"] == batch) / 1e3 for s in sides}
        print(f"{'all, ms':<14}{'':>11}{batch:>6}" + "".join(f"{totals[s]:>15,.1f}" for s in sides))


# --- part 2: the engine decoding --------------------------------------------------------------------------


def run_batch_side(side: str) -> dict:
    """32 requests decoding together, short prompts: output tokens/s, and the weight bytes a step reads."""
    from minserve import LLM, SamplingParams
    from minserve.quant.swap import linear_weight_bytes, weight_bytes

    llm = LLM(MODEL, enable_tracing=False, **minserve_options(side))
    prompts = [[1 + i, 2 + i, 3 + i, 4 + i] for i in range(BATCH_REQUESTS)]
    params = SamplingParams(max_tokens=BATCH_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall_s = time.perf_counter() - start
    step_bytes, weights = linear_weight_bytes(llm.model)
    kv_per_token = llm.engine.kv_bytes_per_token()
    return {
        "batch_tokens_per_s": sum(len(o.token_ids) for o in outputs) / wall_s,
        "kv_bytes_per_token": kv_per_token,
        "kv_tokens_in_budget": KV_BUDGET_BYTES // kv_per_token,
        "step_weight_bytes": step_bytes,
        "bits_per_weight": 8 * step_bytes / weights,
        "weight_bytes": weight_bytes(llm.model),
    }


def llama_cpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def run_decode(args) -> dict:
    from minserve.capacity.roofline import measure_this_machine

    bandwidth = measure_this_machine(repeats=3).memory_bandwidth_bytes_per_s
    single = ["--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats)]
    offline = ["--requests", str(args.requests)]
    results = {}
    for storage in args.formats.split(","):
        side = f"minserve-{storage}"
        print(f"  {side} …", file=sys.stderr, flush=True)
        results[side] = run_side(HERE / "vs_llamacpp.py", "single", side, single)
        results[side] |= run_side(HERE / "quantization.py", "batch", side, [])
        results[side]["offline_tokens_per_s"] = offline_rate(side, offline)
        results[side]["roofline_tokens_per_s"] = bandwidth / results[side]["step_weight_bytes"]
    if llama_cpp_installed():
        print("  llama.cpp-q4_1 …", file=sys.stderr, flush=True)
        side = "llama.cpp-q4_1"
        results[side] = run_side(HERE / "vs_llamacpp.py", "single", side, single)
        results[side]["offline_tokens_per_s"] = offline_rate(side, offline)
    return {"bandwidth_bytes_per_s": bandwidth, "sides": results}


def offline_rate(side: str, options: list[str]) -> float:
    return run_side(HERE / "vs_llamacpp.py", "offline", side, options)["tokens_per_s"]


def print_decode(decode: dict) -> None:
    sides = decode["sides"]
    base = sides.get("minserve-fp32", next(iter(sides.values())))["decode_tokens_per_s"]
    llama = sides.get("llama.cpp-q4_1", {}).get("decode_tokens_per_s")
    print(f"\n2. decode on SmolLM2-135M-Instruct; copy bandwidth {decode['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s\n")
    header = ("side", "bits/w", "read/step MB", "1 stream tok/s", "vs fp32", "vs llama.cpp", "roofline", "32 streams",
              "offline tok/s", "KV tok/256MiB")  # fmt: skip
    print(f"{header[0]:<20}" + "".join(f"{h:>15}" for h in header[1:]))
    for side, r in sides.items():
        rate = r["decode_tokens_per_s"]
        cells = [
            f"{r['bits_per_weight']:.2f}" if "bits_per_weight" in r else "4.5 + q8 emb",
            f"{r['step_weight_bytes'] / 1e6:,.0f}" if "step_weight_bytes" in r else "",
            f"{rate:,.1f}",
            f"{rate / base:.2f}×",
            f"{rate / llama:.2f}×" if llama else "",
            f"{r['roofline_tokens_per_s']:,.0f}" if "roofline_tokens_per_s" in r else "",
            f"{r['batch_tokens_per_s']:,.0f}" if "batch_tokens_per_s" in r else "",
            f"{r['offline_tokens_per_s']:,.0f}" if "offline_tokens_per_s" in r else "",
            f"{r['kv_tokens_in_budget']:,}" if "kv_tokens_in_budget" in r else "",
        ]
        print(f"{side:<20}" + "".join(f"{c:>15}" for c in cells))


# --- part 3: quality --------------------------------------------------------------------------------------


def run_quality(args) -> dict:
    from minserve.quality.quantized import compare_formats, format_table

    tables = {}
    for model in ("minserve-tiny", MODEL):
        reports = compare_formats(model, args.quality_formats.split(","), max_tokens=args.quality_tokens)
        tables[model] = format_table(reports)
    return {model: table.reset_index().to_dict(orient="records") for model, table in tables.items()}


def print_quality(quality: dict) -> None:
    import pandas as pd

    for model, rows in quality.items():
        print(f"\n3. quality of {model} against its float32 self\n")
        print(pd.DataFrame(rows).set_index("format").round(4).to_string())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="kernels,decode,quality", help="comma-separated, of these three")
    parser.add_argument("--kernel-repeats", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=128, help="decode: output tokens of the chat request")
    parser.add_argument("--repeats", type=int, default=3, help="decode: timed runs per side (median reported)")
    parser.add_argument("--quality-tokens", type=int, default=2048, help="quality: held-out tokens scored")
    parser.add_argument("--formats", default=",".join(FORMATS), help="decode: the minserve sides' formats")
    parser.add_argument("--requests", type=int, default=64, help="decode: offline requests (vs_llamacpp's workload)")
    parser.add_argument("--quality-formats", default=",".join(QUALITY_FORMATS), help="quality: the formats")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: one side in its own process
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.part == "batch":
        print(json.dumps(run_batch_side(args.side)))
        return 0
    parts = args.parts.split(",")
    results: dict = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
    }
    steps = {"kernels": (run_kernels, print_kernels), "decode": (run_decode, print_decode),
             "quality": (run_quality, print_quality)}  # fmt: skip
    for part in parts:
        run, show = steps[part]
        results[part] = run(args.kernel_repeats if part == "kernels" else args)
        show(results[part])
        if args.json:  # after every part: a part that fails later loses nothing measured before it
            args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
