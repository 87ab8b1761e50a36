"""What ``minserve plan`` prints: the roofline plan, the parallel layouts and the capacity envelope as text.

The arithmetic lives in :mod:`minserve.capacity.roofline`, :mod:`~minserve.capacity.parallel` and
:mod:`~minserve.capacity.envelope`; :mod:`minserve.capacity.cli` parses the flags, runs it and prints these.
Times are shown with three significant digits in s, ms, µs or ns; sizes and rates with an SI prefix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minserve.capacity import interconnect, parallel, roofline
from minserve.capacity.kv import dtype_bytes, kv_bytes_per_token
from minserve.capacity.memory import estimate_params, fit
from minserve.model.config import ModelConfig

if TYPE_CHECKING:
    from minserve.capacity.envelope import Envelope


def format_parallel_plan(
    name: str,
    config: ModelConfig,
    hw: roofline.Hardware,
    link: interconnect.Interconnect,
    dtype: str,
    plans: dict[int, list[parallel.LayoutPlan]],
) -> str:
    """The printed plan: the model, the GPU and the link, then one table per batch size, one row per layout."""
    params = estimate_params(config)
    gpus = next(iter(plans.values()))[0].layout.gpus
    lines = [
        f"{name}: {_si(params)} parameters, {_si(params * dtype_bytes(dtype))}B of {dtype} weights",
        f"{gpus} × {hw.name}: {_si(hw.peak_flops_per_s)}FLOP/s, {_si(hw.memory_bandwidth_bytes_per_s)}B/s, "
        f"{_si(hw.memory_bytes)}B each",
        f"{link.name}: {_si(link.bandwidth_bytes_per_s)}B/s per GPU each way, {_time(link.latency_s)} a message "
        f"({link.source})",
    ]
    for batch, rows in plans.items():
        context = rows[0].context_tokens
        lines += [
            "",
            f"batch {batch} per replica, context {context:,} tokens; times per decode step (= per output token)",
            f"{'layout':<13}{'fits':>5}{'weights/GPU':>13}{'KV tokens/GPU':>15}{'compute':>10}{'memory':>10}"
            f"{'comm':>10}{'bubble':>10}{'ms/token':>10}{'tok/s/replica':>15}{'tok/s total':>13}  dominant",
        ]
        for plan in rows:
            lines.append(
                f"{plan.layout.name:<13}{'yes' if plan.fits else 'NO':>5}{_si(plan.weights_bytes_per_gpu) + 'B':>13}"
                f"{plan.kv_tokens_per_gpu:>15,}{_time(plan.compute_s):>10}{_time(plan.memory_s):>10}"
                f"{_time(plan.communication_s):>10}{_time(plan.bubble_s):>10}{plan.step_s * 1e3:>10.2f}"
                f"{plan.tokens_per_s_per_replica:>15,.0f}{plan.tokens_per_s:>13,.0f}  {plan.dominant}"
            )
    lines.append(
        "\nLower bounds on time (upper bounds on tokens/s), except the collectives, whose ring model overstates "
        "small messages. fits = weights and every sequence's KV within 90% of each GPU's memory."
    )
    return "\n".join(lines)


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
    """``0.00267`` → ``"2.67 ms"``: three significant digits in s, ms, µs or ns; nothing at all is ``"0"``."""
    if seconds == 0:
        return "0"
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


def format_envelope(envelope: Envelope) -> str:
    """The printed envelope: :meth:`Envelope.header`, :meth:`Envelope.rows` as a table, and its notes."""
    rows = envelope.rows()
    width = {key: max(len(key), *(len(row[key]) for row in rows)) + 2 for key in ("quantity", "value")}
    lines = [*envelope.header(), "", f"{'quantity':<{width['quantity']}}{'value':<{width['value']}}how"]
    lines += [f"{r['quantity']:<{width['quantity']}}{r['value']:<{width['value']}}{r['how']}" for r in rows]
    lines += [f"note: {note}" for note in envelope.notes]
    return "\n".join(lines)
