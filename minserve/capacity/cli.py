"""``minserve plan``: capacity planning before (or instead of) experiments on the engine.

``minserve plan roofline --model Llama-3-8B --gpu H100 --batch 1,8,64 --context 1024 --prompt 512`` prints the
roofline's predicted prefill time and decode step times, which roof binds each, and the critical batch size.

``minserve plan calibrate --out cost.json`` times a short workload on the engine and fits the simulator's
step-cost model; ``minserve plan simulate --cost cost.json --rates 2,4,8`` runs a workload through the
discrete-event simulator (:mod:`minserve.capacity.simulator`: the real scheduler on a virtual clock) and prints
the SLO summary at each rate.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from minserve.capacity import roofline
from minserve.capacity.kv import DTYPE_BYTES, dtype_bytes, kv_bytes_per_token, model_config
from minserve.capacity.memory import estimate_params, fit
from minserve.capacity.presets import MODEL_PRESETS
from minserve.config import EngineConfig
from minserve.flags import ENGINE_SCHEDULING, add_config_flags, config_options
from minserve.model.config import ModelConfig
from minserve.workload import parse_rates


def add_plan_command(commands: argparse._SubParsersAction) -> None:
    """Register ``plan`` and its kinds ``roofline``, ``calibrate`` and ``simulate`` on the top-level parser's
    sub-commands."""
    plan = commands.add_parser(
        "plan",
        help="capacity planning: roofline, calibration, simulation",
        description="Capacity planning (chapters 03, 04, 05, 09).",
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
    rl.add_argument(
        "--kv-dtype", default=None, choices=list(DTYPE_BYTES), help="the KV cache's dtype, when not --dtype's"
    )
    rl.set_defaults(run=_cmd_plan_roofline)
    _add_calibrate(kinds)
    _add_simulate(kinds)


def _add_engine_options(parser: argparse.ArgumentParser, defaults_from: str) -> None:
    """The engine's scheduling knobs, unset (``None``) where not given: the default comes from ``defaults_from``."""
    group = parser.add_argument_group(f"engine (default: {defaults_from})")
    add_config_flags(group, EngineConfig, ENGINE_SCHEDULING, unset=True)


def _engine_options(args: argparse.Namespace) -> dict:
    """The knobs given on the command line, under :class:`~minserve.config.EngineConfig`'s names."""
    return config_options(args, EngineConfig, ENGINE_SCHEDULING)


def _add_calibrate(kinds: argparse._SubParsersAction) -> None:
    cal = kinds.add_parser(
        "calibrate",
        help="fit the simulator's step-cost model on the engine",
        description=_cmd_plan_calibrate.__doc__,
    )
    cal.add_argument("--model", default="minserve-tiny", help="an embedded model or a checkpoint directory")
    cal.add_argument("--out", type=Path, default=Path("step-cost.json"), help="where to write the cost model")
    cal.add_argument("--device", default="auto")
    cal.add_argument("--dtype", default="auto")
    cal.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    cal.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    cal.add_argument("--quick", action="store_true", help="a few seconds' workload: a rough fit, for a try")
    cal.add_argument("--seed", type=int, default=0)
    _add_engine_options(cal, "the engine's")
    cal.set_defaults(run=_cmd_plan_calibrate)


def _cmd_plan_calibrate(args: argparse.Namespace) -> int:
    """Time a short, varied workload on the engine (single prompts, decode batches, a mixed load; about 20 s on
    a 2-core CPU with the embedded model, a few with --quick), fit the step-cost model by least squares, print
    it with its errors, and save it as JSON for `minserve plan simulate --cost`."""
    from minserve.capacity.calibration import QUICK_WORKLOAD, calibrate
    from minserve.engine.llm import LLM

    options = _engine_options(args) | {"enable_tracing": False}
    llm = LLM(
        args.model, device=args.device, dtype=args.dtype, backend=args.backend, num_threads=args.threads, **options
    )
    workload = QUICK_WORKLOAD if args.quick else {}
    cost = calibrate(llm, seed=args.seed, **workload)
    fit_info, info = cost.info["fit"], cost.info
    count = info.get("threads")
    threads = f", {count} thread{'s' if count != 1 else ''}" if count else ""
    print(
        f"{info['model']} on {info['device']} ({info['dtype']}, {info['backend']} backend{threads}): "
        f"{fit_info['samples']} steps measured in {info['measure_s']:.1f} s"
    )
    print(cost.describe())
    print(
        f"fit: median step error {fit_info['median_relative_error']:.1%}, p90 {fit_info['p90_relative_error']:.1%}, "
        f"R² {fit_info['r2']:.3f}; {fit_info['set_aside']} outlying steps set aside"
    )
    print(f"wrote {cost.save(args.out)}")
    return 0


