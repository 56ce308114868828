"""Jobs on two `tilewise serve` replicas behind docker/nginx.conf, sharing one jobs folder (as
compose.yaml's volume): the replica running a job is SIGKILLed; the other takes the job over from
its last finished slab and finishes it, while every status poll through nginx is answered; and
`tilewise batch --jobs` over a folder finishes every file, equal to the synchronous outputs.

Figures (kill to takeover, tiles computed twice, polls answered) are logged at INFO:
``pytest -m slow tests/deploy/test_jobs_replicas.py -o log_cli=true --log-cli-level=INFO``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nibabel as nib
import numpy as np
import pytest

from ._infra import Cluster, Instance, start_balancer, start_instance, stop, tool, wait_http

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)

MODEL = "gaussian-3d"
# 12^3 tiles with a halo of 4 (cores of 4), one per batch: a 64^3 volume is 14 slabs of 196 tiles.
QUERY = {"tile": "12", "halo": "4", "batch_size": "1", "format": "nii.gz"}


@contextlib.contextmanager
def job_cluster(root: Path, models_dir: Path, lease_s: float = 10) -> Iterator[tuple[Cluster, Path]]:
    """Two replicas sharing ``root/jobs`` behind nginx; leases of ``lease_s``, scans every 0.25 s."""
    shared = root / "jobs"
    settings = {"jobs_dir": str(shared), "job_lease_s": str(lease_s), "job_scan_s": "0.25"}
    procs: list[subprocess.Popen[bytes]] = []
    balancer = None
    try:
        instances = []
        for name in ("a", "b"):
            instances.append(start_instance(root, name, models_dir, **settings))
            procs.append(instances[-1].proc)
        for inst in instances:
            wait_http(f"{inst.url}/readyz", 120, inst.proc)
        balancer = start_balancer(root, [inst.addr for inst in instances])
        yield Cluster(instances=instances, balancer=balancer), shared
    finally:
        if balancer is not None:
            stop(balancer.proc, signal.SIGQUIT)
        for proc in procs:
            stop(proc)


def nifti(shape: tuple[int, ...], seed: int) -> bytes:
    data = np.random.default_rng(seed).random(shape, dtype=np.float32)
    return nib.Nifti1Image(data, np.diag([1.2, 1.2, 2.0, 1.0])).to_bytes()


def owner(shared: Path, job_id: str, cluster: Cluster) -> Instance | None:
    """The replica whose process holds the job's newest lease."""
    folder = shared / "jobs" / job_id
    leases = sorted((p for p in folder.glob("lease.*")), key=lambda p: int(p.suffix[1:]))
    if not leases:
        return None
    with contextlib.suppress(OSError, ValueError):
        pid = json.loads(leases[-1].read_text())["pid"]
        return next((i for i in cluster.instances if i.proc.pid == pid), None)
    return None


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    return float(match[1]) if match else 0.0


class Poller(threading.Thread):
    """GET /v1/jobs/{id} through nginx every 0.1 s until the job ends; a 502 is retried at once."""

    def __init__(self, url: str, job_id: str) -> None:
        super().__init__(daemon=True)
        self.url, self.job_id = url, job_id
        self.codes: list[int] = []
        self.last: dict = {}
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                try:
                    response = client.get(f"{self.url}/v1/jobs/{self.job_id}")
                except httpx.TransportError:
                    self.codes.append(0)
                    continue
                self.codes.append(response.status_code)
                if response.status_code == 200:
                    self.last = response.json()
                    if self.last["state"] in ("done", "failed", "cancelled"):
                        return
                time.sleep(0.1)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_the_other_replica_takes_over_a_job_whose_replica_was_killed(tmp_path, models_dir):
    body = nifti((64, 64, 64), seed=0)
    with job_cluster(tmp_path, models_dir) as (cluster, shared):
        lb = cluster.balancer.url
        job = httpx.post(f"{lb}/v1/jobs", params={"model": MODEL, **QUERY}, content=body, timeout=60).json()
        seen: list[int] = []  # events stream through nginx as they happen (no buffering)
        with httpx.stream("GET", f"{lb}/v1/jobs/{job['id']}/events", timeout=30) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[len("data: ") :])["tiles_done"])
                if len(set(seen)) >= 3:
                    break
        assert seen == sorted(seen) and 0 < seen[-1] < 2744, seen
        poller = Poller(lb, job["id"])
        poller.start()
        wait_until(lambda: poller.last.get("tiles_done", 0) >= 600, 120, "600 tiles")
        victim = owner(shared, job["id"], cluster)
        assert victim is not None
        survivor = next(i for i in cluster.instances if i is not victim)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        killed = time.monotonic()
        wait_until(lambda: owner(shared, job["id"], cluster) is survivor, 60, "the takeover")
        takeover_s = time.monotonic() - killed
        poller.join(300)
        assert not poller.is_alive() and poller.last["state"] == "done", poller.last
        codes = poller.codes
        assert set(codes) <= {200, 502}, sorted(set(codes))
        assert codes[-1] == 200
        total = poller.last["tiles_total"]
        resumed = metric(survivor.url, "tilewise_job_tiles_resumed_total")
        computed = metric(survivor.url, "tilewise_job_tiles_computed_total")
        assert metric(survivor.url, "tilewise_job_takeovers_total") == 1
        record = json.loads((shared / "jobs" / job["id"] / "state.json").read_text())
        per_slab = total // record["checkpoint"]["key"]["grid"][0]
        assert total == 2744 and per_slab == 196
        # From its last finished slab: whole slabs skipped, every later tile computed once.
        assert resumed >= 2 * per_slab and resumed % per_slab == 0 and computed + resumed == total
        result = httpx.get(f"{lb}/v1/jobs/{job['id']}/result", timeout=60)
        sync = httpx.post(f"{survivor.url}/v1/models/{MODEL}/infer", params=QUERY, content=body, timeout=300)
        assert result.status_code == sync.status_code == 200 and result.content == sync.content
        logger.info(
            "takeover %.2f s after the kill; %d polls, %d answered 502 (retried); %d tiles resumed",
            takeover_s, len(codes), codes.count(502), resumed,
        )  # fmt: skip


