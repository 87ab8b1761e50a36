"""User-facing configuration: one frozen dataclass per concern, checked when it is built.

Each field that a command line sets carries its help text (and its choices) in its metadata, through
:func:`option`; :mod:`minserve.flags` turns the fields into ``argparse`` flags, so a new setting is one line
here and shows up in every command that takes its group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from minserve.engine.policies import Policy
    from minserve.engine.preemption import Preemption
    from minserve.engine.speculative.config import SpeculativeConfig
    from minserve.quant.swap import QuantScheme


def option(
    default: Any, help: str, choices: Sequence[str] | Callable[[], Sequence[str]] | None = None, flag: str | None = None
) -> Any:
    """A dataclass field with what its command-line flag says: ``help``, ``choices`` (or a function giving
    them, for registries filled later), and ``flag`` when the flag's name is not the field's."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


def _policy_names() -> list[str]:
    from minserve.engine.policies import POLICIES

    return sorted(POLICIES)


def _preemption_names() -> list[str]:
    from minserve.engine.preemption import PREEMPTION_MODES

    return list(PREEMPTION_MODES)


@dataclass(frozen=True)
class EngineConfig:
    """Which model to load, in what precision, where, and how the engine batches and caches.

    ``dtype`` is ``"auto"`` (float32 on the CPU, the checkpoint's dtype on a GPU), ``"float32"``,
    ``"bfloat16"`` or ``"float16"``. ``max_model_len`` caps the context (tokens) below the model's own.

    KV memory is allocated once: ``num_kv_blocks`` blocks of ``block_size`` tokens, or as many as fit in
    ``kv_cache_memory_bytes``, or by default 256 MiB on the CPU and 90% of free memory on a GPU.
    A step runs at most ``max_num_batched_tokens`` tokens of at most ``max_num_seqs`` sequences; with
    ``enable_chunked_prefill`` a long prompt is split across steps to stay within it, without it a prompt is
    prefilled whole in one step. ``scheduling_policy`` orders admission and preemption: ``"fcfs"``,
    ``"priority"``, ``"spf"`` (shortest prompt first, with aging) or ``"static"`` (static batching).
    ``preemption_mode`` is ``"recompute"`` or ``"swap"`` (KV copied to ``swap_space_bytes`` of host memory,
    by default as many blocks as the device cache has).

    ``quantization`` stores the decoder layers' weights as ``"int8"`` (per channel), ``"int4"`` (per group
    of ``quant_group_size`` inputs, with a zero point), ``"int4-awq"`` (int4 after an activation-aware scale
    search on a calibration text, AWQ-style) or ``"fp8"`` (e4m3), and the head in int8; quantized as the
    model loads (:mod:`minserve.quant`). A GGUF file's Q4_0 / Q4_1 blocks are int4 in
    groups of 32 already: under ``"int4"`` they are kept as stored, unless another group size is asked for.
    ``"none"`` keeps ``dtype`` throughout. ``"auto"`` (the default) is int4 on a CPU serving a GGUF file
    stored in 4-bit blocks, with each layer's dense float twin kept for steps of many rows, and ``"none"``
    elsewhere or when ``dtype`` is named (:mod:`minserve.quant.auto`).

    ``kv_cache_dtype`` ``"int8"`` or ``"fp8"`` stores keys and values in one byte, with per-head scales
    measured at start (:mod:`minserve.model.kv_quant`): the same KV memory holds twice the tokens of a
    16-bit cache, four times a 32-bit one.

    ``backend`` computes norms, rotary, activations and attention with ``"torch"`` or minserve's
    ``"triton"`` kernels; ``"auto"`` is Triton on a CUDA GPU, torch elsewhere.

    ``enable_cuda_graphs`` records decode steps as CUDA graphs (on a GPU with the Triton backend); turn it
    off to debug, as vLLM's ``--enforce-eager`` does.

    ``compile_model`` runs decode steps through the model's forward compiled by ``torch.compile`` (the
    torch backend only; :mod:`minserve.engine.compilation`). It compiles when the engine is built: on a
    small CPU about 18 s for minserve-tiny, 30–50 s for a 30-layer model once inductor's cache is warm,
    minutes the first time. Where it cannot compile, building the engine fails, saying why. Left unset
    (``None``), the command decides: ``LLM`` runs eagerly, since a script rarely earns back the compile, and
    ``minserve serve`` compiles where its decode steps are bound by dispatch rather than by the weights'
    bytes: a CPU serving 4-bit or 8-bit codes (:func:`~minserve.engine.compilation.serving_compiles`).

    ``speculative_config`` turns on speculative decoding, in vLLM's dict shape
    (:class:`~minserve.engine.speculative.SpeculativeConfig`); ``None`` leaves it off.

    ``tensor_parallel_size`` splits the model across that many processes (:mod:`minserve.engine.tensor_parallel`):
    each holds its share of the attention heads, KV heads and MLP, and the engine's process schedules and
    samples for all. gloo carries the collectives on the CPU, NCCL on GPUs (one per rank). A script that
    starts one needs Python's ``if __name__ == "__main__":`` guard, as any that spawns processes does.
    ``enable_expert_parallel`` (a mixture-of-experts model, with ``tensor_parallel_size > 1``) gives each rank
    whole experts, ``num_experts / tensor_parallel_size`` of them, instead of a slice of every expert; tokens
    travel to their experts' ranks by all-to-all (:mod:`minserve.parallel.expert_parallel`).
    ``pipeline_parallel_size`` splits the model's layers across that many processes instead, one stage each
    (:mod:`minserve.engine.pipeline_parallel`); each step's batch is split into ``num_micro_batches`` (by
    default one per stage) so that the stages work at once. Decode steps run eager (no CUDA graphs). One kind
    of parallelism at a time, for now.

    ``num_threads`` sets torch's CPU threads for the process the engine runs in (default: torch's choice,
    one per core). On a small CPU shared with other busy processes (an HTTP front end, a load tester), fewer
    threads than cores keeps the forward pass from waiting on a thread whose core is taken.
    """

    model: str = option("minserve-tiny", "a name (see `minserve models`), checkpoint dir, .gguf file or hub id")
    dtype: str = option("auto", "weights and KV dtype", choices=("auto", "float32", "bfloat16", "float16"))
    quantization: str = option("auto", "weight format of the decoder layers and head; auto keeps a GGUF file's "
                               "4-bit blocks on a CPU (with float copies for large steps)",
                               choices=("auto", "none", "int8", "int4", "int4-awq", "fp8"))  # fmt: skip
    quant_group_size: int | None = option(
        None, "int4: inputs sharing a scale and zero point (32, 64, 128, 256; default 32 on GGUF Q4 blocks, else 64)"
    )
    kv_cache_dtype: str = option("auto", "KV cache elements: auto is dtype's; int8 or fp8 hold 2× (4×) the tokens",
                                 choices=("auto", "int8", "fp8"))  # fmt: skip
    device: str = option("auto", "cpu, cuda, cuda:1 …; auto is cuda when available")
    max_model_len: int | None = option(None, "context limit in tokens, below the model's own")
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "KV blocks (default: what fits in the KV memory budget)")
    kv_cache_memory_bytes: int | None = option(None, "KV memory budget in bytes")
    max_num_seqs: int = option(64, "sequences per step, at most")
    max_num_batched_tokens: int = option(1024, "tokens per step, at most")
    enable_prefix_caching: bool = option(True, "share the KV of prompts' common prefixes")
    enable_chunked_prefill: bool = option(True, "split long prompts across steps (off: each prefilled whole)")
    # A name, or a Policy object (chapter 05's exercise plugs one in).
    scheduling_policy: str | Policy = option("fcfs", "admission and preemption order", choices=_policy_names)
    preemption_mode: str | Preemption = option("recompute", "when KV runs out", choices=_preemption_names)
    swap_space_bytes: int | None = option(None, "host memory for swapped KV (default: as much as the device's)")
    enable_tracing: bool = option(True, "record per-request trace events")
    num_threads: int | None = option(None, "torch CPU threads of the engine", flag="threads")
    backend: str = option("auto", "kernels: auto is triton on CUDA, else torch", choices=("auto", "torch", "triton"))
    tensor_parallel_size: int = option(1, "processes to split the model across (heads and MLP), over torch.distributed")
    enable_expert_parallel: bool = option(False, "MoE: each rank holds whole experts (tokens sent by all-to-all) "
                                          "instead of a slice of every expert")  # fmt: skip
    pipeline_parallel_size: int = option(1, "processes to split the model's layers across (stages), over "
                                         "torch.distributed")  # fmt: skip
    num_micro_batches: int | None = option(None, "pipeline parallelism: micro-batches a step's batch is split "
                                           "into (default: one per stage)")  # fmt: skip
    enable_cuda_graphs: bool = option(True, "decode steps as CUDA graphs on a GPU (off: eager)")
    compile_model: bool | None = option(None, "decode steps through torch.compile (torch backend; compiles at "
                                        "start); unset: serve compiles a CPU's 4- or 8-bit codes, LLM stays eager",
                                        flag="compile")  # fmt: skip
    # vLLM's dict ({"method": "ngram", "num_speculative_tokens": 3, ...}) or a SpeculativeConfig.
    speculative_config: Mapping[str, Any] | SpeculativeConfig | None = option(
        None, 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 3}'
    )

    def __post_init__(self) -> None:
        _positive(self, "max_model_len", self.max_model_len, minimum=2, optional=True)
        _positive(self, "block_size", self.block_size)
        _positive(self, "num_kv_blocks", self.num_kv_blocks, optional=True)
        _positive(self, "kv_cache_memory_bytes", self.kv_cache_memory_bytes, optional=True)
        _positive(self, "max_num_seqs", self.max_num_seqs)
        _positive(self, "max_num_batched_tokens", self.max_num_batched_tokens)
        _positive(self, "num_threads", self.num_threads, optional=True)
        _positive(self, "swap_space_bytes", self.swap_space_bytes, minimum=0, optional=True)
        _positive(self, "tensor_parallel_size", self.tensor_parallel_size)
        _positive(self, "pipeline_parallel_size", self.pipeline_parallel_size)
        _positive(self, "num_micro_batches", self.num_micro_batches, optional=True)
        self._check_parallelism()
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "enable_expert_parallel splits the experts across the tensor-parallel ranks: set "
                "tensor_parallel_size > 1 (one process holds every expert anyway)"
            )
        _ = self.speculative  # a mistaken speculative_config fails here, saying what to change
        if self.quantization not in ("auto", "none"):  # likewise an impossible quantization
            from minserve.quant.swap import QuantScheme

            QuantScheme.named(self.quantization, self.quant_group_size)
        from minserve.model.kv_quant import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype)

    def _check_parallelism(self) -> None:
        """Refuse what the parallel engines cannot do yet, saying what to change."""
        parallel = [name for name in ("tensor_parallel_size", "pipeline_parallel_size") if getattr(self, name) > 1]
        if len(parallel) > 1:
            raise ValueError(
                "tensor_parallel_size and pipeline_parallel_size cannot both be > 1 yet: split the model one way "
                "(set the other to 1)"
            )
        if parallel and (self.compile_model or self.speculative_config is not None):
            raise ValueError(
                f"{parallel[0]} > 1 runs eager decode steps without speculative decoding for now: "
                f"drop compile_model and speculative_config, or use {parallel[0]}=1"
            )
        if self.num_micro_batches is not None and self.pipeline_parallel_size == 1:
            raise ValueError(
                "num_micro_batches splits each step between pipeline stages: set pipeline_parallel_size > 1, "
                "or leave num_micro_batches unset"
            )

    @property
    def world_size(self) -> int:
        """The processes the engine runs in: one, or one per tensor-parallel rank or pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def quant_scheme(self, checkpoint: Path, device: torch.device) -> QuantScheme | None:
        """``quantization`` as a checked :class:`~minserve.quant.QuantScheme` for this checkpoint on this
        device (``None``: the checkpoint's own precision); ``"auto"`` decides by both
        (:mod:`minserve.quant.auto`)."""
        from minserve.quant.auto import choose_scheme

        return choose_scheme(self.quantization, self.quant_group_size, checkpoint, device, self.dtype)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` as a checked :class:`SpeculativeConfig` (``None``: no speculation)."""
        from minserve.engine.speculative.config import SpeculativeConfig

        if self.speculative_config is None or isinstance(self.speculative_config, SpeculativeConfig):
            return self.speculative_config
        if not isinstance(self.speculative_config, Mapping):
            raise ValueError(
                f"speculative_config must be a dict or a SpeculativeConfig, got {self.speculative_config!r}"
            )
        return SpeculativeConfig.from_dict(self.speculative_config)


@dataclass(frozen=True)
class SchedulerConfig:
    """How the engine core batches, caches and preempts: everything the engine and the simulator share.

    The engine builds one from its :class:`EngineConfig` once it knows how many KV blocks fit in memory
    (:attr:`LLMEngine.scheduler_config <minserve.engine.engine.LLMEngine>`); the simulator takes one as
    it is. ``num_kv_blocks`` defaults to what the engine allocates for ``minserve-tiny`` on a CPU (256 MiB
    of float32 KV). ``max_model_len`` ``None`` means no context limit. With ``preemption_mode="swap"``,
    ``num_cpu_blocks`` host blocks hold swapped-out KV (``None``: as many as the device has).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    num_kv_blocks: int = 4096
    scheduling_policy: str | Policy = "fcfs"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    preemption_mode: str | Preemption = "recompute"
    num_cpu_blocks: int | None = None

    def __post_init__(self) -> None:
        from minserve.engine.policies import make_policy
        from minserve.engine.preemption import make_preemption

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks"):
            _positive(self, name, getattr(self, name))
        _positive(self, "num_cpu_blocks", self.num_cpu_blocks, minimum=0, optional=True)
        _positive(self, "max_model_len", self.max_model_len, minimum=2, optional=True)
        make_policy(self.scheduling_policy)  # an unknown name fails here, not at the first step
        make_preemption(self.preemption_mode)

    @property
    def host_blocks(self) -> int:
        """Host blocks the block manager gets: none unless swapping, by default as many as the device's."""
        from minserve.engine.preemption import make_preemption

        if not make_preemption(self.preemption_mode).uses_host_memory:
            return 0
        return self.num_kv_blocks if self.num_cpu_blocks is None else self.num_cpu_blocks

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def replace(self, **changes: Any) -> SchedulerConfig:
        return replace(self, **changes)

    @classmethod
    def of(cls, engine_config: EngineConfig, **sized: Any) -> SchedulerConfig:
        """The scheduling part of an :class:`EngineConfig` (every field the two share, by name), with what
        only a loaded engine knows (``num_kv_blocks``, ``max_model_len``, ``num_cpu_blocks``) in ``sized``."""
        shared = {f.name: getattr(engine_config, f.name) for f in fields(cls) if hasattr(engine_config, f.name)}
        return cls(**{**shared, **sized})

    @classmethod
    def from_engine(cls, llm: Any, **overrides: Any) -> SchedulerConfig:
        """The configuration an engine (or an ``LLM``) runs with, its KV block counts included."""
        return getattr(llm, "engine", llm).scheduler_config.replace(**overrides)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("scheduling_policy", "preemption_mode"):  # a strategy object is saved by its name
            data[name] = getattr(data[name], "name", data[name])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], **overrides: Any) -> SchedulerConfig:
        """From :meth:`to_dict`'s output (unknown keys ignored), with ``overrides`` on top."""
        known = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in data.items() if k in known}, **overrides})


