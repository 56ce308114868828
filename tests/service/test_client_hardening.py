"""Issue 11, "Batch client": DICOM skipped, never a write outside OUTPUT_DIR, one symlink policy with
every input in the report, resume verified against a manifest, a truthful report on Ctrl-C, and an
unwritable output folder refused before the first upload. In process with httpx.MockTransport; the
command line (exit codes, real SIGINTs) against a tiny threaded HTTP server."""

from __future__ import annotations

import errno
import gzip
import http.server
import json
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.client import BatchOptions, ClientSettings, Status, TilewiseClient, discover, run_batch
from service.client.errors import OutputDirError
from service.client.manifest import MANIFEST_NAME
from service.client.report import REPORT_NAME


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


# -- never outside OUTPUT_DIR ---------------------------------------------------------------------


def _tree(root: Path, names: list[str]) -> Path:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(gzip.compress(_nifti1(name.encode())))
    return root


def test_outputs_never_leave_output_dir_through_a_symlinked_folder(tmp_path: Path) -> None:
    inputs = _tree(tmp_path / "in", ["a/scan.nii.gz", "b/scan.nii.gz", "c/scan.nii.gz"])
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "a").symlink_to(elsewhere, target_is_directory=True)  # leaves OUTPUT_DIR
    (out / "real").mkdir()
    (out / "b").symlink_to(out / "real", target_is_directory=True)  # stays inside: fine
    server = Server()
    with _client(server) as client:
        outcome = run_batch(BatchOptions(inputs, out, "m", recursive=True), client)
    by_input = {r.input: r for r in outcome.results}
    assert by_input["a/scan.nii.gz"].status is Status.FAILED
    assert "leaves OUTPUT_DIR" in (by_input["a/scan.nii.gz"].error or "")
    assert list(elsewhere.iterdir()) == []  # nothing written outside
    assert by_input["b/scan.nii.gz"].status is Status.DONE and (out / "real" / "scan.nii.gz").is_file()
    assert by_input["c/scan.nii.gz"].status is Status.DONE
    assert len(server.sent) == 2  # the refused one was not even uploaded


# -- one symlink policy, every input in the report -------------------------------------------------


def test_file_links_are_followed_folder_links_only_inside_and_every_path_is_reported(tmp_path: Path) -> None:
    """Issue 25 item 2: a link to a file elsewhere is the user's data (read); a link to a folder
    outside INPUT_DIR is not walked; dangling links and loops are reported."""
    inputs = _tree(tmp_path / "in", ["scan.nii.gz", "sub/deep.nii.gz"])
    outside = _tree(tmp_path / "outside", ["secret.nii.gz", "folder/x.nii.gz"])
    (inputs / "inside-link.nii.gz").symlink_to(inputs / "scan.nii.gz")
    (inputs / "outside-link.nii.gz").symlink_to(outside / "secret.nii.gz")
    (inputs / "dangling.nii.gz").symlink_to(inputs / "gone.nii.gz")
    (inputs / "sub-link").symlink_to(inputs / "sub", target_is_directory=True)
    (inputs / "outside-dir").symlink_to(outside / "folder", target_is_directory=True)
    (inputs / "sub" / "loop").symlink_to(inputs, target_is_directory=True)
    server = Server()
    out = tmp_path / "out"
    with _client(server) as client:
        outcome = run_batch(BatchOptions(inputs, out, "m", recursive=True), client)
    status = {r.input: (r.status, r.error or "") for r in outcome.results}
    assert set(status) == {
        "dangling.nii.gz",
        "inside-link.nii.gz",
        "outside-dir",
        "outside-link.nii.gz",
        "scan.nii.gz",
        "sub-link/deep.nii.gz",
        "sub-link/loop",
        "sub/deep.nii.gz",
        "sub/loop",
    }
    followed = (
        "inside-link.nii.gz",
        "outside-link.nii.gz",
        "scan.nii.gz",
        "sub/deep.nii.gz",
        "sub-link/deep.nii.gz",
    )
    for name in followed:
        assert status[name][0] is Status.DONE, name
    assert (out / "outside-link.nii.gz").is_file() and not (out / "outside-link.nii.gz").is_symlink()
    assert (
        status["outside-dir"][0] is Status.SKIPPED and "folder outside INPUT_DIR" in status["outside-dir"][1]
    )
    assert status["dangling.nii.gz"][0] is Status.SKIPPED and "dangling" in status["dangling.nii.gz"][1]
    assert status["sub/loop"][0] is Status.SKIPPED and "loop" in status["sub/loop"][1]
    bodies = [gzip.decompress(s) for s in server.sent]
    assert any(b"secret" in body for body in bodies)  # the linked file was read
    assert not any(b"folder/x" in body for body in bodies)  # the linked folder was not walked
    report = json.loads((out / REPORT_NAME).read_text())
    assert len(report["files"]) == len(status)  # every input path is in the report


