"""User-facing configuration: one frozen dataclass per concern, checked when it is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minserve.engine.policies import Policy


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

    ``backend`` computes norms, rotary, activations and attention with ``"torch"`` or minserve's
    ``"triton"`` kernels; ``"auto"`` is Triton on a CUDA GPU, torch elsewhere.

    ``enable_cuda_graphs`` records decode steps as CUDA graphs (on a GPU with the Triton backend); turn it
    off to debug, as vLLM's ``--enforce-eager`` does.

    ``num_threads`` sets torch's CPU threads for the process the engine runs in (default: torch's choice,
    one per core). On a small CPU shared with other busy processes (an HTTP front end, a load tester), fewer
    threads than cores keeps the forward pass from waiting on a thread whose core is taken.
    """

    model: str = "minserve-tiny"
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str | Policy = "fcfs"  # a name, or a Policy object (chapter 05's exercise plugs one in)
    preemption_mode: str = "recompute"
    swap_space_bytes: int | None = None
    enable_tracing: bool = True
    num_threads: int | None = None
    backend: str = "auto"
    enable_cuda_graphs: bool = True

    def __post_init__(self) -> None:
        _positive(self, "max_model_len", self.max_model_len, minimum=2, optional=True)
        _positive(self, "block_size", self.block_size)
        _positive(self, "num_kv_blocks", self.num_kv_blocks, optional=True)
        _positive(self, "kv_cache_memory_bytes", self.kv_cache_memory_bytes, optional=True)
        _positive(self, "max_num_seqs", self.max_num_seqs)
        _positive(self, "max_num_batched_tokens", self.max_num_batched_tokens)
        _positive(self, "num_threads", self.num_threads, optional=True)
        _positive(self, "swap_space_bytes", self.swap_space_bytes, minimum=0, optional=True)


def _positive(config: object, name: str, value: object, minimum: int = 1, optional: bool = False) -> None:
    """Refuse a field of ``config`` that is not an integer ≥ ``minimum`` (or None, when ``optional``)."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{type(config).__name__}.{name} must be an integer ≥ {minimum}, got {value!r}")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's limits. Times in seconds, sizes in bytes.

    Past ``max_waiting_requests`` queued requests, new ones get 429 with ``Retry-After: retry_after_s``.
    A request running longer than ``request_timeout_s`` is cancelled. A chat request that sends no
    ``max_tokens`` gets ``default_max_tokens`` (or what is left of the context, if less); a completion
    request gets 16, as OpenAI's API does. A request body over ``max_body_bytes`` is refused (413) while it
    is being read, whatever its framing. On shutdown, running requests get up to ``shutdown_drain_s`` to
    finish. ``api_key``, when set, is required on every route but /health.
    ``trace_out``: a file to write the engine's trace to (Chrome/Perfetto JSON) when the server stops.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_waiting_requests: int = 256
    request_timeout_s: float = 600.0
    default_max_tokens: int = 512
    retry_after_s: int = 1
    max_body_bytes: int = 4 * 2**20
    shutdown_drain_s: float = 30.0
    trace_out: str | None = None

    def __post_init__(self) -> None:
        _positive(self, "port", self.port, minimum=0)
        _positive(self, "max_waiting_requests", self.max_waiting_requests, minimum=0)
        _positive(self, "max_body_bytes", self.max_body_bytes)
        _positive(self, "default_max_tokens", self.default_max_tokens)
        if not self.request_timeout_s > 0:
            raise ValueError(f"ServerConfig.request_timeout_s must be > 0, got {self.request_timeout_s!r}")
