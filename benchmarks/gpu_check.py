"""The GPU check: kernel tests run natively, kernels against torch and SDPA, and the engine against transformers.

    bash benchmarks/gpu_check.sh                # on a machine with a CUDA GPU; writes $OUT (or gpu-check/)

One script, a few minutes, one table. Its parts:

1. **peaks**: this GPU's measured copy bandwidth (a large device-to-device copy) and bf16 matmul FLOP/s,
   the yardsticks the kernels are read against;
2. **kernels**: each kernel file's ``benchmark()`` (kernel against its torch reference, decode attention
   against gather + SDPA, prefill attention against SDPA on contiguous keys), with the fraction of the
   measured peak each achieves;
3. **engine**: the offline workload of ``benchmarks/offline.py`` on a model of Qwen3-0.6B's shape with
   random weights (nothing is downloaded), minserve (Triton backend) against transformers' ``generate``.

Targets from issue 6: paged decode attention ≥ 60% of copy bandwidth at large batch × context; prefill
attention ≥ 70% of SDPA's throughput; the engine ≥ 5× transformers.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN3_0_6B = dict(  # the published config of Qwen/Qwen3-0.6B
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=True,
)  # fmt: skip


def measure_peaks() -> dict[str, float]:
    """Copy bandwidth (bytes/s, read + write) and bf16 matmul FLOP/s, best of a few runs."""
    from minserve.kernels._common import time_ms

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src))
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    matmul_ms = time_ms(lambda: a @ b)
    return {"copy_bytes_per_s": 2 * src.numel() / copy_ms * 1e3, "bf16_flops": 2 * 8192**3 / matmul_ms * 1e3}


def kernel_rows(peaks: dict[str, float]) -> list[dict]:
    from minserve.kernels import decode_attention, kv_store, prefill_attention, rms_norm, rotary, silu_and_mul

    def of_copy(result: dict) -> float:
        return result["kernel_gbps"] * 1e9 / peaks["copy_bytes_per_s"]

    rows = []
    elementwise = [("rms_norm + residual", rms_norm), ("rotary", rotary), ("silu_and_mul", silu_and_mul),
                   ("kv_store", kv_store)]  # fmt: skip
    for name, module in elementwise:
        result = module.benchmark()
        rows.append({"kernel": name, **result, "kernel_vs_copy": of_copy(result)})
    for batch, context in ((8, 1024), (64, 4096), (256, 4096)):
        result = decode_attention.benchmark(batch=batch, context=context)
        rows.append(
            {"kernel": f"decode attention b={batch} ctx={context}", **result, "kernel_vs_copy": of_copy(result)}
        )
    for batch, prompt in ((4, 1024), (8, 2048)):
        result = prefill_attention.benchmark(batch=batch, prompt=prompt)
        rows.append({"kernel": f"prefill attention b={batch} T={prompt}", **result,
                     "kernel_vs_torch": result["kernel_tflops"] / result["torch_tflops"]})  # fmt: skip
    return rows


def engine_rows(num_requests: int, max_prompt: int, max_output: int) -> list[dict]:
    """minserve (triton backend, bf16) against transformers generate on a Qwen3-0.6B-shaped random model."""
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.checkpoints import save_checkpoint

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**QWEN3_0_6B)
    hf = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    directory = save_checkpoint(hf, Path(tempfile.mkdtemp(prefix="qwen3-0.6b-shape-")))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from offline import workload  # the offline benchmark's seeded requests, the same on every machine

    requests = workload(num_requests, 0, max_prompt, max_output)
    rows = [_minserve_side(directory, requests), _transformers_side(hf.cuda(), requests)]
    base = rows[1]["tokens_per_s"]
    return [row | {"vs_transformers": row["tokens_per_s"] / base} for row in rows]


def _minserve_side(directory: Path, requests) -> dict:
    from minserve import LLM, SamplingParams

    llm = LLM(str(directory), dtype="bfloat16", backend="triton", max_num_seqs=256, max_num_batched_tokens=8192)
    llm.generate([requests[0][0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up: compile the kernels
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params)
    torch.cuda.synchronize()
    wall_s = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    del llm
    torch.cuda.empty_cache()
    return {"side": "minserve (triton backend)", "tokens_per_s": tokens / wall_s, "wall_s": wall_s}


def _transformers_side(hf, requests, batch_size: int = 64) -> dict:
    pad = 0
    with torch.inference_mode():
        hf.generate(torch.tensor([requests[0][0]], device="cuda"), max_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            longest = max(len(p) for p, _ in batch)
            ids = torch.tensor([[pad] * (longest - len(p)) + p for p, _ in batch], device="cuda")
            mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch], device="cuda")
            max_new = max(n for _, n in batch)
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                        do_sample=False, pad_token_id=pad)  # fmt: skip
            tokens += sum(n for _, n in batch)
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    side = f"transformers generate, batches of {batch_size}"
    return {"side": side, "tokens_per_s": tokens / wall_s, "wall_s": wall_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--max-output", type=int, default=512)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; this script measures a GPU (the CPU tests run with make test)")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    environment = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    peaks = measure_peaks()
    report = {"environment": environment, "peaks": peaks, "kernels": kernel_rows(peaks)}
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))  # saved as it goes
    if not args.skip_engine:
        report["engine"] = engine_rows(args.requests, args.max_prompt, args.max_output)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(format_report(report))
    (args.out / "gpu_check.md").write_text(format_report(report))
    return 0


def format_report(report: dict) -> str:
    env, peaks = report["environment"], report["peaks"]
    lines = [
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['time_utc']} UTC",
        f"measured peaks: copy {peaks['copy_bytes_per_s'] / 1e9:,.0f} GB/s, "
        f"bf16 matmul {peaks['bf16_flops'] / 1e12:,.0f} TFLOP/s",
        "",
        "| kernel | kernel ms | torch ms | kernel | torch | kernel / peak or torch |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in report["kernels"]:
        if "kernel_tflops" in row:
            rates = f"{row['kernel_tflops']:.0f} TFLOP/s | {row['torch_tflops']:.0f} TFLOP/s"
            share = f"{row['kernel_vs_torch']:.0%} of SDPA"
        else:
            rates = f"{row['kernel_gbps']:,.0f} GB/s | {row['torch_gbps']:,.0f} GB/s"
            share = f"{row['kernel_vs_copy']:.0%} of copy"
        lines.append(f"| {row['kernel']} | {row['kernel_ms']:.3f} | {row['torch_ms']:.3f} | {rates} | {share} |")
    for row in report.get("engine", []):
        lines.append(f"\nengine: {row['side']}: {row['tokens_per_s']:,.0f} output tokens/s "
                     f"({row['vs_transformers']:.2f}× transformers, {row['wall_s']:.1f} s)")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
