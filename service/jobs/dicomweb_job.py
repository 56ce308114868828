"""Jobs named by DICOM UIDs (``POST /v1/jobs?model=NAME&study=UID&series=UID[&store=true]``):
the request's parameters, the series pulled into the job's folder, the SEG stored back.

See :mod:`service.dicomweb` for the server side. ``study`` and ``store`` are job parameters, not
inference parameters; ``series`` is both (it names the series to pull, and the one to read).
``store=true`` makes ``dicom-seg`` the output format (another ``format`` is refused).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.errors import BadParameterError

if TYPE_CHECKING:
    from service.jobs.record import JobRecord

__all__ = ["DICOMWEB_KEYS", "dicomweb_request", "pull_job_input", "store_job_result"]

#: Query keys of a DICOMweb job besides the inference parameters.
DICOMWEB_KEYS = ("study", "store")
_UID_RE = re.compile(r"[0-9]+(?:\.[0-9]+)*")
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def dicomweb_request(
    items: Iterable[tuple[str, str]], params: Any, settings: Any
) -> tuple[dict[str, Any] | None, Any]:
    """``({"study", "series", "store"}, params)`` for a job named by UIDs, ``(None, params)`` otherwise.

    Raises:
        BadParameterError: ``study`` without ``series`` (or the reverse with ``store``), a malformed
            UID or flag, ``store=true`` with a format other than ``dicom-seg``, or no
            ``TILEWISE_DICOMWEB_URL``.
    """
    given: dict[str, str] = {}
    for key, value in items:
        if key in DICOMWEB_KEYS:
            if key in given:
                raise BadParameterError(f"parameter {key!r} is given more than once; give it once")
            given[key] = value.strip()
    store_text = given.get("store", "false").lower()
    if store_text not in _TRUE | _FALSE:
        raise BadParameterError(f"store={given['store']!r} is not true or false")
    store = store_text in _TRUE
    study = given.get("study")
    if study is None:
        if store:
            raise BadParameterError("store=true needs a job named by study=UID&series=UID")
        return None, params
    if len(study) > 64 or not _UID_RE.fullmatch(study):
        raise BadParameterError(f"study={study!r} is not a DICOM UID (digits and dots, up to 64)")
    if params.series is None:
        raise BadParameterError(
            "a DICOMweb job names its series: study=UID&series=UID "
            "(`tilewise batch --dicomweb URL --study UID` runs every series of a study)"
        )
    if not getattr(settings, "dicomweb_url", None):
        raise BadParameterError("this server has no DICOMweb server: set TILEWISE_DICOMWEB_URL")
    if store:
        fmt = None if params.format is None else str(params.format.value)
        if fmt not in (None, "dicom-seg"):
            raise BadParameterError(
                f"store=true stores a DICOM SEG; format={fmt} cannot be stored (drop format)"
            )
        params = type(params).model_validate(params.model_dump(exclude_unset=True) | {"format": "dicom-seg"})
    return {"study": study, "series": params.series, "store": store}, params


def _client(settings: Any) -> Any:
    from service.dicomweb import connect

    return connect(settings.dicomweb_url, settings.dicomweb_username, settings.dicomweb_password)


def pull_job_input(settings: Any, dicomweb: dict[str, Any], path: Path) -> tuple[Path, int]:
    """Pull the job's series into the folder ``path`` (WADO-RS); ``(path, bytes)``.

    Raises:
        DicomwebError, DicomwebNotFoundError, PayloadTooLargeError: see :func:`service.dicomweb.pull_series`.
    """
    from service.dicomweb import pull_series

    pull_series(
        _client(settings), dicomweb["study"], dicomweb["series"], path, max_bytes=settings.max_upload_bytes
    )
    return path, sum(p.stat().st_size for p in path.iterdir())


def store_job_result(settings: Any, record: JobRecord, output: Path) -> dict[str, str] | None:
    """Store a finished job's SEG when it asked (``store=true``); its UIDs, else ``None``.

    Raises:
        DicomwebError: the server refused it or failed.
    """
    if not (record.dicomweb or {}).get("store"):
        return None
    from service.dicomweb import store_seg

    return store_seg(_client(settings), output)