def test_a_hung_replica_loses_its_job_when_the_lease_expires(tmp_path, models_dir):
    """SIGSTOP (not SIGKILL): the owner's lock stays held, so only the expiry frees the job; when the
    owner wakes up it finds the newer lease (fencing) and stops without writing to the job."""
    body = nifti((64, 64, 64), seed=1)
    with job_cluster(tmp_path, models_dir, lease_s=3) as (cluster, shared):
        lb = cluster.balancer.url
        job = httpx.post(f"{lb}/v1/jobs", params={"model": MODEL, **QUERY}, content=body, timeout=60).json()
        status = f"{lb}/v1/jobs/{job['id']}"
        wait_until(lambda: httpx.get(status, timeout=10).json()["tiles_done"] >= 300, 120, "300 tiles")
        victim = owner(shared, job["id"], cluster)
        assert victim is not None
        survivor = next(i for i in cluster.instances if i is not victim)
        victim.proc.send_signal(signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            wait_until(lambda: owner(shared, job["id"], cluster) is survivor, 60, "the takeover")
            takeover_s = time.monotonic() - stopped
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        # Not before the lease expired (3 s after the last renewal, renewed every second): the lock
        # of the stopped owner was held all along.
        assert takeover_s >= 1.9
        wait_until(lambda: httpx.get(status, timeout=10).json()["state"] == "done", 300, "the job to finish")
        before = metric(victim.url, "tilewise_job_tiles_computed_total")
        time.sleep(1.0)
        assert metric(victim.url, "tilewise_job_tiles_computed_total") == before  # it stopped
        assert "was taken over; stopping" in victim.log_text()
        result = httpx.get(f"{status}/result", timeout=60)
        sync = httpx.post(f"{survivor.url}/v1/models/{MODEL}/infer", params=QUERY, content=body, timeout=300)
        assert result.status_code == sync.status_code == 200 and result.content == sync.content
        logger.info("hung owner: taken over %.2f s after SIGSTOP (lease 3 s, scan 0.25 s)", takeover_s)


def test_batch_jobs_survives_a_killed_replica(tmp_path, models_dir):
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    bodies = {f"scan{i}.nii": nifti((48, 48, 48), seed=10 + i) for i in range(4)}
    for name, data in bodies.items():
        (inputs / name).write_bytes(data)
    tilewise = tool("tilewise")
    assert tilewise is not None
    with job_cluster(tmp_path, models_dir) as (cluster, shared):
        lb = cluster.balancer.url
        options = [f"--{k.replace('_', '-')}={v}" for k, v in QUERY.items()]
        cmd = [tilewise, "batch", str(inputs), str(outputs), "--url", lb, "--model", MODEL, "--jobs",
               "--concurrency", "2", "--progress", "log", "--retries", "8", *options]  # fmt: skip
        log = (tmp_path / "batch.log").open("wb")
        batch = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:

            def running_job():
                jobs = httpx.get(f"{lb}/v1/jobs", timeout=10).json()
                return next((j for j in jobs if j["state"] == "running" and j["tiles_done"] >= 200), None)

            job = wait_until(running_job, 120, "a running job")
            victim = owner(shared, job["id"], cluster)
            assert victim is not None
            victim.proc.send_signal(signal.SIGKILL)
            assert batch.wait(600) == 0, (tmp_path / "batch.log").read_text()[-3000:]
        finally:
            stop(batch)
            log.close()
        survivor = next(i for i in cluster.instances if i is not victim)
        report = json.loads((outputs / "tilewise-report.json").read_text())
        assert report["summary"]["done"] == 4 and report["summary"]["failed"] == 0, report
        assert sorted(p.name for p in outputs.iterdir() if not p.name.startswith("tilewise-")) == sorted(
            f"{name}.gz" for name in bodies
        )  # no partial file (.part) left behind
        for name, data in bodies.items():
            sync = httpx.post(
                f"{survivor.url}/v1/models/{MODEL}/infer", params=QUERY, content=data, timeout=300
            )
            assert (outputs / f"{name}.gz").read_bytes() == sync.content, name
        assert metric(survivor.url, "tilewise_job_takeovers_total") >= 1
