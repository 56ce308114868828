"""DICOMweb (QIDO-RS, WADO-RS, STOW-RS) with ``dicomweb-client``: jobs named by study and series
UID instead of a file, and their DICOM SEG stored back.

``TILEWISE_DICOMWEB_URL`` names the server's DICOMweb root (Orthanc: ``http://HOST:8042/dicom-web``),
``TILEWISE_DICOMWEB_USERNAME`` / ``_PASSWORD`` its HTTP basic credentials. A job
``POST /v1/jobs?model=NAME&study=UID&series=UID[&store=true]`` (no body) pulls the series with
WADO-RS into the job's folder (one file per instance, never more than the upload limit), runs it as
an uploaded series, and with ``store=true`` stores its ``dicom-seg`` result with STOW-RS; the job
status then shows ``stored`` (``{"study", "series", "sop_instance"}``).

Errors of the server (unreachable, refused, a series it does not have) are
:class:`DicomwebError` (HTTP 502 ``dicomweb_failed``; 404 ``dicomweb_not_found`` for an unknown
series), naming the server by its URL without credentials.

Imports dicomweb-client and pydicom (the ``dicom`` extra); never torch or FastAPI.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from service.errors import BadParameterError, PayloadTooLargeError, ServiceError

__all__ = ["DicomwebError", "DicomwebNotFoundError", "connect", "pull_series", "series_of_study", "store_seg"]

logger = logging.getLogger(__name__)


class DicomwebError(ServiceError):
    """The DICOMweb server could not be reached, or refused a request (502)."""


class DicomwebNotFoundError(DicomwebError):
    """The DICOMweb server has no such study or series (404)."""


def connect(
    url: str | None, username: str | None = None, password: str | None = None, *, timeout: float = 60.0
) -> Any:
    """A ``dicomweb_client.DICOMwebClient`` for ``url`` (basic authentication when a user is given).

    Raises:
        BadParameterError: no URL (``TILEWISE_DICOMWEB_URL`` unset).
    """
    if not url:
        raise BadParameterError("no DICOMweb server: set TILEWISE_DICOMWEB_URL (or --dicomweb URL)")
    from dicomweb_client import DICOMwebClient
    from dicomweb_client.session_utils import create_session_from_user_pass

    session = create_session_from_user_pass(username, password or "") if username else None
    return DICOMwebClient(url.rstrip("/"), session=session, timeout=timeout)


def _failed(what: str, client: Any, exc: Exception) -> DicomwebError:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    where = getattr(client, "base_url", "the DICOMweb server")
    if status == 404:
        return DicomwebNotFoundError(f"{what}: the DICOMweb server {where} has no such object (404)")
    return DicomwebError(f"{what}: the DICOMweb server {where} failed: {type(exc).__name__} {status or exc}")


def _remote(exc: BaseException) -> bool:
    import requests

    return isinstance(exc, requests.RequestException)


def pull_series(client: Any, study: str, series: str, folder: Path, *, max_bytes: int | None = None) -> int:
    """Retrieve every instance of a series (WADO-RS) into ``folder``, one ``.dcm`` per instance.

    Returns:
        the number of instances written.

    Raises:
        DicomwebNotFoundError: no such series; DicomwebError: the server failed.
        PayloadTooLargeError: the instances pass ``max_bytes`` (what was written is left for the
            caller's folder clean-up).
    """
    folder.mkdir(parents=True, exist_ok=True)
    written = total = 0
    try:
        for ds in client.iter_series(study, series):
            path = folder / f"{written:05d}.dcm"
            ds.save_as(path, enforce_file_format=True)
            written += 1
            total += path.stat().st_size
            if max_bytes is not None and total > max_bytes:
                raise PayloadTooLargeError(
                    f"series {series} is larger than max_upload_bytes={max_bytes} (stopped after {written} "
                    "instances)"
                )
    except PayloadTooLargeError:
        raise
    except Exception as exc:  # noqa: BLE001 - requests / dicomweb-client errors of a remote server
        if isinstance(exc, OSError) and not _remote(exc):
            raise  # the local disk
        raise _failed(f"retrieving series {series} of study {study}", client, exc) from exc
    if written == 0:
        raise DicomwebNotFoundError(
            f"series {series} of study {study} holds no instance on the DICOMweb server"
        )
    logger.info("pulled %d instance(s) of series %s (%d bytes)", written, series, total)
    return written


def store_seg(client: Any, path: Path) -> dict[str, str]:
    """Store the DICOM file at ``path`` (STOW-RS) and return its ``{"study", "series", "sop_instance"}``.

    Raises:
        DicomwebError: the server refused it or failed.
    """
    import pydicom

    ds = pydicom.dcmread(path)
    try:
        response = client.store_instances([ds], study_instance_uid=str(ds.StudyInstanceUID))
    except Exception as exc:  # noqa: BLE001 - requests / dicomweb-client errors of a remote server
        raise _failed(f"storing SEG {ds.SOPInstanceUID}", client, exc) from exc
    failed = response.get("FailedSOPSequence") if response is not None else None
    if failed:
        raise DicomwebError(f"the DICOMweb server refused SEG {ds.SOPInstanceUID}: {failed}")
    stored = {
        "study": str(ds.StudyInstanceUID),
        "series": str(ds.SeriesInstanceUID),
        "sop_instance": str(ds.SOPInstanceUID),
    }
    logger.info("stored SEG %s of series %s", stored["sop_instance"], stored["series"])
    return stored


def series_of_study(
    client: Any, study: str, *, modalities: tuple[str, ...] = ("CT", "MR", "PT")
) -> list[str]:
    """The SeriesInstanceUIDs of a study (QIDO-RS) whose modality is an image volume's (SEG,
    structured reports and presentation states left out).

    Raises:
        DicomwebNotFoundError: no such study; DicomwebError: the server failed.
    """
    try:
        found = client.search_for_series(study_instance_uid=study)
    except Exception as exc:  # noqa: BLE001 - requests / dicomweb-client errors of a remote server
        raise _failed(f"searching the series of study {study}", client, exc) from exc
    out = []
    for item in found or []:
        modality = (item.get("00080060", {}).get("Value") or [""])[0]
        uid = (item.get("0020000E", {}).get("Value") or [""])[0]
        if uid and (not modalities or modality in modalities):
            out.append(str(uid))
    if not found:
        raise DicomwebNotFoundError(f"study {study} has no series on the DICOMweb server")
    return out
