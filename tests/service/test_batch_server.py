"""Acceptance of ``tilewise batch`` (issue 5) against a real ``tilewise serve`` on 127.0.0.1.

Real files, all shipped by PyPI packages: nilearn's MNI152 T1 template (197x233x189), nibabel's
``anatomical.nii`` (33x41x25, big-endian int16), a 16-bit PNG of pydicom-data's ``RG1_UNCR.dcm``
(a 1955x1841 radiograph, halved to keep the 2-core CI fast) and a JPEG of scikit-image's
``page``; plus a truncated ``.nii.gz`` and a text file. Volumes go through ``gaussian-3d`` and
images through ``gaussian-2d``, one batch run per model (a 3D model refuses 2D images with 422),
into one mirrored output tree.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _svc_helpers import Server as SvcServer
from _svc_helpers import clean_env, free_port, start_server, stop_server

nib = pytest.importorskip("nibabel")
tifffile = pytest.importorskip("tifffile")
Image = pytest.importorskip("PIL.Image")

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 120  # torch import + model load on 2 busy cores

VOLUMES = {  # relative input path -> shape
    "study1/mni152_t1.nii.gz": (197, 233, 189),
    "study1/sub/anatomical.nii": (33, 41, 25),
}
IMAGES = ("scans/xray/rg1_uncr.png", "scans/docs/page.jpg")
BROKEN = "study2/broken.nii.gz"
TEXT = "study2/README.txt"


# -- real data ------------------------------------------------------------------------------------


def _mni152() -> Path:
    import nilearn

    return (
        Path(nilearn.__file__).parent
        / "datasets"
        / "data"
        / "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz"
    )


def _anatomical() -> Path:
    return Path(nib.__file__).parent / "tests" / "data" / "anatomical.nii"


def _xray_png(dest: Path) -> None:
    """RG1_UNCR.dcm (MONOCHROME1, 16-bit) inverted for display, halved, as a 16-bit grey PNG."""
    pydicom = pytest.importorskip("pydicom")
    from pydicom.data import get_testdata_file

    path = get_testdata_file("RG1_UNCR.dcm")
    if path is None:
        pytest.skip("pydicom-data is not installed")
    ds = pydicom.dcmread(path)
    pixels = ds.pixel_array.astype(np.int64)
    if ds.PhotometricInterpretation == "MONOCHROME1":
        pixels = pixels.max() - pixels
    h, w = pixels.shape
    halved = pixels[: h // 2 * 2, : w // 2 * 2].reshape(h // 2, 2, w // 2, 2).mean(axis=(1, 3))
    image = Image.fromarray(halved.astype(np.uint16))
    image.save(dest)
    with Image.open(dest) as check:
        assert check.mode.startswith("I;16") or check.mode == "I", check.mode


def _page_jpeg(dest: Path) -> None:
    data = pytest.importorskip("skimage.data")
    Image.fromarray(data.page()).save(dest, quality=90)


def _truncated_nii_gz(dest: Path) -> None:
    """anatomical.nii gzipped, then cut in half: the header survives, the voxels do not."""
    whole = gzip.compress(_anatomical().read_bytes())
    dest.write_bytes(whole[: len(whole) // 2])


@pytest.fixture(scope="module")
def real_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("batch") / "in"
    for rel in (*VOLUMES, *IMAGES, BROKEN, TEXT):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_mni152(), root / "study1/mni152_t1.nii.gz")
    shutil.copyfile(_anatomical(), root / "study1/sub/anatomical.nii")
    _xray_png(root / IMAGES[0])
    _page_jpeg(root / IMAGES[1])
    _truncated_nii_gz(root / BROKEN)
    (root / TEXT).write_text("Scans of study 2. The broken one was cut off during a copy.\n")
    return root


# -- a real server --------------------------------------------------------------------------------


class Server:
    """``tilewise serve`` (the shared :func:`start_server`), restartable on the same port."""

    def __init__(self, workdir: Path, **env: str) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k.removeprefix("TILEWISE_").lower(): v for k, v in env.items()}
        self.proc: SvcServer | None = None

    def start(self) -> None:
        self.proc = start_server(
            self.workdir, cli_args=("--host", "127.0.0.1"), port=self.port, timeout_s=STARTUP_S, **self.env
        )

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)

    def requests(self) -> dict[tuple[str, str], float]:
        assert self.proc is not None
        return self.proc.requests()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("server"), TILEWISE_WARMUP="false")
    srv.start()
    yield srv
    srv.stop()


def batch(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``tilewise batch ...`` in a subprocess (plain log lines: stderr is no terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "batch", *args],
        cwd=REPO,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _load(path: Path) -> np.ndarray:
    name = path.name
    if name.endswith((".nii", ".nii.gz")):
        return np.asarray(nib.load(path).dataobj)
    if name.endswith((".tif", ".tiff")):
        return tifffile.imread(path)
    with Image.open(path) as img:
        return np.asarray(img)


def _report(out: Path) -> dict:
    return json.loads((out / "tilewise-report.json").read_text())


# -- acceptance -----------------------------------------------------------------------------------


def test_batch_real_folder_matches_infer_reports_and_resumes(
    server: Server, real_folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    # Volumes (and the text file) through gaussian-3d.
    run3d = (
        "--url",
        server.url,
        "--model",
        "gaussian-3d",
        "--recursive",
        "--pattern",
        "study*/**",
        "--tile",
        "128",
    )
    first = batch(str(real_folder), str(out), *run3d)
    assert first.returncode == 1, first.stderr  # non-zero because of the corrupt file only
    report = _report(out)
    files = {f["input"]: f for f in report["files"]}
    assert set(files) == {*VOLUMES, BROKEN, TEXT}
    for rel in VOLUMES:
        assert files[rel]["status"] == "done" and files[rel]["error"] is None
    assert files["study1/sub/anatomical.nii"]["output"] == "study1/sub/anatomical.nii.gz"
    assert files[BROKEN]["status"] == "failed" and files[BROKEN]["output"] is None
    assert files[BROKEN]["error"].startswith("HTTP 422 "), files[BROKEN]["error"]  # the server's error
    assert files[TEXT]["status"] == "skipped" and files[TEXT]["output"] is None
    assert report["summary"] | {"seconds": 0, "files_per_s": 0} == {
        "done": 2, "skipped": 1, "failed": 1, "seconds": 0, "files_per_s": 0,
    }  # fmt: skip
    assert "failed 1" in first.stdout

    # Images through gaussian-2d (probabilities, so TIFF outputs), into the same tree.
    run2d = ("--url", server.url, "--model", "gaussian-2d", "--recursive", "--pattern", "scans/**")
    second = batch(str(real_folder), str(out), *run2d, "--concurrency", "2")
    assert second.returncode == 0, second.stderr
    assert {f["output"] for f in _report(out)["files"]} == {
        "scans/xray/rg1_uncr.tiff",
        "scans/docs/page.tiff",
    }

    # The mirrored tree holds exactly the good outputs (no temporary or partial file).
    produced = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert produced == sorted(
        [
            "scans/docs/page.tiff",
            "scans/xray/rg1_uncr.tiff",
            "study1/mni152_t1.nii.gz",
            "study1/sub/anatomical.nii.gz",
            "tilewise-manifest.jsonl",  # what was completed, verified on resume
            "tilewise-report.json",
        ]
    )

    # Every output equals `tilewise infer` on the same file (same codecs, same model, in process).
    from service.cli import main

    expected = tmp_path / "expected"
    stem = {rel: rel.removesuffix(".gz").removesuffix(".nii") for rel in VOLUMES}
    pairs = [(rel, ["--model", "gaussian-3d", "--tile", "128"], stem[rel] + ".nii.gz") for rel in VOLUMES]
    pairs += [(rel, ["--model", "gaussian-2d"], rel.rsplit(".", 1)[0] + ".tiff") for rel in IMAGES]
    for rel, options, out_rel in pairs:
        target = expected / out_rel
        assert main(["infer", str(real_folder / rel), str(target), *options, "--device", "cpu"]) == 0
        got, want = _load(out / out_rel), _load(target)
        assert got.shape == want.shape and got.dtype == want.dtype, out_rel
        # Same code path; only CPU thread counts may differ between the two processes (float32
        # sums in another order), so allow a few ulp of the data's scale.
        scale = float(np.abs(want).max()) or 1.0
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale, err_msg=out_rel)
        if out_rel.endswith(".nii.gz"):
            np.testing.assert_array_equal(nib.load(out / out_rel).affine, nib.load(target).affine)
    assert _load(out / "study1/mni152_t1.nii.gz").shape == VOLUMES["study1/mni152_t1.nii.gz"]

    # Re-runs: completed files are skipped with no request; only the failed one is sent again.
    before = server.requests()
    again3d = batch(str(real_folder), str(out), *run3d)
    again2d = batch(str(real_folder), str(out), *run2d)
    after = server.requests()
    assert again3d.returncode == 1 and again2d.returncode == 0
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: v for k, v in delta.items() if v} == {("gaussian-3d", "422"): 1}
    assert _report(out)["summary"]["skipped"] == 2
    assert "done 0, skipped 2, failed 0" in again2d.stdout


def test_batch_survives_a_server_restart_without_partial_outputs(tmp_path: Path) -> None:
    """Kill the server mid-run, restart it on the same port 3 s later: every file completes, and
    every file that ever appears under a final name in OUTPUT_DIR is a whole, readable volume."""
    inputs, out = tmp_path / "in", tmp_path / "out"
    shapes = {}
    for i in range(16):
        (inputs / f"s{i:02d}").mkdir(parents=True)
        shutil.copyfile(_anatomical(), inputs / f"s{i:02d}/anatomical.nii")
        shapes[f"s{i:02d}/anatomical.nii.gz"] = VOLUMES["study1/sub/anatomical.nii"]

    srv = Server(tmp_path / "server", TILEWISE_WARMUP="false")
    srv.start()
    violations: list[str] = []
    checked: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for path in out.rglob("*") if out.exists() else ():
                rel = str(path.relative_to(out))
                if path.name.startswith(".") or rel in checked or rel.startswith("tilewise-"):
                    continue
                if not path.is_file():
                    continue
                try:
                    data = np.asarray(nib.load(path).dataobj)
                    if data.shape != shapes[rel] or not np.isfinite(data).all():
                        violations.append(f"{rel}: shape {data.shape}")
                    checked.add(rel)
                except Exception as exc:  # noqa: BLE001 - any failure to read is the bug we look for
                    violations.append(f"{rel}: {type(exc).__name__}: {exc}")
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    env = clean_env(TILEWISE_BACKOFF_MAX_S="2")
    args = [str(inputs), str(out), "--url", srv.url, "--model", "gaussian-3d", "-r", "--retries", "30"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "batch", *args, "--progress", "log"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(out.rglob("*.nii.gz")) and time.monotonic() < deadline:  # mid-run: some done
            time.sleep(0.05)
        srv.kill()
        time.sleep(3)
        srv.start()
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        stop.set()
        watcher.join(timeout=30)
        if proc.poll() is None:
            proc.kill()
        srv.stop()
    if proc.returncode != 0:  # the run may give up; a re-run must then finish the rest
        srv.start()
        try:
            rerun = batch(*args, env=env)
        finally:
            srv.stop()
        assert rerun.returncode == 0, rerun.stderr
    assert violations == []
    assert "retry" in stderr, stderr  # the run did see the outage
    report = _report(out)
    assert {f["output"] for f in report["files"]} == set(shapes)
    for rel, shape in shapes.items():
        assert np.asarray(nib.load(out / rel).dataobj).shape == shape
    assert not [p for p in out.rglob(".*") if p.is_file()]  # no temporary file left behind


def test_batch_backs_off_on_503_and_succeeds(tmp_path: Path) -> None:
    """A server with no queue (TILEWISE_QUEUE_SIZE=0) answers 503 + Retry-After to every request
    beyond the running one; three files in flight at once make the client back off (each job
    takes >= 50 ms, the three requests leave within a few ms), then all eight succeed."""
    inputs, out = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    for i in range(8):
        shutil.copyfile(_anatomical(), inputs / f"a{i}.nii")
    srv = Server(
        tmp_path / "server", TILEWISE_WARMUP="false", TILEWISE_QUEUE_SIZE="0", TILEWISE_RETRY_AFTER_S="1"
    )
    srv.start()
    try:
        result = batch(
            str(inputs), str(out), "--url", srv.url, "--model", "gaussian-3d",
            "--concurrency", "3", "--retries", "12",
        )  # fmt: skip
        counts = srv.requests()
    finally:
        srv.stop()
    assert result.returncode == 0, result.stderr
    assert counts.get(("gaussian-3d", "503"), 0) >= 1, counts  # the server did refuse some
    assert counts.get(("gaussian-3d", "200"), 0) == 8
    report = _report(out)
    assert report["summary"]["done"] == 8 and report["summary"]["failed"] == 0
    assert max(f["attempts"] for f in report["files"]) > 1
    assert "HTTP 503 queue_full" in result.stderr
