"""``tilewise infer --dask`` and cluster jobs: the same file as in process (issue 17).

Only the network's tiled passes go to the cluster (:mod:`service.cluster`); decoding, geometry,
preprocessing, TTA, labels and encoding are the pipeline's, so the outputs must agree:
probabilities within 1e-5, labels identical, NIfTI header and affine byte for byte.

- ``--dask local:2`` (a ``LocalCluster`` of two worker processes, one thread each): nilearn's
  MNI152 T1 at 2 mm through the built-in ``tissue-3d`` (``spacing=native``, 8 chunks,
  probabilities). A ``LocalCluster`` by its address: a random conv stack (:mod:`_dask_nets`) whose
  spec resamples and reorients (LPS 1.5 x 1.5 x 2 mm -> RAS 1 mm and back), probabilities, and
  labels with ``tta=mirror`` (8 passes).
- Jobs: ``TILEWISE_DASK_SCHEDULER`` at a ``LocalCluster``'s address and a small
  ``TILEWISE_DASK_MIN_VOXELS``: the large volume's job runs on the cluster (its record names the
  scheduler, its ``stage`` says so, and the cluster ran tasks), the small one in process; both
  equal the synchronous answer.
- ``slow``: ``tissue-3d`` labels, on its own 1 mm grid (resampled both ways) and native; a scheduler and
  two workers started as separate ``dask`` processes, addressed only by ``tcp://127.0.0.1:PORT``,
  and the same run with one worker process killed (SIGKILL) mid-run: Dask re-runs its tasks (on
  the survivor and the worker its nanny restarts) and the file is the same.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
from _dask_nets import NAME, random_volume, write_model
from _inprocess import InProcessClient
from _jobs_helpers import mni152_2mm, wait_for

from service.cli import main

distributed = pytest.importorskip("distributed")

ATOL = 1e-5
HERE = Path(__file__).resolve().parent
logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def mni2(tmp_path_factory: pytest.TempPathFactory, mni152_path: Path) -> Path:
    return mni152_2mm(mni152_path, tmp_path_factory.mktemp("mni") / "mni2.nii.gz")


@pytest.fixture(scope="module")
def conv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("conv-models")
    write_model(folder)
    return folder


def _infer(source: Path, target: Path, *options: str) -> nib.Nifti1Image:
    assert main(["infer", str(source), str(target), "--device", "cpu", *options]) == 0
    return nib.load(target)


def _assert_same(dask: nib.Nifti1Image, local: nib.Nifti1Image, what: str) -> float:
    """Same header and affine; labels identical, probabilities within ``ATOL``; the max difference."""
    assert dask.header.binaryblock == local.header.binaryblock, what
    assert np.array_equal(dask.affine, local.affine), what
    a, b = np.asarray(dask.dataobj), np.asarray(local.dataobj)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.dtype == np.uint8:
        assert np.array_equal(a, b), f"{what}: {int((a != b).sum())} labels differ"
        return 0.0
    diff = float(np.abs(a.astype(np.float64) - b).max())
    logger.info("%s: max |dask - in process| = %.3g", what, diff)
    assert diff <= ATOL, f"{what}: {diff}"
    return diff


def _no_leftovers(folder: Path) -> None:
    assert not [p for p in folder.iterdir() if p.name.startswith((".tilewise-dask", "tilewise-dask", "."))]


# ---------------------------------------------------------------------------------------------
# --dask local:2, and a LocalCluster by its address


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A ``LocalCluster`` of two worker processes (one thread each), shared by the module's tests."""
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as local:
        yield local


def test_tissue_3d_on_local_2_equals_in_process(mni2: Path, tmp_path: Path) -> None:
    base = ["--model", "tissue-3d", "--models", str(tmp_path / "no-models"), "--spacing", "native"]
    base += ["--output", "probabilities"]
    local = _infer(mni2, tmp_path / "local.nii.gz", *base)
    dask = _infer(mni2, tmp_path / "dask.nii.gz", *base, "--dask", "local:2", "--dask-chunk", "64")
    _assert_same(dask, local, "tissue-3d probabilities")
    _no_leftovers(tmp_path)


