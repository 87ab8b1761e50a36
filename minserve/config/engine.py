"""The engine's settings, in groups the way vLLM composes its ``VllmConfig``: which checkpoint in what precision,
what the KV cache is made of, how the scheduler batches, how the model is split across processes, where and
how it runs, and what to speculate with.

Each group is a frozen dataclass that checks itself when it is built and declares its settings' flags once
(:func:`~minserve.config.options.option`). Users never see the groups unless they want to: ``LLM(...)`` and
the command line take the settings flat (``max_num_seqs=8``, ``--max-num-seqs 8``), and
:meth:`EngineConfig.from_options` is the one place that sorts them into their groups.

This module imports nothing of the engine, the model or the quantizers: what a setting's value means to them
(is this quantization possible for this checkpoint?) is checked where they read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from minserve.config.options import Option, check_whole, option
from minserve.config.scheduler import SchedulerConfig
from minserve.config.speculative import SpeculativeConfig


@dataclass(frozen=True)
class CheckpointConfig:
    """Which model to load, and in what precision.

    ``dtype`` is ``"auto"`` (float32 on the CPU, the checkpoint's dtype on a GPU), ``"float32"``,
    ``"bfloat16"`` or ``"float16"``. ``quantization`` stores the decoder layers' weights as ``"int8"`` (per
    channel), ``"int4"`` (per group of ``quant_group_size`` inputs, with a zero point), ``"int4-awq"`` (int4
    after an activation-aware scale search on a calibration text, AWQ-style) or ``"fp8"`` (e4m3), and the head
    in int8; quantized as the model loads (:mod:`minserve.quant`). A GGUF file's Q4_0 / Q4_1 blocks are int4 in
    groups of 32 already: under ``"int4"`` they are kept as stored, unless another group size is asked for.
    ``"none"`` keeps ``dtype`` throughout. ``"auto"`` (the default) is int4 on a CPU serving a GGUF file stored
    in 4-bit blocks, with each layer's dense float twin kept for steps of many rows, and ``"none"`` elsewhere
    or when ``dtype`` is named (:mod:`minserve.quant.auto`).
    """

    model: str = option("minserve-tiny", "a name (see `minserve models`), checkpoint dir, .gguf file or hub id")
    dtype: str = option("auto", "weights and KV dtype", choices=("auto", "float32", "bfloat16", "float16"))
    quantization: str = option("auto", "weight format of the decoder layers and head; auto keeps a GGUF file's "
                               "4-bit blocks on a CPU (with float copies for large steps)",
                               choices=("auto", "none", "int8", "int4", "int4-awq", "fp8"))  # fmt: skip
    quant_group_size: int | None = option(
        None, "int4: inputs sharing a scale and zero point (32, 64, 128, 256; default 32 on GGUF Q4 blocks, else 64)"
    )


@dataclass(frozen=True)
class CacheConfig:
    """What the KV cache is made of and how much memory it gets; how it is counted (blocks, their size, shared
    prefixes) is the scheduler's group, since its block manager does the counting.

    Memory is allocated once: as many blocks as fit in ``kv_cache_memory_bytes``, by default 256 MiB on the
    CPU and 90% of free memory on a GPU (unless the scheduler's ``num_kv_blocks`` names a count).
    ``kv_cache_dtype`` ``"int8"`` or ``"fp8"`` stores keys and values in one byte, with per-head scales measured
    at start (:mod:`minserve.model.kv_quant`): the same memory holds twice the tokens of a 16-bit cache, four
    times a 32-bit one. Under ``preemption_mode="swap"``, ``swap_space_bytes`` of host memory hold the KV of
    preempted sequences (default: as many blocks as the device's cache).
    """

    kv_cache_dtype: str = option("auto", "KV cache elements: auto is dtype's; int8 or fp8 hold 2× (4×) the tokens",
                                 choices=("auto", "int8", "fp8"))  # fmt: skip
    kv_cache_memory_bytes: int | None = option(None, "KV memory budget in bytes")
    swap_space_bytes: int | None = option(None, "host memory for swapped KV (default: as much as the device's)")

    def __post_init__(self) -> None:
        check_whole(self, "kv_cache_memory_bytes", self.kv_cache_memory_bytes, optional=True)
        check_whole(self, "swap_space_bytes", self.swap_space_bytes, minimum=0, optional=True)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split across processes; one kind of parallelism at a time, for now.

    ``tensor_parallel_size`` splits it across that many processes (:mod:`minserve.engine.tensor_parallel`):
    each holds its share of the attention heads, KV heads and MLP, and the engine's process schedules and
    samples for all. gloo carries the collectives on the CPU, NCCL on GPUs (one per rank). A script that starts
    one needs Python's ``if __name__ == "__main__":`` guard, as any that spawns processes does.
    ``enable_expert_parallel`` (a mixture-of-experts model, with ``tensor_parallel_size > 1``) gives each rank
    whole experts, ``num_experts / tensor_parallel_size`` of them, instead of a slice of every expert; tokens
    travel to their experts' ranks by all-to-all (:mod:`minserve.parallel.expert_parallel`).
    ``pipeline_parallel_size`` splits the model's layers across that many processes instead, one stage each
    (:mod:`minserve.engine.pipeline_parallel`); each step's batch is split into ``num_micro_batches`` (by
    default one per stage) so that the stages work at once. Decode steps run eager (no CUDA graphs).
    """

    tensor_parallel_size: int = option(1, "processes to split the model across (heads and MLP), over torch.distributed")
    enable_expert_parallel: bool = option(False, "MoE: each rank holds whole experts (tokens sent by all-to-all) "
                                          "instead of a slice of every expert")  # fmt: skip
    pipeline_parallel_size: int = option(1, "processes to split the model's layers across (stages), over "
                                         "torch.distributed")  # fmt: skip
    num_micro_batches: int | None = option(None, "pipeline parallelism: micro-batches a step's batch is split "
                                           "into (default: one per stage)")  # fmt: skip

    def __post_init__(self) -> None:
        check_whole(self, "tensor_parallel_size", self.tensor_parallel_size)
        check_whole(self, "pipeline_parallel_size", self.pipeline_parallel_size)
        check_whole(self, "num_micro_batches", self.num_micro_batches, optional=True)
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError(
                "tensor_parallel_size and pipeline_parallel_size cannot both be > 1 yet: split the model one way "
                "(set the other to 1)"
            )
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "enable_expert_parallel splits the experts across the tensor-parallel ranks: set "
                "tensor_parallel_size > 1 (one process holds every expert anyway)"
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

    @property
    def split(self) -> str | None:
        """The setting that splits the model (``"tensor_parallel_size"`` or ``"pipeline_parallel_size"``), if any."""
        if self.tensor_parallel_size > 1:
            return "tensor_parallel_size"
        return "pipeline_parallel_size" if self.pipeline_parallel_size > 1 else None


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs and how its steps are executed.

    ``backend`` computes norms, rotary, activations and attention with ``"torch"`` or minserve's ``"triton"``
    kernels; ``"auto"`` is Triton on a CUDA GPU, torch elsewhere. ``enable_cuda_graphs`` records decode steps
    as CUDA graphs (on a GPU with the Triton backend); turn it off to debug, as vLLM's ``--enforce-eager`` does.

    ``compile_model`` runs decode steps through the model's forward compiled by ``torch.compile`` (the torch
    backend only; :mod:`minserve.engine.compilation`). It compiles when the engine is built: on a small CPU
    about 18 s for minserve-tiny, 30–50 s for a 30-layer model once inductor's cache is warm, minutes the first
    time. Where it cannot compile, building the engine fails, saying why. Left unset (``None``), the command
    decides: ``LLM`` runs eagerly, since a script rarely earns back the compile, and ``minserve serve`` compiles
    where its decode steps are bound by dispatch rather than by the weights' bytes: a CPU serving 4-bit or
    8-bit codes (:func:`~minserve.engine.compilation.serving_compiles`).

    ``num_threads`` sets torch's CPU threads for the process the engine runs in (default: torch's choice, one
    per core). On a small CPU shared with other busy processes (an HTTP front end, a load tester), fewer threads
    than cores keeps the forward pass from waiting on a thread whose core is taken.
    """

    device: str = option("auto", "cpu, cuda, cuda:1 …; auto is cuda when available")
    backend: str = option("auto", "kernels: auto is triton on CUDA, else torch", choices=("auto", "torch", "triton"))
    enable_cuda_graphs: bool = option(True, "decode steps as CUDA graphs on a GPU (off: eager)")
    compile_model: bool | None = option(None, "decode steps through torch.compile (torch backend; compiles at "
                                        "start); unset: serve compiles a CPU's 4- or 8-bit codes, LLM stays eager",
                                        flag="compile")  # fmt: skip
    num_threads: int | None = option(None, "torch CPU threads of the engine", flag="threads")

    def __post_init__(self) -> None:
        check_whole(self, "num_threads", self.num_threads, optional=True)


def _engine_scheduler() -> SchedulerConfig:
    """An engine's scheduler group: its KV block count is what fits in memory, worked out when it starts."""
    return SchedulerConfig(num_kv_blocks=None)


