"""``minserve plan``: capacity planning from arithmetic, before any experiment. ``plan roofline`` is its first kind.

``minserve plan roofline --model Llama-3-8B --gpu H100 --batch 1,8,64 --context 1024 --prompt 512`` prints the
roofline's predicted prefill time and decode step times, which roof binds each, and the critical batch size.
"""

from __future__ import annotations

import argparse

from minserve.capacity import roofline
from minserve.capacity.kv import DTYPE_BYTES, dtype_bytes, kv_bytes_per_token, model_config
from minserve.capacity.memory import estimate_params, fit
from minserve.capacity.presets import MODEL_PRESETS
from minserve.model.config import ModelConfig


def add_plan_command(commands: argparse._SubParsersAction) -> None:
    """Register ``plan`` and its sub-command ``roofline`` on the top-level parser's sub-commands."""
    plan = commands.add_parser(
        "plan", help="capacity planning from arithmetic", description="Capacity planning (chapters 03, 04, 09)."
    )
    kinds = plan.add_subparsers(dest="plan_command", required=True, metavar="KIND")
    gpus = ", ".join([*roofline.HARDWARE, roofline.THIS_MACHINE])
    rl = kinds.add_parser(
        "roofline", help="predicted prefill and decode step times on a GPU", description=_cmd_plan_roofline.__doc__
    )
    rl.add_argument(
        "--model",
        default="minserve-tiny",
        help=f"a preset ({', '.join(MODEL_PRESETS)}), an embedded model, or a checkpoint directory",
    )
    rl.add_argument("--gpu", default="H100", help=f"one of {gpus} ('this' measures this machine)")
    rl.add_argument("--batch", default="1,8,64", help="decode batch sizes, comma-separated")
    rl.add_argument("--context", type=int, default=1024, help="tokens in each sequence's KV cache at decode")
    rl.add_argument("--prompt", type=int, default=512, help="prompt tokens to prefill")
    rl.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPE_BYTES],
        help="weights and KV dtype (auto: the GPU's, bfloat16; float32 on 'this')",
    )
    rl.set_defaults(run=_cmd_plan_roofline)


def _cmd_plan_roofline(args: argparse.Namespace) -> int:
    """Predict prefill time and decode step times for a model on a GPU from the roofline: each phase's FLOPs
    and bytes, the time of each at the GPU's peak FLOP/s and memory bandwidth, and which of the two binds."""
    batches = parse_batches(args.batch)
    if args.context <= 0 or args.prompt <= 0:
        raise ValueError(f"--context and --prompt must be positive, got {args.context} and {args.prompt}")
    config = resolve_model(args.model)
    hw = roofline.hardware(args.gpu)
    dtype = hw.dtype if args.dtype == "auto" else args.dtype
    print(format_roofline_plan(args.model, config, hw, dtype, args.prompt, batches, args.context))
    return 0


def parse_batches(text: str) -> list[int]:
    """``"1,8,64"`` → ``[1, 8, 64]``; every batch a positive integer."""
    try:
        batches = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--batch must be comma-separated integers, got {text!r}") from None
    if not batches or min(batches) <= 0:
        raise ValueError(f"--batch must list positive integers, got {text!r}")
    return batches


def resolve_model(name: str) -> ModelConfig:
    """A preset by name, else an embedded model or a checkpoint directory (its config.json only)."""
    if name in MODEL_PRESETS:
        return model_config(name)
    from minserve.model.loader import ModelNotFoundError, load_config, resolve_model_path

    try:
        return load_config(resolve_model_path(name))
    except ModelNotFoundError:
        raise ValueError(
            f"unknown model {name!r}; use a preset ({', '.join(MODEL_PRESETS)}), an embedded model "
            "(minserve models lists them) or a checkpoint directory"
        ) from None


def format_roofline_plan(
    name: str, config: ModelConfig, hw: roofline.Hardware, dtype: str, prompt: int, batches: list[int], context: int
) -> str:
    """The printed plan: a header with the model, the GPU's roofs and the critical batch size, then one row
    per phase (prefill of ``prompt`` tokens; a decode step at each batch size with ``context`` tokens each)."""
    params = estimate_params(config)
    lines = [
        f"{name}: {_si(params)} parameters, {_si(params * dtype_bytes(dtype))}B of {dtype} weights, "
        f"KV {kv_bytes_per_token(config, dtype):,} bytes/token",
        f"{hw.name}: {_si(hw.peak_flops_per_s)}FLOP/s dense {hw.dtype}, {_si(hw.memory_bandwidth_bytes_per_s)}B/s, "
        f"{_si(hw.memory_bytes)}B ({hw.source})",
        f"ridge point {hw.ridge_point_flops_per_byte:,.0f} FLOP/byte; critical batch size ≈ "
        f"{roofline.critical_batch_size(hw, dtype):,.0f} (decode below it is memory-bound on the weights alone)",
        "",
        f"{'phase':<8}{'tokens':>8}{'batch':>7}{'context':>9}{'FLOPs':>10}{'bytes':>10}{'FLOP/B':>9}"
        f"{'compute':>10}{'memory':>10}{'predicted':>11}  {'bound':<8}{'tokens/s':>12}  fits",
    ]
    rows = [("prefill", prompt, 1, prompt, roofline.predict_prefill(config, prompt, hw, dtype))]
    rows += [("decode", 1, b, context, roofline.predict_decode(config, b, context, hw, dtype)) for b in batches]
    for phase, tokens, batch, ctx, p in rows:
        fits = fit(config, hw.memory_bytes, ctx, batch, dtype).fits if hw.memory_bytes else None
        lines.append(
            f"{phase:<8}{tokens:>8}{batch:>7}{ctx:>9}{_si(p.flops):>10}{_si(p.bytes):>10}"
            f"{p.intensity_flops_per_byte:>9.1f}{_time(p.compute_s):>10}{_time(p.memory_s):>10}"
            f"{_time(p.time_s):>11}  {p.bound:<8}{tokens * batch / p.time_s:>12,.0f}  "
            f"{'?' if fits is None else 'yes' if fits else 'NO'}"
        )
    lines.append(
        "\nLower bounds: real kernels reach a fraction of either roof. tokens/s = new tokens per predicted second; "
        "fits = weights and KV within 90% of the memory."
    )
    return "\n".join(lines)


def _time(seconds: float) -> str:
    """``0.00267`` → ``"2.67 ms"``: three significant digits in s, ms, µs or ns."""
    for factor, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if seconds >= factor:
            return f"{seconds / factor:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _si(value: float) -> str:
    """``16.06e9`` → ``"16.1 G"``: three significant digits and an SI prefix (append the unit)."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "


__all__ = ["add_plan_command", "format_roofline_plan", "parse_batches", "resolve_model"]
