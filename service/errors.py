"""Exceptions raised by :mod:`service`.

Hierarchy (each class also inherits the builtin it refines, so ``except ValueError`` keeps working)::

    ServiceError(Exception)
      BadParameterError(ServiceError, ValueError)        query / option value
      EmptyBodyError(ServiceError, ValueError)           no file in the request
      AuthenticationError(ServiceError)                  missing or wrong API key
      ForbiddenError(ServiceError)                       a key that may not do this (not admin)
        CrossOriginError                                 a state-changing request from another site
      BadHostError(ServiceError)                         a Host header not in TILEWISE_ALLOWED_HOSTS
      UnsupportedMediaTypeError(ServiceError)            not a format tilewise reads
      DecodeError(ServiceError, ValueError)              corrupt / truncated file
      UnusableInputError(ServiceError, ValueError)       wrong dims, NaN-only data
        DicomSeriesError                                 a DICOM upload that is no one usable series
      PayloadTooLargeError(ServiceError)                 bytes, voxels or pixels over the limit
        MemoryBudgetError                                the plan's predicted memory over the limit
      OverBudgetError(ServiceError)                      batch size, tile count or work over the limit
      UploadTimeoutError(ServiceError)                   the body arrives too slowly (408)
      QueueFullError(ServiceError)                       the device queue is full (Retry-After)
      NotReadyError(ServiceError)                        models loading / shutting down
      ClusterUnavailableError(ServiceError)              the Dask cluster cannot be reached or started
      JobNotFoundError(ServiceError, LookupError)        no job of this id (or it expired)
      JobStateError(ServiceError)                        e.g. the result of a job not done (409)
        IdempotencyKeyReusedError                        an Idempotency-Key sent with another request

This module imports nothing but the standard library. The HTTP status and error code of every
exception (these and the foreign ``models.errors``, ``tiling.errors``) are in ONE table,
:data:`service.http_errors.STATUS`, which only the server imports.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "BadHostError",
    "BadParameterError",
    "ClusterUnavailableError",
    "CrossOriginError",
    "DecodeError",
    "DicomSeriesError",
    "EmptyBodyError",
    "ForbiddenError",
    "IdempotencyKeyReusedError",
    "InsufficientStorageError",
    "JobNotFoundError",
    "JobStateError",
    "MemoryBudgetError",
    "NotReadyError",
    "OverBudgetError",
    "PayloadTooLargeError",
    "QueueFullError",
    "ServiceError",
    "UnsupportedMediaTypeError",
    "UnusableInputError",
    "UploadTimeoutError",
]


class ServiceError(Exception):
    """Root of every error raised by :mod:`service`."""


class BadParameterError(ServiceError, ValueError):
    """A query parameter or command-line option with an invalid value (names the parameter)."""


class EmptyBodyError(ServiceError, ValueError):
    """A request without a file (empty raw body, or multipart without the ``file`` field)."""


class AuthenticationError(ServiceError):
    """The API key is missing or wrong."""


class ForbiddenError(ServiceError):
    """The key is right but may not do this (e.g. reload the models without an admin key)."""


class CrossOriginError(ForbiddenError):
    """A state-changing request sent by a page of another origin (CSRF), refused."""


class BadHostError(ServiceError):
    """The ``Host`` header names none of ``TILEWISE_ALLOWED_HOSTS`` (DNS rebinding)."""


class UnsupportedMediaTypeError(ServiceError):
    """The content is none of the formats tilewise reads (detected by magic bytes)."""


class DecodeError(ServiceError, ValueError):
    """The format was recognized, but the file is corrupt or truncated."""


class UnusableInputError(ServiceError, ValueError):
    """A readable file that the model cannot use: dimensionality, channels, NaN-only data."""


class DicomSeriesError(UnusableInputError):
    """A DICOM upload that is no one usable series (several series, gantry tilt, a missing slice,
    mixed orientations or sizes, no pixel data ...); the message names the fault."""


class PayloadTooLargeError(ServiceError):
    """The upload exceeds the byte limit, or the image the voxel / pixel limit."""


class InsufficientStorageError(ServiceError):
    """The disk cannot hold the output and temporaries of a streamed request (names both figures)."""


class MemoryBudgetError(PayloadTooLargeError):
    """The request's plan would hold more memory than ``max_request_bytes`` (names both)."""


class OverBudgetError(ServiceError):
    """The request's plan asks for more tiles, work or batch than the server allows (names both)."""


class UploadTimeoutError(ServiceError):
    """The request body stalled or arrived below the minimum rate."""


class QueueFullError(ServiceError):
    """The inference queue of the device is full; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReadyError(ServiceError):
    """The models are not loaded yet, or the server is shutting down."""


class ClusterUnavailableError(ServiceError):
    """The Dask cluster (``--dask``, ``TILEWISE_DASK_SCHEDULER``) cannot be reached or started, or
    the ``distributed`` extra is not installed (503: retry, or run in process)."""


class JobNotFoundError(ServiceError, LookupError):
    """No job of this id: never submitted, malformed, or removed after ``TILEWISE_JOB_TTL_S``."""


class JobStateError(ServiceError):
    """The job is not in a state that allows this, e.g. its result before it is done."""


class IdempotencyKeyReusedError(JobStateError):
    """An ``Idempotency-Key`` already names a job with another model, other parameters or another body."""
