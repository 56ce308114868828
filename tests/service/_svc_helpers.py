"""Helpers of the service tests: real uvicorn servers in subprocesses, tolerances."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[2]
GREY_ONLY_SPEC = """\
# A one-channel 2D model with no colour conversion: RGB input must be refused (422).
name: grey-only-2d
backend: analytic
architecture: gaussian
spatial_dims: 2
in_channels: 1
out_channels: 1
params: {sigma: 1.0, truncate: 4.0}
receptive_field: 4
preprocess: []
output: {activation: none, kind: probabilities, dtype: float32}
defaults: {tile: 64, halo: 4, overlap: 0, blend: constant, batch_size: 1}
"""


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    """A running ``tilewise`` server subprocess."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss_bytes(self) -> int:
        """Resident set size of the server process (``VmRSS``)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line")

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def kill(self) -> None:
        """Stop the server abruptly (SIGKILL: requests in flight are cut off)."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def requests(self) -> dict[tuple[str, str], float]:
        """``tilewise_requests_total`` per ``(model, status)``."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        counts = {}
        for m in re.finditer(r"^tilewise_requests_total\{([^}]*)\} ([0-9.e+]+)$", text, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            counts[(labels.get("model", ""), labels.get("status", ""))] = float(m.group(2))
        return counts


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without ``TILEWISE_*`` variables but the test's empty ``TILEWISE_MODELS_DIR``
    and session ``TILEWISE_WEB_DIR`` and ``TILEWISE_MEASUREMENTS_DIR`` (set by the root conftest),
    plus ``extra``."""
    keep = {"TILEWISE_MODELS_DIR", "TILEWISE_WEB_DIR", "TILEWISE_MEASUREMENTS_DIR"}
    keep.add("TILEWISE_USER_MODELS_DIR")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILEWISE_") or k in keep}
    env.update(extra)
    return env


def start_server(
    tmp_dir: Path,
    *,
    timeout_s: float = 180.0,
    cli_args: tuple[str, ...] | None = None,
    port: int | None = None,
    log_level: str = "WARNING",
    **env: str,
) -> Server:
    """Start ``uvicorn --factory service.app:create_app`` with ``TILEWISE_*`` variables, or
    ``tilewise serve --port P *cli_args`` when ``cli_args`` is given; on ``port`` (default: a free
    one) so that a test can restart a server where its clients expect it. The one way tests start
    servers; ``TILEWISE_MODELS_DIR`` defaults to the test session's empty folder (built-ins only),
    and ``TILEWISE_WARMUP`` to ``false`` (``warmup="true"`` for a test of the warm-up).
    ``timeout_s`` is the longest time without progress: each model warmed (``/readyz``'s
    ``warming`` list shrinking) restarts it, so a loaded machine is slow but not a failure."""
    port = free_port() if port is None else port
    log = tmp_dir / f"server-{port}.log"
    environ = clean_env(**{f"TILEWISE_{k.upper()}": v for k, v in env.items()})
    environ.setdefault("TILEWISE_DEVICE", "cpu")
    # No warm-up unless a test asks for it (``warmup="true"``): a model is then measured when a
    # request first needs it, not every built-in model at every start (minutes on a loaded machine).
    environ.setdefault("TILEWISE_WARMUP", "false")
    environ.setdefault("TILEWISE_TMP_DIR", str(tmp_dir))
    environ["PYTHONPATH"] = str(REPO) + os.pathsep + environ.get("PYTHONPATH", "")
    environ.setdefault("OMP_NUM_THREADS", "2")
    if cli_args is None:
        cmd = [sys.executable, "-m", "uvicorn", "--factory", "service.app:create_app",
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    else:
        cmd = [
            sys.executable,
            "-m",
            "service.cli",
            "--log-level",
            log_level,
            "serve",
            "--port",
            str(port),
            *cli_args,
        ]
    with log.open("ab") as sink:
        process = subprocess.Popen(cmd, cwd=tmp_dir, env=environ, stdout=sink, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + timeout_s
    warming: list[str] | None = None
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            answer = httpx.get(f"{server.url}/readyz", timeout=2.0)
            if answer.status_code == 200:
                return server
            left = answer.json().get("warming")
            if left is not None and left != warming:  # progress under load: the clock restarts
                warming, deadline = left, time.monotonic() + timeout_s
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.25)
    stop_server(server)
    raise RuntimeError(f"server not ready after {timeout_s} s:\n{server.log_tail()}")


def stop_server(server: Server) -> None:
    """Stop the subprocess (SIGTERM, then SIGKILL after 15 s)."""
    if server.alive():
        server.process.terminate()
        try:
            server.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=15)


def tolerance(x: np.ndarray, rel: float = 1e-4) -> float:
    """DESIGN.md's rule: tolerances are for unit-range data and scale with max |x|."""
    return rel * max(float(np.abs(x).max()), 1.0)
