"""Prometheus metrics, named as vLLM names them (``vllm:…`` becomes ``minserve:…``), so dashboards carry over.

Counters and histograms are updated when a request finishes; the gauges (running, waiting, KV usage) are
read from the engine at scrape time, so they are never stale.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minserve.admission import QueueState
from minserve.engine.engine import EngineStats
from minserve.engine.outputs import RequestOutput
from minserve.serve.protocol import finish_reason

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_success = Counter(
            "minserve:request_success", "Finished requests by finish reason", ["finished_reason"], registry=r
        )
        self.requests_rejected = Counter(
            "minserve:requests_rejected", "Requests refused before the engine, by reason", ["reason"], registry=r
        )
        self.prompt_tokens = Counter("minserve:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("minserve:generation_tokens", "Tokens generated", registry=r)
        self.prefix_cache_queries = Counter("minserve:prefix_cache_queries", "Prompt tokens looked up", registry=r)
        self.prefix_cache_hits = Counter("minserve:prefix_cache_hits", "Prompt tokens found cached", registry=r)
        self.ttft = Histogram("minserve:time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram(
            "minserve:inter_token_latency_seconds", "Gaps between tokens", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.e2e = Histogram(
            "minserve:e2e_request_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.queue_time = Histogram(
            "minserve:request_queue_time_seconds", "Arrival to first step", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.running = Gauge("minserve:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("minserve:num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("minserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0–1)", registry=r)
        self.preemptions = Gauge("minserve:num_preemptions", "Preemptions since start", registry=r)
        # Speculative decoding (zero without it): vLLM's spec_decode counters, as totals since the core started,
        # and the two ratios a dashboard would compute from them.
        self.verify_steps = Gauge(
            "minserve:spec_decode_num_drafts", "Steps of a request that verified drafts", registry=r
        )
        self.acceptance_rate = Gauge(
            "minserve:spec_decode_acceptance_rate", "Draft tokens kept / draft tokens verified", registry=r
        )
        self.mean_accepted_length = Gauge(
            "minserve:spec_decode_mean_accepted_length", "Tokens per verifying step (kept drafts + 1)", registry=r
        )
        self.draft_tokens = Gauge("minserve:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Gauge(
            "minserve:spec_decode_num_accepted_tokens", "Draft tokens the model kept", registry=r
        )
        self.engine_restarts = Gauge(
            "minserve:engine_restarts", "Engine cores started after the previous one died", registry=r
        )
        # What admission control decides from (minserve's own, no vLLM name): read at scrape time.
        self.queued_prompt_tokens = Gauge(
            "minserve:queued_prompt_tokens", "Prompt tokens of requests with no first token yet", registry=r
        )
        self.prefill_rate = Gauge(
            "minserve:prefill_tokens_per_second", "Measured prefill rate, EWMA over recent steps", registry=r
        )
        self.decode_step = Gauge(
            "minserve:decode_step_seconds", "Measured decode step time, EWMA over recent steps", registry=r
        )
        self.degraded_mode = Gauge("minserve:degraded_mode", "1 while degraded modes are on, else 0", registry=r)

    def observe_load(self, queue: QueueState, degraded: bool) -> None:
        """The admission gauges, from the front end's view of the queue now."""
        self.queued_prompt_tokens.set(queue.queued_prompt_tokens)
        self.prefill_rate.set(queue.rates.prefill_tokens_per_s)
        self.decode_step.set(queue.rates.decode_step_s)
        self.degraded_mode.set(int(degraded))

    def observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        self.request_success.labels(finished_reason=finish_reason(output) or "unknown").inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(len(output.token_ids))
        self.prefix_cache_queries.inc(len(output.prompt_token_ids))
        self.prefix_cache_hits.inc(output.num_cached_tokens)
        if m.ttft_s is not None:
            self.ttft.observe(m.ttft_s)
        for gap in m.itl_s:
            self.itl.observe(gap)
        if m.e2e_s is not None:
            self.e2e.observe(m.e2e_s)
        if m.queue_s is not None:
            self.queue_time.observe(m.queue_s)

    def render(self, stats: EngineStats, engine_restarts: int = 0) -> bytes:
        """The text exposition format, with the gauges read from ``stats`` now."""
        self.engine_restarts.set(engine_restarts)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total)
        self.preemptions.set(stats.num_preemptions)
        self.draft_tokens.set(stats.num_draft_tokens)
        self.accepted_tokens.set(stats.num_accepted_tokens)
        self.verify_steps.set(stats.num_verify_steps)
        self.acceptance_rate.set(stats.acceptance_rate)
        self.mean_accepted_length.set(stats.mean_accepted_length)
        return generate_latest(self.registry)
