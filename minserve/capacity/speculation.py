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

Where v comes from: a verification step runs B·(k+1) tokens through the weights, so on the roofline it
costs what a decode step of B·(k+1) tokens costs. :func:`stop_paying_batch` and
:func:`roofline_stop_paying_batch` turn that into the batch where speculation stops paying.
"""

from __future__ import annotations

from minserve.capacity.kv import ModelLike, kv_bytes_per_token, model_config
from minserve.capacity.roofline import (
    Hardware,
    Prediction,
    decode_flops,
    predict,
    predict_decode,
    weights_read_bytes,
)


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


def break_even_acceptance(num_speculative_tokens: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """The acceptance rate α above which speculation pays (speedup ≥ 1), by bisection (the speedup grows with
    α). At k = 1 it is exactly c + v − 1: (1 + α) / (c + v) ≥ 1. Returns 1.0 where even α = 1 does not pay."""
    k = num_speculative_tokens
    if predicted_speedup(1.0, k, draft_cost, verify_cost) < 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(50):  # 2⁻⁵⁰: far below any α one can measure
        middle = (low + high) / 2
        low, high = (low, middle) if predicted_speedup(middle, k, draft_cost, verify_cost) >= 1 else (middle, high)
    return high


# --- where speculation stops paying, from the roofline -------------------------------------------------------
#
# A verification step of B sequences runs B·(k+1) tokens through the weights: its FLOPs are a decode step's of
# B·(k+1) tokens, while it reads the weights once and each sequence's KV cache once (its k + 1 queries share
# the same keys). Below the critical batch B* (chapter 03: the ridge point × bytes per weight / 2) a step
# costs its weight read, whatever its tokens; past it, time grows in proportion to the tokens. So with the
# weights alone, v(B) = max(1, B(k+1)/B*) / max(1, B/B*), and speculation pays while E[tokens] ≥ k·c + v.


def stop_paying_batch(
    critical_batch: float, acceptance_rate: float, num_speculative_tokens: int, draft_cost: float = 0.0
) -> float:
    """The batch past which speculation loses, weights only (no KV reads): ``B* · (E − k·c) / (k + 1)``.

    Below B*/(k+1) the verification is free (v = 1); between there and B*, v = B(k+1)/B* and the speedup
    E / (k·c + v) falls to 1 at this batch. 0 where it never pays (E ≤ k·c + 1)."""
    k = num_speculative_tokens
    spare = expected_tokens_per_step(acceptance_rate, k) - k * draft_cost
    return critical_batch * spare / (k + 1) if spare > 1 else 0.0


def verify_prediction(
    model: ModelLike, batch: int, num_speculative_tokens: int, context_tokens: int, hw: Hardware
) -> Prediction:
    """Roofline of one verification step: ``batch`` sequences of ``context_tokens`` keys, k + 1 queries each.
    FLOPs of batch·(k+1) decode tokens; bytes of the weights once and each sequence's KV once."""
    config, tokens = model_config(model), batch * (num_speculative_tokens + 1)
    kv = batch * context_tokens * kv_bytes_per_token(config, hw.dtype)
    return predict(decode_flops(config, tokens, context_tokens), weights_read_bytes(config, hw.dtype, tokens) + kv, hw)


def roofline_verify_cost(
    model: ModelLike, batch: int, num_speculative_tokens: int, context_tokens: int, hw: Hardware
) -> float:
    """v on ``hw``'s roofline: a verification step's time over a plain decode step's, same batch and context."""
    plain = predict_decode(model, batch, context_tokens, hw, hw.dtype).time_s
    return verify_prediction(model, batch, num_speculative_tokens, context_tokens, hw).time_s / plain


def roofline_speedup(
    model: ModelLike,
    hw: Hardware,
    acceptance_rate: float,
    num_speculative_tokens: int,
    context_tokens: int,
    batch: int,
    draft_cost: float = 0.0,
) -> float:
    """The speedup the roofline allows at ``batch``: E[tokens per step] / (k·c + v) with v from
    :func:`roofline_verify_cost`. An engine's kernels reach neither roof exactly, so read it as a ceiling."""
    v = roofline_verify_cost(model, batch, num_speculative_tokens, context_tokens, hw)
    return predicted_speedup(acceptance_rate, num_speculative_tokens, draft_cost, v)


def roofline_stop_paying_batch(
    model: ModelLike,
    hw: Hardware,
    acceptance_rate: float,
    num_speculative_tokens: int,
    context_tokens: int,
    draft_cost: float = 0.0,
    max_batch: int = 1 << 16,
) -> int:
    """The largest batch (≤ ``max_batch``) at which the roofline says speculation still pays, KV reads
    included; ``max_batch`` where it pays at every batch tried, 0 where it never pays. Bisection: v grows
    with the batch."""

    def pays(batch: int) -> bool:
        k = num_speculative_tokens
        return roofline_speedup(model, hw, acceptance_rate, k, context_tokens, batch, draft_cost) >= 1

    if not pays(1):
        return 0
    if pays(max_batch):
        return max_batch
    low, high = 1, max_batch  # pays(low), not pays(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if pays(middle) else (low, middle)
    return low
