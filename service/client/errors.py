"""Exceptions raised by :mod:`service.client`; httpx's own are translated in :mod:`service.client.api`.

Hierarchy::

    ClientError(Exception)
      TransportFailure(ClientError, ConnectionError)   no answer: refused, reset, cut off, timed out
      ServerError(ClientError)                          an HTTP error answer ({"error", "detail"})
        UnknownModelError(ServerError, LookupError)     the server has no model of that name
      Interrupted(ClientError)                          the run was aborted (second Ctrl-C)
      JobFailedError(ClientError)                       a job ended failed or cancelled
      OutputDirError(ClientError, OSError)              OUTPUT_DIR cannot be created or written

``retryable`` tells the retry loop which failures are worth another attempt: every
:class:`TransportFailure`, and the statuses 429, 502, 503 and 504 (overload, a restarting
replica behind a load balancer, a gateway timeout).
"""

from __future__ import annotations

__all__ = [
    "RETRYABLE_STATUSES",
    "ClientError",
    "Interrupted",
    "JobFailedError",
    "OutputDirError",
    "ServerError",
    "TransportFailure",
    "UnknownModelError",
]

#: HTTP statuses retried with backoff (``Retry-After`` honoured when the server sends it).
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})


class ClientError(Exception):
    """Root of the batch client's errors.

    Attributes:
        attempts: how many requests were made before giving up (set by the retry loop).
    """

    retryable: bool = False
    attempts: int = 1


class TransportFailure(ClientError, ConnectionError):
    """The request got no complete answer: connection refused or reset, timeout, body cut off."""

    retryable = True


class ServerError(ClientError):
    """The server answered with an HTTP error status.

    Args:
        status: HTTP status code.
        code: the ``error`` field of the JSON error body (``"http_<status>"`` when there is none).
        detail: the ``detail`` field, or the start of a non-JSON body.
        retry_after_s: the ``Retry-After`` header in seconds, when the server sent one.
    """

    def __init__(self, status: int, code: str, detail: str, retry_after_s: float | None = None):
        super().__init__(f"HTTP {status} {code}: {detail}" if detail else f"HTTP {status} {code}")
        self.status = status
        self.code = code
        self.detail = detail
        self.retry_after_s = retry_after_s

    @property
    def retryable(self) -> bool:  # type: ignore[override]
        """Whether the status is one of :data:`RETRYABLE_STATUSES`."""
        return self.status in RETRYABLE_STATUSES


class UnknownModelError(ServerError, LookupError):
    """The server does not serve the requested model (the message lists the ones it has)."""


class Interrupted(ClientError):
    """The request was abandoned because the run is being aborted; nothing was written."""


class OutputDirError(ClientError, OSError):
    """OUTPUT_DIR cannot be created or written (read-only, full, no permission)."""


class JobFailedError(ClientError):
    """A job ended ``failed`` or ``cancelled`` (its error code and detail are the server's)."""

    def __init__(self, job_id: str, code: str, detail: str) -> None:
        super().__init__(f"job {job_id}: {code}: {detail}")
        self.job_id = job_id
        self.code = code
        self.detail = detail