def test_conv_stack_with_geometry_tta_and_labels_on_a_cluster(
    cluster: Any, conv_dir: Path, tmp_path: Path
) -> None:
    source = random_volume(tmp_path / "in.nii.gz", (24, 22, 18))
    base = ["--model", NAME, "--models", str(conv_dir)]
    runs = {"probabilities": ["--output", "probabilities"], "tta-labels": ["--tta", "mirror"]}
    for what, options in runs.items():
        local = _infer(source, tmp_path / f"local-{what}.nii.gz", *base, *options)
        dask = _infer(source, tmp_path / f"dask-{what}.nii.gz", *base, *options,
                      "--dask", cluster.scheduler_address)  # fmt: skip
        _assert_same(dask, local, f"conv stack {what}")
    assert nib.load(tmp_path / "local-tta-labels.nii.gz").shape == (24, 22, 18)


def test_dask_failures_exit_1_and_leave_nothing(
    conv_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import service.cluster

    monkeypatch.setattr(service.cluster, "CONNECT_TIMEOUT_S", 2)
    source = random_volume(tmp_path / "in.nii.gz", (12, 12, 12))
    out = tmp_path / "out"
    base = ["infer", str(source), str(out / "x.nii.gz"), "--model", NAME, "--models", str(conv_dir)]
    assert main([*base, "--dask", "local:zero"]) == 1
    assert main([*base, "--dask", "tcp://127.0.0.1:9", "--device", "cpu"]) == 1  # nothing listens
    assert not out.exists() or not list(out.iterdir())


# ---------------------------------------------------------------------------------------------
# Jobs


def test_a_large_job_goes_to_the_cluster_and_a_small_one_stays(
    cluster: Any, conv_dir: Path, make_settings: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from models import ModelRepository
    from service.app import create_app

    large = random_volume(tmp_path / "large.nii.gz", (40, 36, 30)).read_bytes()
    small = random_volume(tmp_path / "small.nii.gz", (10, 9, 8)).read_bytes()
    with distributed.Client(cluster, set_as_default=False) as watcher:
        before = watcher.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.transition_log))
        settings = make_settings(
            tmp_dir=tmp_path / "tmp", jobs_dir=tmp_path / "jobs", models_dir=conv_dir,
            dask_scheduler=cluster.scheduler_address, dask_min_voxels=40 * 36 * 30 - 1,
        )  # fmt: skip
        app = create_app(settings, repository=ModelRepository(conv_dir, device="cpu"))
        with InProcessClient(app) as client, caplog.at_level(logging.INFO, logger="service.jobs.runner"):
            results = {}
            for name, body in (("large", large), ("small", small)):
                job = client.post("/v1/jobs", params={"model": NAME}, content=body).json()

                def finished(url: str = f"/v1/jobs/{job['id']}") -> dict[str, Any] | None:
                    status: dict[str, Any] = client.get(url).json()
                    return status if status["state"] in ("done", "failed") else None

                status = wait_for(finished, 120, f"the {name} job")
                assert status["state"] == "done", status
                result = client.get(f"/v1/jobs/{job['id']}/result")
                sync = client.post(f"/v1/models/{NAME}/infer", content=body)
                assert result.status_code == sync.status_code == 200
                record = json.loads((tmp_path / "jobs" / "jobs" / job["id"] / "state.json").read_text())
                results[name] = (status, record, result.content, sync.content)
        tasks = watcher.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.transition_log))
    for name, (_, _, got, want) in results.items():
        a, b = (nib.Nifti1Image.from_bytes(gzip.decompress(x)) for x in (got, want))
        _assert_same(a, b, f"{name} job")
    large_status, large_record = results["large"][:2]
    assert large_record["cluster"] == cluster.scheduler_address
    assert large_status["stage"] == "dask: reading the output back"
    assert large_status["tiles_done"] == large_status["tiles_total"] > 0
    assert results["small"][1].get("cluster") is None and results["small"][0]["stage"] is None
    sent = [r for r in caplog.records if "tiled passes on the Dask cluster" in r.getMessage()]
    assert len(sent) == 1 and large_record["id"] in sent[0].getMessage()
    assert tasks > before