# -- resume verifies what was completed ------------------------------------------------------------


def test_resume_redoes_truncated_garbage_and_unrecorded_outputs(tmp_path: Path) -> None:
    names = ["a.nii.gz", "b.nii.gz", "c.nii.gz", "d.nii.gz", "e.nii.gz"]
    inputs = _tree(tmp_path / "in", names)
    out = tmp_path / "out"
    with _client(Server()) as client:
        first = run_batch(BatchOptions(inputs, out, "m"), client)
    assert first.count(Status.DONE) == 5
    manifest = [json.loads(line) for line in (out / MANIFEST_NAME).read_text().splitlines()]
    assert {m["input"] for m in manifest} == set(names)
    assert all(len(m["sha256"]) == 64 and m["size"] == (out / m["output"]).stat().st_size for m in manifest)
    (out / "a.nii.gz").write_bytes((out / "a.nii.gz").read_bytes()[:5])  # truncated
    garbage = bytearray((out / "b.nii.gz").read_bytes())
    garbage[-1] ^= 0xFF
    (out / "b.nii.gz").write_bytes(bytes(garbage))  # same size, other bytes
    (out / "c.nii.gz").unlink()  # missing
    kept = [line for line in (out / MANIFEST_NAME).read_text().splitlines() if '"d.nii.gz"' not in line]
    (out / MANIFEST_NAME).write_text("\n".join(kept) + '\n{"input": "cut short')  # d unrecorded
    server = Server()
    with _client(server) as client:
        again = run_batch(BatchOptions(inputs, out, "m"), client)
    by_input = {r.input: r for r in again.results}
    assert {k for k, r in by_input.items() if r.status is Status.DONE} == {
        "a.nii.gz",
        "b.nii.gz",
        "c.nii.gz",
        "d.nii.gz",
    }
    assert by_input["e.nii.gz"].status is Status.SKIPPED and "verified" in (by_input["e.nii.gz"].error or "")
    assert len(server.sent) == 4
    for name in names:
        assert (out / name).read_bytes().startswith(b"OUT:")
    with _client(Server()) as client:  # other parameters: nothing is trusted
        other = run_batch(BatchOptions(inputs, out, "m", params={"tile": "32"}), client)
    assert other.count(Status.DONE) == 5


# -- OUTPUT_DIR checked before the first upload -----------------------------------------------------


@pytest.fixture()
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder nobody can write into: mode 0o555, or, for root (whom modes do not stop), the
    immutable attribute."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("running as root without chattr +i: no way to make a read-only folder")
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_read_only_output_dir_stops_the_run_before_any_upload(tmp_path: Path, read_only_dir: Path) -> None:
    inputs = _tree(tmp_path / "in", ["a.nii.gz"])
    server = Server()
    with _client(server) as client, pytest.raises(OutputDirError, match="not writable"):
        run_batch(BatchOptions(inputs, read_only_dir, "m"), client)
    assert server.sent == [] and list(read_only_dir.iterdir()) == []
    with _client(server) as client, pytest.raises(OutputDirError, match="not writable"):
        run_batch(BatchOptions(inputs, read_only_dir / "new", "m"), client)  # cannot even create it


def test_full_output_dir_stops_the_run_before_any_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = _tree(tmp_path / "in", ["a.nii.gz"])

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    server = Server()
    with _client(server) as client, pytest.raises(OutputDirError, match="No space left"):
        run_batch(BatchOptions(inputs, tmp_path / "out", "m"), client)
    assert server.sent == [] and list((tmp_path / "out").iterdir()) == []


