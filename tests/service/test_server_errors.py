"""Bad input against a real server: the right status and JSON error each time, and the server lives.

Also: request ids, the byte limit enforced while reading, temporary files removed, metrics, docs,
and the API key (on a second server).
"""

from __future__ import annotations

import gzip
import io
import socket
import struct
import time
import zlib
from pathlib import Path

import httpx
import nibabel as nib
import numpy as np
import pytest
from _svc_helpers import Server, start_server, stop_server
from PIL import Image


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares ``width x height`` 8-bit grey pixels, with one tiny IDAT."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + chunk(b"IEND", b"")
    )


def _png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def _nifti(data: np.ndarray) -> bytes:
    return gzip.compress(nib.Nifti1Image(data, np.eye(4)).to_bytes(), compresslevel=1)


def _truncated(path: Path) -> bytes:
    raw = path.read_bytes()
    return raw[: len(raw) // 2]


@pytest.fixture(scope="module")
def example4d_path() -> Path:
    path = Path(nib.__file__).parent / "tests" / "data" / "example4d.nii.gz"
    if not path.is_file():
        pytest.skip("nibabel's example4d.nii.gz is missing")
    return path


def _cases(mni152: Path, example4d: Path) -> list[tuple[str, str, bytes, dict[str, str], int, str]]:
    rng = np.random.default_rng(0)
    volume = _nifti(rng.random((12, 10, 8), dtype=np.float32))
    rgb = _png(rng.integers(0, 255, (40, 30, 3), dtype=np.uint8))
    grey = _png(rng.integers(0, 255, (40, 30), dtype=np.uint8))
    nan = _nifti(np.full((8, 8, 8), np.nan, dtype=np.float32))
    whole_gz = gzip.compress(
        nib.Nifti1Image(rng.random((40, 40, 40), dtype=np.float32), np.eye(4)).to_bytes()
    )
    truncated_gz = whole_gz[: len(whole_gz) // 2]
    return [
        ("random-bytes", "gaussian-3d", rng.bytes(4096), {}, 415, "unsupported_media_type"),
        ("empty-body", "gaussian-3d", b"", {}, 400, "empty_body"),
        ("truncated-nii-gz", "gaussian-3d", truncated_gz, {}, 422, "decode_error"),
        ("truncated-mni152", "gaussian-3d", _truncated(mni152), {}, 422, "decode_error"),
        ("4d-nifti-to-3d-model", "gaussian-3d", example4d.read_bytes(), {}, 422, "unusable_input"),
        ("rgb-png-to-grey-only", "grey-only-2d", rgb, {}, 422, "unusable_input"),
        (
            "png-100000x100000",
            "gaussian-2d",
            _png_header_only(100_000, 100_000),
            {},
            413,
            "payload_too_large",
        ),
        ("unknown-model", "gaussian-4d", volume, {}, 404, "unknown_model"),
        ("tile-0", "gaussian-3d", volume, {"tile": "0"}, 400, "bad_parameter"),
        ("halo-minus-1", "gaussian-3d", volume, {"halo": "-1"}, 400, "bad_parameter"),
        ("halo-empties-core", "gaussian-3d", volume, {"tile": "8", "halo": "4"}, 400, "bad_parameter"),
        ("tile-wrong-axes", "gaussian-3d", volume, {"tile": "8,8"}, 400, "bad_parameter"),
        ("unknown-parameter", "gaussian-3d", volume, {"tiles": "8"}, 400, "bad_parameter"),
        ("bad-format", "gaussian-3d", volume, {"format": "jpeg"}, 400, "bad_parameter"),
        ("png-for-3d-output", "gaussian-3d", volume, {"format": "png"}, 400, "bad_parameter"),
        ("2d-image-to-3d-model", "gaussian-3d", grey, {}, 422, "unusable_input"),
        ("3d-volume-to-2d-model", "gaussian-2d", volume, {}, 422, "unusable_input"),
        ("nan-only", "gaussian-3d", nan, {}, 422, "unusable_input"),
    ]


def test_bad_inputs(client: httpx.Client, mni152_path: Path, example4d_path: Path, server_tmp: Path) -> None:
    for name, model, body, params, status, code in _cases(mni152_path, example4d_path):
        response = client.post(f"/v1/models/{model}/infer", content=body, params=params)
        assert response.status_code == status, (name, response.text)
        payload = response.json()
        assert payload["error"] == code, (name, payload)
        assert payload["detail"] and "Traceback" not in payload["detail"], name
        assert response.headers["x-request-id"] == payload["request_id"], name
        assert client.get("/healthz").status_code == 200, name
    _assert_no_temporary_files(server_tmp)


def _read_response(sock: socket.socket) -> str:
    """One HTTP response (headers and ``Content-Length`` body) read from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        part = sock.recv(65536)
        if not part:
            break
        body += part
    return (head + b"\r\n\r\n" + body).decode("latin-1")


def _assert_no_temporary_files(folder: Path) -> None:
    """No request folder is left (the running server's own, empty, process folder is)."""
    deadline = time.monotonic() + 5
    while any(folder.glob("tilewise-work/*/req-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(folder.glob("tilewise-work/*/req-*"))
    assert not [p for p in folder.glob("tilewise-*") if p.name != "tilewise-work"]


def test_upload_limit_stops_reading_early(server: Server, server_tmp: Path) -> None:
    """A declared body over the limit is refused before it is sent; an undeclared one when it
    passes the limit (the server answers while the client is still sending)."""
    limit = 8 * 2**20
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=30) as sock:
        head = (
            "POST /v1/models/gaussian-3d/infer HTTP/1.1\r\nHost: test\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {10 * limit}\r\n\r\n"
        )
        sock.sendall(head.encode() + b"\0" * 65536)  # 1/1280 of the declared body
        reply = _read_response(sock)
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert '"error":"payload_too_large"' in reply

    # Chunked, no Content-Length: the server answers once the body passes the limit, while the
    # client has not finished (the final zero-size chunk is never sent).
    import threading

    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=60) as sock:
        head = (
            "POST /v1/models/gaussian-3d/infer HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"100000\r\n" + b"\1" * 2**20 + b"\r\n"  # 1 MiB chunks

        def send() -> None:
            try:
                sock.sendall(head.encode())
                for _ in range(limit // 2**20 + 2):
                    sock.sendall(chunk)
            except OSError:
                pass  # the server closed the connection after answering

        sender = threading.Thread(target=send)
        sender.start()
        reply = _read_response(sock)
        sender.join(60)
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert "stopped reading after" in reply
    assert httpx.get(f"{server.url}/healthz", timeout=60).status_code == 200
    _assert_no_temporary_files(server_tmp)


def test_request_id_is_echoed_or_made(client: httpx.Client) -> None:
    assert client.get("/healthz", headers={"X-Request-ID": "abc-123"}).headers["x-request-id"] == "abc-123"
    made = client.get("/healthz", headers={"X-Request-ID": "bad id with spaces"}).headers["x-request-id"]
    assert made != "bad id with spaces" and len(made) == 32


def test_health_ready_models_metrics_docs(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready" and "gaussian-3d" in ready["models"]
    models = {m["name"]: m for m in client.get("/v1/models").json()}
    assert {"gaussian-2d", "gaussian-3d", "sobel-3d", "log-2d", "grey-only-2d"} <= set(models)
    entry = models["gaussian-3d"]
    for key in ("name", "spatial_dims", "in_channels", "out_channels", "backend", "alignment", "scale",
                "receptive_field", "params", "defaults"):  # fmt: skip
        assert key in entry, key
    assert set(entry["defaults"]) >= {"tile", "halo", "overlap", "blend", "batch_size", "output", "format"}
    assert entry["params"]["sigma"] == 2.0
    assert client.get("/v1/models/gaussian-3d").json()["name"] == "gaussian-3d"
    assert client.get("/v1/models/nope").status_code == 404
    metrics = client.get("/metrics").text
    for name in ("tilewise_requests_total", "tilewise_request_seconds", "tilewise_tiles_total",
                 "tilewise_queue_depth", "tilewise_bytes_in_total", "tilewise_bytes_out_total"):  # fmt: skip
        assert name in metrics, name
    openapi = client.get("/openapi.json").json()
    infer = openapi["paths"]["/v1/models/{name}/infer"]["post"]
    names = {p["name"] for p in infer["parameters"]}
    assert {"tile", "halo", "overlap", "blend", "batch_size", "output", "format"} <= names
    assert "multipart/form-data" in infer["requestBody"]["content"]
    assert client.get("/docs").status_code == 200
    unknown = client.get("/v2/nothing")
    assert unknown.status_code == 404 and unknown.json()["error"] == "not_found"


def test_api_key_with_tilewise_serve(tmp_path: Path, anatomical_path: Path, models_dir: Path) -> None:
    """``tilewise serve`` with options; ``TILEWISE_API_KEY`` protects ``/v1``."""
    options = ("--host", "127.0.0.1", "--models", str(models_dir), "--device", "cpu", "--queue-size", "1")
    server = start_server(tmp_path, cli_args=options, api_key="s3cret-key", warmup="false")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            body = anatomical_path.read_bytes()
            assert http.get("/healthz").status_code == 200  # probes need no key
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-key"}):
                response = http.post("/v1/models/gaussian-3d/infer", content=body, headers=headers)
                assert response.status_code == 401
                assert response.json()["error"] == "unauthorized"
                assert response.headers["www-authenticate"] == "Bearer"
            assert http.get("/v1/models").status_code == 401
            good = {"Authorization": "Bearer s3cret-key"}
            assert http.get("/v1/models", headers=good).status_code == 200
            response = http.post("/v1/models/gaussian-3d/infer", content=body, headers=good)
            assert response.status_code == 200, response.text
            names = [m["name"] for m in http.get("/v1/models", headers=good).json()]
            assert "grey-only-2d" in names  # --models was honoured
    finally:
        stop_server(server)


def _metric(url: str, prefix: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith(prefix):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_client_that_disconnects_frees_its_queue_slot(server: Server, anatomical_path: Path) -> None:
    """A waiting request whose client goes away leaves the queue while the running job goes on."""
    import threading

    depth = "tilewise_queue_depth "
    assert _wait_for(lambda: _metric(server.url, depth) == 0)
    volume = np.random.default_rng(0).random((64, 64, 64), dtype=np.float32)  # 4096 tiles of 20^3
    slow_body = nib.Nifti1Image(volume, np.eye(4)).to_bytes()
    slow_url = f"{server.url}/v1/models/gaussian-3d/infer?tile=20&halo=8&batch_size=1&format=nii"
    result: list[int] = []
    slow = threading.Thread(
        target=lambda: result.append(httpx.post(slow_url, content=slow_body, timeout=300).status_code)
    )
    slow.start()
    assert _wait_for(lambda: _metric(server.url, depth) == 1)
    gone_before = _metric(server.url, 'tilewise_requests_total{model="gaussian-3d",status="499"}')
    body = anatomical_path.read_bytes()
    head = (
        f"POST /v1/models/gaussian-3d/infer HTTP/1.1\r\nHost: test\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(head + body)
        assert _wait_for(lambda: _metric(server.url, depth) == 2)
    # The socket is closed: the waiting job must leave the queue before the running one ends.
    assert _wait_for(lambda: _metric(server.url, depth) <= 1, timeout_s=10)
    if not slow.is_alive():
        pytest.skip("the running job ended before the disconnect could be observed (machine too fast)")
    slow.join(300)
    assert result == [200]
    assert _metric(server.url, 'tilewise_requests_total{model="gaussian-3d",status="499"}') == gone_before + 1
    assert httpx.get(f"{server.url}/healthz", timeout=60).status_code == 200


def test_full_upload_bound_refuses_an_upload_before_reading_it(
    tmp_path: Path, models_dir: Path, anatomical_path: Path
) -> None:
    """Uploads in progress have a bound of their own and hold no queue slot: with both upload
    places held by unfinished bodies, one more upload gets 503 + Retry-After and none of its body
    is read or written, while the device queue stays empty."""
    server = start_server(
        tmp_path,
        models_dir=str(models_dir),
        queue_size="1",
        max_uploads="2",
        retry_after_s="5",
        warmup="false",
    )
    port = int(server.url.rsplit(":", 1)[1])
    depth = "tilewise_queue_depth "
    requests = lambda: list(tmp_path.glob("tilewise-work/*/req-*"))  # noqa: E731
    try:
        head = "POST /v1/models/gaussian-3d/infer HTTP/1.1\r\nHost: test\r\nContent-Length: {}\r\n\r\n"
        slow = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
        try:
            for sock in slow:  # max_uploads=2: both places held, bodies unfinished
                sock.sendall(head.format(2**22).encode() + b"\0" * 65536)
            assert _wait_for(lambda: len(requests()) == 2)
            assert _metric(server.url, depth) == 0  # no inference slot is held by an upload
            bytes_in = _metric(server.url, "tilewise_bytes_in_total")
            body = np.random.default_rng(0).bytes(65536)
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(head.format(len(body)).encode() + body)
                reply = _read_response(sock)
            assert reply.startswith("HTTP/1.1 503"), reply[:300]
            assert "\r\nretry-after: 5\r\n" in reply.lower()
            assert '"error":"queue_full"' in reply and "max_uploads=2" in reply
            assert _metric(server.url, "tilewise_bytes_in_total") == bytes_in  # nothing was read
            assert len(requests()) == 2  # nor written
        finally:
            for sock in slow:
                sock.close()
        # The clients went away mid-upload: their places are free again.
        assert _wait_for(lambda: not requests())
        response = httpx.post(
            f"{server.url}/v1/models/gaussian-3d/infer", content=anatomical_path.read_bytes(), timeout=60
        )
        assert response.status_code == 200, response.text
        _assert_no_temporary_files(tmp_path)
    finally:
        stop_server(server)
