"""The scheduler's settings: how a step is batched, how the KV cache is counted, and who waits or yields.

One group, which the engine core takes as it is: the engine hands it over with the KV block counts that fit
in memory filled in, the simulator with the counts it is told. The names of the scheduling policies and the
preemption modes are the user's vocabulary, declared here; :mod:`minserve.engine.policies` and
:mod:`minserve.engine.preemption` implement one class per name (a test holds the two lists equal).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from minserve.config.options import check_whole, option

if TYPE_CHECKING:  # the engine's strategy objects, which a chapter's exercise may plug in instead of a name
    from minserve.engine.policies import Policy
    from minserve.engine.preemption import Preemption

SCHEDULING_POLICIES = ("fcfs", "priority", "spf", "static")
PREEMPTION_MODES = ("recompute", "swap")
# The KV blocks of a simulated engine told no count: what the engine allocates for minserve-tiny on a CPU
# (256 MiB of float32 KV).
SIMULATED_KV_BLOCKS = 4096


@dataclass(frozen=True)
class SchedulerConfig:
    """How the engine core batches, counts KV blocks and preempts: everything the engine and the simulator share.

    A step runs at most ``max_num_batched_tokens`` tokens of at most ``max_num_seqs`` sequences; with
    ``enable_chunked_prefill`` a long prompt is split across steps to stay within it, without it a prompt is
    prefilled whole in one step. ``scheduling_policy`` orders admission and preemption: ``"fcfs"``,
    ``"priority"``, ``"spf"`` (shortest prompt first, with aging) or ``"static"`` (static batching), or a
    :class:`~minserve.engine.policies.Policy` object (chapter 05's exercise plugs one in).
    ``preemption_mode`` is ``"recompute"`` or ``"swap"`` (KV copied to ``num_cpu_blocks`` host blocks; ``None``:
    as many as the device has), or a :class:`~minserve.engine.preemption.Preemption` object.

    The KV cache is counted in ``num_kv_blocks`` blocks of ``block_size`` tokens; with
    ``enable_prefix_caching`` prompts that share a prefix share its blocks. ``num_kv_blocks`` ``None`` means
    "as many as the cache's memory holds", which the engine works out when it starts (an engine's configuration
    leaves it so unless told); a simulator's configuration has a count, by default :data:`SIMULATED_KV_BLOCKS`.
    ``max_model_len`` caps the context (tokens: prompt and output) below the model's own; ``None``: the model's.
    """

    max_num_seqs: int = option(64, "sequences per step, at most")
    max_num_batched_tokens: int = option(1024, "tokens per step, at most")
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(SIMULATED_KV_BLOCKS, "KV blocks (default: what fits in the KV memory budget)")
    scheduling_policy: str | Policy = option("fcfs", "admission and preemption order", choices=SCHEDULING_POLICIES)
    enable_chunked_prefill: bool = option(True, "split long prompts across steps (off: each prefilled whole)")
    enable_prefix_caching: bool = option(True, "share the KV of prompts' common prefixes")
    max_model_len: int | None = option(None, "context limit in tokens, below the model's own")
    preemption_mode: str | Preemption = option("recompute", "when KV runs out", choices=PREEMPTION_MODES)
    num_cpu_blocks: int | None = option(None, "host blocks for swapped-out KV (default: as many as the device's)")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            check_whole(self, name, getattr(self, name))
        check_whole(self, "num_kv_blocks", self.num_kv_blocks, optional=True)
        check_whole(self, "num_cpu_blocks", self.num_cpu_blocks, minimum=0, optional=True)
        check_whole(self, "max_model_len", self.max_model_len, minimum=2, optional=True)
        _check_named(self.scheduling_policy, "scheduling_policy", SCHEDULING_POLICIES, "a Policy")
        _check_named(self.preemption_mode, "preemption_mode", PREEMPTION_MODES, "a Preemption")

    @property
    def sized(self) -> bool:
        """Whether the KV block count is known (an engine's configuration is, once the engine has started)."""
        return self.num_kv_blocks is not None

    @property
    def swaps(self) -> bool:
        """Whether preemption copies KV to host memory: a strategy object says so itself; of the names, swap does."""
        return getattr(self.preemption_mode, "uses_host_memory", self.preemption_mode == "swap")

    @property
    def host_blocks(self) -> int:
        """Host blocks the block manager gets: none unless swapping, by default as many as the device's."""
        if not self.swaps:
            return 0
        return self._blocks() if self.num_cpu_blocks is None else self.num_cpu_blocks

    @property
    def kv_capacity_tokens(self) -> int:
        return self._blocks() * self.block_size

    def _blocks(self) -> int:
        if self.num_kv_blocks is None:
            raise ValueError("this SchedulerConfig has no KV block count yet: the engine sizes it when it starts")
        return self.num_kv_blocks

    def replace(self, **changes: Any) -> SchedulerConfig:
        return replace(self, **changes)

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


def _check_named(value: object, name: str, names: tuple[str, ...], kind: str) -> None:
    """A name must be one of ``names``; an object (a strategy of the engine's) is checked where it is used."""
    if isinstance(value, str) and value not in names:
        raise ValueError(f"{name} must be one of {list(names)} or {kind}, got {value!r}")
