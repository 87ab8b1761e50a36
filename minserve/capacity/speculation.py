"""What speculative decoding should buy, before measuring it.

With k drafted tokens a step, each accepted independently with probability α (the acceptance rate), a step
emits the accepted run plus one token from the target, on average

    E[tokens per step] = (1 − α^(k+1)) / (1 − α)          (k + 1 when α = 1)

(Leviathan et al. 2023). A step costs one target forward over k + 1 positions plus k draft forwards. Where the
target's forward is memory-bound, k + 1 positions cost about what one does, so with c the cost of one draft
forward relative to one target step, the speedup over plain decoding is

    speedup = E[tokens per step] / (k·c + 1).

Where it is not memory-bound (large batches, a CPU whose step grows with its tokens), the verification
step itself costs v > 1 plain steps, and the speedup is E[tokens per step] / (k·c + v): chapter 08 measures
v, and where it eats the gain.
"""

from __future__ import annotations


def expected_tokens_per_step(acceptance_rate: float, num_speculative_tokens: int) -> float:
    """Mean tokens one speculative step emits (1 … k + 1)."""
    alpha, k = acceptance_rate, num_speculative_tokens
    if not 0 <= alpha <= 1 or k < 0:
        raise ValueError(f"need 0 ≤ acceptance_rate ≤ 1 and k ≥ 0, got {alpha} and {k}")
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(
    acceptance_rate: float, num_speculative_tokens: int, draft_cost: float, verify_cost: float = 1.0
) -> float:
    """Speedup over plain decoding with a draft forward costing ``draft_cost`` plain steps (0 for n-gram) and
    the verification step ``verify_cost`` plain steps (1 where the forward is memory-bound)."""
    if draft_cost < 0 or verify_cost <= 0:
        raise ValueError(f"need draft_cost ≥ 0 and verify_cost > 0, got {draft_cost} and {verify_cost}")
    k = num_speculative_tokens
    return expected_tokens_per_step(acceptance_rate, k) / (k * draft_cost + verify_cost)
