"""``minserve plan``: capacity planning before (or instead of) experiments on the engine.

``minserve plan roofline --model Llama-3-8B --gpu H100 --batch 1,8,64 --context 1024 --prompt 512`` prints the
roofline's predicted prefill time and decode step times, which roof binds each, and the critical batch size.

``minserve plan parallel --model Llama-3-70B --gpu H100 --gpus 8 --interconnect nvlink4 --batch 1,32`` prints,
for every tensor × pipeline × data parallel layout of the GPUs, whether it fits and its predicted decode time
per token and throughput, split into compute, memory, communication and pipeline bubble
(:mod:`minserve.capacity.parallel`).

``minserve plan calibrate --out cost.json`` times a short workload on the engine and fits the simulator's
step-cost model; ``minserve plan simulate --cost cost.json --rates 2,4,8`` runs a workload through the
discrete-event simulator (:mod:`minserve.capacity.simulator`: the real scheduler on a virtual clock) and prints
the SLO summary at each rate.

``minserve plan capacity --cost cost.json --prompt-len lognormal:256:128 --output-len lognormal:64:32
--slo-ttft-ms 500 --slo-tpot-ms 100 --target-rate 20 --usd-per-hour 2.5`` prints one replica's capacity
envelope (:mod:`minserve.capacity.planner`): KV-limited concurrency, sustainable throughput, the highest
rate that meets the SLO, Little's law there, the queue limit it implies, and the replicas and cost of the
target rate; ``--gpu H100 --model Llama-3-8B`` plans from the roofline instead of a calibration.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from minserve import slo
from minserve.capacity import interconnect, parallel, roofline
from minserve.capacity.kv import DTYPE_BYTES, model_config
from minserve.capacity.plan_text import format_envelope, format_parallel_plan, format_roofline_plan
from minserve.capacity.presets import MODEL_PRESETS
from minserve.config import EngineConfig
from minserve.flags import ENGINE_SCHEDULING, add_config_flags, config_options
from minserve.model.config import ModelConfig
from minserve.workload import parse_rates

if TYPE_CHECKING:  # the planner runs the simulator, which loads the engine: imported when planning
    from minserve.capacity.planner import Machine


def add_plan_command(commands: argparse._SubParsersAction, plot_capacity: Callable[..., Path] | None = None) -> None:
    """Register ``plan`` and its kinds ``roofline``, ``parallel``, ``calibrate``, ``simulate`` and ``capacity``
    on the top-level parser's sub-commands. ``plot_capacity(envelope, path)`` draws ``plan capacity --plot``'s
    chart (the lab's, handed down by the command line: this layer has no plotting)."""
    plan = commands.add_parser(
        "plan",
        help="capacity planning: roofline, parallel layouts, calibration, simulation, capacity envelope",
        description="Capacity planning (chapters 03, 04, 05, 06, 09).",
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
    _add_parallel(kinds)
    _add_calibrate(kinds)
    _add_simulate(kinds)
    _add_capacity(kinds, plot_capacity)


def _add_parallel(kinds: argparse._SubParsersAction) -> None:
    par = kinds.add_parser(
        "parallel",
        help="which TP × PP × DP layouts fit on N GPUs, and how fast each decodes",
        description=_cmd_plan_parallel.__doc__,
    )
    par.add_argument("--model", default="Llama-3-70B", help="a preset, an embedded model, or a checkpoint directory")
    par.add_argument(
        "--gpu", default="H100", help=f"one of {', '.join(roofline.HARDWARE)} ('this' measures this machine)"
    )
    par.add_argument("--gpus", type=int, default=8, help="how many GPUs to split the model over")
    par.add_argument(
        "--interconnect",
        default="nvlink4",
        help=f"the link between them: {', '.join([*interconnect.INTERCONNECTS, interconnect.THIS_MACHINE])}",
    )
    par.add_argument("--batch", default="1,32", help="sequences decoding at once per replica, comma-separated")
    par.add_argument("--context", type=int, default=4096, help="tokens in each sequence's KV cache")
    par.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_BYTES], help="weights and activations")
    par.add_argument("--kv-dtype", default=None, choices=list(DTYPE_BYTES), help="the KV cache's, when not --dtype's")
    par.add_argument("--micro-batches", type=int, default=None, help="per step with PP (default: min(batch, PP))")
    par.add_argument("--layouts", default=None, help="only these, comma-separated, like TP8,TP4xPP2 (default: all)")
    par.set_defaults(run=_cmd_plan_parallel)


