"""compose.yaml shares one jobs folder between every replica (CPU and GPU), writable by their user."""

from __future__ import annotations

import re
import subprocess

import yaml

from ._infra import DOCKER, REPO, require_tool


def test_every_replica_mounts_the_one_jobs_volume():
    compose = require_tool("docker-compose", "apt-get install -y docker-compose")
    result = subprocess.run(
        [compose, "-f", "docker/compose.yaml", "--profile", "gpu", "config"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert "jobs" in config["volumes"]
    for name in ("tilewise", "tilewise-gpu"):
        service = config["services"][name]
        assert service["environment"]["TILEWISE_JOBS_DIR"] == "/jobs"
        mounts = [v.split(":")[:2] if isinstance(v, str) else [v.get("source"), v.get("target")]
                  for v in service["volumes"]]  # fmt: skip
        assert ["jobs", "/jobs"] in mounts, service["volumes"]
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):  # the volume starts owned by uid 10001
        assert re.search(r"mkdir -p /jobs && chown 10001:10001 /jobs", (DOCKER / dockerfile).read_text())
