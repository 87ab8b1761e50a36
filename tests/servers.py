"""A minserve server inside the test process, for tests that need to look at its engine while it serves."""

from __future__ import annotations

import threading
import time

import uvicorn

from minserve.config import EngineConfig, ServerConfig
from minserve.engine.async_engine import AsyncLLMEngine
from minserve.serve.api import create_app
from minserve.serve.launch import free_port

MODEL = "minserve-tiny"


class RunningServer:
    """uvicorn on a free loopback port, in a thread; stopped (and drained) by ``stop``.

    ``engine`` is the server's :class:`AsyncLLMEngine`, so a test can read its blocks and its trace.
    """

    def __init__(self, server_config: ServerConfig | None = None, model_path=None, **engine_options) -> None:
        """``model_path``: a checkpoint to serve under the name ``MODEL`` (default: the embedded model)."""
        self.engine = AsyncLLMEngine(EngineConfig(model=str(model_path or MODEL), **engine_options))
        app = create_app(self.engine, MODEL, server_config or ServerConfig())
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_until_idle(self, timeout_s: float = 10.0) -> None:
        """Until no request is in flight and every KV block is free (aborts land at the next step)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.engine.stats()
            if stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0 and not self.engine.num_in_flight:
                return
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
