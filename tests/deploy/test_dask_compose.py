"""Static checks of the compose profile `dask`: a scheduler and N workers from the tilewise image.

The images install the `distributed` extra (Dask + zarr), so the same image runs `tilewise serve`,
`dask scheduler` and `dask worker`; scheduler and workers mount the shared data folder at the same
path, because zarr inputs and outputs are passed to the workers by path.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from ._infra import DOCKER, REPO, require_tool


def _config(*profiles: str) -> dict:
    compose = require_tool("docker-compose", "apt-get install -y docker-compose")
    args = [a for p in profiles for a in ("--profile", p)]
    result = subprocess.run(
        [compose, "-f", "docker/compose.yaml", *args, "config"], capture_output=True, text=True, timeout=120,
        cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


@pytest.mark.parametrize(
    "profiles", [pytest.param(("dask",), id="dask"), pytest.param(("dask", "dask-gpu"), id="dask-gpu")]
)
def test_compose_config_valid_with_dask_profiles(profiles):
    compose = require_tool("docker-compose", "apt-get install -y docker-compose")
    args = [a for p in profiles for a in ("--profile", p)]
    result = subprocess.run(
        [compose, "-f", "docker/compose.yaml", *args, "config", "-q"], capture_output=True, text=True,
        timeout=120, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_dask_profile_scheduler_and_workers_share_image_and_data():
    services = _config("dask", "dask-gpu")
    scheduler, worker, gpu = services["dask-scheduler"], services["dask-worker"], services["dask-worker-gpu"]
    assert scheduler["image"] == worker["image"] == services["tilewise"]["image"]
    assert gpu["image"] == services["tilewise-gpu"]["image"]
    assert scheduler["entrypoint"] == ["dask", "scheduler"] and "8786" in scheduler["command"]
    assert "dask" in scheduler["profiles"] and worker["profiles"] == ["dask"]
    assert int(worker["deploy"]["replicas"]) >= 2

    def data_mounts(svc: dict) -> set[str]:
        return {v.rsplit(":", 1)[0] for v in svc["volumes"] if ":/data" in v and not v.endswith(":ro")}

    (shared,) = data_mounts(scheduler)
    assert shared.endswith(":/data")
    for svc in (worker, gpu):
        assert svc["entrypoint"] == ["dask", "worker"]
        assert svc["command"][0] == "tcp://dask-scheduler:8786"
        assert data_mounts(svc) == {shared}, "every worker reads and writes the same data folder at /data"
        assert svc["depends_on"]["dask-scheduler"]["condition"] == "service_healthy"
        nthreads = svc["command"][svc["command"].index("--nthreads") + 1]
        assert nthreads == "1"
    assert "8786" in " ".join(scheduler["healthcheck"]["test"])
    command = gpu["command"]
    assert command[command.index("--resources") + 1] == "GPU=1"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1


def test_images_install_the_distributed_extra():
    (line,) = re.findall(r"^distributed = \[(.*)\]$", (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    names = {re.split(r"[<>=!~]", d.strip().strip('"'))[0] for d in line.split(",")}
    assert names == {"dask[distributed]", "zarr"}
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        assert 'o["distributed"]' in (DOCKER / dockerfile).read_text(), dockerfile
