"""A server SIGKILLed mid-job and started again finishes the job from its last finished slab: at
most one slab (tile row) of tiles is computed twice, and the result still equals the synchronous
answer byte for byte. Slow (two server starts and a 210-tile run): ``-m slow``."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest
from _jobs_helpers import metric, mni152_2mm, wait_for
from _svc_helpers import start_server, stop_server

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)

MODEL = "gaussian-3d"
# MNI152 at 2 mm (99x117x95), tiles of 32 with a halo of 8: a 6x7x5 grid, 35 tiles per slab.
QUERY = {"tile": "32", "halo": "8", "batch_size": "1"}


def test_a_killed_server_resumes_its_job_from_the_last_slab(tmp_path, mni152_path):
    body = mni152_2mm(mni152_path, tmp_path / "mni2.nii.gz").read_bytes()
    jobs_dir = tmp_path / "jobs"
    env = {"jobs_dir": str(jobs_dir), "job_scan_s": "0.2", "warmup": "false"}
    first = start_server(tmp_path, **env)
    restarted = None
    try:
        url = first.url
        job = httpx.post(f"{url}/v1/jobs", params={"model": MODEL, **QUERY}, content=body, timeout=60).json()
        state_file = jobs_dir / "jobs" / job["id"] / "state.json"

        def mid_run() -> bool:
            return httpx.get(f"{url}/v1/jobs/{job['id']}", timeout=10).json()["tiles_done"] >= 85

        wait_for(mid_run, 180, "85 tiles")  # inside the third slab (tiles 70-104)
        computed_before = metric(url, "tilewise_job_tiles_computed_total", model=MODEL)
        first.kill()
        killed_at = time.monotonic()
        record = json.loads(state_file.read_text())
        rows_done = record["checkpoint"]["rows_done"]
        total, per_slab = (
            record["tiles_total"],
            record["tiles_total"] // record["checkpoint"]["key"]["grid"][0],
        )
        assert (total, per_slab) == (210, 35) and rows_done >= 2

        restarted = start_server(tmp_path, port=int(url.rsplit(":", 1)[1]), **env)
        final = wait_for(
            lambda: (
                (s := httpx.get(f"{url}/v1/jobs/{job['id']}", timeout=10).json())["state"] == "done" and s
            ),
            300,
            "the job to finish after the restart",
        )
        seconds = time.monotonic() - killed_at
        resumed = metric(url, "tilewise_job_tiles_resumed_total", model=MODEL)
        computed_after = metric(url, "tilewise_job_tiles_computed_total", model=MODEL)
        assert resumed == rows_done * per_slab  # batch_size 1: no batch alignment
        assert computed_after + resumed == total  # nothing before the last slab ran again
        twice = computed_before + computed_after - total
        assert 0 <= twice <= per_slab, (computed_before, computed_after, resumed)
        assert final["tiles_done"] == total
        result = httpx.get(f"{url}/v1/jobs/{job['id']}/result", timeout=60)
        sync = httpx.post(f"{url}/v1/models/{MODEL}/infer", params=QUERY, content=body, timeout=300)
        assert result.status_code == sync.status_code == 200 and result.content == sync.content
        logger.info("kill to done %.1f s; tiles computed twice: %d (a slab: %d)", seconds, twice, per_slab)
    finally:
        for server in (first, restarted):
            if server is not None:
                stop_server(server)
