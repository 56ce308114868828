"""Issue 11, "Batch client": DICOM skipped, never a write outside OUTPUT_DIR, one symlink policy with
every input in the report, resume verified against a manifest, a truthful report on Ctrl-C, and an
unwritable output folder refused before the first upload. No server: httpx.MockTransport."""

from __future__ import annotations

import gzip
import random
import struct
from pathlib import Path

import httpx
import pytest

from service.client import BatchOptions, ClientSettings, Status, TilewiseClient, discover, run_batch


def _nifti1(payload: bytes = b"") -> bytes:
    head = bytearray(352)
    head[0:4] = struct.pack("<i", 348)
    head[344:348] = b"n+1\x00"
    return bytes(head) + payload


class Server:
    """Answers ``/v1/models`` and echoes every upload as ``OUT:`` + its first 16 bytes."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json=[{"name": "m", "spatial_dims": 3, "defaults": {}}])
        body = request.read()
        self.sent.append(body)
        return httpx.Response(200, content=b"OUT:" + body[:16], headers={"X-Tilewise-Format": "nii.gz"})


def _client(server: Server, **settings) -> TilewiseClient:
    return TilewiseClient(
        ClientSettings(url="http://tilewise.test", **settings),
        transport=httpx.MockTransport(server),
        sleep=lambda s: None,
        rng=random.Random(0),
    )


# -- DICOM ----------------------------------------------------------------------------------------


def test_dicom_files_are_skipped_with_advice_whatever_their_name(tmp_path: Path) -> None:
    data = pytest.importorskip("pydicom.data")
    root = tmp_path / "in"
    root.mkdir()
    for name, target in (("ct.dcm", "ct.dcm"), ("mr.dcm", "looks-like.tif")):
        source = "CT_small.dcm" if name == "ct.dcm" else "MR_small.dcm"
        (root / target).write_bytes(Path(data.get_testdata_file(source)).read_bytes())
    (root / "scan.nii.gz").write_bytes(gzip.compress(_nifti1(b"\0" * 64)))
    found = {str(c.rel): c for c in discover(root)}
    assert found["ct.dcm"].kind == "dicom" and not found["ct.dcm"].sendable
    assert found["looks-like.tif"].kind == "dicom" and not found["looks-like.tif"].sendable
    server = Server()
    with _client(server) as client:
        outcome = run_batch(BatchOptions(root, tmp_path / "out", "m"), client)
    by_input = {r.input: r for r in outcome.results}
    for name in ("ct.dcm", "looks-like.tif"):
        assert by_input[name].status is Status.SKIPPED and "dcm2niix" in (by_input[name].error or "")
    assert by_input["scan.nii.gz"].status is Status.DONE
    assert len(server.sent) == 1  # only the NIfTI was uploaded
