"""Run the server: claim the address, load the model, build the app, hand it to uvicorn.

The address is claimed first: a port out of range, a host that does not resolve or a port already in use is
a one-line error (exit code 2) in a second, not after the model has loaded.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from minserve.admission import make_admission
from minserve.config import EngineConfig, ServerConfig
from minserve.engine.async_engine import AsyncLLMEngine
from minserve.serve.api import create_app
from minserve.serve.connections import OncePerMinute, protocol_class
from minserve.serve.degrade import make_degrader
from minserve.serve.info import startup_line
from minserve.serve.lifetime import DrainingServer

GRACEFUL_CLOSE_S = 2.0  # after the drain, how long uvicorn waits for connections to finish their last bytes
LISTEN_BACKLOG = 2048  # pending connections the kernel queues for accept

logger = logging.getLogger("minserve.serve")


def serve(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM), then drain running requests and stop. An engine config
    that leaves ``compile_model`` unset compiles where it pays
    (:func:`~minserve.engine.compilation.serving_compiles`)."""
    configure_logging(log_level)
    make_admission(server_config)  # a mistaken policy or degraded mode fails now, before the model loads
    make_degrader(server_config, lambda enabled: None)
    listener = listen(server_config.host, server_config.port)
    if engine_config.device.compile_model is None:  # neither --compile nor --no-compile: where it pays
        from minserve.engine.compilation import serving_compiles

        compiles, why = serving_compiles(engine_config)
        logger.info("decode steps %s (--compile or --no-compile to choose)", why)
        device = dataclasses.replace(engine_config.device, compile_model=compiles)
        engine_config = dataclasses.replace(engine_config, device=device)
    engine = AsyncLLMEngine(engine_config)
    app = create_app(engine, model_name=engine_config.checkpoint.model, config=server_config)
    if server_config.host not in ("127.0.0.1", "localhost", "::1") and not server_config.api_key:
        print(f"warning: serving on {server_config.host} without --api-key: anyone who can reach it can use it")
    host, port = listener.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    server = uvicorn_server(app, lambda: logger.info(startup_line(app.state.info, url)), log_level=log_level)
    server.run(sockets=[listener])


def uvicorn_server(app: FastAPI, on_ready: Callable[[], None] | None = None, **options) -> DrainingServer:
    """uvicorn for a minserve app: its connection ledger's HTTP protocol, its drain on SIGTERM, and a short
    graceful close (the app has drained before uvicorn is told to stop). ``options``: uvicorn's."""
    config = uvicorn.Config(
        app,
        http=protocol_class(app.state.connections),
        timeout_graceful_shutdown=GRACEFUL_CLOSE_S,
        backlog=LISTEN_BACKLOG,
        **options,
    )
    return DrainingServer(config, app.state.lifetime, on_ready)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; ``ValueError`` with one readable line if it cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, OverflowError) as error:
        raise ValueError(f"cannot serve on {host}:{port}: {error}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot serve on {host}:{port}: {error.strerror or error}") from None
    return sock


def configure_logging(level: str) -> None:
    """minserve's own log lines (a failed request's traceback, a restarted engine core) beside uvicorn's."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("minserve")
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logging.getLogger("asyncio").addFilter(OncePerMinute())  # a failed accept, once a minute, not per accept