# -- the command line, against a real (tiny) HTTP server: exit codes, Ctrl-C -----------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    """``/v1/models``, and infer answers whose pace the test sets (``server.mode``)."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        body = json.dumps([{"name": "m", "spatial_dims": 3, "defaults": {}}]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        server: _HTTPServer = self.server  # type: ignore[assignment]
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with server.lock:
            server.posts += 1
        answer = b"OUT:" + body[:16]
        if server.mode == "slow":  # answers after a second
            time.sleep(1.0)
        self.send_response(200)
        self.send_header("X-Tilewise-Format", "nii.gz")
        if server.mode == "endless":  # starts the body, then trickles forever
            self.send_header("Content-Length", str(1 << 30))
            self.end_headers()
            try:
                while not server.closing.is_set():
                    self.wfile.write(b"x" * 1024)
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass
            return
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.mode, self.posts, self.lock, self.closing = mode, 0, threading.Lock(), threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture()
def http_server(request: pytest.FixtureRequest) -> Iterator[_HTTPServer]:
    server = _HTTPServer(request.param)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.closing.set()
    server.shutdown()
    server.server_close()


def _interruptible() -> None:
    """In the child before exec: SIGINT to its default, so Python installs its Ctrl-C handler even
    when the tests run where SIGINT is ignored (a shell's background job: ``.ci/run &``)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc.communicate(timeout=...)``; on a timeout the client is killed and its pipes read to
    the end (closed) before the failure is raised."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


def _batch(args: list[str], **kwargs) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILEWISE_")}
    return subprocess.Popen(
        [sys.executable, "-m", "service.cli", "batch", *args, "--model", "m", "--progress", "log"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_interruptible,
        **kwargs,
    )


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("http_server", ["fast"], indirect=True)
def test_cli_read_only_output_dir_exits_2_with_one_line(
    tmp_path: Path, read_only_dir: Path, http_server: _HTTPServer
) -> None:
    inputs = _tree(tmp_path / "in", ["a.nii.gz", "b.nii.gz"])
    proc = _batch([str(inputs), str(read_only_dir), "--url", http_server.url])
    stdout, stderr = _communicate(proc, 60)
    assert proc.returncode == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "not writable" in lines[0] and "Traceback" not in stderr
    assert http_server.posts == 0


def _report(out: Path) -> dict[str, tuple[str, str]]:
    report = json.loads((out / REPORT_NAME).read_text())
    assert report["interrupted"] is True
    return {f["input"]: (f["status"], f["error"] or "") for f in report["files"]}


@pytest.mark.parametrize("http_server", ["slow"], indirect=True)
def test_cli_first_ctrl_c_finishes_files_in_flight_and_reports_them_done(
    tmp_path: Path, http_server: _HTTPServer
) -> None:
    names = [f"s{i}.nii.gz" for i in range(6)]
    inputs, out = _tree(tmp_path / "in", names), tmp_path / "out"
    proc = _batch([str(inputs), str(out), "--url", http_server.url, "--concurrency", "2"])
    _wait_for(lambda: http_server.posts >= 2)
    proc.send_signal(signal.SIGINT)
    _, stderr = _communicate(proc, 60)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    files = _report(out)
    done = {k for k, (status, _) in files.items() if status == "done"}
    assert len(done) >= 2 and set(files) == set(names)  # the two in flight completed: done
    for name in done:
        assert (out / name).read_bytes().startswith(b"OUT:")
    for name in set(names) - done:
        assert files[name] == ("skipped", "interrupted before it was sent") and not (out / name).exists()
    assert not list(out.rglob("*.part"))
    recorded = {json.loads(line)["input"] for line in (out / MANIFEST_NAME).read_text().splitlines()}
    assert recorded == done


@pytest.mark.parametrize("http_server", ["endless"], indirect=True)
def test_cli_second_ctrl_c_aborts_transfers_cleanly(tmp_path: Path, http_server: _HTTPServer) -> None:
    names = [f"s{i}.nii.gz" for i in range(4)]
    inputs, out = _tree(tmp_path / "in", names), tmp_path / "out"
    proc = _batch([str(inputs), str(out), "--url", http_server.url, "--concurrency", "2"])
    _wait_for(lambda: len(list(out.rglob("*.part"))) >= 2)  # two answers half written
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, stderr = _communicate(proc, 30)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    files = _report(out)
    aborted = {k for k, (status, error) in files.items() if status == "failed" and "aborted" in error}
    assert len(aborted) == 2 and set(files) == set(names)
    assert all(files[n] == ("skipped", "interrupted before it was sent") for n in set(names) - aborted)
    assert not list(out.rglob("*.part")) and not any((out / n).exists() for n in names)