# ---------------------------------------------------------------------------------------------
# slow


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tissue_3d_labels_on_local_2_equal_in_process(mni2: Path, tmp_path: Path) -> None:
    # Its own 1 mm grid (2 mm -> 1 mm and back, the labels the argmax of resampled probabilities),
    # and spacing=native (labels reduced on the workers).
    base = ["--model", "tissue-3d", "--models", str(tmp_path / "no-models")]
    for what, options in {"1 mm": [], "native": ["--spacing", "native", "--dask-chunk", "64"]}.items():
        local = _infer(mni2, tmp_path / "local.nii.gz", *base, *options)
        dask = _infer(mni2, tmp_path / "dask.nii.gz", *base, *options, "--dask", "local:2")
        _assert_same(dask, local, f"tissue-3d labels, {what}")


class _DaskProcesses:
    """``dask scheduler`` and ``dask worker`` processes (each in its own process group), stopped on exit."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen[bytes]] = []
        self.scheduler_file = folder / "scheduler.json"
        path = [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        dask = Path(sys.executable).with_name("dask")
        self.command = [str(dask)] if dask.exists() else [sys.executable, "-m", "dask"]

    def __enter__(self) -> _DaskProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                if p.poll() is None:
                    os.killpg(p.pid, sig)
            deadline = time.monotonic() + 20
            while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
                time.sleep(0.1)

    def _start(self, *args: str) -> None:
        log = open(self.folder / f"dask-{len(self.procs)}.log", "wb")  # noqa: SIM115 - closed below
        self.procs.append(
            subprocess.Popen([*self.command, *args], stdout=log, stderr=subprocess.STDOUT, env=self.env,
                             start_new_session=True)
        )  # fmt: skip
        log.close()

    def scheduler(self) -> str:
        self._start("scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                    "--scheduler-file", str(self.scheduler_file))  # fmt: skip
        wait_for(lambda: self.scheduler_file.exists() and self.scheduler_file.stat().st_size, 60, "scheduler")
        address: str = json.loads(self.scheduler_file.read_text())["address"]
        return address

    def worker(self) -> None:
        self._start("worker", "--scheduler-file", str(self.scheduler_file), "--nworkers", "1",
                    "--nthreads", "1", "--no-dashboard", "--death-timeout", "60")  # fmt: skip


@pytest.fixture
def dask_processes(tmp_path: Path) -> Iterator[_DaskProcesses]:
    with _DaskProcesses(tmp_path) as procs:
        yield procs


def _chunks_written(workdir: Path) -> int:
    return sum(1 for f in workdir.glob("*/out.zarr/**/*") if f.is_file() and f.name not in ("zarr.json",))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_separate_dask_processes_and_a_killed_worker(dask_processes: _DaskProcesses, tmp_path: Path) -> None:
    address = dask_processes.scheduler()
    assert address.startswith("tcp://127.0.0.1:")
    dask_processes.worker()
    dask_processes.worker()
    source = random_volume(tmp_path / "in.nii.gz", (48, 44, 36))
    fast, slow = tmp_path / "models-fast", tmp_path / "models-slow"
    write_model(fast)
    write_model(slow, params={"delay_s": 0.5})  # same weights, 0.5 s per forward pass
    probabilities = ["--model", NAME, "--output", "probabilities"]
    want = _infer(source, tmp_path / "local.nii.gz", *probabilities, "--models", str(fast))
    with distributed.Client(address, set_as_default=False, timeout=60) as watcher:
        watcher.wait_for_workers(2, timeout=120)
        plain = _infer(source, tmp_path / "plain.nii.gz", *probabilities, "--models", str(fast),
                       "--dask", address)  # fmt: skip
        _assert_same(plain, want, "separate processes")
        workdir = tmp_path / "work"
        args = [str(source), str(tmp_path / "killed.nii.gz"), *probabilities, "--models", str(slow),
                "--dask", address, "--dask-workdir", str(workdir)]  # fmt: skip
        with ThreadPoolExecutor(1) as pool:
            run = pool.submit(_infer, *map(Path, args[:2]), *args[2:])
            wait_for(lambda: _chunks_written(workdir) >= 3 or run.done(), 300, "3 chunks to be written")
            assert not run.done(), run.result()
            pids = watcher.run(os.getpid)
            victim = sorted(pids.values())[0]
            os.kill(victim, signal.SIGKILL)
            written = _chunks_written(workdir)
            killed = run.result(timeout=600)
        logger.info("SIGKILL of worker pid %d after %d of 27 chunks written", victim, written)
        assert written < 27
    _assert_same(killed, want, "separate processes, a worker killed")
    assert not list(workdir.iterdir())
