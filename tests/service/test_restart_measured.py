"""A restarted server reads its models' measurements instead of measuring again (issue 25 item 1).

Through the real entry point (``tilewise serve``): the first start measures every built-in model
(tens of seconds idle, minutes on a loaded machine); the second, with the same measurement
folder, must be ready in a fraction of that, and its log must show no footprint measured. While
the first warms up, ``/readyz`` answers 503 with the models still ``warming``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.service._svc_helpers import start_server, stop_server

pytestmark = pytest.mark.slow


def test_restart_is_ready_in_a_fraction_of_the_first_start(tmp_path: Path) -> None:
    measured = tmp_path / "measured"
    options = ("--measurements-dir", str(measured))
    start = time.perf_counter()
    server = start_server(tmp_path, cli_args=options, log_level="INFO", warmup="true")
    first_s = time.perf_counter() - start
    try:
        assert httpx.get(f"{server.url}/readyz", timeout=10).json()["status"] == "ready"
    finally:
        stop_server(server)
    first_log = server.log.read_text(errors="replace")
    assert "footprint: batch" in first_log  # measured
    assert re.search(r"warming up tissue-3d \(\d+/\d+\)", first_log)
    files = sorted(p.name for p in measured.glob("*.json"))
    assert any(f.startswith("tissue-3d-") for f in files), files

    start = time.perf_counter()
    again = start_server(tmp_path, cli_args=options, log_level="INFO", warmup="true")
    second_s = time.perf_counter() - start
    stop_server(again)
    second_log = again.log.read_text(errors="replace")
    assert "footprint: batch" not in second_log, "measured again"
    assert second_log.count("measurements read from") >= len(files)
    assert second_s < first_s / 3, (first_s, second_s)
