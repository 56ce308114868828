"""Helpers for the deployment tests: the repo's nginx.conf in front of real `tilewise serve` processes.

nginx runs the repository's own ``docker/nginx.conf`` with only the upstream server addresses and
the listen address substituted (a free port on 127.0.0.1); its pid file is set on the command line
(``-g``) and everything else it writes goes to a temporary prefix or to stdout/stderr, which land
in files under ``tmp_path``. The instances are ``tilewise serve`` processes on free ports.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
NGINX_CONF = DOCKER / "nginx.conf"

#: The upstream server line of docker/nginx.conf; tests replace its address, keep its parameters.
UPSTREAM_RE = re.compile(r"^(?P<indent>[ \t]*)server tilewise:8000(?P<params>[^;]*);[ \t]*$", re.MULTILINE)
LISTEN_RE = re.compile(r"^(?P<indent>[ \t]*)listen 8080;[ \t]*$", re.MULTILINE)


def tool(name: str) -> str | None:
    """The path of a command-line tool: PATH first, then the interpreter's own bin folder (venv)."""
    found = shutil.which(name)
    if found:
        return found
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else None


def require_tool(name: str, how: str) -> str:
    """The tool's path, or skip the test naming how to install it."""
    path = tool(name)
    if path is None:
        pytest.skip(f"{name} is not installed ({how})")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def render_nginx_conf(upstreams: Sequence[str], listen: str) -> str:
    """docker/nginx.conf with the upstream addresses and the listen address replaced, nothing else."""
    text = NGINX_CONF.read_text()
    match = UPSTREAM_RE.search(text)
    assert match is not None, "docker/nginx.conf lost its `server tilewise:8000 ...;` line"
    servers = "\n".join(f"{match['indent']}server {addr}{match['params']};" for addr in upstreams)
    text = text[: match.start()] + servers + text[match.end() :]
    text, n = LISTEN_RE.subn(lambda m: f"{m['indent']}listen {listen};", text)
    assert n == 1, "docker/nginx.conf lost its `listen 8080;` line"
    return text


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers 200; fail early when ``proc`` exits."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            response = httpx.get(url, timeout=2.0)
            if response.status_code == 200:
                return
            last = response.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer 200 within {timeout} s (last: {last!r})")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
    """Signal one process we started and reap it (SIGKILL if it outlives ``timeout``)."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass
class Instance:
    """One `tilewise serve` process."""

    port: int
    proc: subprocess.Popen[bytes]
    tmp_dir: Path
    log: Path

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.addr}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Balancer:
    """nginx running the repository's nginx.conf."""

    port: int
    proc: subprocess.Popen[bytes]
    conf: Path
    access_log: Path
    error_log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def access_entries(self) -> list[dict[str, str]]:
        """Parsed access-log lines (format `tilewise` of nginx.conf), oldest first."""
        entries = []
        for line in self.access_log.read_text(errors="replace").splitlines():
            match = re.search(
                r'"(?P<request>[^"]*)" (?P<status>\d{3}) .* rid=(?P<rid>\S*) upstream=(?P<upstream>.*?) '
                r"upstream_status=(?P<upstream_status>.*?) rt=",
                line,
            )
            if match:
                entries.append(match.groupdict())
        return entries


@dataclass
class Cluster:
    """Two (or more) instances behind one nginx."""

    instances: list[Instance]
    balancer: Balancer


def instance_env(tmp_dir: Path, models_dir: Path) -> dict[str, str]:
    """The environment of one instance: TILEWISE_ settings as compose.yaml sets them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILEWISE_")}
    env.update(
        TILEWISE_MODELS_DIR=str(models_dir),
        TILEWISE_USER_MODELS_DIR=str(models_dir),
        TILEWISE_DEVICE="cpu",
        # compose.yaml's defaults: 1 GiB uploads, 512 Mi voxels.
        TILEWISE_MAX_UPLOAD_BYTES=str(2**30),
        TILEWISE_MAX_VOXELS=str(2**29),
        TILEWISE_TMP_DIR=str(tmp_dir),
        TILEWISE_WARMUP="false",
        # One interpreter thread pool per instance is plenty; keep the shared CPUs usable.
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
    )
    return env


def start_instance(
    root: Path, name: str, models_dir: Path, port: int | None = None, **settings: str
) -> Instance:
    """Start `tilewise serve` on ``port`` (default: a free one); returns at once (see wait_http).
    Starting one again under the same name and port continues its folder and appends to its log.
    ``settings`` are more ``TILEWISE_<NAME>`` variables (``jobs_dir="/shared"``)."""
    tilewise = tool("tilewise")
    assert tilewise is not None, "the tilewise console script is not installed (pip install -e .)"
    port = free_port() if port is None else port
    tmp_dir = root / f"{name}-tmp"
    tmp_dir.mkdir(exist_ok=True)
    log = root / f"{name}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [tilewise, "serve", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={
                **instance_env(tmp_dir, models_dir),
                **{f"TILEWISE_{k.upper()}": v for k, v in settings.items()},
            },
            cwd=root,
        )
    return Instance(port=port, proc=proc, tmp_dir=tmp_dir, log=log)


def start_balancer(root: Path, upstreams: Sequence[str]) -> Balancer:
    """Start nginx with docker/nginx.conf (upstreams and listen address substituted)."""
    nginx = require_tool("nginx", "apt-get install -y nginx")
    prefix = root / "nginx"
    prefix.mkdir()
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(render_nginx_conf(upstreams, f"127.0.0.1:{port}"))
    access_log, error_log = prefix / "stdout.log", prefix / "stderr.log"
    cmd = [nginx, "-c", str(conf), "-p", f"{prefix}/", "-g", f"daemon off; pid {prefix}/nginx.pid;"]
    check = subprocess.run([*cmd, "-t"], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    with access_log.open("wb") as out, error_log.open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
    balancer = Balancer(port=port, proc=proc, conf=conf, access_log=access_log, error_log=error_log)
    wait_http(f"{balancer.url}/lb-healthz", 20, proc)
    return balancer
