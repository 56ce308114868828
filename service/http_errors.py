"""HTTP mapping of every exception, and the JSON error handlers (server side only).

Bodies are ``{"error": "<code>", "detail": "<what and why>", "request_id": "<id>"}``. Client
errors carry the exception's message; a 500 carries a generic detail and the traceback goes to
the log only. 503 answers carry ``Retry-After``.

| Exceptions                                                        | Status |
|-------------------------------------------------------------------|--------|
| ``BadParameterError``, ``EmptyBodyError``, ``tiling.GridError``,   | 400    |
|  FastAPI request validation                                       |        |
| ``AuthenticationError``                                           | 401    |
| ``UnknownModelError``, ``JobNotFoundError``                       | 404    |
| ``JobStateError``                                                 | 409    |
| ``PayloadTooLargeError``                                          | 413    |
| ``UnsupportedMediaTypeError``                                     | 415    |
| ``DecodeError``, ``UnusableInputError``, ``models.InputError``    | 422    |
| ``QueueFullError``, ``NotReadyError``, ``BackendUnavailableError``, | 503    |
|  ``DeviceOutOfMemoryError``                                       |        |
| anything else                                                     | 500    |
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from models import errors as model_errors
from service.errors import (
    AuthenticationError,
    NotReadyError,
    PayloadTooLargeError,
    QueueFullError,
    ServiceError,
)
from service.requestid import current_request_id
from tiling import errors as tiling_errors

__all__ = ["ErrorInfo", "classify", "error_response", "install_error_handlers"]

logger = logging.getLogger(__name__)

DEFAULT_RETRY_AFTER_S = 2

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "unprocessable",
    503: "unavailable",
}


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """How one exception is answered."""

    status: int
    code: str
    detail: str
    headers: dict[str, str] = field(default_factory=dict)


def classify(exc: BaseException, *, retry_after_s: int = DEFAULT_RETRY_AFTER_S) -> ErrorInfo:
    """The status, code, detail and headers for ``exc`` (see the module table)."""
    retry = {"Retry-After": str(retry_after_s)}
    if isinstance(exc, QueueFullError):
        return ErrorInfo(503, exc.code, str(exc), {"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, NotReadyError):
        return ErrorInfo(503, exc.code, str(exc), retry)
    if isinstance(exc, AuthenticationError):
        return ErrorInfo(401, exc.code, str(exc), {"WWW-Authenticate": "Bearer"})
    if isinstance(exc, PayloadTooLargeError):
        return ErrorInfo(413, exc.code, str(exc), {"Connection": "close"})
    if isinstance(exc, ServiceError):
        if type(exc) is ServiceError:
            return ErrorInfo(500, "internal_error", "internal error (see the server log)")
        return ErrorInfo(exc.status, exc.code, str(exc))
    if isinstance(exc, model_errors.UnknownModelError):
        return ErrorInfo(404, "unknown_model", str(exc))
    if isinstance(exc, model_errors.InputError):
        return ErrorInfo(422, "unusable_input", str(exc))
    if isinstance(exc, model_errors.DeviceOutOfMemoryError):
        return ErrorInfo(503, "device_out_of_memory", "the device ran out of memory; retry later", retry)
    if isinstance(exc, model_errors.BackendUnavailableError):
        return ErrorInfo(503, "backend_unavailable", str(exc), retry)
    if isinstance(exc, tiling_errors.GridError):
        return ErrorInfo(400, "bad_parameter", str(exc))
    if isinstance(exc, RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()
        )
        return ErrorInfo(400, "bad_parameter", problems or "invalid request")
    if isinstance(exc, StarletteHTTPException):
        headers = dict(exc.headers or {})
        return ErrorInfo(
            exc.status_code, _HTTP_CODES.get(exc.status_code, "http_error"), str(exc.detail), headers
        )
    return ErrorInfo(500, "internal_error", "internal error (see the server log)")


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
