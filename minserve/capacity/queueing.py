"""What a queue past its capacity does to latency, in the fluid approximation (chapters 09 and 10).

Requests arrive at a steady rate λ and the server finishes at most λ* of them a second. Below capacity
nobody waits for anyone; above it the backlog grows by (λ − λ*) every second, and a finite run never
reaches a steady state. Rates are requests per second, times in ms.
"""

from __future__ import annotations


def predicted_ttft_ms(
    offered_rps: float, capacity_rps: float, num_requests: int, base_ttft_ms: float, quantile: float = 0.5
) -> float:
    """TTFT at ``quantile`` of a finite run, from a fluid queue: below capacity, the unloaded TTFT; above, a wait.

    ``num_requests`` arrive at ``offered_rps`` and leave at most at ``capacity_rps``. Request ``k`` arrives at
    k / λ and cannot start before k / λ*, so it waits k · (1/λ* − 1/λ) when λ > λ*. The request at the
    ``quantile`` waits q·N times that gap: past the knee a finite run has no steady state, and its latency
    grows with the number of requests sent, not only with the rate.
    """
    backlog_s = max(0.0, 1 / capacity_rps - 1 / offered_rps) if offered_rps > 0 and capacity_rps > 0 else 0.0
    return base_ttft_ms + quantile * num_requests * backlog_s * 1e3
