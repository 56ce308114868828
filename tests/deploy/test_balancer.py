"""docker/nginx.conf in front of two real `tilewise serve` processes on 127.0.0.1.

The first tests share one pair of instances and one nginx (`cluster`, module scope; the SIGTERM
test stops an instance, so it comes after the others that use it); the kill test has its own
(`fresh_cluster`). Starting a pair takes 15-25 s here, most of it importing torch. Requests go
through nginx the way clients send them: GET /v1/models and POST /v1/models/{name}/infer with the
file as the body.
"""

from __future__ import annotations

import gzip
import re
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx
import nibabel as nib
import numpy as np
import pytest
from scipy import ndimage

from ._infra import NGINX_CONF, Cluster, Instance, wait_http
from ._infra import stop as stop_process

pytestmark = pytest.mark.slow  # heavy: run with -m slow

SMALL_MODEL = "gaussian-3d"


@pytest.fixture(scope="module")
def small_volume() -> tuple[bytes, np.ndarray]:
    """An uncompressed NIfTI (24^3 float32, deterministic) and its oracle output."""
    data = np.random.default_rng(0).random((24, 24, 24), dtype=np.float32)
    image = nib.Nifti1Image(data, np.diag([1.5, 1.5, 2.0, 1.0]))
    expected = ndimage.gaussian_filter(data, sigma=2.0, truncate=4.0, mode="constant")
    return image.to_bytes(), expected


def infer_url(base: str, model: str = SMALL_MODEL) -> str:
    return f"{base}/v1/models/{model}/infer?format=nii"


def decode(content: bytes) -> np.ndarray:
    return np.asarray(nib.Nifti1Image.from_bytes(content).dataobj)


def assert_correct(response: httpx.Response, expected: np.ndarray) -> None:
    assert response.status_code == 200, response.text[:500]
    out = decode(response.content).squeeze()
    assert out.shape == expected.shape
    # Gaussian smoothing of [0, 1) data in float32: the oracle agrees to ~1e-6; 1e-4 leaves margin.
    np.testing.assert_allclose(out, expected, atol=1e-4)


def max_fails() -> int:
    match = re.search(r"server tilewise:8000 .*max_fails=(\d+)", NGINX_CONF.read_text())
    assert match is not None
    return int(match[1])


def fail_timeout() -> float:
    match = re.search(r"server tilewise:8000 .*fail_timeout=(\d+)s", NGINX_CONF.read_text())
    assert match is not None
    return float(match[1])


def slow_request(seed: int) -> tuple[bytes, np.ndarray, str]:
    """A 96^3 NIfTI, its sobel-3d oracle, and the query that makes the instance take seconds on it
    (8^3 tiles, batch 1: ~2.4 s on one core), so that a signal lands while it is being computed."""
    data = np.random.default_rng(seed).random((96, 96, 96), dtype=np.float32)
    axes = [ndimage.sobel(data, axis=a, mode="constant") for a in range(3)]
    expected = np.sqrt(sum(a * a for a in axes))
    return nib.Nifti1Image(data, np.eye(4)).to_bytes(), expected, "&tile=8&batch_size=1"


