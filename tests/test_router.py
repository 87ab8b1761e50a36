"""The router in front of real `minserve serve` replicas: the openai client through it, each policy's choices,
and failures (a hung replica, a killed one, none left). The policies alone: test_routing.py."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable

import httpx
import pytest

from minserve.bench.server_metrics import scrape
from minserve.cli import _replica_serve_argv, build_parser, main
from minserve.serve.launch import ServerProcess, ServerThread, free_port, start_servers
from minserve.serve.router import REPLICA_HEADER, create_router_app
from minserve.serve.routing import RouterConfig

MODEL = "minserve-tiny"
REPLICA_ARGS = ["--threads", "1"]
# A prefix longer than the prefix-aware policy's key (256 characters), made unique per call below.
CODE = "import os\nimport sys\n\n\ndef read_config(path):\n    with open(path) as handle:\n"
CODE += "        return handle.read()\n\n"


@pytest.fixture(scope="module")
def replicas():
    servers = start_servers(2, REPLICA_ARGS, MODEL)
    yield servers
    for server in servers:
        server.stop()


class RunningRouter(ServerThread):
    """The router's app served in a thread of this process (:class:`ServerThread`); ``router`` is its state."""

    def __init__(self, urls: list[str], **config) -> None:
        app = create_router_app(urls, RouterConfig(**config))
        self.router = app.state.router
        super().__init__(app)
        _wait_for(lambda: self.server.started, "the router to start")

    def complete(self, prompt: str, max_tokens: int = 4, **fields) -> httpx.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
        return httpx.post(self.url + "/v1/completions", json=body, timeout=60)

    def replica(self, url: str):
        return next(replica for replica in self.router.replicas if replica.url == url)

    def metric(self, name: str, replica: str | None = None) -> float:
        key = name + (f'{{replica="{replica}"}}' if replica else "")
        return scrape(self.url)[key]

    def __enter__(self) -> RunningRouter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.02)


