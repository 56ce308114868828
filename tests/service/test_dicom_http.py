"""DICOM over HTTP (issue 22 items 1 and 3): a series as several multipart ``file`` parts or as a
zip, faults as 422 ``dicom_series_invalid`` with nothing left in the work folder, and DICOMweb jobs
against a real Orthanc (started here on 127.0.0.1; skipped only when Orthanc is not installed):
the series stored with STOW-RS, a job given by its UIDs, the SEG found with QIDO-RS afterwards,
referencing the source series, with one segment per tissue label."""

from __future__ import annotations

import gzip
import io
import time
import zipfile
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest

pydicom = pytest.importorskip("pydicom")

from _dicom_helpers import write_series  # noqa: E402
from _inprocess import InProcessClient  # noqa: E402
from _orthanc import orthanc  # noqa: E402

from models import ModelRepository  # noqa: E402
from service.app import create_app  # noqa: E402

CT5N = Path(pydicom.data.__file__).parent / "test_files" / "dicomdirtests" / "98892001" / "CT5N"
DIRTESTS = CT5N.parent.parent


def _leftovers(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "tilewise-jobs" not in p.parts
    )


def test_series_as_multipart_parts_and_zip(make_settings: Any, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    app = create_app(make_settings(tmp_dir=work), repository=ModelRepository("/nonexistent", device="cpu"))
    files = [("file", (p.name, p.read_bytes(), "application/dicom")) for p in sorted(CT5N.iterdir())]
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(CT5N.iterdir()):
            zf.write(path, path.name)
    url = "/v1/models/gaussian-3d/infer"
    with InProcessClient(app) as client:
        parts = client.post(url, files=files)
        zipped = client.post(url, content=archive.getvalue())
        several = client.post(
            url,
            files=[("file", (p.name, p.read_bytes())) for p in sorted(DIRTESTS.rglob("*")) if p.is_file()],
        )
        gap = client.post(
            url,
            files=[
                ("file", (p.name, p.read_bytes())) for p in sorted((DIRTESTS / "77654033" / "CT2").iterdir())
            ],
        )
        not_seg = client.post(url, files=files, params={"format": "dicom-seg"})
        page = client.get("/")
        script = client.get("/static/web/js/dicomweb.js")
    assert 'id="pacs-form"' in page.text and "js/dicomweb.js" in page.text  # the page submits by UID too
    assert script.status_code == 200 and "study, series" in script.text
    assert parts.status_code == 200, parts.text
    assert zipped.status_code == 200 and zipped.content == parts.content
    out = tmp_path / "out.nii.gz"
    out.write_bytes(parts.content)
    img = nib.load(out)
    from service.codecs import decode

    volume = decode(CT5N)
    assert img.shape == (16, 16, 5) and np.allclose(img.affine, volume.affine, atol=1e-5)
    assert img.header["descrip"].tobytes().startswith(b"tilewise gaussian-3d sha256:")
    assert several.status_code == 422 and several.json()["error"] == "dicom_series_invalid"
    assert several.json()["detail"].startswith("several series: ")
    assert gap.status_code == 422 and "missing slice between z=-99.48 and z=103.02" in gap.json()["detail"]
    assert not_seg.status_code == 200  # gaussian-3d gives probabilities: a FRACTIONAL SEG
    assert pydicom.dcmread(io.BytesIO(not_seg.content)).SegmentationType == "FRACTIONAL"
    assert _leftovers(work) == []  # no temporary file left, refusals included


def _wait(client: Any, job: str, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = client.get(f"/v1/jobs/{job}").json()
        if status["state"] in ("done", "failed", "cancelled") or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("model", "segments", "kind"),
    [
        ("gaussian-3d", 1, "FRACTIONAL"),  # analytic: fast, one probability channel
        # the tissue labels; slow where tissue-3d's footprint is first measured (a CI step)
        pytest.param("tissue-3d", 2, "BINARY", marks=pytest.mark.slow),
    ],
)
def test_dicomweb_job_pulls_and_stores_the_seg(
    model: str, segments: int, kind: str, mni152_path: Path, make_settings: Any, tmp_path: Path
) -> None:
    import dicomweb_client

    img = nib.load(mni152_path)
    box = (slice(80, 112), slice(100, 132), slice(70, 98))
    data = np.rint(np.asarray(img.get_fdata())[box]).astype(np.int16)
    affine = img.affine.copy()
    affine[:3, 3] = img.affine[:3, :3] @ [s.start for s in box] + img.affine[:3, 3]
    paths = write_series(data, affine, tmp_path / "series")
    source = pydicom.dcmread(paths[0], stop_before_pixels=True)
    study, series = str(source.StudyInstanceUID), str(source.SeriesInstanceUID)
    (tmp_path / "orthanc").mkdir()
    with orthanc(tmp_path / "orthanc") as url:
        pacs = dicomweb_client.DICOMwebClient(url)
        pacs.store_instances([pydicom.dcmread(p) for p in paths])
        settings = make_settings(tmp_dir=tmp_path / "work", dicomweb_url=url, jobs_dir=tmp_path / "jobs")
        (tmp_path / "work").mkdir()
        app = create_app(settings, repository=ModelRepository("/nonexistent", device="cpu"))
        with InProcessClient(app) as client:
            answer = client.post(
                "/v1/jobs", params={"model": model, "study": study, "series": series, "store": "true"}
            )
            assert answer.status_code == 202, answer.text
            status = _wait(client, answer.json()["id"])
            assert status["state"] == "done", status
            stored = status["stored"]
            result = client.get(f"/v1/jobs/{status['id']}/result")
            missing = client.post(
                "/v1/jobs", params={"model": model, "study": study, "series": "1.2.3", "store": "true"}
            )
            no_series = client.post("/v1/jobs", params={"model": model, "study": study})
        segs = pacs.search_for_series(study, search_filters={"Modality": "SEG"})
        assert [s["0020000E"]["Value"][0] for s in segs] == [stored["series"]]
        (seg,) = pacs.retrieve_series(study, stored["series"])
    assert stored["study"] == study and stored["sop_instance"] == seg.SOPInstanceUID
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == series
    assert seg.FrameOfReferenceUID == source.FrameOfReferenceUID
    assert len(seg.SegmentSequence) == segments and seg.SegmentationType == kind
    assert pydicom.dcmread(io.BytesIO(result.content)).SOPInstanceUID == seg.SOPInstanceUID
    assert missing.status_code == 404 and missing.json()["error"] == "dicomweb_not_found"
    assert no_series.status_code == 400 and "series" in no_series.json()["detail"]


@pytest.mark.slow  # starts a real server (minutes under load); a CI step of .ci/run
def test_batch_client_runs_a_study_from_dicomweb(tmp_path: Path) -> None:
    """``tilewise batch --dicomweb URL --study UID OUTPUT_DIR --model NAME`` against Orthanc and a
    real server: one SEG per image series of the study, named by its SeriesInstanceUID."""
    import subprocess
    import sys

    import dicomweb_client
    from _svc_helpers import REPO, clean_env, start_server, stop_server

    paths = sorted(CT5N.iterdir())
    source = pydicom.dcmread(paths[0], stop_before_pixels=True)
    (tmp_path / "orthanc").mkdir()
    (tmp_path / "server").mkdir()
    with orthanc(tmp_path / "orthanc") as url:
        dicomweb_client.DICOMwebClient(url).store_instances([pydicom.dcmread(p) for p in paths])
        server = start_server(tmp_path / "server")
        try:
            command = [sys.executable, "-m", "service.cli", "batch", "--dicomweb", url, "--study",
                       str(source.StudyInstanceUID), str(tmp_path / "out"), "--model", "gaussian-3d",
                       "--format", "dicom-seg", "--url", server.url]  # fmt: skip
            done = subprocess.run(
                command, capture_output=True, text=True, env=clean_env(), cwd=REPO, timeout=300
            )
        finally:
            stop_server(server)
    assert done.returncode == 0, done.stderr
    (output,) = sorted((tmp_path / "out").iterdir())
    assert output.name == f"{source.SeriesInstanceUID}.dcm"
    seg = pydicom.dcmread(output)
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == source.SeriesInstanceUID


def test_a_cluster_route_probes_the_named_series(make_settings: Any, tmp_path: Path) -> None:
    """With ``TILEWISE_DASK_SCHEDULER`` set, a job's input is probed for its size before it runs; an
    upload of several series with ``series=`` names the one to probe (and run), as the run decodes it.
    The scheduler is never reached: the series is below ``TILEWISE_DASK_MIN_VOXELS``."""
    uid = str(pydicom.dcmread(sorted(CT5N.iterdir())[0], stop_before_pixels=True).SeriesInstanceUID)
    files = [("file", (p.name, p.read_bytes())) for p in sorted(DIRTESTS.rglob("*")) if p.is_file()]
    settings = make_settings(
        tmp_dir=tmp_path,
        jobs_dir=tmp_path / "jobs",
        dask_scheduler="tcp://127.0.0.1:9",
        dask_min_voxels=10**9,
    )
    app = create_app(settings, repository=ModelRepository("/nonexistent", device="cpu"))
    with InProcessClient(app) as client:
        answer = client.post("/v1/jobs", params={"model": "gaussian-3d", "series": uid}, files=files)
        assert answer.status_code == 202, answer.text
        status = _wait(client, answer.json()["id"])
        assert status["state"] == "done", status
        result = client.get(f"/v1/jobs/{status['id']}/result")
        alone = client.post(
            "/v1/models/gaussian-3d/infer", files=[("file", (p.name, p.read_bytes())) for p in CT5N.iterdir()]
        )
    assert status.get("cluster") is None
    assert result.status_code == alone.status_code == 200
    a, b = (nib.Nifti1Image.from_bytes(gzip.decompress(r.content)) for r in (result, alone))
    assert a.shape == (16, 16, 5) and np.array_equal(a.get_fdata(), b.get_fdata())
