"""Request ids: taken from a sane ``X-Request-ID`` header or generated, logged, and echoed back.

A pure ASGI middleware (no ``BaseHTTPMiddleware``, which buffers and breaks disconnect
detection) stores the id in a context variable for log lines and error bodies, logs the request
at INFO on the way in and out, and adds ``X-Request-ID`` to every response.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["RequestIdMiddleware", "current_request_id"]

logger = logging.getLogger(__name__)

_REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("tilewise_request_id", default="")
_SANE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_QUIET = {"/healthz", "/readyz", "/metrics"}


def current_request_id() -> str:
    """The id of the request being handled in this context (``""`` outside requests)."""
    return _REQUEST_ID.get()


class RequestIdMiddleware:
    """Assign, log and return a request id for every HTTP request.

    Args:
        app: the wrapped application.
        on_error: builds the response for an exception that escaped the app's own handlers
            (it is answered here, inside the request's context, instead of by Starlette's
            outermost error middleware, which would lose the request id).
    """

    def __init__(self, app: ASGIApp, on_error: Callable[[BaseException], Response] | None = None) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = ""
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                incoming = value.decode("latin-1")
                break
        request_id = incoming if _SANE.match(incoming) else uuid.uuid4().hex
        token = _REQUEST_ID.set(request_id)
        scope.setdefault("state", {})["request_id"] = request_id
        path = scope.get("path", "")
        quiet = path in _QUIET
        started = time.perf_counter()
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        log = logger.debug if quiet else logger.info
        log("request %s in: %s %s", request_id, scope.get("method"), path)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if status or self.on_error is None:
                raise
            await self.on_error(exc)(scope, receive, send_with_id)
        finally:
            log(
                "request %s out: %s %s -> %s in %.3fs",
                request_id,
                scope.get("method"),
                path,
                status or "no response",
                time.perf_counter() - started,
            )
            _REQUEST_ID.reset(token)
