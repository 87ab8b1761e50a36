"""Faults on the real server: the engine core killed mid-run, clients hanging up mid-stream, clients that stop reading.

    python benchmarks/faults.py                     # all three on minserve-tiny (~2 minutes)
    python benchmarks/faults.py --only disconnect

Each fault gets a fresh ``minserve serve`` in its own process:

* ``core``: ``--requests`` streams running, then the engine core process is killed (SIGKILL, as the OOM
  killer would). Measured: when ``/health`` first answers 503, how long until every in-flight stream has
  ended and how (an error event naming the failure, not a hang), how long until ``/health`` is 200 again
  with a new core, and whether a request after that is served.
* ``disconnect``: ``--requests`` streams, each client hanging up after 4 chunks. Measured from ``/metrics``
  (polled every 10 ms): the time from the last hang-up until no request runs and no KV block is in use, in
  seconds and in decode steps (the server's own ``decode_step_seconds``).
* ``slow``: ``--requests`` clients send a long streaming request and then read nothing for ``--stall-s``
  seconds (a raw socket, never read), against the same number of clients that read at once. Measured: the
  server's front-end memory (VmRSS) over each, sampled every 0.25 s: bounded, because a stream that cannot be
  sent merges its pending tokens instead of queueing them (:mod:`minserve.engine.async_engine`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overload import memory_mib, server_memory

from minserve.bench import server_metrics
from minserve.bench.arrivals import OpenLoop
from minserve.bench.client import ClientConfig, RequestResult
from minserve.bench.runner import run_once, run_sync
from minserve.bench.workload import LengthDist, WorkloadSpec, build_requests
from minserve.serve.launch import ServerProcess, engine_core_pid

MODEL = "minserve-tiny"


def in_background(requests, client: ClientConfig) -> tuple[threading.Thread, dict]:
    """Send ``requests`` all at once from a thread; the results land in the returned dict when it ends."""
    box: dict = {}

    def send() -> None:
        box["results"] = run_sync(run_once(requests, OpenLoop(float("inf")), client, progress=False)).results
        box["ended_s"] = time.perf_counter()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, box


def wait_for(condition, timeout_s: float, every_s: float = 0.01) -> float | None:
    """Poll ``condition()`` until true; the perf_counter time it first was, or None past ``timeout_s``."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if condition():
            return time.perf_counter()
        time.sleep(every_s)
    return None


def running(url: str) -> int:
    return int((server_metrics.scrape(url) or {}).get("num_requests_running", 0))


def health_status(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def restarts(url: str) -> int:
    """Engine cores the server has restarted, from ``/health`` (-1 while it is not healthy)."""
    try:
        response = httpx.get(url + "/health", timeout=2)
    except httpx.HTTPError:
        return -1
    return response.json().get("engine_restarts", -1) if response.status_code == 200 else -1


def how_ended(result: RequestResult) -> str:
    if result.status != "failed":
        return result.status
    detail = json.loads(result.error_message).get("code") if result.error == "server_error" else None
    return f"{result.error}:{detail}" if detail else result.error or "failed"


def core_killed(args: argparse.Namespace) -> dict:
    with ServerProcess(["--max-num-seqs", str(args.requests)]) as server:
        client = ClientConfig(server.url, MODEL, ignore_eos=True, timeout_s=120)
        spec = WorkloadSpec(args.requests, LengthDist("fixed", 16), LengthDist("fixed", 1024))
        thread, box = in_background(build_requests(spec), client)
        wait_for(lambda: running(server.url) == args.requests, 60)
        time.sleep(0.5)  # every stream has tokens on the wire
        old_core = engine_core_pid(server.pid)
        killed_s = time.perf_counter()
        os.kill(old_core, signal.SIGKILL)
        unhealthy_s = wait_for(lambda: health_status(server.url) == 503, 30)
        thread.join(120)
        healthy_s = wait_for(lambda: restarts(server.url) >= 1, 120)
        after = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "def", "max_tokens": 8},
                           timeout=60)  # fmt: skip
        results = box.get("results", [])
        messages = Counter(r.error_message for r in results if r.error_message)
        return {
            "in_flight": args.requests,
            "ended": dict(Counter(how_ended(r) for r in results)),
            "hung": args.requests - len(results),
            "error_message": messages.most_common(1)[0][0] if messages else None,
            "health_503_after_s": None if unhealthy_s is None else unhealthy_s - killed_s,
            "all_streams_ended_after_s": box["ended_s"] - killed_s if "ended_s" in box else None,
            "healthy_again_after_s": None if healthy_s is None else healthy_s - killed_s,
            "request_after_restart": after.status_code,
            "health": httpx.get(server.url + "/health", timeout=5).json(),
        }


