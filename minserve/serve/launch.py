"""``minserve serve`` as a child process: started on a free port, waited for, and always stopped.

The tour (``minserve demo``), chapter 10's notebook, the soak test and the server benchmark all need a real
server in its own process, so that the load tester measures it over HTTP as it would measure vLLM, and
the server's memory can be read on its own. This module starts one and makes sure it does not outlive its
owner: ``stop()`` asks it to drain and exit (SIGTERM, as a process manager would), and kills it after a
grace period; on Linux the child is also told to die with its parent, so a crashed notebook kernel leaves
no server behind.

    with ServerProcess(["--max-num-seqs", "32"]) as server:
        httpx.get(server.url + "/health")
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# Loading a model from disk (the embedded one takes a second or two), and compiling its decode steps where
# the server does (SmolLM2: ~30 s once inductor's cache is warm, three minutes or more the first time).
STARTUP_TIMEOUT_S = 600.0
STOP_GRACE_S = 30.0  # SIGTERM drains running requests; past this the server is killed


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def resident_bytes(pid: int) -> int:
    """A process's resident memory now, in bytes (Linux: /proc; 0 elsewhere, or when it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def engine_core_pid(server_pid: int) -> int:
    """The engine core of the server ``server_pid`` (Linux): its child started by multiprocessing's spawn, not
    the resource tracker beside it; 0 when there is none. A restarted core is the child of the thread that
    restarted it, so every thread's children are looked at."""
    for children in Path(f"/proc/{server_pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
    return 0


class MemorySampler:
    """Resident memory of named processes every ``every_s`` seconds, in a background thread while in a
    ``with``: ``samples[name]`` holds (seconds since the ``with`` began, bytes), a first sample at once.

        with MemorySampler({"front_end": server.pid}, every_s=0.5) as memory:
            ...  # load the server
        memory.summary()["front_end"]["max"]
    """

    def __init__(self, pids: dict[str, int], every_s: float = 0.5) -> None:
        self.pids, self.every_s = dict(pids), every_s
        self.samples: dict[str, list[tuple[float, int]]] = {name: [] for name in self.pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def _sample(self) -> None:
        while True:
            now = time.monotonic() - self._start
            for name, pid in self.pids.items():
                self.samples[name].append((now, resident_bytes(pid)))
            if self._stop.wait(self.every_s):
                return

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, dict[str, int]]:
        """Per process, its first, largest and last sample, in bytes."""
        return {
            name: {"first": s[0][1], "max": max(b for _, b in s), "last": s[-1][1]}
            for name, s in self.samples.items()
            if s
        }


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class ServerProcess:
    """One ``minserve serve`` in a child process. ``args`` are extra command-line options for it.

    ``url`` is the base URL (without ``/v1``); ``pid`` the child's process id; ``log_path`` the file the
    server's output goes to (read it when something fails).
    """

    def __init__(
        self,
        args: list[str] | tuple[str, ...] = (),
        model: str = "minserve-tiny",
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        env: dict[str, str] | None = None,
        wait: bool = True,
        own_process_group: bool = False,
    ) -> None:
        """``wait=False`` returns once the process is started; :meth:`wait_until_healthy` waits for it.
        ``own_process_group`` starts it in a session of its own, as a service manager does, so that a signal
        can be sent to all its processes (``os.killpg(server.pid, ...)``) without reaching this one."""
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.model = model
        self.log_path = Path(tempfile.mkstemp(prefix="minserve-serve-", suffix=".log")[1])
        command = [sys.executable, "-m", "minserve.cli", "serve", "--model", model]
        command += ["--host", host, "--port", str(self.port), "--log-level", "warning", *args]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                start_new_session=own_process_group,
            )
        atexit.register(self.stop)
        self.startup_timeout_s = startup_timeout_s
        if wait:
            self.wait_until_healthy()

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_until_healthy(self) -> None:
        """Until its ``/health`` answers 200; a server that exits or takes past its start-up timeout raises."""
        timeout_s = self.startup_timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"minserve serve exited with code {self.process.returncode}:\n{self.log_tail()}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"minserve serve did not become healthy in {timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, num_lines: int = 30) -> str:
        """The last lines the server printed."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def rss_bytes(self) -> int:
        """The server's resident memory now, in bytes (Linux: /proc; elsewhere 0)."""
        return resident_bytes(self.pid)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """Ask the server to drain and exit; kill it past ``grace_s``. Idempotent.

        Returns the exit code: −15 after a graceful drain, because uvicorn re-raises the SIGTERM it handled
        (so a process manager sees the signal it sent); −9 when it had to be killed.
        """
        atexit.unregister(self.stop)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class ServerThread:
    """An app served by uvicorn in a thread of this process, on a free loopback port: for tests that read the
    engine while it serves, or plug in an object a command line cannot carry (chapter 09's grader plugs in
    the learner's admission policy). ``stop`` asks uvicorn to exit, which runs the app's shutdown."""

    def __init__(self, app: Any, startup_timeout_s: float = 10.0) -> None:
        import uvicorn  # only for this in-process server; a child process imports its own

        from minserve.serve.server import uvicorn_server

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        options = {"host": "127.0.0.1", "port": self.port, "log_level": "warning"}
        # A minserve app brings its connection limits and its drain; another app (a router's) is served plainly.
        minserve_app = hasattr(app.state, "lifetime")
        self.server = uvicorn_server(app, **options) if minserve_app else uvicorn.Server(uvicorn.Config(app, **options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        """As SIGTERM does: drain (a minserve app, for its ``shutdown_drain_s`` at most), then exit."""
        lifetime = getattr(self.server, "lifetime", None)
        if lifetime is not None:
            lifetime.begin_drain()
        else:
            self.server.should_exit = True
        self.thread.join(30)


def start_servers(
    count: int, args: list[str] | tuple[str, ...] = (), model: str = "minserve-tiny"
) -> list[ServerProcess]:
    """``count`` servers, started side by side (each loads its model while the others do). If one fails to
    start, the others are stopped and its error is raised: a caller never holds half a fleet.

    All are started from the calling thread: the die-with-parent signal fires when the *thread* that
    started a child exits, so children started from a pool's worker threads would be killed with them.
    """
    servers = [ServerProcess(args, model, wait=False) for _ in range(count)]
    try:
        for server in servers:
            server.wait_until_healthy()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
