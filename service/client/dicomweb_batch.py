"""``tilewise batch --dicomweb URL --study UID OUTPUT_DIR --model NAME``: every image series of a
study, pulled from a DICOMweb server, run through a tilewise server.

The series are listed with QIDO-RS (CT, MR and PT; SEG and reports left out), each pulled with
WADO-RS into a temporary folder, sent as one zip (``POST /v1/models/{model}/infer``), and its
output written to ``OUTPUT_DIR/SERIES_UID.SUFFIX`` (``.nii.gz`` by default, ``.dcm`` with
``--format dicom-seg``). Temporary files are removed, whatever happens. A series that fails is
reported and the others go on.

Imports httpx, dicomweb-client and pydicom (the ``dicom`` extra); never torch or FastAPI.
"""

from __future__ import annotations

import logging
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.options import FORMAT_SUFFIXES

__all__ = ["SeriesResult", "run_dicomweb_batch"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SeriesResult:
    """One series of the study: its output file, or why it failed."""

    series: str
    output: Path | None
    error: str | None = None


def run_dicomweb_batch(
    client: Any,
    url: str,
    study: str,
    output_dir: Path,
    model: str,
    params: Mapping[str, str],
    *,
    username: str | None = None,
    password: str | None = None,
) -> list[SeriesResult]:
    """Run every image series of ``study`` on ``url`` through ``client``'s server.

    Args:
        client: a :class:`service.client.TilewiseClient`.
        url: the DICOMweb root (``http://pacs:8042/dicom-web``).
        study: the StudyInstanceUID.
        output_dir: where the outputs go (created).
        model: the model's name; ``params`` the inference query parameters.

    Raises:
        DicomwebError: the study cannot be listed (no such study, server unreachable).
    """
    from service.dicomweb import connect, pull_series, series_of_study

    pacs = connect(url, username, password)
    series_uids = series_of_study(pacs, study)
    output_dir.mkdir(parents=True, exist_ok=True)
    suffix = FORMAT_SUFFIXES.get(str(params.get("format") or "nii.gz"), ".nii.gz")
    results = []
    for uid in series_uids:
        with tempfile.TemporaryDirectory(prefix="tilewise-dicomweb-") as tmp:
            folder, archive = Path(tmp) / "series", Path(tmp) / "series.zip"
            target = output_dir / f"{uid}{suffix}"
            partial = output_dir / f".{uid}{suffix}.partial"
            try:
                pull_series(pacs, study, uid, folder)
                with zipfile.ZipFile(archive, "w") as zf:
                    for path in sorted(folder.iterdir()):
                        zf.write(path, path.name)
                client.infer_to_file(archive, partial, model, {**params, "series": uid}, label=uid)
                partial.replace(target)
            except Exception as exc:  # noqa: BLE001 - one series failing never stops the others
                partial.unlink(missing_ok=True)
                logger.error("series %s: %s", uid, exc)
                results.append(SeriesResult(uid, None, f"{type(exc).__name__}: {exc}"))
                continue
        logger.info("series %s -> %s", uid, target)
        results.append(SeriesResult(uid, target))
    return results