def _positive(config: object, name: str, value: object, minimum: int = 1, optional: bool = False) -> None:
    """Refuse a field of ``config`` that is not an integer ≥ ``minimum`` (or None, when ``optional``)."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{type(config).__name__}.{name} must be an integer ≥ {minimum}, got {value!r}")


MAX_PORT = 65535


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's limits. Times in seconds, sizes in bytes.

    ``admission`` decides which requests are refused at once with 429 (:mod:`minserve.admission`):
    ``"queue-length"`` (past ``max_waiting_requests`` waiting), ``"token-budget"`` (past
    ``max_queued_prompt_tokens`` prompt tokens queued) or ``"deadline"`` (a predicted time to first token
    over ``admission_headroom`` × ``ttft_slo_ms``, or × the request's shorter timeout); the last two keep the
    queue-length limit too. Or an :class:`~minserve.admission.AdmissionPolicy` object, the whole
    policy (chapter 09's exercise). A 429's ``Retry-After`` is predicted from the queue, at least ``retry_after_s``.
    A request running longer than ``request_timeout_s``, or than the timeout it sends itself (body
    ``timeout`` or header ``X-Request-Timeout``, seconds, capped by ``request_timeout_s``), is stopped (504).
    Degraded modes (:mod:`minserve.serve.degrade`) turn on when ``degrade_enter_requests`` requests are in
    the server and off when no more than ``degrade_exit_requests`` (default: half as many) remain: a
    ``degraded_max_tokens`` cap, a shorter context ``degraded_max_model_len`` (longer prompts get 429), and
    with ``degraded_no_speculation`` speculative decoding off. A chat request that sends no
    ``max_tokens`` gets ``default_max_tokens`` (or what is left of the context, if less); a completion
    request gets 16, as OpenAI's API does. A request body over ``max_body_bytes`` is refused (413) while it
    is being read, whatever its framing. On shutdown, running requests get up to ``shutdown_drain_s`` to
    finish; past that they are ended (503) and the server exits. ``api_key``, when set, is required on every
    route but /health. The server holds at most ``max_connections`` connections (at the limit a new one
    takes the place of the longest-idle one) and closes one that sends no complete request for
    ``connection_idle_timeout_s`` (:mod:`minserve.serve.connections`). An engine core silent for longer than
    ``stall_timeout_s`` (or ten of its slowest recent steps) is reported stalled (:mod:`minserve.serve.watchdog`).
    ``trace_out``: a file to write the engine's trace to (Chrome/Perfetto JSON) when the server stops.
    """

    host: str = option("127.0.0.1", "address to bind; 127.0.0.1 is loopback only")
    port: int = option(8000, "TCP port")
    api_key: str | None = option(None, "require this bearer token (or set MINSERVE_API_KEY)")
    # A name, or an AdmissionPolicy object (chapter 09's exercise plugs one in). Checked when the server
    # starts, by minserve.admission.make_admission (the simulator runs the same policies).
    admission: str | object = option("queue-length", "which requests get 429 at once: queue-length, "
                                     "token-budget or deadline")  # fmt: skip
    max_waiting_requests: int = option(256, "past this queue length: 429 (under every --admission)")
    max_queued_prompt_tokens: int = option(32768, "--admission token-budget: past this many queued prompt tokens: 429")
    ttft_slo_ms: float = option(1000.0, "--admission deadline: 429 when the predicted TTFT is over this, ms")
    # Why not 1: admitted at a prediction equal to the SLO, the actual TTFTs scatter around it and about half
    # miss (measured in the simulator and on the server; chapter 09).
    admission_headroom: float = option(0.5, "--admission deadline: admit while the predicted TTFT is within this "
                                       "share of the TTFT SLO (or of a shorter timeout of its own)")  # fmt: skip
    request_timeout_s: float = option(600.0, "a request running longer is cancelled (504)")
    default_max_tokens: int = option(512, "a chat request's max_tokens when it sends none")
    retry_after_s: int = option(1, "the Retry-After of a 503, and the least of a 429's, seconds")
    degrade_enter_requests: int | None = option(None, "degraded modes on at this many requests in the server")
    degrade_exit_requests: int | None = option(None, "… and off again at this many (default: half as many)")
    degraded_max_tokens: int | None = option(None, "degraded: cap each request's max_tokens at this")
    degraded_max_model_len: int | None = option(None, "degraded: a shorter context, tokens (longer prompts: 429)")
    degraded_no_speculation: bool = option(False, "degraded: speculative decoding off")
    max_body_bytes: int = option(4 * 2**20, "largest request body, bytes (413 past it)")
    shutdown_drain_s: float = option(30.0, "on SIGTERM, how long running requests may finish before they are ended")
    max_connections: int = option(1024, "most open connections; past it the longest-idle one is closed")
    connection_idle_timeout_s: float = option(10.0, "close a connection that sends no complete request for this long")
    stall_timeout_s: float = option(30.0, "an engine core silent this long (at least) is reported stalled (503)")
    trace_out: str | None = option(None, "on exit, write the engine's trace here (Perfetto JSON)")

    def __post_init__(self) -> None:
        _positive(self, "port", self.port, minimum=0)
        if self.port > MAX_PORT:
            raise ValueError(f"ServerConfig.port must be at most {MAX_PORT} (0: any free port), got {self.port}")
        _positive(self, "max_connections", self.max_connections)
        for name in ("shutdown_drain_s", "connection_idle_timeout_s", "stall_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"ServerConfig.{name} must be a positive number of seconds, got {value!r}")
        _positive(self, "max_waiting_requests", self.max_waiting_requests, minimum=0)
        _positive(self, "max_body_bytes", self.max_body_bytes)
        _positive(self, "default_max_tokens", self.default_max_tokens)
        if not self.request_timeout_s > 0:
            raise ValueError(f"ServerConfig.request_timeout_s must be > 0, got {self.request_timeout_s!r}")
        _positive(self, "max_queued_prompt_tokens", self.max_queued_prompt_tokens)
        if not self.ttft_slo_ms > 0:
            raise ValueError(f"ServerConfig.ttft_slo_ms must be > 0, got {self.ttft_slo_ms!r}")
        if not 0 < self.admission_headroom <= 1:
            raise ValueError(f"ServerConfig.admission_headroom must be in (0, 1], got {self.admission_headroom!r}: "
                             "the share of the TTFT budget a predicted TTFT may use")  # fmt: skip
        _positive(self, "degrade_enter_requests", self.degrade_enter_requests, optional=True)
        _positive(self, "degrade_exit_requests", self.degrade_exit_requests, minimum=0, optional=True)
