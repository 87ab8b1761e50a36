"""A minserve server inside the test process, for tests that need to look at its engine while it serves."""

from __future__ import annotations

import time

from minserve.config import EngineConfig, ServerConfig
from minserve.engine.async_engine import AsyncLLMEngine
from minserve.serve.api import create_app
from minserve.serve.launch import ServerThread

MODEL = "minserve-tiny"


class RunningServer:
    """uvicorn on a free loopback port, in a thread; stopped (and drained) by ``stop``.

    ``engine`` is the server's :class:`AsyncLLMEngine`, so a test can read its blocks and its trace.
    """

    def __init__(self, server_config: ServerConfig | None = None, model_path=None, **engine_options) -> None:
        """``model_path``: a checkpoint to serve under the name ``MODEL`` (default: the embedded model)."""
        self.engine = AsyncLLMEngine(EngineConfig.from_options(model=str(model_path or MODEL), **engine_options))
        self.serving = ServerThread(create_app(self.engine, MODEL, server_config or ServerConfig()))
        self.port, self.url = self.serving.port, self.serving.url

    def wait_until_idle(self, timeout_s: float = 10.0) -> None:
        """Until no request is in flight and every KV block is free (aborts land at the next step)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.engine.stats()
            if stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0 and not self.engine.num_in_flight:
                return
            time.sleep(0.02)

    def stop(self) -> None:
        self.serving.stop()
