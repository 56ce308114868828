"""Exceptions raised by :mod:`service`, each carrying its HTTP status and error code.

Hierarchy (each class also inherits the builtin it refines, so ``except ValueError`` keeps working)::

    ServiceError(Exception)                              500 internal_error
      BadParameterError(ServiceError, ValueError)        400 bad_parameter   (query / option value)
      EmptyBodyError(ServiceError, ValueError)           400 empty_body
      AuthenticationError(ServiceError)                  401 unauthorized    (missing or wrong API key)
      UnsupportedMediaTypeError(ServiceError)            415 unsupported_media_type
      DecodeError(ServiceError, ValueError)              422 decode_error    (corrupt / truncated file)
      UnusableInputError(ServiceError, ValueError)       422 unusable_input  (wrong dims, NaN-only data)
      PayloadTooLargeError(ServiceError)                 413 payload_too_large (bytes, voxels or pixels)
      JobNotFoundError(ServiceError, LookupError)        404 job_not_found
      JobStateError(ServiceError)                        409 job_state
      QueueFullError(ServiceError)                       503 queue_full (+ Retry-After)
      NotReadyError(ServiceError)                        503 not_ready (models loading / shutting down)

This module imports nothing but the standard library, so the batch client can use the codes
without pulling in FastAPI or torch. The mapping of *foreign* exceptions (``models.errors``,
``tiling.errors``) to statuses lives in :mod:`service.http_errors`, which only the server imports.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "BadParameterError",
    "DecodeError",
    "EmptyBodyError",
    "JobNotFoundError",
    "JobStateError",
    "NotReadyError",
    "PayloadTooLargeError",
    "QueueFullError",
    "ServiceError",
    "UnsupportedMediaTypeError",
    "UnusableInputError",
]


class ServiceError(Exception):
    """Root of every error raised by :mod:`service`.

    Attributes:
        status: the HTTP status a server answers with.
        code: the machine-readable ``error`` field of the JSON error body.
    """

    status: int = 500
    code: str = "internal_error"


class BadParameterError(ServiceError, ValueError):
    """A query parameter or command-line option with an invalid value (names the parameter)."""

    status = 400
    code = "bad_parameter"


class EmptyBodyError(ServiceError, ValueError):
    """A request without a file (empty raw body, or multipart without the ``file`` field)."""

    status = 400
    code = "empty_body"


class AuthenticationError(ServiceError):
    """The API key is missing or wrong."""

    status = 401
    code = "unauthorized"


class UnsupportedMediaTypeError(ServiceError):
    """The content is none of the formats tilewise reads (detected by magic bytes)."""

    status = 415
    code = "unsupported_media_type"


class DecodeError(ServiceError, ValueError):
    """The format was recognized, but the file is corrupt or truncated."""

    status = 422
    code = "decode_error"


class UnusableInputError(ServiceError, ValueError):
    """A readable file that the model cannot use: dimensionality, channels, NaN-only data."""

    status = 422
    code = "unusable_input"


class PayloadTooLargeError(ServiceError):
    """The upload exceeds the byte limit, or the image the voxel / pixel limit."""

    status = 413
    code = "payload_too_large"


class JobNotFoundError(ServiceError, LookupError):
    """No job with this id (never created, or expired)."""

    status = 404
    code = "job_not_found"


class JobStateError(ServiceError):
    """The job is not in a state that allows this request (e.g. result before it finished)."""

    status = 409
    code = "job_state"


class QueueFullError(ServiceError):
    """The inference queue of the device is full; retry after ``retry_after_s`` seconds."""

    status = 503
    code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReadyError(ServiceError):
    """The models are not loaded yet, or the server is shutting down."""

    status = 503
    code = "not_ready"
