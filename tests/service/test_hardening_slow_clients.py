"""Issue 24 item 4, through real sockets on a `tilewise serve` process: slow clients hold nothing
for long, and other clients are served throughout.

Attackers bind their sockets to other loopback addresses (127.0.0.2 ...: each a client of its
own, by address), normal requests come from 127.0.0.1. Timeouts are configured small (grace 1 s,
header timeout 2 s), so every loop here ends within seconds.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from _svc_helpers import Server, start_server, stop_server
from PIL import Image

MODEL = "gaussian-3d"
MIN_RATE = 16384
RATE = 20000  # bytes/s: 22 % above the minimum, as the 19.5 KB/s
HEADER_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 48


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    try:  # other loopback addresses must be usable as source addresses here
        with socket.socket() as probe:
            probe.bind(("127.0.0.17", 0))
    except OSError:
        pytest.skip("127.0.0.0/8 beyond 127.0.0.1 is not bindable here")
    srv = start_server(
        tmp_path_factory.mktemp("slow-clients"),
        cli_args=(
            "--no-warmup", "--drain", "0", "--queue-size", "4",
            "--max-uploads", "16", "--max-uploads-per-client", "4",
            "--upload-grace", "1", "--upload-min-rate", str(MIN_RATE), "--upload-idle", "5",
            "--header-timeout", str(HEADER_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
        ),
    )  # fmt: skip
    yield srv
    stop_server(srv)


def address(server: Server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def read_answer(sock: socket.socket, timeout: float = 10.0) -> tuple[int, bytes] | None:
    """The status and body of the server's answer, or ``None`` when it closed without one."""
    sock.setblocking(True)
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.lower().split(b"\r\n")
        length = next((int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length")), 0)
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    except (ConnectionResetError, TimeoutError):
        return None
    return int(head.split()[1]), body


class SlowUpload(threading.Thread):
    """One upload from ``source`` at ``rate`` bytes/s (paced on the clock, so a late thread
    catches up), until the server answers, ``stop`` is set, or 30 s have passed.

    ``answer`` is ``(status, body, seconds)`` once the server answered, ``None`` while it did not.
    """

    def __init__(self, server: Server, source: str, rate: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.target, self.source, self.rate, self.stop = address(server), source, rate, stop
        self.answer: tuple[int, bytes, float] | None = None
        self.started = threading.Event()

    def run(self) -> None:
        with socket.create_connection(self.target, timeout=30, source_address=(self.source, 0)) as sock:
            head = (
                f"POST /v1/models/{MODEL}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {8 * 2**20}\r\n\r\n"
            )
            sock.sendall(head.encode())
            began, sent = time.monotonic(), 0
            self.started.set()
            sock.setblocking(False)
            while not self.stop.is_set() and time.monotonic() - began < 30:
                try:
                    if sock.recv(1, socket.MSG_PEEK):
                        break  # the server answered
                except BlockingIOError:
                    pass
                except OSError:
                    break
                due = int((time.monotonic() - began) * self.rate) - sent
                try:
                    if due > 0:
                        sent += sock.send(b"\0" * due)
                except BlockingIOError:
                    pass
                except OSError:
                    break
                time.sleep(0.05)
            if self.stop.is_set():
                return
            answer = read_answer(sock)
            if answer is not None:
                self.answer = (answer[0], answer[1], time.monotonic() - began)


def attack(server: Server, sources: list[str], stop: threading.Event) -> list[SlowUpload]:
    uploads = [SlowUpload(server, source, RATE, stop) for source in sources]
    for upload in uploads:
        upload.start()
    for upload in uploads:
        upload.started.wait(10)
    return uploads


def normal_requests(server: Server, n: int) -> list[httpx.Response]:
    """``n`` ordinary requests from 127.0.0.1, one after another (a small PNG: gaussian-2d's
    footprint, measured at its first run, is quick to measure)."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (96, 80), dtype=np.uint8)).save(buffer, "PNG")
    with httpx.Client(timeout=60) as client:
        return [
            client.post(f"{server.url}/v1/models/gaussian-2d/infer", content=buffer.getvalue())
            for _ in range(n)
        ]


def test_one_client_of_16_slow_uploads_leaves_the_others_served(server: Server) -> None:
    """16 uploads at 20 KB/s from one client: 4 are let in (its share), 12 get 503 at once; the 4
    keep their slots (the minimum rate is not raised: 4 of 16 slots) and every normal request of
    another client meanwhile is answered 200."""
    rss = server.rss_bytes()
    stop = threading.Event()
    uploads = attack(server, ["127.0.0.2"] * 16, stop)
    try:
        time.sleep(0.5)  # the 12 refusals are immediate
        responses = normal_requests(server, 5)
        time.sleep(1.5)  # past the grace period: the 4 at 20 KB/s are still in
        held = [u for u in uploads if u.answer is None]
    finally:
        stop.set()
        for upload in uploads:
            upload.join(10)
    assert [r.status_code for r in responses] == [200] * 5, [r.text[:200] for r in responses]
    refused = [u.answer for u in uploads if u.answer is not None]
    assert len(refused) == 12 and len(held) == 4, [a[:2] for a in refused]
    for status, body, _ in refused:  # refused at admission, from the head (the detail says which rule)
        assert status == 503 and "TILEWISE_MAX_UPLOADS_PER_CLIENT=4" in json.loads(body)["detail"], body
    assert server.rss_bytes() - rss < 64 * 2**20


def test_16_slow_clients_are_cut_as_the_slots_fill(server: Server) -> None:
    """16 uploads at 20 KB/s from 16 addresses fill all 16 slots: the minimum rate rises to 4 x
    16 KiB/s, so they are cut (408) once their grace period is over, until the pressure has eased
    (at 20 KB/s an upload may stay once about half the slots are free); then another client is
    served."""
    stop = threading.Event()
    uploads = attack(server, [f"127.0.0.{i}" for i in range(2, 18)], stop)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and sum(u.answer is not None for u in uploads) < 7:
            time.sleep(0.1)
        time.sleep(0.5)
        cut = [u.answer for u in uploads if u.answer is not None]
        responses = normal_requests(server, 3)
    finally:
        stop.set()
        for upload in uploads:
            upload.join(10)
    assert len(cut) >= 7, len(cut)  # 16 slots -> at most 9 left, where 20 KB/s is fast enough
    for status, body, _ in cut:  # cut by the raised rate (the detail), not by the idle timeout
        assert status == 408, body
        detail = json.loads(body)["detail"]
        assert "of the upload slots are taken" in detail and "x upload_min_rate=16384" in detail, detail
    assert [r.status_code for r in responses] == [200] * 3, [r.text[:200] for r in responses]


def test_headers_at_one_byte_per_second_are_cut(server: Server) -> None:
    head = f"POST /v1/models/{MODEL}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\n".encode()
    with socket.create_connection(address(server), timeout=30) as sock:
        began, sent = time.monotonic(), 0
        sock.setblocking(False)
        while sent < len(head) and time.monotonic() - began < 20:
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break  # answered
            except BlockingIOError:
                pass
            except OSError:
                break
            try:
                sent += sock.send(head[sent : sent + 1])
            except OSError:
                break
            time.sleep(1.0)
        answer = read_answer(sock)
        elapsed = time.monotonic() - began
    assert sent < len(head)  # cut before the head was complete
    assert answer is not None and answer[0] == 408, answer
    assert json.loads(answer[1])["error"] == "request_timeout"
    assert HEADER_TIMEOUT_S <= elapsed < 20  # after the header timeout, before this client gave up
    with socket.create_connection(address(server), timeout=30) as sock:  # a silent one too
        began = time.monotonic()
        answer = read_answer(sock, timeout=20)
        assert answer is not None and answer[0] == 408 and time.monotonic() - began >= HEADER_TIMEOUT_S


def test_connections_are_capped_and_idle_ones_dropped(server: Server) -> None:
    """MAX_CONNECTIONS idle connections: a request beyond gets 503 at once; after the header
    timeout they are closed by the server and requests are served again."""
    idle = [socket.create_connection(address(server), timeout=30) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)
        with httpx.Client(timeout=30) as client:
            busy = client.get(f"{server.url}/v1/models")
        assert busy.status_code == 503, busy.text
        closed = 0
        for sock in idle:
            answer = read_answer(sock, timeout=HEADER_TIMEOUT_S + 8)
            closed += answer is not None and answer[0] == 408
        assert closed == MAX_CONNECTIONS
        with httpx.Client(timeout=30) as client:
            assert client.get(f"{server.url}/v1/models").status_code == 200
    finally:
        for sock in idle:
            sock.close()