def _cmd_plan_parallel(args: argparse.Namespace) -> int:
    """For every way of splitting a model over --gpus GPUs (tensor × pipeline × data parallel): whether the
    weights and the batch's KV cache fit on each GPU, and a decode step's predicted time per output token and
    throughput, from the roofline (compute, memory) on each GPU's share plus the collectives over the
    interconnect (ring all-reduce: 2(n−1)/n × size / bandwidth + 2(n−1) × latency) and the pipeline's bubble."""
    batches = parse_batches(args.batch)
    if args.context <= 0:
        raise ValueError(f"--context must be positive, got {args.context}")
    if args.gpus <= 0:
        raise ValueError(f"--gpus must be positive, got {args.gpus}")
    config = resolve_model(args.model)
    hw = roofline.hardware(args.gpu)
    link = interconnect.interconnect(args.interconnect)
    dtype = hw.dtype if args.dtype == "auto" else args.dtype
    chosen = parallel.layouts(config, args.gpus)
    if args.layouts:
        chosen = [parallel.Layout.parse(text) for text in args.layouts.split(",") if text.strip()]
        wrong = [layout.name for layout in chosen if layout.gpus != args.gpus]
        if wrong:
            raise ValueError(f"layouts {', '.join(wrong)} do not use exactly --gpus {args.gpus} GPUs")
    if not chosen:
        raise ValueError(f"no layout of {args.gpus} GPUs splits {args.model}'s heads evenly; try another --gpus")
    plans = {
        batch: [
            parallel.plan_layout(
                config, layout, hw, link, batch, args.context, dtype, args.kv_dtype, args.micro_batches
            )
            for layout in chosen
        ]
        for batch in batches
    }
    print(format_parallel_plan(args.model, config, hw, link, dtype, plans))
    if not args.layouts:
        for note in parallel.left_out(config, args.gpus):
            print(f"left out: {note}")
    return 0


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
    target = _slo_target(args)
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


def _add_capacity(kinds: argparse._SubParsersAction, plot_capacity: Callable[..., Path] | None) -> None:
    cap = kinds.add_parser(
        "capacity",
        help="one replica's capacity envelope, and the replicas and cost of a target rate",
        description=_cmd_plan_capacity.__doc__,
    )
    machine = cap.add_argument_group("the machine")
    machine.add_argument(
        "--gpu",
        default=roofline.THIS_MACHINE,
        help=f"'this' (with --cost) or a GPU from the roofline's table: {', '.join(roofline.HARDWARE)}",
    )
    machine.add_argument("--cost", type=Path, default=None, help="--gpu this: a step-cost file from `plan calibrate`")
    machine.add_argument(
        "--model",
        default=None,
        help="--gpu NAME: a preset, an embedded model or a checkpoint (--gpu this: the calibrated model, checked)",
    )
    machine.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_BYTES], help="--gpu NAME: the weights'")
    machine.add_argument("--kv-dtype", default=None, choices=list(DTYPE_BYTES), help="--gpu NAME: the KV cache's")
    machine.add_argument(
        "--step-overhead-ms",
        type=float,
        default=0.0,
        help="--gpu NAME: added to every roofline step (launches, scheduling)",
    )
    work = cap.add_argument_group("the workload")
    work.add_argument("--prompt-len", default="lognormal:256:128", help="N, uniform:MEAN:SPREAD or lognormal:MEAN:SD")
    work.add_argument("--output-len", default="lognormal:64:32", help="as --prompt-len")
    work.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt starts with")
    work.add_argument("--arrival", default="poisson", choices=["poisson", "gamma", "constant"])
    work.add_argument("--burstiness", type=float, default=1.0, help="--arrival gamma: its shape, <1 burstier")
    work.add_argument("--num-prompts", type=int, default=500, help="requests in each simulated run")
    work.add_argument("--seed", type=int, default=0)
    contract = cap.add_argument_group("the SLO and the target")
    contract.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT at most this")
    contract.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT at most this")
    contract.add_argument("--slo-attainment", type=float, default=0.99, help="share of requests that must meet it")
    contract.add_argument("--target-rate", type=float, default=None, help="requests/s to serve: how many replicas")
    contract.add_argument("--usd-per-hour", type=float, default=None, help="one replica's price, for the cost")
    cap.add_argument("--tolerance", type=float, default=0.02, help="the rate search's bracket, a share of the rate")
    cap.add_argument("--plot", type=Path, default=None, help="also write the attainment-against-rate chart (HTML)")
    _add_engine_options(cap, "the calibrated engine's, or the simulator's for a GPU")
    cap.set_defaults(run=_cmd_plan_capacity, plot_capacity=plot_capacity)


