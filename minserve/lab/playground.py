"""Chapter 05's scheduling playground: a widget whose whole callback is the plain function
:func:`playground_result` (a policy, a rate and a long-prompt share → a simulation's goodput and tails).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from minserve import slo
from minserve.capacity.experiments import (
    class_summary,
    mixed_workload,
)
from minserve.capacity.simulator import (
    SchedulerConfig,
    Simulator,
    StepCostModel,
)
from minserve.engine.policies import Policy, ShortestPromptFirst
from minserve.lab.theme import SLO_COLOR

if TYPE_CHECKING:
    pass


# --- the scheduling playground -----------------------------------------------------------------------------


def playground_policies(aging_tokens_per_step: float = 4.0) -> dict[str, str | Policy]:
    """The playground's choices: FCFS, static batching, shortest prompt first without and with aging."""
    return {
        "FCFS": "fcfs",
        "static batching": "static",
        "shortest prompt first, no aging": ShortestPromptFirst(aging_tokens_per_step=0.0),
        f"shortest prompt first, aging {aging_tokens_per_step:g}": ShortestPromptFirst(aging_tokens_per_step),
    }


@dataclass(frozen=True)
class Playground:
    """What the playground simulates besides its controls: the cost model, the engine's fixed knobs, the
    workload's shape and size, and the SLO goodput is measured against."""

    cost: StepCostModel
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_requests: int = 300
    workload: Mapping[str, Any] = field(default_factory=dict)  # mixed_workload's keyword arguments
    slo_target: slo.SLO = field(default_factory=lambda: slo.SLO(name="interactive", ttft_s=0.5, tpot_s=0.05))
    seed: int = 0


def playground_result(
    playground: Playground,
    policy: str | Policy,
    rate_rps: float,
    chunked_prefill: bool = True,
    num_kv_blocks: int | None = None,
) -> dict[str, Any]:
    """The playground's whole callback: simulate the playground's workload at ``rate_rps`` under ``policy``, with
    chunked prefill on or off and ``num_kv_blocks`` KV blocks (default: the config's).

    Keys: everything :meth:`SimResult.summary` gives under the playground's SLO (``goodput_rps``,
    ``attainment``, ``request_throughput_rps``, the ``ttft_ms`` and ``tpot_ms`` distributions, ``steps``,
    ``preemptions``…), the short and long requests' TTFT (:func:`class_summary`), ``max_step_tokens`` (the
    most tokens one step ran) and ``error`` (``""``, or why the simulation could not run, e.g. a request
    bigger than the whole KV cache).
    Invariants: ``goodput_rps ≤ request_throughput_rps``; the same arguments give the same numbers.
    """
    config = SchedulerConfig(
        **{
            **playground.config.__dict__,
            "scheduling_policy": policy,
            "enable_chunked_prefill": chunked_prefill,
            "num_kv_blocks": playground.config.num_kv_blocks if num_kv_blocks is None else num_kv_blocks,
        }
    )
    requests = mixed_workload(playground.num_requests, rate_rps, seed=playground.seed, **playground.workload)
    long_threshold = dict(playground.workload).get("long_prompt", (768, 1536))[0]
    try:
        result = Simulator(playground.cost, config).run(requests)
    except (ValueError, RuntimeError) as error:
        return {"error": str(error)}
    return {
        **result.summary(playground.slo_target),
        **class_summary(result, long_threshold),
        "max_step_tokens": max((s.features.num_tokens for s in result.steps), default=0),
        "error": "",
    }


def playground_html(result: Mapping[str, Any], slo_target: slo.SLO | None = None) -> str:
    """The playground's readout: a small HTML table of the simulated numbers."""
    if result.get("error"):
        return f"<p style='color:{SLO_COLOR}'>{result['error']}</p>"
    contract = ""
    if slo_target is not None:
        parts = [f"{k.upper()} ≤ {v * 1e3:g} ms" for k, v in slo_target.targets().items()]
        contract = " (" + ", ".join(parts) + ")"
    rows = [
        (f"goodput{contract}", f"{result['goodput_rps']:.2f} req/s ({result['attainment']['all']:.0%} of requests)"),
        ("throughput",
         f"{result['request_throughput_rps']:.2f} req/s, {result['output_throughput_tps']:,.0f} tokens/s"),
        ("TTFT p50 / p99", f"{result['ttft_ms']['p50']:,.0f} / {result['ttft_ms']['p99']:,.0f} ms"),
        ("short prompts: TTFT p50 / p99",
         f"{result['ttft_short_p50_ms']:,.0f} / {result['ttft_short_p99_ms']:,.0f} ms"),
        ("long prompts: TTFT p50 / longest",
         f"{result['ttft_long_p50_ms']:,.0f} / {result['ttft_long_max_ms']:,.0f} ms"),
        ("TPOT p50 / p99", f"{result['tpot_ms']['p50']:.1f} / {result['tpot_ms']['p99']:.1f} ms"),
        ("ITL p99", f"{result['itl_ms']['p99']:.1f} ms"),
        ("steps, most tokens in one", f"{result['steps']:,}, {result['max_step_tokens']:,}"),
        ("preemptions", f"{result['preemptions']:,}"),
        ("simulated", f"{result['virtual_s']:.1f} s in {result['wall_s']:.2f} s"),
    ]  # fmt: skip
    body = "".join(
        f"<tr><td style='padding:0 12px'>{k}</td><td style='text-align:right'>{v}</td></tr>" for k, v in rows
    )
    return f"<table>{body}</table>"


def scheduling_playground(
    playground: Playground,
    policies: Mapping[str, str | Policy] | None = None,
    rate_rps: float = 8.0,
    max_rate_rps: float = 20.0,
) -> widgets.VBox:
    """Policy, arrival rate, chunked prefill and KV blocks → the simulated TTFT, TPOT and goodput."""
    choices = dict(policies or playground_policies())
    policy = widgets.Dropdown(options=list(choices), value=next(iter(choices)), description="policy")
    rate = widgets.FloatSlider(
        value=rate_rps, min=0.5, max=max_rate_rps, step=0.5, description="rate req/s", continuous_update=False
    )
    chunked = widgets.Checkbox(value=playground.config.enable_chunked_prefill, description="chunked prefill")
    blocks = widgets.IntSlider(
        value=playground.config.num_kv_blocks,
        min=max(8, playground.config.num_kv_blocks // 32),
        max=playground.config.num_kv_blocks * 2,
        step=max(1, playground.config.num_kv_blocks // 64),
        description="KV blocks",
        continuous_update=False,
    )
    readout = widgets.HTML()
    controls = [policy, rate, chunked, blocks]

    def update(_change: object = None) -> None:
        result = playground_result(playground, choices[policy.value], rate.value, chunked.value, blocks.value)
        readout.value = playground_html(result, playground.slo_target)

    for control in controls:
        control.observe(update, names="value")
    update()
    return widgets.VBox([*controls, readout])
