"""The server's own account of a run: its Prometheus ``/metrics`` before and after, subtracted.

A load tester sees latency from outside; the server counts from inside (requests by finish reason, tokens,
prefix-cache hits, preemptions). Putting the two side by side is how a run is cross-checked: every request
the client saw finish should be one the server counted.

Servers prefix their metric names (``minserve:``, ``vllm:``, ``sglang:``); the prefix is dropped, so the same
keys serve for all of them. Counters are differenced; gauges keep their value after the run.
"""

from __future__ import annotations

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Prometheus sample name suffixes that belong to a counter or a histogram's running totals.
_CUMULATIVE_SUFFIXES = ("_total", "_count", "_sum")


def _unprefixed(name: str) -> str:
    return name.split(":", 1)[1] if ":" in name else name


def _sample_key(name: str, labels: dict[str, str]) -> str:
    """``request_success_total{finished_reason="stop"}`` as one flat key."""
    key = _unprefixed(name)
    if labels:
        key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return key


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition, keyed by unprefixed name and labels (buckets left out)."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") or sample.name.endswith("_created"):
                continue
            samples[_sample_key(sample.name, sample.labels)] = float(sample.value)
    return samples


def scrape(base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> dict[str, float] | None:
    """The server's metrics now, or ``None`` when it has no ``/metrics`` (or it cannot be read)."""
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return parse_metrics(response.text)
    except ValueError:  # not Prometheus text after all
        return None


def difference(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the run added: counters and histogram totals as after − before, other samples as after."""
    return {key: value - before.get(key, 0.0) if _is_cumulative(key) else value for key, value in sorted(after.items())}


def _is_cumulative(key: str) -> bool:
    return key.split("{", 1)[0].endswith(_CUMULATIVE_SUFFIXES)


def finished_by_reason(delta: dict[str, float]) -> dict[str, int]:
    """``{"stop": 40, "length": 55, "abort": 5}`` from the ``request_success_total`` counters of a delta.

    Other labels (vLLM adds ``model_name``) are summed over.
    """
    counts: dict[str, int] = {}
    for key, value in delta.items():
        match = _FINISHED.fullmatch(key)
        if match and value:
            counts[match["reason"]] = counts.get(match["reason"], 0) + round(value)
    return counts


_FINISHED = re.compile(r'request_success_total\{.*finished_reason="(?P<reason>[^"]*)".*\}')