def _add_simulate(kinds: argparse._SubParsersAction) -> None:
    sim = kinds.add_parser(
        "simulate",
        help="run a workload through the scheduler simulator",
        description=_cmd_plan_simulate.__doc__,
    )
    sim.add_argument("--cost", type=Path, required=True, help="a step-cost file from `minserve plan calibrate`")
    sim.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    sim.add_argument("--rates", default="4", help="requests/s, Poisson, comma-separated sweep; inf = all at once")
    sim.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: <1 burstier")
    sim.add_argument("--prompt-len", default="uniform:256:240", help="N, uniform:MEAN:SPREAD or lognormal:MEAN:SD")
    sim.add_argument("--output-len", default="uniform:64:48", help="as --prompt-len")
    sim.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt starts with")
    sim.add_argument("--slo-ttft-ms", type=float, default=None, help="for goodput: TTFT at most this")
    sim.add_argument("--slo-tpot-ms", type=float, default=None, help="for goodput: TPOT at most this")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--json", type=Path, default=None, help="also write the summaries here")
    _add_engine_options(sim, "the calibrated engine's, from the cost file")
    sim.set_defaults(run=_cmd_plan_simulate)


def _cmd_plan_simulate(args: argparse.Namespace) -> int:
    """Run a seeded workload (Poisson arrivals at each of --rates, prompt and output lengths from their specs)
    through the discrete-event simulator: the engine's own scheduler and block manager on a virtual clock, each
    step costed by the model in --cost. Prints TTFT, TPOT, ITL and E2E percentiles, throughput, and goodput
    under an SLO when one is given. The engine's knobs default to those the cost file was calibrated with."""
    from minserve import slo
    from minserve.capacity.simulator import SchedulerConfig, Simulator, StepCostModel, make_requests
    from minserve.workload import parse_length, poisson_arrivals, request_lengths

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be ≥ 1, got {args.num_prompts}")
    rates = parse_rates(args.rates)
    cost = StepCostModel.load(args.cost)
    config = SchedulerConfig.from_dict(cost.info.get("engine", {}), **_engine_options(args))
    limit = config.max_model_len - 1 if config.max_model_len else 1 << 20
    lengths = request_lengths(parse_length(args.prompt_len, limit), parse_length(args.output_len), args.num_prompts,
                              args.seed)  # fmt: skip
    prompts, outputs = [p for p, _ in lengths], [o for _, o in lengths]
    target = None
    if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None:
        target = slo.SLO("cli", ttft_s=_seconds(args.slo_ttft_ms), tpot_s=_seconds(args.slo_tpot_ms))
    print(
        f"{args.num_prompts} requests, prompts {args.prompt_len}, outputs {args.output_len} tokens; "
        f"policy {_policy_name(config.scheduling_policy)}, max_num_seqs {config.max_num_seqs}, "
        f"{config.max_num_batched_tokens} tokens/step, {config.num_kv_blocks} KV blocks of {config.block_size}, "
        f"chunked prefill {'on' if config.enable_chunked_prefill else 'off'}, "
        f"prefix caching {'on' if config.enable_prefix_caching else 'off'}; cost model {args.cost}"
    )
    header = (
        f"{'rate/s':>7}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'TPOT p50':>10}{'p90':>8}{'ITL p99':>9}"
        f"{'E2E p50':>9}{'req/s':>8}{'tok/s':>8}{'goodput':>9}{'preempt':>8}{'steps':>8}{'sim s':>7}"
    )
    print(f"{'':>7}{'ms':>10}{'':>18}{'ms':>10}{'':>8}{'ms':>9}{'ms':>9}")
    print(header)
    rows = []
    for index, rate in enumerate(rates):
        arrivals = poisson_arrivals(args.num_prompts, rate, args.seed + index, args.burstiness)
        requests = make_requests(
            arrivals, prompts, outputs, seed=args.seed + index, shared_prefix_tokens=args.shared_prefix_len
        )
        summary = Simulator(cost, config).run(requests).summary(target)
        rows.append({"rate_rps": rate if math.isfinite(rate) else None, **summary})  # None: all at once
        goodput = f"{summary['goodput_rps']:.2f}" if target is not None else "-"
        ttft, tpot = summary["ttft_ms"], summary["tpot_ms"]
        print(
            f"{rate:>7.3g}{ttft['p50']:>10.1f}{ttft['p90']:>9.1f}{ttft['p99']:>9.1f}"
            f"{tpot['p50']:>10.2f}{tpot['p90']:>8.2f}{summary['itl_ms']['p99']:>9.1f}{summary['e2e_ms']['p50']:>9.0f}"
            f"{summary['request_throughput_rps']:>8.2f}{summary['output_throughput_tps']:>8.0f}"
            f"{goodput:>9}{summary['preemptions']:>8}{summary['steps']:>8}{summary['wall_s']:>7.2f}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "run"},
            "config": config.to_dict(),
            "cost_model": cost.to_dict(),
            "runs": rows,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _seconds(milliseconds: float | None) -> float | None:
    return None if milliseconds is None else milliseconds / 1e3


def _policy_name(policy: object) -> str:
    return getattr(policy, "name", str(policy))


def _cmd_plan_roofline(args: argparse.Namespace) -> int:
    """Predict prefill time and decode step times for a model on a GPU from the roofline: each phase's FLOPs
    and bytes, the time of each at the GPU's peak FLOP/s and memory bandwidth, and which of the two binds."""
    batches = parse_batches(args.batch)
    if args.context <= 0 or args.prompt <= 0:
        raise ValueError(f"--context and --prompt must be positive, got {args.context} and {args.prompt}")
    config = resolve_model(args.model)
    hw = roofline.hardware(args.gpu)
    dtype = hw.dtype if args.dtype == "auto" else args.dtype
    print(format_roofline_plan(args.model, config, hw, dtype, args.prompt, batches, args.context, args.kv_dtype))
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
    name: str,
    config: ModelConfig,
    hw: roofline.Hardware,
    dtype: str,
    prompt: int,
    batches: list[int],
    context: int,
    kv_dtype: str | None = None,
) -> str:
    """The printed plan: a header with the model, the GPU's roofs and the critical batch size, then one row
    per phase (prefill of ``prompt`` tokens; a decode step at each batch size with ``context`` tokens each).
    The KV cache is in ``kv_dtype`` (default: ``dtype``)."""
    params = estimate_params(config)
    kv_dtype = kv_dtype or dtype
    lines = [
        f"{name}: {_si(params)} parameters, {_si(params * dtype_bytes(dtype))}B of {dtype} weights, "
        f"KV {kv_bytes_per_token(config, kv_dtype):,} bytes/token ({kv_dtype})",
        f"{hw.name}: {_si(hw.peak_flops_per_s)}FLOP/s dense {hw.dtype}, {_si(hw.memory_bandwidth_bytes_per_s)}B/s, "
        f"{_si(hw.memory_bytes)}B ({hw.source})",
        f"ridge point {hw.ridge_point_flops_per_byte:,.0f} FLOP/byte; critical batch size ≈ "
        f"{roofline.critical_batch_size(hw, dtype):,.0f} (decode below it is memory-bound on the weights alone)",
        "",
        f"{'phase':<8}{'tokens':>8}{'batch':>7}{'context':>9}{'FLOPs':>10}{'bytes':>10}{'FLOP/B':>9}"
        f"{'compute':>10}{'memory':>10}{'predicted':>11}  {'bound':<8}{'tokens/s':>12}  fits",
    ]
    rows = [("prefill", prompt, 1, prompt, roofline.predict_prefill(config, prompt, hw, dtype, kv_dtype=kv_dtype))]
    rows += [
        ("decode", 1, b, context, roofline.predict_decode(config, b, context, hw, dtype, kv_dtype)) for b in batches
    ]
    for phase, tokens, batch, ctx, p in rows:
        fits = fit(config, hw.memory_bytes, ctx, batch, dtype, kv_dtype).fits if hw.memory_bytes else None
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