def in_thread(target) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``target`` in a started thread; the list collects what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # reported by the test after join()
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def wait_for_request(cluster: Cluster, request_id: str, timeout: float = 30) -> Instance:
    """The instance whose log shows ``request_id`` (nginx passes X-Request-ID through)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for inst in cluster.instances:
            if request_id in inst.log_text():
                return inst
        time.sleep(0.05)
    raise AssertionError(f"no instance logged request {request_id}")


def test_requests_spread_over_both_and_request_id_passes_through(cluster, small_volume):
    body, expected = small_volume
    lb = cluster.balancer.url
    models = httpx.get(f"{cluster.instances[0].url}/v1/models", timeout=30).json()
    n_before = len(cluster.balancer.access_entries())
    ids = []
    with httpx.Client(timeout=60) as client:
        for i in range(4):
            rid = f"spread-{i}-{uuid.uuid4().hex[:8]}"
            ids.append(rid)
            response = client.get(f"{lb}/v1/models", headers={"X-Request-ID": rid})
            assert response.status_code == 200 and response.json() == models
            assert response.headers["X-Request-ID"] == rid
            assert_correct(client.post(infer_url(lb), content=body), expected)
    entries = cluster.balancer.access_entries()[n_before:]
    used = [e["upstream"] for e in entries if "/v1/" in e["request"]]
    addrs = [inst.addr for inst in cluster.instances]
    # Sequential requests: least_conn ties, so nginx alternates.
    for addr in addrs:
        assert used.count(addr) >= 3, used
    assert [e["rid"] for e in entries if e["request"].startswith("GET /v1/models")] == ids
    # The instances saw the client's ids.
    logs = "".join(inst.log_text() for inst in cluster.instances)
    assert all(rid in logs for rid in ids)


def sparse_nifti(path: Path, shape: tuple[int, ...], dtype: type) -> int:
    """An uncompressed NIfTI of zeros written as a sparse file (header, then a hole)."""
    header = nib.Nifti1Header()
    header.set_data_dtype(dtype)
    header.set_data_shape(shape)
    header.set_qform(np.eye(4), code=1)
    header.set_sform(np.eye(4), code=1)
    offset = 352
    header.set_data_offset(offset)
    size = offset + int(np.prod(shape)) * np.dtype(dtype).itemsize
    with path.open("wb") as f:
        f.write(header.binaryblock)
        f.write(b"\0" * (offset - len(header.binaryblock)))
        f.truncate(size)
    return size


def test_large_nifti_passes_through(cluster, tmp_path):
    """A NIfTI of over 300 MB goes through nginx to an instance and back (1 GB volumes in service).

    float64 zeros (8 bytes a voxel: the most bytes for the least work), 6144 x 6144 x 1 (a 2D
    image as NIfTI, 302 MB), through gaussian-2d (a few seconds here). The instances run with
    compose.yaml's limits (1 GiB uploads, 512 Mi voxels); the service's defaults (2 GiB, 1 Gi
    voxels) would do as well.
    """
    shape = (6144, 6144, 1)
    path = tmp_path / "big.nii"
    size = sparse_nifti(path, shape, np.float64)
    assert size >= 300 * 10**6
    rid = f"large-{uuid.uuid4().hex[:8]}"
    with path.open("rb") as f:
        response = httpx.post(
            f"{cluster.balancer.url}/v1/models/gaussian-2d/infer",
            content=f,
            headers={"Content-Length": str(size), "X-Request-ID": rid},
            timeout=600,
        )
    assert response.status_code == 200, response.text[:500]
    out = nib.Nifti1Image.from_bytes(gzip.decompress(response.content))
    assert out.shape[:2] == shape[:2] and int(np.prod(out.shape)) == int(np.prod(shape))
    assert not np.asarray(out.dataobj).any()
    (entry,) = [e for e in cluster.balancer.access_entries() if e["rid"] == rid]
    assert entry["status"] == "200"


def test_sigterm_lets_the_in_flight_request_finish(cluster):
    """SIGTERM while a request is being computed: the instance finishes it, then exits; others serve.

    Stops an instance of the module's cluster: keep this test after the others that use it.
    """
    lb = cluster.balancer.url
    big, expected, slow = slow_request(1)
    rid = f"term-{uuid.uuid4().hex[:8]}"
    stopped: list[Instance] = []

    def terminate_receiver() -> None:
        inst = wait_for_request(cluster, rid)
        inst.proc.send_signal(signal.SIGTERM)
        stopped.append(inst)
        # Readiness fails first, while the instance still serves ...
        deadline = time.monotonic() + 5
        while httpx.get(f"{inst.url}/readyz", timeout=2).status_code != 503:
            assert time.monotonic() < deadline, "/readyz did not fail after SIGTERM"
            time.sleep(0.05)
        assert httpx.get(f"{inst.url}/healthz", timeout=2).headers["connection"] == "close"
        # ... then, after the drain (TILEWISE_DRAIN_S, 5 s), it stops listening.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{inst.url}/healthz", timeout=1)
            except httpx.ConnectError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the instance still accepts connections after SIGTERM")

    watcher, errors = in_thread(terminate_receiver)
    response = httpx.post(
        infer_url(lb, "sobel-3d") + slow, content=big, headers={"X-Request-ID": rid}, timeout=120
    )
    watcher.join(60)
    assert not errors, errors
    assert response.status_code == 200, response.text[:500]
    # Gradient magnitude of [0, 1) data: values up to ~20; float32 rounding stays far below 1e-3.
    np.testing.assert_allclose(decode(response.content).squeeze(), expected, atol=1e-3)
    (inst,) = stopped
    # uvicorn re-raises the signal after its graceful shutdown: exit status 0 or -SIGTERM.
    assert inst.proc.wait(40) in (0, -signal.SIGTERM), inst.log_text()[-3000:]
    log = inst.log_text()
    assert "Application shutdown complete" in log
    # The drained instance answered it itself, after the signal: it was in flight.
    assert log.index("SIGTERM: not ready") < log.index(f"request {rid} out: POST"), log[-3000:]
    (entry,) = [e for e in cluster.balancer.access_entries() if e["rid"] == rid]
    assert entry["status"] == "200" and entry["upstream"] == inst.addr, entry
    for _ in range(4):
        assert httpx.get(f"{lb}/v1/models", timeout=30).status_code == 200


def test_killed_instance(fresh_cluster, small_volume):
    """Kill one instance while it computes a synchronous inference, during a run of requests.

    nginx holds the whole upload of a synchronous inference and replays it on the live instance:
    the client gets the correct 200, not a 502. GETs keep answering correctly; POSTs that find
    the instance gone are passed on; and after max_fails failures nginx stops sending to it.
    """
    cluster = fresh_cluster
    body, expected = small_volume
    lb = cluster.balancer.url
    models = httpx.get(f"{lb}/v1/models", timeout=30).json()
    big, big_expected, slow = slow_request(2)
    victim: list[Instance] = []
    rid = f"kill-{uuid.uuid4().hex[:8]}"

    def kill_receiver() -> None:
        inst = wait_for_request(cluster, rid)
        inst.proc.send_signal(signal.SIGKILL)
        inst.proc.wait(10)
        victim.append(inst)

    with httpx.Client(timeout=60) as client:
        for _ in range(2):
            assert client.get(f"{lb}/v1/models").json() == models
            assert_correct(client.post(infer_url(lb), content=body), expected)
        n_before = len(cluster.balancer.access_entries())
        started = time.monotonic()

        killer, errors = in_thread(kill_receiver)
        response = client.post(infer_url(lb, "sobel-3d") + slow, content=big, headers={"X-Request-ID": rid})
        killer.join(30)
        assert not errors, errors
        assert response.status_code == 200, response.text[:500]
        assert response.headers["X-Request-ID"] == rid
        np.testing.assert_allclose(decode(response.content).squeeze(), big_expected, atol=1e-3)

        for _ in range(6):
            response = client.get(f"{lb}/v1/models")
            assert response.status_code == 200 and response.json() == models
            assert_correct(client.post(infer_url(lb), content=body), expected)

    (dead,) = victim
    (live,) = [i for i in cluster.instances if i is not dead]
    after = cluster.balancer.access_entries()[n_before:]
    # Replayed: the killed instance first (its connection reset: 502), then the live one.
    first = after[0]
    assert first["rid"] == rid and first["status"] == "200", first
    assert first["upstream"] == f"{dead.addr}, {live.addr}", first
    assert first["upstream_status"].replace(" ", "") == "502,200", first
    touched = [e for e in after if dead.addr in e["upstream"]]
    # Marked failed after max_fails failures (each passed on to the live instance), then tried
    # again once per fail_timeout.
    windows = 1 + int((time.monotonic() - started) // fail_timeout())
    assert len(touched) <= max_fails() * windows, [e["upstream"] for e in after]
    assert all(e["status"] == "200" for e in after), [e["status"] for e in after]


def test_no_502_or_503_while_one_replica_is_up(fresh_cluster, small_volume, models_dir):
    """A replica is stopped (SIGTERM) and started again while clients keep sending GETs and POSTs
    through nginx: every request gets a correct 200, and the restarted replica gets its share.

    Before the drain and the tuned balancer, a SIGTERMed replica made nginx answer 502 "no live
    upstreams" (a POST written onto a keep-alive connection the replica was closing cannot be
    retried) and a restarted one was avoided while the other answered 503.
    """
    from ._infra import start_instance

    cluster = fresh_cluster
    body, expected = small_volume
    lb = cluster.balancer.url
    statuses: list[tuple[str, int]] = []
    stop = threading.Event()
    failures: list[str] = []

    def client_loop(kind: str) -> None:
        with httpx.Client(timeout=60) as client:
            deadline = time.monotonic() + 120  # bounded, whatever happens
            while not stop.is_set() and time.monotonic() < deadline:
                if kind == "get":
                    response = client.get(f"{lb}/v1/models")
                    ok = response.status_code == 200 and bool(response.json())
                else:
                    response = client.post(infer_url(lb), content=body)
                    ok = response.status_code == 200
                    if ok:
                        out = decode(response.content).squeeze()
                        ok = bool(np.allclose(out, expected, atol=1e-4))
                statuses.append((kind, response.status_code))
                if not ok:
                    failures.append(f"{kind} {response.status_code} {response.text[:200]}")

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in ("get", "post", "post")]
    for t in threads:
        t.start()
    back: Instance | None = None
    try:
        time.sleep(2)
        victim = cluster.instances[0]
        n_before = len(cluster.balancer.access_entries())
        victim.proc.send_signal(signal.SIGTERM)
        assert victim.proc.wait(60) in (0, -signal.SIGTERM), victim.log_text()[-3000:]
        time.sleep(2)  # clients keep going with one replica
        name = victim.tmp_dir.name.removesuffix("-tmp")
        back = start_instance(victim.tmp_dir.parent, name, models_dir, port=victim.port)
        cluster.instances[0] = back
        wait_http(f"{back.url}/readyz", 120, back.proc)
        time.sleep(8)  # longer than fail_timeout: nginx sends to it again
    finally:
        stop.set()
        for t in threads:
            t.join(90)
        if back is not None:  # started here: the fixture stops only the instances it started
            stop_process(back.proc)
    assert not failures, (failures[:5], cluster.balancer.error_log.read_text()[-3000:])
    assert len(statuses) > 30, len(statuses)
    after = cluster.balancer.access_entries()[n_before:]
    bad = [(e["request"][:40], e["status"], e["upstream_status"]) for e in after if e["status"] != "200"]
    assert not bad, bad
    restarted = [e for e in after if e["upstream"].split(", ")[-1] == back.addr]
    assert len(restarted) >= 3, [e["upstream"] for e in after[-20:]]
    assert back is not None and "Application startup complete" in back.log_text()
