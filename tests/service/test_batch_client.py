"""Unit tests of the batch client (service.client): no server, httpx.MockTransport for HTTP."""

from __future__ import annotations

import gzip
import io
import json
import logging
import random
import struct
import subprocess
import sys
from pathlib import Path, PurePosixPath

import httpx
import pytest

from service.client import (
    BatchOptions,
    ClientSettings,
    ServerError,
    Status,
    TilewiseClient,
    TransportFailure,
    UnknownModelError,
    discover,
    output_format,
    output_relpath,
    run_batch,
    sniff_file,
)
from service.client.plan import glob_to_regex
from service.client.progress import make_progress
from service.client.retry import backoff_delay, parse_retry_after
from service.client.runner import remove_stale_parts
from service.sniff import sniff_bytes

MODELS = [
    {"name": "gaussian-3d", "spatial_dims": 3, "defaults": {"output": "probabilities", "format": None}},
    {"name": "seg-2d", "spatial_dims": 2, "defaults": {"output": "labels", "format": None}},
]


def _nifti1_header() -> bytes:
    head = bytearray(352)
    head[0:4] = struct.pack("<i", 348)
    head[344:348] = b"n+1\x00"
    return bytes(head)


def _nifti2_header() -> bytes:
    head = bytearray(544)
    head[0:4] = struct.pack(">i", 540)
    head[4:8] = b"n+2\x00"
    return bytes(head)


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    """in/: a.nii.gz (gzip NIfTI-1), sub/b.nii (NIfTI-2 big-endian), sub/deep/c.png, d.jpg (bytes only),
    notes.txt, broken.nii.gz (not even gzip), .hidden.png."""
    root = tmp_path / "in"
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "a.nii.gz").write_bytes(gzip.compress(_nifti1_header() + b"\0" * 64))
    (root / "sub" / "b.nii").write_bytes(_nifti2_header() + b"\0" * 16)
    (root / "sub" / "deep" / "c.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 32)
    (root / "d.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\0" * 32)
    (root / "notes.txt").write_text("not an image\n")
    (root / "broken.nii.gz").write_bytes(b"garbage, not gzip")
    (root / ".hidden.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return root


# -- sniffing, globbing, naming -------------------------------------------------------------------


def test_sniff_by_content(folder: Path, tmp_path: Path) -> None:
    assert sniff_file(folder / "a.nii.gz") == "nifti"
    assert sniff_file(folder / "sub" / "b.nii") == "nifti"
    assert sniff_file(folder / "sub" / "deep" / "c.png") == "png"
    assert sniff_file(folder / "d.jpg") == "jpeg"
    assert sniff_file(folder / "notes.txt") is None
    assert sniff_file(folder / "broken.nii.gz") is None
    tiff = tmp_path / "t.dat"
    tiff.write_bytes(b"II*\x00" + b"\0" * 8)
    assert sniff_file(tiff) == "tiff"  # by content, whatever the name
    empty = tmp_path / "empty.nii"
    empty.write_bytes(b"")
    assert sniff_file(empty) is None
    other_gz = tmp_path / "x.gz"
    other_gz.write_bytes(gzip.compress(b"hello" * 200))
    assert sniff_file(other_gz) is None


def test_truncated_nii_gz_is_still_a_candidate(tmp_path: Path) -> None:
    whole = gzip.compress(_nifti1_header() + bytes(range(256)) * 400)
    cut = tmp_path / "cut.nii.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    assert sniff_file(cut) == "nifti"  # the server, not the client, reports it as corrupt


@pytest.mark.parametrize(
    ("pattern", "path", "hit"),
    [
        pytest.param("**/*.png", "page.png", True, id="doublestar-zero-dirs"),
        pytest.param("**/*.png", "a/b/page.png", True, id="doublestar-deep"),
        pytest.param("*.png", "a/page.png", False, id="star-stays-in-folder"),
        pytest.param("a/*.nii.gz", "a/scan.nii.gz", True, id="folder-prefix"),
        pytest.param("a/**", "a/b/c.tif", True, id="trailing-doublestar"),
        pytest.param("scan?.nii", "scan1.nii", True, id="question"),
        pytest.param("scan[!0-4].nii", "scan7.nii", True, id="negated-class"),
        pytest.param("scan[!0-4].nii", "scan3.nii", False, id="negated-class-miss"),
        pytest.param("*.nii", "x.nii.gz", False, id="anchored-end"),
    ],
)
def test_glob(pattern: str, path: str, hit: bool) -> None:
    assert bool(glob_to_regex(pattern).match(path)) is hit


def test_discover_walks_recursively_and_keeps_name_claimed_files(folder: Path, tmp_path: Path) -> None:
    out = folder / "out"  # an output folder inside the input folder is not walked
    out.mkdir()
    (out / "a.nii.gz").write_bytes(gzip.compress(_nifti1_header()))
    found = {str(c.rel): c for c in discover(folder, recursive=True, exclude=out)}
    assert set(found) == {"a.nii.gz", "broken.nii.gz", "d.jpg", "notes.txt", "sub/b.nii", "sub/deep/c.png"}
    assert found["broken.nii.gz"].kind is None and found["broken.nii.gz"].sendable  # name claims NIfTI
    assert not found["notes.txt"].sendable
    flat = {str(c.rel) for c in discover(folder)}
    assert flat == {"a.nii.gz", "broken.nii.gz", "d.jpg", "notes.txt"}
    by_pattern = {str(c.rel) for c in discover(folder, patterns=["**/*.nii*"], exclude=out)}
    assert by_pattern == {"a.nii.gz", "broken.nii.gz", "sub/b.nii"}


@pytest.mark.parametrize(
    ("kind", "kwargs", "fmt"),
    [
        pytest.param("nifti", {}, "nii.gz", id="nifti"),
        pytest.param("png", {}, "tiff", id="2d-probabilities"),
        pytest.param("jpeg", {"output": "labels"}, "png", id="2d-labels"),
        pytest.param("jpeg", {"defaults": {"output": "labels", "format": None}}, "png", id="2d-model-labels"),
        pytest.param("nifti", {"fmt": "npy"}, "npy", id="explicit"),
        pytest.param("png", {"defaults": {"format": "npy"}}, "npy", id="model-format"),
    ],
)
def test_output_format(kind: str, kwargs: dict, fmt: str) -> None:
    assert output_format(kind, **kwargs) == fmt


def test_output_relpath() -> None:
    assert output_relpath(PurePosixPath("a/b/scan.nii.gz"), "nii.gz") == PurePosixPath("a/b/scan.nii.gz")
    assert output_relpath(PurePosixPath("x/page.jpg"), "png") == PurePosixPath("x/page.png")
    assert output_relpath(PurePosixPath("x/PAGE.TIF"), "tiff") == PurePosixPath("x/PAGE.tiff")
    assert output_relpath(PurePosixPath("v.nii"), "nii.gz") == PurePosixPath("v.nii.gz")
    with pytest.raises(ValueError, match="format='bmp'"):
        output_relpath(PurePosixPath("x.png"), "bmp")


# -- backoff --------------------------------------------------------------------------------------


def test_backoff_grows_is_jittered_and_capped() -> None:
    rng = random.Random(0)
    for retry in range(1, 12):
        ceiling = min(8.0, 0.5 * 2 ** (retry - 1))
        delays = [backoff_delay(retry, base_s=0.5, max_s=8.0, rng=rng) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1  # jitter
    # Retry-After wins when larger, with at most 10 % jitter, and stays under the cap.
    assert 3.0 <= backoff_delay(1, base_s=0.5, max_s=30, retry_after_s=3, rng=rng) <= 3.3
    assert backoff_delay(1, base_s=0.5, max_s=2, retry_after_s=60, rng=rng) == 2


def test_parse_retry_after() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 1.5 ") == 1.5
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    when = "Wed, 21 Oct 2015 07:28:10 GMT"
    assert parse_retry_after(when, now=1445412480.0) == pytest.approx(10.0)


# -- HTTP client with a mock transport ------------------------------------------------------------


class FakeServer:
    """A scripted server: answers infer requests from a list of responses / exceptions, in order."""

    def __init__(self, script: list, fmt: str | None = None) -> None:
        self.script = list(script)
        self.fmt = fmt
        self.infer_bodies: list[bytes] = []
        self.infer_params: list[dict] = []
        self.auth: list[str | None] = []
        self.model_gets = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.auth.append(request.headers.get("authorization"))
        if request.method == "GET" and request.url.path == "/v1/models":
            self.model_gets += 1
            return httpx.Response(200, json=MODELS)
        assert request.method == "POST" and request.url.path.endswith("/infer")
        self.infer_bodies.append(request.read())
        self.infer_params.append(dict(request.url.params))
        step = self.script.pop(0) if self.script else "ok"
        if isinstance(step, Exception):
            raise step
        if step == "ok":
            body = self.infer_bodies[-1]
            head = gzip.decompress(body)[:544] if body.startswith(b"\x1f\x8b") else body
            sniffed = sniff_bytes(head)
            fmt = self.fmt or ("nii.gz" if sniffed is not None and sniffed.kind == "nifti" else "png")
            return httpx.Response(200, content=b"OUT:" + body[:16], headers={"X-Tilewise-Format": fmt})
        return step


def _client(server: FakeServer, sleeps: list[float], **settings) -> TilewiseClient:
    settings.setdefault("url", "http://tilewise.test")
    return TilewiseClient(
        ClientSettings(**settings),
        transport=httpx.MockTransport(server),
        sleep=sleeps.append,
        rng=random.Random(0),
    )


def test_503_backs_off_honouring_retry_after_then_succeeds(tmp_path: Path) -> None:
    src = tmp_path / "scan.nii"
    src.write_bytes(_nifti1_header())
    busy = httpx.Response(503, json={"error": "queue_full", "detail": "full"}, headers={"Retry-After": "2"})
    server = FakeServer([busy, httpx.ConnectError("refused"), busy, "ok"])
    sleeps: list[float] = []
    with _client(server, sleeps, retries=5, api_key="s3cret") as client:
        answer = client.infer_to_file(src, tmp_path / "out", "gaussian-3d", {"tile": "64,64,32"})
    assert answer.attempts == 4 and answer.format == "nii.gz"
    assert (tmp_path / "out").read_bytes() == b"OUT:" + _nifti1_header()[:16]
    assert all(body == src.read_bytes() for body in server.infer_bodies)  # whole file resent each time
    assert server.infer_params[-1] == {"tile": "64,64,32"}
    assert set(server.auth) == {"Bearer s3cret"}
    assert len(sleeps) == 3
    assert 2.0 <= sleeps[0] <= 2.2 and 2.0 <= sleeps[2] <= 2.2  # Retry-After honoured
    assert 0.25 <= sleeps[1] <= 1.0  # backoff for the connection error (retry 2: ceiling 1 s)


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param(httpx.ConnectError("refused"), id="connect"),
        pytest.param(httpx.ReadTimeout("slow"), id="timeout"),
        pytest.param(httpx.RemoteProtocolError("cut off"), id="cut-off"),
        pytest.param(httpx.Response(502, text="bad gateway"), id="502"),
        pytest.param(httpx.Response(504, text="gateway timeout"), id="504"),
    ],
)
def test_retryable_failures_give_up_after_retries(tmp_path: Path, failure) -> None:
    src = tmp_path / "scan.nii"
    src.write_bytes(_nifti1_header())
    server = FakeServer([failure] * 10)
    sleeps: list[float] = []
    with _client(server, sleeps, retries=2) as client, pytest.raises((TransportFailure, ServerError)) as info:
        client.infer_to_file(src, tmp_path / "out", "gaussian-3d")
    assert info.value.attempts == 3 and len(server.infer_bodies) == 3 and len(sleeps) == 2


def test_client_errors_are_not_retried(tmp_path: Path) -> None:
    src = tmp_path / "scan.nii"
    src.write_bytes(_nifti1_header())
    corrupt = httpx.Response(422, json={"error": "decode_error", "detail": "truncated gzip stream"})
    server = FakeServer([corrupt])
    with _client(server, []) as client, pytest.raises(ServerError) as info:
        client.infer_to_file(src, tmp_path / "out", "gaussian-3d")
    assert (info.value.status, info.value.code, info.value.attempts) == (422, "decode_error", 1)
    assert str(info.value) == "HTTP 422 decode_error: truncated gzip stream"


def test_a_refused_run_sends_nothing(folder: Path, tmp_path: Path) -> None:
    posts = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            posts.append(request)
        return httpx.Response(401, json={"error": "unauthorized", "detail": "missing API key"})

    settings = ClientSettings(url="http://tilewise.test")
    with TilewiseClient(settings, transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(ServerError, match="HTTP 401 unauthorized: missing API key"):
            run_batch(BatchOptions(folder, tmp_path / "out", "gaussian-3d"), client)
    assert posts == []


def test_settings_read_the_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILEWISE_API_KEY", "from-env")
    monkeypatch.setenv("TILEWISE_MODELS_DIR", "/server/only")  # a server variable: ignored
    settings = ClientSettings(url="http://h:1/")
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "from-env"
    assert settings.url == "http://h:1"
    assert ClientSettings(url="http://h:1", api_key="flag").api_key.get_secret_value() == "flag"
    with pytest.raises(ValueError, match="http"):
        ClientSettings(url="h:1")


def test_unknown_model(tmp_path: Path) -> None:
    with _client(FakeServer([]), []) as client, pytest.raises(UnknownModelError, match="gaussian-3d"):
        client.model_info("nope")


# -- a whole run against the fake server ----------------------------------------------------------


def test_run_batch_mirrors_tree_reports_and_resumes(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    corrupt = httpx.Response(422, json={"error": "decode_error", "detail": "not gzip"})
    # Sorted order of sends is not guaranteed with threads; make 'broken' fail by content instead.

    def server_for(script):
        server = FakeServer(script)
        inner = server.__call__

        def handler(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.read().startswith(b"garbage"):
                server.infer_bodies.append(request.read())
                return corrupt
            return inner(request)

        return server, handler

    server, handler = server_for([])
    settings = ClientSettings(url="http://tilewise.test", concurrency=2)
    options = BatchOptions(folder, out, "seg-2d", recursive=True)
    with TilewiseClient(settings, transport=httpx.MockTransport(handler), sleep=lambda s: None) as client:
        outcome = run_batch(options, client)
    by_input = {r.input: r for r in outcome.results}
    assert by_input["a.nii.gz"].status is Status.DONE and by_input["a.nii.gz"].output == "a.nii.gz"
    assert by_input["sub/deep/c.png"].output == "sub/deep/c.png"  # seg-2d defaults to labels: png
    assert by_input["d.jpg"].output == "d.png"
    assert by_input["notes.txt"].status is Status.SKIPPED and by_input["notes.txt"].output is None
    assert by_input["broken.nii.gz"].status is Status.FAILED
    assert by_input["broken.nii.gz"].error == "HTTP 422 decode_error: not gzip"
    assert not outcome.ok
    assert (out / "sub" / "deep" / "c.png").read_bytes().startswith(b"OUT:")
    assert not list(out.rglob("*.part"))
    report = json.loads((out / "tilewise-report.json").read_text())
    assert report["summary"]["done"] == 4 and report["summary"]["failed"] == 1
    assert report["summary"]["skipped"] == 1
    assert {f["status"] for f in report["files"]} == {"done", "failed", "skipped"}
    assert set(report["files"][0]) >= {"input", "output", "status", "seconds", "error"}

    # Re-run: completed files are skipped without a request; only the corrupt one is re-sent.
    server2, handler2 = server_for([])
    with TilewiseClient(settings, transport=httpx.MockTransport(handler2), sleep=lambda s: None) as client:
        again = run_batch(options, client)
    assert [r.input for r in again.results if r.status is Status.DONE] == []
    assert len(server2.infer_bodies) == 1 and server2.infer_bodies[0].startswith(b"garbage")
    assert again.count(Status.SKIPPED) == 5


def test_progress_bar_counts_files_and_bytes(folder: Path, tmp_path: Path) -> None:
    stream = io.StringIO()
    with _client(FakeServer([]), []) as client:
        outcome = run_batch(
            BatchOptions(folder, tmp_path / "out", "seg-2d", recursive=True),
            client,
            progress=make_progress("bar", stream=stream),
        )
    assert outcome.count(Status.FAILED) == 0
    final = stream.getvalue().split("\r")[-1]
    assert "5/5 files" in final and "100%" in final


def test_failed_transfer_leaves_no_output(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    server = FakeServer([httpx.ReadError("reset")] * 100)
    options = BatchOptions(folder, out, "gaussian-3d", patterns=["a.nii.gz"])
    with _client(server, [], retries=1) as client:
        outcome = run_batch(options, client)
    assert outcome.count(Status.FAILED) == 1 and outcome.results[0].attempts == 2
    assert sorted(p.name for p in out.iterdir()) == ["tilewise-report.json"]


def test_output_takes_the_format_the_server_answered(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    server = FakeServer([], fmt="tiff")  # the plan says png (labels), the server wrote tiff
    with _client(server, []) as client:
        outcome = run_batch(BatchOptions(folder, out, "seg-2d", patterns=["*.jpg"]), client)
    assert outcome.ok and outcome.results[0].output == "d.tiff"
    assert (out / "d.tiff").is_file() and not (out / "d.png").exists()


def test_two_inputs_with_one_output_name_fail_the_second(folder: Path, tmp_path: Path) -> None:
    (folder / "d.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # d.jpg and d.png both map to d.png
    server = FakeServer([])
    with _client(server, []) as client:
        outcome = run_batch(BatchOptions(folder, tmp_path / "out", "seg-2d", patterns=["d.*"]), client)
    by_input = {r.input: r for r in outcome.results}
    assert by_input["d.jpg"].status is Status.DONE and by_input["d.jpg"].output == "d.png"
    assert by_input["d.png"].status is Status.FAILED and "also that of d.jpg" in by_input["d.png"].error
    assert len(server.infer_bodies) == 1


def test_stale_temporary_files_of_dead_processes_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    pid = int(dead.stdout)
    (tmp_path / "a").mkdir()
    stale = tmp_path / "a" / f".scan.nii.gz.{pid}-0123abcd.part"
    stale.write_bytes(b"partial")
    mine = tmp_path / f".x.png.{__import__('os').getpid()}-0123abcd.part"
    mine.write_bytes(b"in progress")
    assert remove_stale_parts(tmp_path) == 1
    assert not stale.exists() and mine.exists()


def test_client_package_imports_no_torch_numpy_or_fastapi() -> None:
    code = (
        "import sys, service.client, service.commands.batch; "
        "bad = [m for m in ('torch', 'numpy', 'fastapi', 'starlette', 'nibabel') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_retry_for_outlasts_a_restart_and_says_at_once_that_nobody_listens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--retry-for (issue 25 item 3): 12 refused connections (a restart) outlast --retries 2 but
    within 300 s of waiting; the first refusal is said at once, before any wait."""
    src = tmp_path / "scan.nii"
    src.write_bytes(_nifti1_header())
    server = FakeServer([httpx.ConnectError("refused")] * 12 + ["ok"])
    sleeps: list[float] = []
    with caplog.at_level(logging.WARNING), _client(server, sleeps, retries=2, retry_for_s=300) as client:
        answer = client.infer_to_file(src, tmp_path / "out", "gaussian-3d", {})
    assert answer.attempts == 13 and len(sleeps) == 12
    assert sum(sleeps) <= 300.0
    first = caplog.records[0].getMessage()
    assert "no server answers at http://tilewise.test" in first and "retrying for up to 300 s" in first

    server = FakeServer([httpx.ConnectError("refused")] * 12 + ["ok"])
    with _client(server, [], retries=2, retry_for_s=0) as client, pytest.raises(TransportFailure) as info:
        client.infer_to_file(src, tmp_path / "out2", "gaussian-3d", {})
    assert info.value.attempts == 3
