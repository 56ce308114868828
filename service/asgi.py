"""Small pure-ASGI middlewares around the app (no ``BaseHTTPMiddleware``: it buffers bodies and
hides client disconnects).

- :class:`HeadMiddleware`: ``HEAD`` is answered like ``GET`` without a body (FastAPI's routes list
  ``GET`` only, so ``HEAD`` was a 405), with the ``GET`` response's status and headers
  (``Content-Length`` included, as RFC 9110 allows).
- :class:`HeadSizeMiddleware`: a request line or headers longer than ``max_bytes`` get a JSON
  414 / 431. (``tilewise serve``'s protocol answers a head that arrives in pieces past the limit;
  a head that arrives whole is parsed, and is refused here.)
- :class:`DrainMiddleware`: while the server drains before it stops (``app.state.draining``),
  every response carries ``Connection: close``, so that a load balancer's keep-alive connections
  end after their current response and none is idle when the listener closes (a request written
  onto a connection the server is closing could not be retried by the balancer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["DrainMiddleware", "HeadMiddleware", "HeadSizeMiddleware"]


class HeadSizeMiddleware:
    """Refuse a request line over ``max_bytes`` (414 ``uri_too_long``) or headers over it (431
    ``headers_too_large``); ``respond(status, code, detail)`` builds the JSON error."""

    def __init__(self, app: ASGIApp, max_bytes: int, respond: Callable[[int, str, str], Response]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 1
            headers = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
            refusal = None
            if target > self.max_bytes:
                refusal = (414, "uri_too_long", f"the request target is longer than {self.max_bytes} bytes")
            elif headers > self.max_bytes:
                refusal = (
                    431,
                    "headers_too_large",
                    f"the request's headers are longer than {self.max_bytes} bytes",
                )
            if refusal is not None:
                response = self.respond(*refusal)
                response.headers["Connection"] = "close"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HeadMiddleware:
    """Run ``HEAD`` requests as ``GET`` and drop the body the app sends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # drop every chunk but the last, sent empty
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_headers_only)


class DrainMiddleware:
    """Add ``Connection: close`` to every response once ``state.draining`` is true.

    Args:
        app: the wrapped application.
        state: an object with a boolean ``draining`` attribute (the app's ``state``).
    """

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and getattr(self.state, "draining", False):
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_closing)
