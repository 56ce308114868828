"""Memory: no request of the test set raises the server's resident memory by more than the
budget the server declares (``TILEWISE_MAX_REQUEST_BYTES``), and a request over it is refused
before it costs anything. Measured on a real `tilewise serve` process: before each request its
peak RSS (``VmHWM``) is reset (``/proc/PID/clear_refs``), and the rise is that peak minus the RSS
before the request. The largest rise is written to stdout (``pytest -rA``)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import httpx
import nibabel as nib
import numpy as np
import pytest
from _svc_helpers import Server, start_server, stop_server
from PIL import Image

BUDGET = 192 * 2**20


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def _reset_peak(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _volume(shape: tuple[int, ...]) -> bytes:
    data = np.random.default_rng(0).random(shape, dtype=np.float32)
    return nib.Nifti1Image(data, np.eye(4)).to_bytes()


def _png(size: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (size, size), dtype=np.uint8)).save(
        buffer, "PNG"
    )
    return buffer.getvalue()


#: (model, query, body, expected status): the test set, small to near the budget.
CASES = [
    ("gaussian-3d", "", lambda: _volume((64, 64, 64)), 200),
    ("gaussian-3d", "tile=64", lambda: _volume((128, 128, 128)), 200),
    ("gaussian-3d", "tile=64&overlap=16&blend=gaussian", lambda: _volume((128, 128, 128)), 200),
    ("sobel-3d", "batch_size=8&tile=32", lambda: _volume((96, 96, 96)), 200),
    ("gaussian-2d", "", lambda: _png(1024), 200),
    ("log-2d", "tile=256&overlap=32&blend=hann&batch_size=4", lambda: _png(1536), 200),
    # predicted ~150 MiB: 4 tiles of 64^3, their buffers, the network's allowance, input and output
    ("gaussian-3d", "tile=64&halo=0&overlap=48&batch_size=4", lambda: _volume((128, 128, 128)), 200),
    # predicted ~900 MiB (measured 711 MiB before the allowance for the network): refused
    ("gaussian-3d", "tile=64&halo=0&overlap=48&batch_size=32", lambda: _volume((128, 128, 128)), 413),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(
        tmp_path_factory.mktemp("rss"), max_request_bytes=str(BUDGET), max_upload_bytes=str(2**26)
    )
    yield srv
    stop_server(srv)


def test_no_request_raises_rss_beyond_the_budget(server: Server) -> None:
    if not _reset_peak(server.pid):
        pytest.skip("/proc/PID/clear_refs is not writable here")
    rises = []
    with httpx.Client(timeout=300) as client:
        # One round first: allocator pools, thread pools and lazy imports are paid once per process,
        # and each model's warm-up measurements (receptive field, footprint: the server of a test
        # skips its warm-up, so a model's first request measures it) once per model.
        first_of_each: list[tuple] = []
        for case in CASES:
            if case[3] == 200 and case[0] not in {c[0] for c in first_of_each}:
                first_of_each.append(case)
        for model, query, body, _ in [*CASES[:2], *first_of_each]:
            client.post(f"{server.url}/v1/models/{model}/infer?{query}", content=body())
        for model, query, make_body, status in CASES:
            body = make_body()
            base = _status(server.pid, "VmRSS")
            assert _reset_peak(server.pid)
            response = client.post(f"{server.url}/v1/models/{model}/infer?{query}", content=body)
            peak = _status(server.pid, "VmHWM")
            assert response.status_code == status, response.text[:300]
            rises.append((max(0, peak - base), model, query))
    largest = max(rises)
    sys.stdout.write(
        "RSS rise per request (MiB): "
        + ", ".join(f"{m} {q or 'defaults'}: {r / 2**20:.1f}" for r, m, q in rises)
        + f"\nlargest: {largest[0] / 2**20:.1f} MiB ({largest[1]} {largest[2]}); "
        + f"budget {BUDGET / 2**20:.0f} MiB\n"
    )
    assert largest[0] <= BUDGET, rises
    assert rises[-1][0] < 16 * 2**20, rises[-1]  # the refused one cost (almost) nothing
