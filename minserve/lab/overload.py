"""Chapter 09 on the real server: the simulator's admission policies as ``minserve serve`` flags, a server
started per policy, and the overload and retry-storm experiments of :mod:`minserve.bench.overload` run
against them.

The simulated sweep (:func:`minserve.capacity.experiments.overload_sweep`) and the served one take the same
policy objects: :func:`server_args` turns each into the flags that make the server build the same policy,
so the two sides of chapter 09's figure differ in the machine, not in the rule. Each experiment starts its
own servers (:class:`~minserve.serve.launch.ServerProcess`) and stops them when it ends, and samples the
server's resident memory while it runs. Times are seconds, rates requests per second, memory bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pandas as pd

from minserve import slo
from minserve.admission import AdmissionPolicy, DeadlineAware, QueueLength
from minserve.bench import overload
from minserve.bench.client import ClientConfig
from minserve.bench.workload import WorkloadSpec
from minserve.capacity.simulator import SchedulerConfig
from minserve.serve.launch import MemorySampler, ServerProcess

MEMORY_SAMPLE_S = 0.25  # how often the server's resident memory is read during a run
CAPACITY_TIMEOUT_S = 120.0  # the capacity run's per-request timeout: long enough never to cut one short


def server_args(policy: AdmissionPolicy | None) -> list[str]:
    """The ``minserve serve`` flags that build ``policy`` in the server: ``QueueLength(n)`` is
    ``--admission queue-length --max-waiting-requests n``; ``DeadlineAware(t, h)`` is ``--admission deadline
    --ttft-slo-ms 1000·t --admission-headroom h`` (behind the server's default queue-length limit, which a
    short queue never reaches). ``None``: no flags, the server's defaults."""
    if policy is None:
        return []
    if isinstance(policy, QueueLength):
        return ["--admission", "queue-length", "--max-waiting-requests", str(policy.max_waiting_requests)]
    if isinstance(policy, DeadlineAware):
        return ["--admission", "deadline", "--ttft-slo-ms", f"{policy.ttft_slo_s * 1e3:g}",
                "--admission-headroom", f"{policy.headroom:g}"]  # fmt: skip
    raise ValueError(f"{policy!r} has no command-line form; run it in-process with ServerConfig(admission=...)")


def engine_args(config: SchedulerConfig, threads: int = 1) -> list[str]:
    """The flags that give the server's engine the simulator's batch: slots, token budget and KV blocks, and
    ``threads`` torch threads (one: on a small shared CPU a second waits on a busy core)."""
    return [
        "--max-num-seqs", str(config.max_num_seqs), "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--num-kv-blocks", str(config.num_kv_blocks), "--threads", str(threads),
    ]  # fmt: skip


@contextmanager
def running_server(args: Sequence[str], model: str = "minserve-tiny") -> Iterator[ServerProcess]:
    """A ``minserve serve`` with ``args``, stopped when the ``with`` ends, whatever happened in it."""
    server = ServerProcess(list(args), model=model)
    try:
        yield server
    finally:
        server.stop()


@dataclass
class ServedOverload:
    """What :func:`overload_on_server` measured: the capacity (requests/s) the runs were scaled to, every
    run of every policy, and each policy's server memory samples (seconds, bytes)."""

    capacity_rps: float
    runs: list[overload.OverloadRun]
    memory: dict[str, list[tuple[float, int]]]

    def table(self) -> pd.DataFrame:
        """:func:`minserve.bench.overload.overload_table` of every run."""
        return overload.overload_table(self.runs)

    def memory_growth(self) -> dict[str, float]:
        """Per policy, the server's largest resident memory over its first sample (a ratio; 1: flat)."""
        return {policy: max(b for _, b in s) / s[0][1] for policy, s in self.memory.items() if s and s[0][1]}


def overload_on_server(
    policies: Mapping[str, AdmissionPolicy | None],
    config: SchedulerConfig,
    workload: WorkloadSpec,
    contract: slo.SLO,
    load_multiples: Sequence[float] = (1.0, 2.0, 3.0),
    duration_s: float = 4.0,
    timeout_s: float = 5.0,
    capacity_requests: int = 64,
    model: str = "minserve-tiny",
) -> ServedOverload:
    """Each policy on its own fresh server (:func:`server_args`, :func:`engine_args` of ``config``): the
    capacity measured once, on the first, with a closed loop of twice the batch
    (:func:`~minserve.bench.overload.measure_capacity`, ``capacity_requests`` requests); then on every
    server the same open-loop runs at ``load_multiples`` × that capacity, ``duration_s`` each, every
    request bounded by the client's ``timeout_s`` (:func:`~minserve.bench.overload.run_overload`)."""
    capacity, runs, memory = 0.0, [], {}
    for label, policy in policies.items():
        with running_server([*engine_args(config), *server_args(policy)], model) as server:
            client = ClientConfig(server.url, model, ignore_eos=True, timeout_s=timeout_s, send_deadline=True)
            if not capacity:  # with no timeout that matters: a closed loop's requests queue, and all must count
                patient = ClientConfig(server.url, model, ignore_eos=True, timeout_s=CAPACITY_TIMEOUT_S)
                capacity = overload.measure_capacity(patient, workload, 2 * config.max_num_seqs, capacity_requests)
            with MemorySampler({"server": server.pid}, MEMORY_SAMPLE_S) as sampler:
                runs += overload.run_overload(client, workload, capacity, load_multiples, duration_s, contract, label)
            memory[label] = sampler.samples["server"]
    return ServedOverload(capacity, runs, memory)


def retry_storm_on_server(
    strategies: Sequence[str],
    policy: AdmissionPolicy | None,
    config: SchedulerConfig,
    workload: WorkloadSpec,
    storm: overload.StormShape,
    timeout_s: float = 5.0,
    model: str = "minserve-tiny",
    **retry: Any,
) -> list[overload.StormRun]:
    """One server with ``policy``, and the same ``storm`` (its load in multiples of a capacity measured
    before, e.g. by :func:`overload_on_server`) once per strategy
    (:func:`~minserve.bench.overload.run_retry_storm`, each with its own salted prompts; ``retry``: the
    retrier's options, :func:`~minserve.bench.overload.make_retrier`)."""
    with running_server([*engine_args(config), *server_args(policy)], model) as server:
        client = ClientConfig(server.url, model, ignore_eos=True, timeout_s=timeout_s, send_deadline=True)
        return [overload.run_retry_storm(client, strategy, workload, storm, **retry) for strategy in strategies]


def users_load(storm: overload.StormShape) -> list[tuple[float, float]]:
    """The users' own request rate through ``storm`` (without retries), as (seconds, requests/s) at each
    change: calm, the spike, calm again, and the end."""
    calm, spike = storm.calm_multiple * storm.capacity_rps, storm.spike_multiple * storm.capacity_rps
    return [(0.0, calm), (storm.before_s, spike), (storm.spike_end_s, calm), (storm.spike_end_s + storm.after_s, calm)]
