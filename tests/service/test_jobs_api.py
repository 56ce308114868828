"""The jobs API against a real server on 127.0.0.1 (API key on, queue of 2): the MNI152 T1 as a job
equals the synchronous answer byte for byte; events, cancel, idempotency, a crowd of submissions,
ids and keys that never reach the file system. (A synchronous client that disconnects stops its
run: tests/service/test_hardening_sockets.py.)"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import httpx
import pytest
from _jobs_helpers import VOLATILE_HEADERS, cpu_seconds, metric, mni152_2mm, nifti, read_events, wait_for
from _svc_helpers import Server, start_server, stop_server

from service.client import ClientSettings, JobFailedError, TilewiseClient

logger = logging.getLogger(__name__)

KEY = "jobs-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "gaussian-3d"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("jobs-api")
    srv = start_server(
        root, api_key=KEY, queue_size="2", jobs_dir=str(root / "jobs"), job_scan_s="0.2", warmup="false"
    )
    yield srv
    stop_server(srv)


@pytest.fixture
def client(server: Server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        yield http


def wait_state(client: httpx.Client, job_id: str, states: tuple[str, ...], timeout: float = 120) -> dict:
    def check():
        status = client.get(f"/v1/jobs/{job_id}").json()
        return status if status["state"] in states else None

    return wait_for(check, timeout, f"job {job_id} in {states}")


def test_mni152_as_a_job_streams_progress_and_equals_the_synchronous_answer(client, mni152_path, tmp_path):
    body = mni152_2mm(mni152_path, tmp_path / "mni2.nii.gz").read_bytes()
    query = {"batch_size": "1", "tile": "48", "halo": "8"}
    submitted = client.post("/v1/jobs", params={"model": MODEL, **query}, content=body)
    assert submitted.status_code == 202, submitted.text
    job = submitted.json()
    assert submitted.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["state"] == "queued" and job["model"] == MODEL and job["created"].endswith("Z")
    opened = time.monotonic()
    with client.stream("GET", f"/v1/jobs/{job['id']}/events") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = read_events(stream)
    seconds = time.monotonic() - opened
    names = [name for name, _ in events]
    assert names[-1] == "done" and set(names[:-1]) == {"progress"}
    done = [data["tiles_done"] for _, data in events]
    total = events[-1][1]["tiles_total"]
    assert done == sorted(done) and done[-1] == total > 1
    assert len({d for d in done if 0 < d < total}) >= 2, done  # rising tile by tile, not all at once
    final = events[-1][1]
    rate = len(events) / seconds
    # The record is written at most every 0.2 s while a job runs, and at each state and slab.
    assert len(events) <= seconds / 0.2 + 10, (len(events), seconds)
    logger.info("%d events in %.1f s (%.1f/s) for %d tiles", len(events), seconds, rate, total)
    assert final["progress"] == 1.0 and final["eta_s"] == 0.0 and final["finished"] >= final["started"]
    result = client.get(f"/v1/jobs/{job['id']}/result")
    sync = client.post(f"/v1/models/{MODEL}/infer", params=query, content=body)
    assert result.status_code == sync.status_code == 200
    assert result.content == sync.content
    same = {k: v for k, v in sync.headers.items() if k not in VOLATILE_HEADERS}
    assert {k: v for k, v in result.headers.items() if k not in VOLATILE_HEADERS} == same
    assert f"tiles={total};" in result.headers["x-tilewise-plan"]
    listed = client.get("/v1/jobs").json()
    assert listed[0]["id"] == job["id"] and listed[0]["state"] == "done"


def test_routes_need_the_key_and_ids_never_become_paths(server: Server, client: httpx.Client):
    assert httpx.get(f"{server.url}/v1/jobs", timeout=10).status_code == 401
    assert httpx.post(f"{server.url}/v1/jobs?model={MODEL}", content=b"x", timeout=10).status_code == 401
    for job_id in ("..%2F..%2Fstate.json", "0" * 31, "F" * 32, "0" * 32):
        for suffix in ("", "/events", "/result"):
            response = client.get(f"/v1/jobs/{job_id}{suffix}")
            assert response.status_code == 404, (job_id, suffix, response.text)
        assert client.delete(f"/v1/jobs/{job_id}").status_code == 404
    assert client.get("/v1/jobs/" + "0" * 32).json()["error"] == "unknown_job"
    assert client.post("/v1/jobs", content=nifti((8, 8, 8))).json()["error"] == "bad_parameter"
    assert client.post("/v1/jobs?model=nope-3d", content=nifti((8, 8, 8))).status_code == 404
    bad_key = client.post(
        f"/v1/jobs?model={MODEL}", content=nifti((8, 8, 8)), headers={"Idempotency-Key": "a b"}
    )
    assert bad_key.status_code == 400
    assert client.post(f"/v1/jobs?model={MODEL}&tile=0", content=nifti((8, 8, 8))).status_code == 400
    assert client.post(f"/v1/jobs?model={MODEL}", content=b"").json()["error"] == "empty_body"


def test_cancel_stops_the_network_within_a_batch(server: Server, client: httpx.Client, tmp_path):
    # 4,096 tiles of 12^3, one per batch: tens of seconds of work.
    query = {"model": MODEL, "tile": "12", "halo": "4", "batch_size": "1"}
    submitted = time.monotonic()
    job = client.post("/v1/jobs", params=query, content=nifti((64, 64, 64))).json()
    wait_for(lambda: client.get(f"/v1/jobs/{job['id']}").json()["tiles_done"] >= 20, 60, "20 tiles")
    per_tile_s = (time.monotonic() - submitted) / 20  # this machine, under its present load (an upper bound)
    early = client.get(f"/v1/jobs/{job['id']}/result")
    assert early.status_code == 409 and early.json()["error"] == "job_not_done"
    cancelled_at = time.monotonic()
    answer = client.delete(f"/v1/jobs/{job['id']}")
    assert answer.status_code == 202
    status = wait_state(client, job["id"], ("cancelled",), timeout=60)
    assert status["finished"] is not None and status["tiles_done"] < status["tiles_total"]
    # stopped at once: in a small part of the time its remaining tiles would have taken
    left_s = (status["tiles_total"] - status["tiles_done"]) * per_tile_s
    assert time.monotonic() - cancelled_at < 0.25 * left_s, (time.monotonic() - cancelled_at, left_s)
    tiles = metric(server.url, "tilewise_tiles_total", model=MODEL)
    cpu = cpu_seconds(server.pid)
    time.sleep(2.0)
    assert metric(server.url, "tilewise_tiles_total", model=MODEL) == tiles  # the network stopped
    assert cpu_seconds(server.pid) - cpu < 0.5  # idle: two seconds of wall time, little CPU
    gone = client.get(f"/v1/jobs/{job['id']}/result")
    assert gone.status_code == 409 and "was cancelled: it has no result" in gone.json()["detail"]
    assert client.delete(f"/v1/jobs/{job['id']}").json()["state"] == "cancelled"  # stays cancelled


def test_a_retried_submission_makes_one_job(client: httpx.Client):
    body = nifti((20, 20, 20), seed=1)
    headers = {"Idempotency-Key": "retry-7f3c"}
    first = client.post(f"/v1/jobs?model={MODEL}", content=body, headers=headers)
    again = client.post(f"/v1/jobs?model={MODEL}", content=body, headers=headers)
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    assert [j["id"] for j in client.get("/v1/jobs").json()].count(first.json()["id"]) == 1
    other = client.post(f"/v1/jobs?model={MODEL}&tile=16", content=body, headers=headers)
    assert other.status_code == 409 and other.json()["error"] == "idempotency_key_reused"
    # issue 23 item 8: the same key, model and parameters with another file is refused too
    changed = client.post(f"/v1/jobs?model={MODEL}", content=nifti((20, 20, 20), seed=2), headers=headers)
    assert changed.status_code == 409 and changed.json()["error"] == "idempotency_key_reused"
    assert "sha256" in changed.json()["detail"]
    wait_state(client, first.json()["id"], ("done",))
    for empty in ("",):  # `-H "Idempotency-Key: $(uuidgen)"` where uuidgen is missing
        blank = client.post(f"/v1/jobs?model={MODEL}", content=body, headers={"Idempotency-Key": empty})
        assert blank.status_code == 400 and "Idempotency-Key" in blank.json()["detail"], empty


def test_twenty_concurrent_submissions_with_a_queue_of_two_are_queued_or_refused(client: httpx.Client):
    bodies = [nifti((24, 24, 24), seed=i) for i in range(20)]
    answers: dict[int, httpx.Response] = {}
    barrier = threading.Barrier(20)

    def submit(i: int) -> None:
        barrier.wait()
        answers[i] = client.post(f"/v1/jobs?model={MODEL}&batch_size=1&tile=16&halo=4", content=bodies[i])

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in answers.values())
    assert set(codes) <= {202, 503} and 202 in codes and 503 in codes, codes
    for response in answers.values():
        if response.status_code == 503:
            assert response.json()["error"] == "queue_full" and "retry-after" in response.headers
    accepted = [r.json()["id"] for r in answers.values() if r.status_code == 202]
    for job_id in accepted:  # none lost: every accepted job finishes
        assert wait_state(client, job_id, ("done", "failed", "cancelled"))["state"] == "done"


def test_the_batch_client_runs_a_job_and_reports_a_failed_one(server: Server, tmp_path: Path):
    source = tmp_path / "in.nii"
    source.write_bytes(nifti((20, 20, 20), seed=3))
    seen = []
    settings = ClientSettings(url=server.url, api_key=KEY, backoff_base_s=0.05)
    with TilewiseClient(settings) as api:
        answer = api.run_job(source, tmp_path / "out.nii.gz", MODEL, {"tile": "16", "halo": "4"},
                             on_progress=lambda d, t: seen.append((d, t)))  # fmt: skip
        assert answer.format == "nii.gz" and (tmp_path / "out.nii.gz").stat().st_size == answer.bytes_out
        assert seen[-1][0] == seen[-1][1] == 8
        source.write_bytes(nifti((20, 20, 20), seed=3)[:-4000])  # the header is fine, the data cut
        with pytest.raises(JobFailedError, match="decode_error"):
            api.run_job(source, tmp_path / "bad.nii.gz", MODEL)
