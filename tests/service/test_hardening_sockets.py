"""Issue 11, server side, through real sockets: `tilewise serve` processes on 127.0.0.1.

A client that disconnects stops its run; slow uploads hold no inference slot and end in 408;
an oversized request line or header is answered with JSON 414 / 431; temporary folders of killed
processes are removed by the next start, and a stopped server removes its own. Every loop here
is bounded in time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import nibabel as nib
import numpy as np
import pytest
from _svc_helpers import Server, start_server, stop_server

MODEL = "gaussian-3d"


def nifti(shape: tuple[int, ...]) -> bytes:
    data = np.random.default_rng(0).random(shape, dtype=np.float32)
    return nib.Nifti1Image(data, np.eye(4)).to_bytes()


def serve(tmp_dir: Path, *options: str, **env: str) -> Server:
    """`tilewise serve` (the production command: its protocol and shutdown) without warm-up."""
    return start_server(tmp_dir, cli_args=("--no-warmup", *options), **env)


def host_port(server: Server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def read_response(sock: socket.socket, timeout: float = 20.0) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP/1.1 response (``Content-Length`` framed) from a raw socket."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before a response head: {data[:200]!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def tiles_total(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(rf'^tilewise_tiles_total{{model="{MODEL}"}} ([0-9.e+]+)$', text, re.M)
    return float(match[1]) if match else 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = serve(
        tmp_path_factory.mktemp("sockets"),
        "--queue-size", "1", "--upload-grace", "1", "--upload-min-rate", "16384", "--upload-idle", "5",
    )  # fmt: skip
    yield srv
    stop_server(srv)


def test_long_query_and_huge_header_get_json_414_and_431(server: Server) -> None:
    get = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    cases = [
        (b"GET /v1/models?q=" + b"a" * 80_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 414, "uri_too_long"),
        (get + b"X-Big: " + b"b" * 2**20 + b"\r\n\r\n", 431, "headers_too_large"),
        # 40 headers of 1 KB, in one piece (h11 parses a complete head of any size)
        (get + (b"X-M: " + b"m" * 1000 + b"\r\n") * 40 + b"\r\n", 431, "headers_too_large"),
        (get + b"bad header line\r\n\r\n", 400, "bad_request"),
    ]  # fmt: skip
    for request, status, code in cases:
        with socket.create_connection(host_port(server), timeout=20) as sock:
            sock.sendall(request)
            got, headers, body = read_response(sock)
        assert got == status, body[:300]
        assert headers["content-type"] == "application/json"
        assert json.loads(body)["error"] == code
    assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200  # the server is fine


def test_stalled_uploads_hold_no_inference_slot(server: Server) -> None:
    """Three clients sending 1 KB/s: other requests are served (queue_size=1: two slots), and the
    slow ones get 408 once the grace period (1 s) has shown them below 16 KiB/s."""
    results: dict[int, tuple[int, dict, float]] = {}

    def slow_client(i: int) -> None:
        started = time.monotonic()
        with socket.create_connection(host_port(server), timeout=30) as sock:
            head = (
                f"POST /v1/models/{MODEL}/infer HTTP/1.1\r\nHost: localhost\r\n"
                f"Content-Length: {2**20}\r\n\r\n"
            )
            sock.sendall(head.encode())
            sock.setblocking(False)
            while time.monotonic() - started < 20:  # bounded: the server must answer long before
                try:
                    if sock.recv(1, socket.MSG_PEEK):
                        break
                except BlockingIOError:
                    pass
                try:
                    sock.send(b"\0" * 1024)
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    break
                time.sleep(1.0)
            sock.setblocking(True)
            status, _, body = read_response(sock)
            results[i] = (status, json.loads(body), time.monotonic() - started)

    threads = [threading.Thread(target=slow_client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the three uploads are in progress
    body = nifti((16, 16, 16))
    with httpx.Client(timeout=60) as client:
        for _ in range(4):
            response = client.post(f"{server.url}/v1/models/{MODEL}/infer?format=nii", content=body)
            assert response.status_code == 200, response.text
    for t in threads:
        t.join(30)
    assert sorted(results) == [0, 1, 2]
    for status, error, _ in results.values():
        assert status == 408 and error["error"] == "upload_timeout", error
        detail = error["detail"]  # the rate rule, not the idle timeout
        assert "slower than" in detail and "upload_min_rate=" in detail, detail


def test_a_client_that_disconnects_stops_its_run(server: Server) -> None:
    """13,824 tiles of 12^3 (one per batch) take tens of seconds; the client leaves after the first
    ones: the tiles counter stops within a batch and never reaches the plan's count."""
    query = "tile=12&halo=4&batch_size=1&format=nii"
    body = nifti((96, 96, 96))
    before = tiles_total(server)
    with socket.create_connection(host_port(server), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/models/{MODEL}/infer?{query} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        sent_at = time.monotonic()
        deadline = sent_at + 60
        while tiles_total(server) - before < 50:
            assert time.monotonic() < deadline, "the run never started counting tiles"
            time.sleep(0.1)
        per_tile_s = (time.monotonic() - sent_at) / 50  # here and now (an upper bound)
    # The socket is closed: the run stops at its next batch.
    time.sleep(1.0)
    stopped = tiles_total(server)
    time.sleep(2.0)
    assert tiles_total(server) == stopped
    assert stopped - before < 13824
    # The device is free again at once.
    started = time.monotonic()
    response = httpx.post(
        f"{server.url}/v1/models/{MODEL}/infer?format=nii", content=nifti((16,) * 3), timeout=60
    )
    waited_s = time.monotonic() - started
    left_s = (13824 - (stopped - before)) * per_tile_s  # what the abandoned run had left
    assert response.status_code == 200 and waited_s < 0.25 * left_s, (waited_s, left_s)


def _process_folders(root: Path) -> list[Path]:
    work = root / "tilewise-work"
    return sorted(p for p in work.iterdir() if p.is_dir()) if work.is_dir() else []


def test_temporary_folders_of_dead_processes_are_removed(tmp_path: Path) -> None:
    """A folder of a process that is gone (killed mid-upload, or any earlier crash) is removed by the
    next start on the same folder; a live server's is kept; a stopped server removes its own."""
    work = tmp_path / "tilewise-work"
    leftover = work / "424242-deadbeef" / "req-old"
    leftover.mkdir(parents=True)
    (leftover / "input").write_bytes(b"\0" * 4096)
    (leftover.parent / ".owner").write_text("424242\n")

    victim = serve(tmp_path)
    try:
        assert not leftover.parent.exists()  # swept at start-up
        (victim_folder,) = _process_folders(tmp_path)
        assert victim_folder.name.startswith(f"{victim.pid}-")
        # Killed mid-upload: its request folder stays behind.
        with socket.create_connection(host_port(victim), timeout=30) as sock:
            head = (
                f"POST /v1/models/{MODEL}/infer HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100000\r\n\r\n"
            )
            sock.sendall(head.encode())
            sock.sendall(b"\0" * 1000)
            deadline = time.monotonic() + 20
            while not list(victim_folder.glob("req-*/input")):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            victim.kill()
    finally:
        stop_server(victim)
    assert list(victim_folder.glob("req-*/input"))

    live = serve(tmp_path)
    try:
        assert not victim_folder.exists()  # the dead process's folder went at start-up
        (live_folder,) = _process_folders(tmp_path)
        other = serve(tmp_path)  # a second replica on the same disk keeps the live one's folder
        try:
            assert live_folder.exists() and len(_process_folders(tmp_path)) == 2
        finally:
            other.process.send_signal(signal.SIGTERM)
            other.process.wait(60)
        assert [p.name for p in _process_folders(tmp_path)] == [live_folder.name]
    finally:
        stop_server(live)
    assert not work.exists() or not any(work.iterdir())
    assert not os.path.exists(live_folder)