def _cmd_plan_capacity(args: argparse.Namespace) -> int:
    """One replica's capacity envelope for a workload and an SLO: the sequences the KV cache holds at once, the
    sustainable token throughput of a full batch (from the calibrated step costs of this machine, --cost, or
    from the roofline of a GPU, --gpu H100 --model Llama-3-8B), the highest arrival rate at which the
    simulator meets the SLO (bisection), Little's law's requests in flight there, the queue limit it implies
    (for `minserve serve --max-waiting-requests`), and for --target-rate the replicas and, with
    --usd-per-hour, their cost per hour and per million output tokens."""
    from minserve.capacity import planner
    from minserve.capacity.envelope import plan_capacity
    from minserve.workload import parse_length

    target = _slo_target(args)
    if target is None:
        raise ValueError("give the SLO: --slo-ttft-ms and/or --slo-tpot-ms")
    checks = [
        (0 < args.slo_attainment <= 1, f"--slo-attainment must be in (0, 1], got {args.slo_attainment}"),
        (args.num_prompts >= 1, f"--num-prompts must be ≥ 1, got {args.num_prompts}"),
        (0 < args.tolerance < 1, f"--tolerance must be in (0, 1), got {args.tolerance}"),
        (args.target_rate is None or args.target_rate > 0, f"--target-rate must be > 0, got {args.target_rate}"),
        (args.usd_per_hour is None or args.usd_per_hour >= 0, f"--usd-per-hour must be ≥ 0, got {args.usd_per_hour}"),
        (args.usd_per_hour is None or args.target_rate is not None,
         "--usd-per-hour prices the replicas a --target-rate needs: give --target-rate too"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    machine = _capacity_machine(args)
    limit = machine.config.max_model_len - 1 if machine.config.max_model_len else 1 << 20
    workload = planner.Workload(
        parse_length(args.prompt_len, limit), parse_length(args.output_len), args.shared_prefix_len,
        args.num_prompts, args.arrival, args.burstiness, args.seed,
    )  # fmt: skip
    envelope = plan_capacity(machine, workload, target, args.slo_attainment, args.target_rate,
                                     args.usd_per_hour, args.tolerance)  # fmt: skip
    print(format_envelope(envelope))
    if args.plot is not None:
        if args.plot_capacity is None:
            raise ValueError("--plot needs the lab's plotting, which this command line was built without")
        print(f"wrote {args.plot_capacity(envelope, args.plot)}")
    return 0


def _capacity_machine(args: argparse.Namespace) -> Machine:
    """The machine ``plan capacity`` plans for: this one from ``--cost``, or a GPU's roofline."""
    from minserve.capacity import planner
    from minserve.capacity.cost_model import StepCostModel

    knobs = _engine_options(args)
    if args.gpu.strip().lower() == roofline.THIS_MACHINE:
        if args.cost is None:
            raise ValueError(
                "--gpu this plans from a calibration of this machine: give --cost FILE (make one with "
                "`minserve plan calibrate --out FILE`), or name a GPU to plan from its roofline"
            )
        cost = StepCostModel.load(args.cost)
        calibrated = cost.info.get("model")
        if args.model is not None and calibrated is not None and args.model != calibrated:
            raise ValueError(f"{args.cost} is a calibration of {calibrated}, not {args.model}; calibrate "
                             f"{args.model} or leave out --model")  # fmt: skip
        return planner.calibrated_machine(cost, **knobs)
    if args.cost is not None:
        raise ValueError(f"--cost is a calibration of this machine; with --gpu {args.gpu} the roofline prices the "
                         "steps: leave out --cost, or use --gpu this")  # fmt: skip
    if args.model is None:
        raise ValueError(f"--gpu {args.gpu} plans a model from the roofline: give --model (a preset: "
                         f"{', '.join(MODEL_PRESETS)}, an embedded model or a checkpoint directory)")  # fmt: skip
    if args.step_overhead_ms < 0:
        raise ValueError(f"--step-overhead-ms must be ≥ 0, got {args.step_overhead_ms}")
    hw = roofline.hardware(args.gpu)
    dtype = hw.dtype if args.dtype == "auto" else args.dtype
    return planner.roofline_machine(resolve_model(args.model), hw, dtype, args.kv_dtype,
                                    step_overhead_s=args.step_overhead_ms / 1e3, **knobs)  # fmt: skip


def _seconds(milliseconds: float | None) -> float | None:
    return None if milliseconds is None else milliseconds / 1e3


def _slo_target(args: argparse.Namespace) -> slo.SLO | None:
    """The SLO of ``--slo-ttft-ms`` and ``--slo-tpot-ms`` (``None`` when neither is given)."""
    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        return None
    return slo.SLO("cli", ttft_s=_seconds(args.slo_ttft_ms), tpot_s=_seconds(args.slo_tpot_ms))


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


__all__ = [
    "add_plan_command",
    "parse_batches",
    "resolve_model",
]
