"""The CPU image builds and runs without a Docker engine (buildah, chroot isolation, vfs storage).

Slow (5 to 9 minutes here, most of it vfs copying the ~1.3 GB of torch and friends): run with
``python -m pytest tests/deploy -m slow``. Needs root, buildah and debootstrap (apt-get install -y
buildah debootstrap). The base image is a stand-in for python:3.11-slim-bookworm made by
docker/make-standin-base.sh (kept between runs); the built image and container are removed after.

pip inside the build reaches the indexes exactly as pip on this machine does: the settings that
``pip config list`` shows (CA bundle, index URLs, find-links, constraints) go into a pip.conf that is
mounted at /etc/pip.conf for every RUN, and the files and folders they name are mounted read-only at
the same paths (``buildah bud -v``). The Dockerfile itself knows nothing of this.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from ._infra import DOCKER, REPO, free_port, require_tool, wait_http

pytestmark = pytest.mark.slow

STORAGE = ["--storage-driver", os.environ.get("BUILDAH_STORAGE_DRIVER", "vfs")]
BUILD_TIMEOUT_S = 1800


def pip_config() -> dict[str, str]:
    """``pip config list`` as {key: value}; later scopes (user, site, environment) win."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    config: dict[str, str] = {}
    for line in out.splitlines():
        name, sep, value = line.partition("=")
        if not sep:
            continue
        key = name.split(".", 1)[1] if "." in name else name
        config[key] = value.strip().strip("'\"")
    return config


def host_paths(config: dict[str, str]) -> list[Path]:
    """Local files and folders that the pip settings refer to (to mount at the same paths)."""
    paths: list[Path] = []
    for key in ("cert", "client-cert", "constraint", "requirement"):
        paths += [Path(v) for v in config.get(key, "").split()]
    for key in ("find-links", "index-url", "extra-index-url"):
        for value in config.get(key, "").split():
            parsed = urlparse(value)
            if parsed.scheme in ("", "file"):
                path = Path(parsed.path)
                # A file:// "simple" index links to its files with relative paths (../../files).
                paths.append(path.parent if path.name == "simple" else path)
    return [p for p in dict.fromkeys(paths) if p.exists()]


def pip_mirror_args(tmp_path: Path) -> tuple[list[str], str]:
    """``-v`` mounts that give pip in the build this machine's pip settings; the torch index URL."""
    config = pip_config()
    keys = ("cert", "client-cert", "constraint", "index-url", "extra-index-url", "find-links")
    keys += ("trusted-host", "timeout", "default-timeout", "retries")
    lines = ["[global]"] + [f"{k} = {config[k]}" for k in keys if config.get(k)]
    conf = tmp_path / "pip.conf"
    conf.write_text("\n".join(lines) + "\n")
    mounts = ["-v", f"{conf}:/etc/pip.conf:ro"]
    for path in host_paths(config):
        mounts += ["-v", f"{path}:{path}:ro"]
    # torch==2.13.0 comes from wherever pip here gets it (the CPU wheel), not PyTorch's own index.
    torch_index = config.get("index-url") or os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
    return mounts, torch_index


@pytest.fixture(scope="module")
def standin_base() -> str:
    if os.geteuid() != 0:
        pytest.skip("buildah with vfs storage and debootstrap need root")
    require_tool("buildah", "apt-get install -y buildah")
    require_tool("debootstrap", "apt-get install -y debootstrap")
    result = subprocess.run(
        [str(DOCKER / "make-standin-base.sh")], capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def cpu_image(standin_base: str, tmp_path_factory: pytest.TempPathFactory):
    buildah = require_tool("buildah", "apt-get install -y buildah")
    tmp = tmp_path_factory.mktemp("build")
    mounts, torch_index = pip_mirror_args(tmp)
    tag = f"localhost/tilewise-deploy-test:{uuid.uuid4().hex[:8]}"
    cmd = [
        buildah,
        *STORAGE,
        "bud",
        "--isolation",
        "chroot",
        "--format",
        "docker",
        "-f",
        str(DOCKER / "Dockerfile"),
        "--build-arg",
        f"BASE_IMAGE={standin_base}",
        "--build-arg",
        f"TORCH_INDEX_URL={torch_index}",
        *mounts,
        "-t",
        tag,
        str(REPO),
    ]
    log = tmp / "build.log"
    start = time.monotonic()
    with log.open("w") as out:
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
    seconds = time.monotonic() - start
    assert result.returncode == 0, f"{shlex.join(cmd)}\n{log.read_text()[-6000:]}"
    print(f"buildah bud took {seconds:.0f} s")  # noqa: T201 (shown with -s)
    try:
        yield tag
    finally:
        subprocess.run([buildah, *STORAGE, "rmi", "-f", tag], capture_output=True, timeout=300)


def image_config(tag: str) -> dict:
    buildah = require_tool("buildah", "apt-get install -y buildah")
    out = subprocess.run(
        [buildah, *STORAGE, "inspect", "--type", "image", tag],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return json.loads(out)["Docker"]["config"]


def test_image_config(cpu_image):
    config = image_config(cpu_image)
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["tilewise", "serve"]
    assert "/healthz" in " ".join(config["Healthcheck"]["Test"])
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["TILEWISE_MODELS_DIR"] == "/opt/tilewise/models"


def test_image_serves_healthz(cpu_image, tmp_path):
    """`buildah run` starts `tilewise serve` in the image; /healthz answers 200, as its HEALTHCHECK asks."""
    buildah = require_tool("buildah", "apt-get install -y buildah")
    name = f"tilewise-deploy-test-{uuid.uuid4().hex[:8]}"
    subprocess.run([buildah, *STORAGE, "from", "--name", name, cpu_image], check=True, capture_output=True)
    port = free_port()
    log = tmp_path / "serve.log"
    # chroot isolation shares the host's network: the server is reachable on 127.0.0.1.
    serve = [buildah, *STORAGE, "run", "--isolation", "chroot", name, "--"]
    serve += ["tilewise", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(serve, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz", 300, proc)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}\n{log.read_text(errors='replace')[-4000:]}") from exc
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
        wait_http(f"http://127.0.0.1:{port}/readyz", 300, proc)
        names = [m["name"] for m in httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()]
        # text-det-2d is listed only when its ONNX file is in the model folder: prepared at build time.
        assert {"gaussian-3d", "text-det-2d"} <= set(names), names
        # The page, with its volume viewer (NiiVue, taken from npm at build time).
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=30)
        assert page.status_code == 200 and '<meta name="tilewise-viewer" content="niivue">' in page.text
        viewer = httpx.get(f"http://127.0.0.1:{port}/static/vendor/niivue.umd.js", timeout=30)
        assert viewer.status_code == 200 and viewer.content.startswith(b"(function(")
        # The image's own HEALTHCHECK command (port 8000 there) succeeds against this port.
        test = image_config(cpu_image)["Healthcheck"]["Test"]
        assert test[0] == "CMD"
        check = [arg.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for arg in test[1:]]
        result = subprocess.run(
            [buildah, *STORAGE, "run", "--isolation", "chroot", name, "--", *check],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
    finally:
        # The process group is ours (start_new_session): buildah and the server it runs.
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        subprocess.run([buildah, *STORAGE, "rm", name], capture_output=True, timeout=300)
