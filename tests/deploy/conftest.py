"""Fixtures of the deployment tests (helpers in _infra.py)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._infra import Balancer, Cluster, Instance, require_tool, start_balancer, start_instance, stop, wait_http


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty model folder: the analytic built-ins need no files."""
    return tmp_path_factory.mktemp("models")


@contextlib.contextmanager
def running_cluster(root: Path, models_dir: Path) -> Iterator[Cluster]:
    """Two `tilewise serve` instances on 127.0.0.1 behind nginx (docker/nginx.conf)."""
    require_tool("nginx", "apt-get install -y nginx")
    procs: list[subprocess.Popen[bytes]] = []
    balancer: Balancer | None = None
    try:
        instances: list[Instance] = []
        for name in ("a", "b"):
            instances.append(start_instance(root, name, models_dir))
            procs.append(instances[-1].proc)
        for inst in instances:
            try:
                wait_http(f"{inst.url}/readyz", 120, inst.proc)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{exc}\n--- log ---\n{inst.log_text()[-4000:]}") from exc
        balancer = start_balancer(root, [inst.addr for inst in instances])
        procs.append(balancer.proc)
        yield Cluster(instances=instances, balancer=balancer)
    finally:
        for proc in reversed(procs):
            # SIGQUIT: nginx's graceful stop.
            stop(proc, signal.SIGQUIT if balancer is not None and proc is balancer.proc else signal.SIGTERM)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Cluster]:
    """One cluster for a module's tests, in file order (a test that stops an instance goes last)."""
    with running_cluster(tmp_path_factory.mktemp("cluster"), models_dir) as shared:
        yield shared


@pytest.fixture
def fresh_cluster(tmp_path: Path, models_dir: Path) -> Iterator[Cluster]:
    """A cluster of the test's own (for tests that kill an instance mid-run)."""
    with running_cluster(tmp_path, models_dir) as own:
        yield own