def _openai(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _four_ways(client) -> list[str]:
    """Greedy text of a completion and a chat, each streamed and not."""
    common = {"model": MODEL, "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    messages = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "A stack class."}]
    texts = [client.completions.create(prompt="def fib(n):", **common).choices[0].text]
    stream = client.completions.create(prompt="def fib(n):", stream=True, **common)
    texts.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    texts.append(client.chat.completions.create(messages=messages, **common).choices[0].message.content)
    stream = client.chat.completions.create(messages=messages, stream=True, **common)
    texts.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
    return texts


def test_the_openai_client_gets_through_the_router_what_a_replica_gives(replicas):
    direct = _four_ways(_openai(replicas[0].url))
    with RunningRouter([server.url for server in replicas]) as router:
        routed = _four_ways(_openai(router.url))
        assert _openai(router.url).models.list().data[0].id == MODEL
    assert routed == direct and all(direct)


def test_round_robin_alternates(replicas):
    urls = [server.url for server in replicas]
    before = [_finished(url) for url in urls]
    with RunningRouter(urls, policy="round-robin") as router:
        answered = [router.complete(f"x{i} = ").headers[REPLICA_HEADER] for i in range(6)]
    assert answered == [urls[i % 2] for i in range(6)]
    assert [_finished(url) - count for url, count in zip(urls, before)] == [3, 3], "the replicas' own count"


def _finished(url: str) -> float:
    metrics = scrape(url)
    return sum(value for key, value in metrics.items() if key.startswith("request_success_total"))


def test_least_outstanding_sends_to_the_idle_replica_while_the_other_streams(replicas):
    urls = [server.url for server in replicas]
    long = {"model": MODEL, "prompt": "class Parser:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with RunningRouter(urls, policy="least-outstanding") as router:
        with httpx.stream("POST", router.url + "/v1/completions", json=long, timeout=60) as stream:
            busy = stream.headers[REPLICA_HEADER]
            lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # it has begun
            assert router.replica(busy).in_flight == 1
            answered = [router.complete(f"y{i} = ").headers[REPLICA_HEADER] for i in range(4)]
            assert router.metric("requests_in_flight", busy) == 1
        assert answered == [url for url in urls if url != busy] * 4
        _wait_for(lambda: router.replica(busy).in_flight == 0, "the closed stream to be released")


def test_prefix_aware_keeps_a_prefix_on_one_replica_where_it_hits_the_cache(replicas):
    urls = [server.url for server in replicas]
    with RunningRouter(urls, policy="prefix-aware") as router:
        prefix = f"# {uuid.uuid4().hex}\n" + CODE * 3  # nothing cached anywhere starts like it
        before = {url: scrape(url) for url in urls}
        homes = {router.complete(prefix + f"def task_{i}(x):").headers[REPLICA_HEADER] for i in range(4)}
        assert len(homes) == 1
        (home,) = homes
        gained = {url: _cache_delta(before[url], scrape(url)) for url in urls}
        away = next(url for url in urls if url != home)
        assert gained[away] == (0, 0), "the other replica never saw the prefix"
        hits, queries = gained[home]
        assert hits >= 3 * 16, "the three requests after the first find the prefix's blocks cached"
        assert hits / queries > 0.5, "most of what the four prompts hold is the shared prefix"

        # Different prefixes spread over both replicas (all 16 on one: odds 2 in 65536), each staying put.
        salt = uuid.uuid4().hex
        first = [router.complete(f"# {salt} {i}\n" + CODE * 3).headers[REPLICA_HEADER] for i in range(16)]
        again = [router.complete(f"# {salt} {i}\n" + CODE * 3 + "pass").headers[REPLICA_HEADER] for i in range(16)]
        assert set(first) == set(urls) and again == first


def _cache_delta(before: dict, after: dict) -> tuple[float, float]:
    keys = ("prefix_cache_hits_total", "prefix_cache_queries_total")
    return tuple(after[key] - before[key] for key in keys)


def test_a_hung_replica_is_taken_out_and_comes_back(replicas):
    urls = [server.url for server in replicas]
    hung = replicas[1]
    config = {"health_interval_s": 0.1, "health_timeout_s": 0.3, "unhealthy_after": 2}
    with RunningRouter(urls, **config) as router:
        os.kill(hung.pid, signal.SIGSTOP)  # alive, listening, answering nothing
        try:
            _wait_for(lambda: not router.replica(hung.url).healthy, "the hung replica to be taken out")
            assert router.replica(hung.url).failed_checks >= 2
            assert router.metric("replica_healthy", hung.url) == 0
            health = httpx.get(router.url + "/health").json()
            assert health["status"] == "ok" and [r["healthy"] for r in health["replicas"]] == [True, False]
            answered = {router.complete(f"z{i} = ").headers[REPLICA_HEADER] for i in range(4)}
            assert answered == {urls[0]}
        finally:
            os.kill(hung.pid, signal.SIGCONT)
        _wait_for(lambda: router.replica(hung.url).healthy, "the replica to come back")
        answered = {router.complete(f"w{i} = ").headers[REPLICA_HEADER] for i in range(2)}
        assert answered == set(urls)
        assert router.metric("retries_total", hung.url) == 0


@pytest.fixture
def victim():
    server = ServerProcess(REPLICA_ARGS, MODEL)
    yield server
    server.stop()


def test_a_dead_replica_cuts_its_stream_and_its_next_request_is_retried_elsewhere(replicas, victim):
    survivor = replicas[0]
    # Health checks far apart: the router learns of the death from the traffic itself.
    with RunningRouter([victim.url, survivor.url], health_interval_s=60) as router:
        long = {"model": MODEL, "prompt": "class Parser:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", router.url + "/v1/completions", json=long, timeout=60) as stream:
            assert stream.headers[REPLICA_HEADER] == victim.url  # round robin's first
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # the client holds a token
            victim.process.kill()
            rest = [line for line in lines if line.startswith("data:")]
        assert rest and '"replica_failed"' in rest[-1] and "data: [DONE]" not in rest, "ends with an error, not resent"
        assert router.metric("stream_failures_total", victim.url) == 1
        assert router.metric("retries_total", victim.url) == 0

        direct = httpx.post(survivor.url + "/v1/completions", json=_greedy("x = "), timeout=60).json()
        answers = [httpx.post(router.url + "/v1/completions", json=_greedy("x = "), timeout=60) for _ in range(3)]
        assert [a.status_code for a in answers] == [200] * 3
        assert {a.headers[REPLICA_HEADER] for a in answers} == {survivor.url}
        assert [a.json()["choices"][0]["text"] for a in answers] == [direct["choices"][0]["text"]] * 3
        assert router.metric("retries_total", victim.url) == 1, "the one request sent to the dead replica"
        assert not router.replica(victim.url).healthy, "a refused connection takes it out at once"


def _greedy(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_with_no_healthy_replica_the_answer_is_503_with_retry_after():
    nowhere = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there
    with RunningRouter(nowhere, retry_after_s=7) as router:
        health = httpx.get(router.url + "/health")
        assert health.status_code == 503 and not any(r["healthy"] for r in health.json()["replicas"])
        for route in ("/v1/completions", "/v1/chat/completions"):
            answer = httpx.post(router.url + route, json=_greedy("x"), timeout=30)
            assert answer.status_code == 503 and answer.headers["Retry-After"] == "7"
            error = answer.json()["error"]
            assert error["code"] == "no_healthy_replica" and error["type"] == "service_unavailable"
        assert httpx.get(router.url + "/v1/models").status_code == 503
        assert router.metric("requests_unavailable_total") == 3


class StandIn(ServerThread):
    """A replica stand-in: a real HTTP server whose completions answer with ``status`` (a restarting
    replica's 503, a full queue's 429), counting the requests it got."""

    def __init__(self, status: int) -> None:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        app, self.requests = FastAPI(), 0

        @app.get("/health")
        def health():
            return {"status": "ok"}

        @app.post("/v1/completions")
        def completions():
            self.requests += 1
            return JSONResponse({"error": {"message": "busy", "type": "x", "param": None, "code": None}}, status)

        super().__init__(app)
        _wait_for(lambda: self.server.started, "the stand-in to start")


def test_a_503_is_retried_on_another_replica_and_a_429_is_not(replicas):
    restarting, full = StandIn(503), StandIn(429)
    try:
        with RunningRouter([restarting.url, replicas[0].url]) as router:
            answer = router.complete("x = ")
            assert answer.status_code == 200 and answer.headers[REPLICA_HEADER] == replicas[0].url
            assert restarting.requests == 1 and router.metric("retries_total", restarting.url) == 1
        with RunningRouter([full.url, replicas[0].url]) as router:
            answer = router.complete("x = ")
            assert answer.status_code == 429 and answer.headers[REPLICA_HEADER] == full.url, "backpressure is passed on"
            assert router.metric("retries_total", full.url) == 0
    finally:
        restarting.stop()
        full.stop()


def test_route_passes_its_model_and_engine_flags_to_the_replicas_it_starts():
    parser = build_parser()
    flags = ["--threads", "1", "--max-num-seqs", "8", "--no-prefix-caching", "--speculative-config",
             '{"method": "ngram", "num_speculative_tokens": 2}']  # fmt: skip
    args = parser.parse_args(["route", "--replicas", "2", "--policy", "prefix-aware", *flags])
    replica_args = parser.parse_args(["serve", *_replica_serve_argv(args)])
    for name in ("num_threads", "max_num_seqs", "enable_prefix_caching", "speculative_config"):
        assert getattr(replica_args, name) == getattr(args, name)
    assert (replica_args.num_threads, replica_args.enable_prefix_caching) == (1, False)
    with pytest.raises(ValueError, match="--replicas N"):
        _replica_serve_argv(parser.parse_args(["route", "--replica", "http://a:1", "--max-num-seqs", "8"]))
    assert main(["route"]) == 2  # no replica at all: an error saying what to give
    assert main(["route", "--replica", "127.0.0.1:8001"]) == 2  # not a URL
