"""Chapter 09 exercise, reference solution (instructors: ``minserve grade ch09 --solutions``)."""

from __future__ import annotations

import math

from minserve.admission import AdmissionPolicy, QueueState, Refusal, RequestFacts

NEARLY_FULL_KV = 0.95


class SLOAdmission(AdmissionPolicy):
    """Refuse a request whose predicted TTFT is over ``headroom`` × its budget; Retry-After = the excess."""

    name = "slo-admission"

    def __init__(self, ttft_slo_s: float, headroom: float = 0.5) -> None:
        if not (isinstance(ttft_slo_s, (int, float)) and math.isfinite(ttft_slo_s) and ttft_slo_s > 0):
            raise ValueError(f"ttft_slo_s must be a positive number of seconds, got {ttft_slo_s!r}")
        if not (isinstance(headroom, (int, float)) and 0 < headroom <= 1):
            raise ValueError(f"headroom must be in (0, 1], got {headroom!r}")
        self.ttft_slo_s, self.headroom = ttft_slo_s, headroom

    def prefill_wait_s(self, queue: QueueState) -> float:
        return queue.queued_prompt_tokens / queue.rates.prefill_tokens_per_s

    def slot_wait_s(self, queue: QueueState) -> float:
        if queue.max_num_seqs is None or not queue.rates.finished_per_s:
            return 0.0
        free = 0 if queue.kv_usage >= NEARLY_FULL_KV else max(0, queue.max_num_seqs - queue.num_running)
        must_finish = queue.num_waiting + 1 - free
        return max(0, must_finish) / queue.rates.finished_per_s

    def predicted_ttft_s(self, request: RequestFacts, queue: QueueState) -> float:
        ahead_s = max(self.prefill_wait_s(queue), self.slot_wait_s(queue))  # the two waits overlap
        return ahead_s + request.prompt_tokens / queue.rates.prefill_tokens_per_s

    def budget_s(self, request: RequestFacts) -> float:
        own = request.timeout_s
        return self.headroom * (self.ttft_slo_s if own is None else min(self.ttft_slo_s, own))

    def decide(self, request: RequestFacts, queue: QueueState) -> Refusal | None:
        if queue.queued_prompt_tokens == 0 and self.slot_wait_s(queue) == 0:
            return None  # nothing ahead: waiting cannot help
        predicted_s, budget_s = self.predicted_ttft_s(request, queue), self.budget_s(request)
        if predicted_s <= budget_s:
            return None
        message = f"predicted time to first token {predicted_s:.2f} s is over the budget of {budget_s:.2f} s"
        return Refusal("ttft_slo", predicted_s - budget_s, message)
