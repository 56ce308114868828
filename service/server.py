"""How ``tilewise serve`` runs uvicorn: JSON answers to malformed requests, and a draining stop.

- :class:`JsonH11Protocol`: uvicorn's h11 protocol answers a request whose head does not parse
  with a plain-text 400 and closes the socket while the client is still sending, so a client
  that sends an 80 KB query or a 1 MB header sees a TCP reset. Here the answer is JSON like every
  other error: ``414 uri_too_long`` when the request line alone passes the head limit
  (``TILEWISE_MAX_HEADER_BYTES``, h11's ``max_incomplete_event_size``), ``431 headers_too_large``
  when the headers do, ``400 bad_request`` otherwise; then the socket is half-closed and what the
  client still sends is read and dropped for a moment (a lingering close), so the answer is not
  lost to a reset.
- Header timeout: uvicorn times out an idle keep-alive connection, but not a request whose head
  arrives slowly (headers at 1 byte/s held a bare ``tilewise serve`` connection for over 60 s).
  :class:`JsonH11Protocol` gives a request's line and headers ``header_timeout_s``
  (``TILEWISE_HEADER_TIMEOUT_S``, default 10) from the connection's start or the request's first
  byte; then it answers ``408 request_timeout`` (JSON) and closes. With uvicorn's
  ``limit_concurrency`` (``TILEWISE_MAX_CONNECTIONS``: requests beyond get 503) this bounds what
  slow-header clients can hold: at most that many connections, each for at most the timeout.
- :class:`DrainingServer`: on SIGTERM, ``/readyz`` fails first and every response closes its
  connection (``state.draining``), while requests are still served; after ``TILEWISE_DRAIN_S``
  seconds uvicorn stops as usual: it closes the listener (a balancer's next connection is refused,
  which it can always retry elsewhere), finishes the requests in flight, runs the lifespan's
  shutdown (temporary folders removed) and exits. A second signal, or SIGINT, stops at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["DrainingServer", "JsonH11Protocol", "protocol_with"]

logger = logging.getLogger(__name__)

#: After refusing a malformed head: how long, and how many bytes, to keep reading and dropping.
LINGER_S = 2.0
LINGER_BYTES = 4 * 2**20
_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
}


class JsonH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with JSON 400 / 414 / 431 answers and a lingering close."""

    _discarded = -1  # bytes dropped after a refusal; -1: not refused
    #: Seconds a request's line and headers may take (``None``: no bound, uvicorn's behaviour).
    header_timeout_s: float | None = None
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._discarded >= 0:
            self._discarded += len(data)
            if self._discarded > LINGER_BYTES:
                self.transport.close()
            return
        if self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # the first byte of a request: its head has the timeout from now
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_head_timer()  # the head is in

    def _arm_head_timer(self) -> None:
        if self.header_timeout_s is not None and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        detail = f"the request's line and headers did not arrive within {self.header_timeout_s:g} s"
        self._refuse(408, "request_timeout", detail, linger=False)

    def _refuse(self, status: int, code: str, detail: str, *, linger: bool = True) -> None:
        request_id = uuid.uuid4().hex
        body = json.dumps({"error": code, "detail": detail, "request_id": request_id}).encode()
        head = (
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\nx-request-id: %s\r\n\r\n"
            % (status, _REASONS[status], len(body), request_id.encode())
        )
        logger.info("request %s refused before parsing: %d %s", request_id, status, code)
        self.transport.write(head + body)
        if not linger:
            self.transport.close()
            return
        self._discarded = 0
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the answer, then sees the end
        self.loop.call_later(LINGER_S, self.transport.close)

    def send_400_response(self, msg: str) -> None:  # noqa: ARG002 - uvicorn's generic message
        buffered, _ = self.conn.trailing_data
        limit = self.config.h11_max_incomplete_event_size or 16 * 1024
        status, code, detail = 400, "bad_request", "the request's head is not valid HTTP/1.1"
        if len(buffered) > limit:
            line_end = buffered.find(b"\r\n")
            if line_end < 0 or line_end > limit:
                status, code = 414, "uri_too_long"
                detail = f"the request line is longer than {limit} bytes (a query that long is refused)"
            else:
                status, code = 431, "headers_too_large"
                detail = f"the request's headers are longer than {limit} bytes"
        self._refuse(status, code, detail)


def protocol_with(header_timeout_s: float | None) -> type[JsonH11Protocol]:
    """:class:`JsonH11Protocol` with a header timeout (uvicorn builds one per connection)."""
    return type("JsonH11Protocol", (JsonH11Protocol,), {"header_timeout_s": header_timeout_s})


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains for ``drain_s`` seconds on SIGTERM before it stops.

    Args:
        config: the uvicorn configuration.
        state: the app's ``state`` (its ``draining`` flag is set on SIGTERM).
        drain_s: seconds between SIGTERM and the listener closing.
    """

    def __init__(self, config: uvicorn.Config, state: Any, drain_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_s = drain_s
        self.drain_started: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain_started is None and not self.should_exit and self.drain_s > 0:
            self._captured_signals.append(sig)  # re-raised after the shutdown, as uvicorn does
            self.drain_started = time.monotonic()
            self.state.draining = True
            logger.info("SIGTERM: not ready; draining for %.1f s, then stopping", self.drain_s)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and time.monotonic() - self.drain_started >= self.drain_s:
            self.should_exit = True
        return await super().on_tick(counter)