def disconnect(args: argparse.Namespace) -> dict:
    with ServerProcess(["--max-num-seqs", str(args.requests)]) as server:
        client = ClientConfig(server.url, MODEL, ignore_eos=True, timeout_s=120)
        spec = WorkloadSpec(args.requests, LengthDist("fixed", 16), LengthDist("fixed", 1024), cancel_fraction=1.0)
        thread, box = in_background(build_requests(spec), client)
        thread.join(120)
        freed_s = wait_for(lambda: _idle(server_metrics.scrape(server.url) or {}), 30)
        metrics = server_metrics.scrape(server.url) or {}
        results = box.get("results", [])
        step_s = metrics.get("decode_step_seconds", float("nan"))
        freed_after_s = None if freed_s is None else freed_s - box["ended_s"]
        return {
            "streams": args.requests,
            "ended": dict(Counter(how_ended(r) for r in results)),
            "freed_after_last_hang_up_s": freed_after_s,
            "decode_step_s": step_s,
            "freed_after_steps": None if freed_after_s is None else freed_after_s / step_s,
            "aborted_on_server": server_metrics.finished_by_reason(metrics).get("abort", 0),
        }


def _idle(metrics: dict) -> bool:
    return metrics.get("num_requests_running", 1) == 0 and metrics.get("kv_cache_usage_perc", 1) == 0


def slow_readers(args: argparse.Namespace) -> dict:
    body = json.dumps({"model": MODEL, "prompt": "def fib(n):", "max_tokens": 1500, "stream": True,
                       "ignore_eos": True}).encode()  # fmt: skip
    memory = {}
    for mode in ("reading", "stalled"):
        with ServerProcess(["--max-num-seqs", str(args.requests)]) as server:
            host, port = server.url.removeprefix("http://").split(":")
            request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body  # fmt: skip
            with server_memory(server.pid, 0.25) as sampler:
                sockets = [_socket(host, int(port)) for _ in range(args.requests)]
                for sock in sockets:
                    sock.sendall(request)
                if mode == "stalled":
                    time.sleep(args.stall_s)  # read nothing: the server's send buffers fill
                received = sum(_drain(sock) for sock in sockets)
            memory[mode] = memory_mib(sampler)["front_end"] | {"bytes_received": received}
    return memory


def _socket(host: str, port: int) -> socket.socket:
    """A connection with a small receive buffer, so a reader that stops reading pushes back on the server
    soon (loopback's default buffers would hold a whole stream)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    return sock


def _drain(sock: socket.socket) -> int:
    """Read a response to its end (``Connection: close``: the server closes the socket after it); bytes read."""
    total = 0
    sock.settimeout(120)
    with sock:
        while chunk := sock.recv(65536):
            total += len(chunk)
    return total


FAULTS = {"core": core_killed, "disconnect": disconnect, "slow": slow_readers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(FAULTS), help="run one fault")
    parser.add_argument("--requests", type=int, default=8, help="streams in flight for each fault")
    parser.add_argument("--stall-s", type=float, default=15.0, help="slow readers: seconds without reading")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results = {}
    for name in [args.only] if args.only else list(FAULTS):
        results[name] = FAULTS[name](args)
        print(f"{name}: done", flush=True)
    print(f"\n`{' '.join(['python', *sys.argv])}`")
    print(f"{MODEL}; torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.machine()}\n")
    for name, found in results.items():
        print(f"**{name}**\n\n| measure | value |\n|---|---|")
        for key, value in found.items():
            shown = f"{value:.3g}" if isinstance(value, float) else json.dumps(value)
            print(f"| {key} | {shown} |")
        print()
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
