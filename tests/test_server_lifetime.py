"""Issue 37, items 1–3: a server that cannot be held hostage by connections, a stopped core, or a stuck drain.

Each test runs ``minserve serve`` in a process of its own on loopback, as a service manager would, and bounds
both what it does and how long it may take: generous for a loaded machine, but bounds.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx

from minserve.serve.launch import ServerProcess, engine_core_pid
from tests.servers import MODEL

FLOOD = 600  # silent connections, three times the server's limit below
MAX_CONNECTIONS = 200
IDLE_TIMEOUT_S = 2.0


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _health(server: ServerProcess, timeout_s: float = 10) -> httpx.Response:
    return httpx.get(server.url + "/health", timeout=timeout_s)


def _wait_until(check, timeout_s: float, every_s: float = 0.1) -> float:
    """Seconds until ``check()`` is true; AssertionError past ``timeout_s``."""
    start_s = time.monotonic()
    while time.monotonic() - start_s < timeout_s:
        if check():
            return time.monotonic() - start_s
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s} s")


def test_a_connection_flood_is_bounded_and_health_still_answers():
    args = ["--max-connections", str(MAX_CONNECTIONS), "--connection-idle-timeout-s", str(IDLE_TIMEOUT_S)]
    with ServerProcess(args) as server:
        base_fds = _open_fds(server.pid)
        flood = [socket.create_connection((server.host, server.port)) for _ in range(FLOOD)]
        try:
            start_s = time.monotonic()
            assert _health(server).status_code == 200  # the longest-idle connection made room for it
            assert time.monotonic() - start_s < 5
            _wait_until(lambda: _open_fds(server.pid) <= base_fds + MAX_CONNECTIONS + 5, 10)
            # A slow client: half a request line, then nothing. Closed at the idle timeout, as the silent ones.
            slow = socket.create_connection((server.host, server.port))
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            slow.settimeout(IDLE_TIMEOUT_S + 10)
            start_s = time.monotonic()
            assert slow.recv(1024) == b""
            assert time.monotonic() - start_s < IDLE_TIMEOUT_S + 5
            _wait_until(lambda: _open_fds(server.pid) <= base_fds + 5, IDLE_TIMEOUT_S + 10)
        finally:
            for connection in flood:
                connection.close()
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'minserve:http_connections_closed_total{reason="evicted"}' in metrics
        assert 'minserve:http_connections_closed_total{reason="idle"}' in metrics
        log = Path(server.log_path).read_text()
        assert len(log) < 5_000 and "Too many open files" not in log, log[-2000:]


def test_a_stopped_core_is_reported_and_deadlines_hold_whatever_it_does():
    with ServerProcess(["--stall-timeout-s", "1"]) as server:
        core = engine_core_pid(server.pid)
        assert core and _health(server).status_code == 200
        os.kill(core, signal.SIGSTOP)
        try:
            took_s = _wait_until(lambda: _health(server).status_code == 503, 10)
            assert took_s < 1 + 5  # the bound (1 s floor; a tiny model's steps are far shorter), plus margin
            assert _health(server).json()["status"] == "engine_stalled"
            assert "minserve:engine_stalled 1.0" in httpx.get(server.url + "/metrics", timeout=10).text
            refused = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "0"}, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_stalled"
        finally:
            os.kill(core, signal.SIGCONT)
        _wait_until(lambda: _health(server).status_code == 200, 15)  # the same core, resumed: no restart
        assert _health(server).json()["engine_restarts"] == 0


def test_a_stopped_core_cannot_hold_a_request_past_its_timeout_nor_the_server_past_its_drain():
    drain_s = 3.0
    server = ServerProcess(["--shutdown-drain-s", str(drain_s)])  # stall bound 30 s: requests still admitted
    try:
        core = engine_core_pid(server.pid)
        os.kill(core, signal.SIGSTOP)
        body = {"model": MODEL, "prompt": "0", "max_tokens": 64}
        start_s = time.monotonic()
        answer = httpx.post(server.url + "/v1/completions", json=body | {"timeout": 2}, timeout=30)
        took_s = time.monotonic() - start_s
        assert answer.status_code == 504 and answer.json()["error"]["code"] == "timeout"
        assert took_s < 2 + 3, took_s  # kept by the front end, not when the core resumes

        result = {}

        def stuck() -> None:
            result["answer"] = httpx.post(server.url + "/v1/completions", json=body, timeout=60)

        caller = threading.Thread(target=stuck)
        caller.start()
        time.sleep(0.5)  # the request is in the (stopped) core
        start_s = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        _wait_until(lambda: _health(server).json().get("status") == "draining", 5)
        assert _health(server).status_code == 503
        server.process.wait(drain_s + 10)
        took_s = time.monotonic() - start_s
        caller.join(10)
        assert took_s < drain_s + 5, took_s
        answer = result["answer"]
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down", answer.text
    finally:
        server.stop(grace_s=1)
