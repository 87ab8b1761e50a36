"""Run the server: load the model, build the app, hand it to uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from minserve.config import EngineConfig, ServerConfig
from minserve.engine.admission import make_admission
from minserve.engine.async_engine import AsyncLLMEngine
from minserve.serve.api import create_app
from minserve.serve.degrade import make_degrader


def serve(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM), then drain running requests and stop."""
    configure_logging(log_level)
    make_admission(server_config)  # a mistaken policy or degraded mode fails now, before the model loads
    make_degrader(server_config, lambda enabled: None)
    engine = AsyncLLMEngine(engine_config)
    app = create_app(engine, model_name=engine_config.model, config=server_config)
    if server_config.host not in ("127.0.0.1", "localhost", "::1") and not server_config.api_key:
        print(f"warning: serving on {server_config.host} without --api-key: anyone who can reach it can use it")
    uvicorn.run(app, host=server_config.host, port=server_config.port, log_level=log_level)


def configure_logging(level: str) -> None:
    """minserve's own log lines (a failed request's traceback, a restarted engine core) beside uvicorn's."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("minserve")
    logger.addHandler(handler)
    logger.setLevel(level.upper())
