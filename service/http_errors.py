"""HTTP mapping of every exception (ONE table), and the JSON error handlers (server side only).

Bodies are ``{"error": "<code>", "detail": "<what and why>", "request_id": "<id>"}``. Client
errors carry the exception's message; a 500 carries a generic detail and the traceback goes to
the log only. 503 answers carry ``Retry-After``; 401 ``WWW-Authenticate``; 413 ``Connection: close``.

:data:`STATUS` maps exception classes to ``(status, code)``; an exception takes the entry of the
first class in its MRO that has one (so a subclass inherits its parent's status unless listed),
and anything unlisted is a 500.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from models import errors as model_errors
from service.dicomweb import DicomwebError, DicomwebNotFoundError
from service.errors import (
    AuthenticationError,
    BadHostError,
    BadParameterError,
    ClusterUnavailableError,
    CrossOriginError,
    DecodeError,
    DicomSeriesError,
    EmptyBodyError,
    ForbiddenError,
    IdempotencyKeyReusedError,
    InsufficientStorageError,
    JobNotFoundError,
    JobStateError,
    MemoryBudgetError,
    NotReadyError,
    OverBudgetError,
    PayloadTooLargeError,
    QueueFullError,
    ServiceError,
    UnsupportedMediaTypeError,
    UnusableInputError,
    UploadTimeoutError,
)
from service.requestid import current_request_id
from tiling import errors as tiling_errors

__all__ = [
    "STATUS",
    "ErrorInfo",
    "classify",
    "error_response",
    "install_error_handlers",
    "plain_error_response",
]

logger = logging.getLogger(__name__)

DEFAULT_RETRY_AFTER_S = 2

#: The one table: exception class -> (HTTP status, error code). The first class of an exception's
#: MRO found here decides; anything else is 500 ``internal_error`` (a generic detail).
STATUS: dict[type[BaseException], tuple[int, str]] = {
    BadParameterError: (400, "bad_parameter"),
    EmptyBodyError: (400, "empty_body"),
    model_errors.ParamError: (400, "bad_parameter"),
    tiling_errors.GridError: (400, "bad_parameter"),
    RequestValidationError: (400, "bad_parameter"),
    BadHostError: (400, "bad_host"),
    AuthenticationError: (401, "unauthorized"),
    ForbiddenError: (403, "forbidden"),
    CrossOriginError: (403, "cross_origin"),
    model_errors.UnknownModelError: (404, "unknown_model"),
    JobNotFoundError: (404, "unknown_job"),
    UploadTimeoutError: (408, "upload_timeout"),
    PayloadTooLargeError: (413, "payload_too_large"),
    MemoryBudgetError: (413, "over_budget"),
    JobStateError: (409, "job_not_done"),
    IdempotencyKeyReusedError: (409, "idempotency_key_reused"),
    UnsupportedMediaTypeError: (415, "unsupported_media_type"),
    DecodeError: (422, "decode_error"),
    UnusableInputError: (422, "unusable_input"),
    DicomSeriesError: (422, "dicom_series_invalid"),
    # a run that cannot be spread over the Dask cluster as asked (tile-dependent network, no shared out)
    tiling_errors.DistributedError: (422, "not_distributable"),
    model_errors.InputError: (422, "unusable_input"),
    OverBudgetError: (422, "over_budget"),
    DicomwebNotFoundError: (404, "dicomweb_not_found"),
    DicomwebError: (502, "dicomweb_failed"),
    QueueFullError: (503, "queue_full"),
    NotReadyError: (503, "not_ready"),
    ClusterUnavailableError: (503, "cluster_unavailable"),
    tiling_errors.RunCancelledError: (503, "cancelled"),
    model_errors.BackendUnavailableError: (503, "backend_unavailable"),
    model_errors.ModelUnavailableError: (503, "model_unavailable"),
    model_errors.DeviceOutOfMemoryError: (503, "device_out_of_memory"),
    InsufficientStorageError: (507, "insufficient_storage"),
}
#: Details that would leak internals are replaced.
_GENERIC = {"device_out_of_memory": "the device ran out of memory; retry later"}

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    408: "request_timeout",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "unprocessable",
    503: "unavailable",
    507: "insufficient_storage",
}


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """How one exception is answered."""

    status: int
    code: str
    detail: str
    headers: dict[str, str] = field(default_factory=dict)


def classify(exc: BaseException, *, retry_after_s: int = DEFAULT_RETRY_AFTER_S) -> ErrorInfo:
    """The status, code, detail and headers for ``exc`` (see :data:`STATUS`)."""
    if isinstance(exc, StarletteHTTPException):  # routing: 404 unknown path, 405 method, ...
        given = dict(exc.headers or {})
        return ErrorInfo(
            exc.status_code,
            _HTTP_CODES.get(exc.status_code, "http_error"),
            _routing_detail(exc.status_code, str(exc.detail), given),
            given,
        )
    entry = next((STATUS[c] for c in type(exc).__mro__ if c in STATUS), None)
    if entry is None:
        return ErrorInfo(500, "internal_error", "internal error (see the server log)")
    status, code = entry
    detail = _GENERIC.get(code, str(exc))
    if isinstance(exc, RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()
        )
        detail = problems or "invalid request"
    headers: dict[str, str] = {}
    if status == 503:
        retry = exc.retry_after_s if isinstance(exc, QueueFullError) else retry_after_s
        headers["Retry-After"] = str(retry)
    elif status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif status in (408, 413):
        headers["Connection"] = "close"
    return ErrorInfo(status, code, detail, headers)


def _routing_detail(status: int, detail: str, headers: dict[str, str]) -> str:
    """Starlette's bare "Not Found" / "Method Not Allowed" of a routing miss, with what to do."""
    if status == 404 and detail == "Not Found":
        return "Not Found: no such path; the API's paths are listed at /docs (and /openapi.json)"
    allow = next((v for k, v in headers.items() if k.lower() == "allow"), None)
    if status == 405 and detail == "Method Not Allowed" and allow:
        return f"Method Not Allowed: this path answers {allow} (see /docs)"
    return detail


