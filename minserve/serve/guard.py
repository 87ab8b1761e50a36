"""What is checked before a request is parsed: its API key, and its body's size while the body is read.

A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` would pass
every chunk of every stream through an extra queue and task switch.

**The key** follows RFC 6750: ``Authorization: Bearer <token>``, the scheme case-insensitive and required.
A 401 names the scheme in ``WWW-Authenticate`` (with ``error="invalid_token"`` when a token was sent).

Two ``Authorization`` headers are refused (400) rather than one of them believed: which one a proxy or a
framework reads differs, and a bad key followed by a good one must not pass as the good one.

**The size** is enforced on the bytes as they arrive, not on the ``Content-Length`` header alone: a chunked
body has no such header, and a client may lie in it. Reading stops at the first byte past the limit, so an
oversized body costs the server at most ``max_body_bytes`` of memory and no tokenizing.

**The encoding**: a JSON body must be UTF-8 (RFC 8259). One that is not is refused here with the offending
byte named, rather than with the JSON parser's generic complaint.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minserve.config import ServerConfig

REALM = 'Bearer realm="minserve"'
OPEN_PATHS = ("/health",)  # a load balancer's health check needs no key


class RequestGuard:
    """Refuses, with ``refuse(status, message, param, code, headers)``, a request without the key or too large."""

    def __init__(self, app: ASGIApp, config: ServerConfig, refuse: Callable[..., Response]) -> None:
        self.app, self.config, self.refuse = app, config, refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        problem = self._auth_problem(scope["path"], scope["headers"]) or self._declared_size_problem(headers)
        if problem is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(receive)
            problem = self._too_large() if body is None else _encoding_problem(body)
            if problem is None:
                receive = _replay(body, receive)
        if problem is not None:
            await self.refuse(*problem)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _auth_problem(self, path: str, raw_headers: list[tuple[bytes, bytes]]) -> tuple | None:
        if not self.config.api_key or path in OPEN_PATHS:
            return None
        sent = [value for name, value in raw_headers if name.lower() == b"authorization"]
        if len(sent) > 1:
            return 400, f"{len(sent)} Authorization headers: send exactly one", None, "duplicate_header", None
        scheme, _, token = (sent[0] if sent else b"").decode("latin-1").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            message = "missing API key: send the header 'Authorization: Bearer <key>'"
            return 401, message, None, "invalid_api_key", {"WWW-Authenticate": REALM}
        if not secrets.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            challenge = f'{REALM}, error="invalid_token"'
            return 401, "invalid API key", None, "invalid_api_key", {"WWW-Authenticate": challenge}
        return None

    def _declared_size_problem(self, headers: dict[bytes, bytes]) -> tuple | None:
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.config.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> tuple:
        return 413, f"request body over {self.config.max_body_bytes} bytes", None, "body_too_large", None

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it passes the limit (the rest is never read)."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.config.max_body_bytes:
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


def _encoding_problem(body: bytes) -> tuple | None:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as error:
        message = f"the request body is not valid UTF-8 (byte 0x{body[error.start]:02x} at offset {error.start})"
        return 400, message, None, "invalid_encoding", None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then the connection's own messages (a
    disconnect, which a streaming response listens for)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