# The groups whose settings LLM(...) and the command line take flat, by the group's field in EngineConfig.
GROUPS: dict[str, type] = {
    "checkpoint": CheckpointConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "device": DeviceConfig,
}
# Settings of a group that the engine works out itself, which no user sets: the host blocks come from
# swap_space_bytes.
SIZED_BY_THE_ENGINE = frozenset({"num_cpu_blocks"})
SPECULATIVE_OPTION = "speculative_config"  # vLLM's name for the speculative group, given as a dict


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from, in groups: ``checkpoint``, ``cache``, ``scheduler``, ``parallel``,
    ``device``, and ``speculative`` (:class:`~minserve.config.speculative.SpeculativeConfig`, vLLM's dict
    shape; ``None`` leaves speculative decoding off). ``enable_tracing`` records each request's trace events.

    Build it from the flat settings users give with :meth:`from_options`; read a setting from its group
    (``config.scheduler.block_size``).
    """

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=_engine_scheduler)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeConfig | None = None
    enable_tracing: bool = option(True, "record per-request trace events")

    def __post_init__(self) -> None:
        if self.scheduler.num_cpu_blocks is not None:
            raise ValueError("the engine sizes its host blocks from cache.swap_space_bytes: leave num_cpu_blocks unset")
        split = self.parallel.split
        if split and (self.device.compile_model or self.speculative is not None):
            raise ValueError(
                f"{split} > 1 runs eager decode steps without speculative decoding for now: "
                f"drop compile_model and speculative_config, or use {split}=1"
            )

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """The configuration from the flat settings ``LLM(...)`` and the command line take (``model=…``,
        ``max_num_seqs=…``, ``speculative_config={...}``): each sorted into its group, the rest left at their
        defaults. An unknown name is an error that lists the known ones."""
        known, owners = cls.options(), _owners()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unknown engine setting(s) {unknown}; the settings are {sorted(known)}")
        defaults = cls()
        groups = {
            group: replace(getattr(defaults, group), **{k: v for k, v in options.items() if owners.get(k) == group})
            for group in GROUPS
        }
        tracing = options.get("enable_tracing", defaults.enable_tracing)
        return cls(**groups, speculative=_speculative(options.get(SPECULATIVE_OPTION)), enable_tracing=tracing)

    @classmethod
    def options(cls) -> dict[str, Option]:
        """Every setting :meth:`from_options` takes, with its default here (an engine's KV block count is
        ``None``: what fits), for :mod:`minserve.flags`."""
        defaults = cls()
        table = {
            f.name: Option(f.name, str(f.type), getattr(getattr(defaults, group), f.name), f.metadata)
            for group, group_cls in GROUPS.items()
            for f in fields(group_cls)
            if f.name not in SIZED_BY_THE_ENGINE
        }
        table[SPECULATIVE_OPTION] = Option(
            SPECULATIVE_OPTION, "Mapping[str, Any] | None", None,
            {"help": 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 3}'},
        )  # fmt: skip
        own = {f.name: f for f in fields(cls)}["enable_tracing"]
        table["enable_tracing"] = Option("enable_tracing", str(own.type), own.default, own.metadata)
        return table


def _owners() -> dict[str, str]:
    """Each flat setting's group."""
    return {
        f.name: group
        for group, group_cls in GROUPS.items()
        for f in fields(group_cls)
        if f.name not in SIZED_BY_THE_ENGINE
    }


def _speculative(given: Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """``speculative_config`` as a checked :class:`SpeculativeConfig` (``None``: no speculation)."""
    if given is None or isinstance(given, SpeculativeConfig):
        return given
    if not isinstance(given, Mapping):
        raise ValueError(f"speculative_config must be a dict or a SpeculativeConfig, got {given!r}")
    return SpeculativeConfig.from_dict(given)