def error_response(exc: BaseException, *, retry_after_s: int = DEFAULT_RETRY_AFTER_S) -> JSONResponse:
    """The JSON response for ``exc``, logged with the request id."""
    info = classify(exc, retry_after_s=retry_after_s)
    request_id = current_request_id()
    if info.status >= 500 and info.status != 503:
        logger.error("request %s failed: %s", request_id, exc, exc_info=exc)
    else:
        logger.info("request %s answered %d %s: %s", request_id, info.status, info.code, info.detail)
    headers = dict(info.headers)
    if request_id:
        headers["X-Request-ID"] = request_id
    body = {"error": info.code, "detail": info.detail, "request_id": request_id}
    return JSONResponse(body, status_code=info.status, headers=headers)


def plain_error_response(status: int, code: str, detail: str) -> JSONResponse:
    """A JSON error for a refusal that no exception stands for (e.g. a request head too large)."""
    request_id = current_request_id()
    logger.info("request %s answered %d %s: %s", request_id, status, code, detail)
    headers = {"X-Request-ID": request_id} if request_id else {}
    return JSONResponse({"error": code, "detail": detail, "request_id": request_id}, status, headers=headers)


def install_error_handlers(app: FastAPI, *, retry_after_s: int = DEFAULT_RETRY_AFTER_S) -> None:
    """Register one JSON handler per exception root (Starlette finds them by MRO)."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:  # noqa: ARG001
        return error_response(exc, retry_after_s=retry_after_s)

    for root in (
        ServiceError,
        model_errors.ModelError,
        tiling_errors.TilingError,
        RequestValidationError,
        StarletteHTTPException,
        Exception,
    ):
        app.add_exception_handler(root, handle)
