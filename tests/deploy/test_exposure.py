"""docker/ exposes nothing unauthenticated by default (issue 24 items 6 and 8): the Dask scheduler
and its dashboard are published on no host interface (internal network only, or Dask's TLS), and a
published service port always sits behind an API key (the default deployment cannot be anonymous
without saying so). Reads compose.yaml and the Dockerfiles as text: no docker needed."""

from __future__ import annotations

import copy
import re
from typing import Any

import yaml

from ._infra import DOCKER

SCHEDULER_PORTS = {8786, 8787}
SERVICE_PORTS = {8000, 8080}
_VAR = re.compile(r"\$\{(\w+)(?::?[-?]([^}]*))?\}")


def resolve(text: str) -> str:
    """Compose's ``${VAR:-default}`` with an empty environment: the default (empty when none)."""
    return _VAR.sub(lambda m: m[2] or "", text)


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(resolve((DOCKER / "compose.yaml").read_text()))


def published_targets(service: dict[str, Any]) -> set[int]:
    """Container ports a service publishes on the host (short and long ``ports`` syntax)."""
    targets = set()
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            targets.add(int(entry["target"]))
        else:
            targets.add(int(str(entry).split("/")[0].rsplit(":", 1)[-1].split("-")[0]))
    return targets


def _true(value: object) -> bool:
    return str(value).strip().lower() in {"1", "true", "yes", "on"}


def exposure_problems(compose: dict[str, Any], dockerfiles: dict[str, str]) -> list[str]:
    """What in ``compose`` and ``dockerfiles`` (name -> text) publishes a port without a key or TLS."""
    problems = []
    services: dict[str, dict[str, Any]] = compose["services"]
    networks = compose.get("networks") or {}
    published_service = False
    for name, svc in services.items():
        env = svc.get("environment") or {}
        entry = " ".join(svc.get("entrypoint") or [])
        scheduler = "dask scheduler" in entry or "dask-scheduler" in entry
        tls = _true(env.get("DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION", ""))
        ports = published_targets(svc)
        if (scheduler or ports & SCHEDULER_PORTS) and ports and not tls:
            problems.append(f"{name} publishes the Dask scheduler/dashboard ({sorted(ports)}) without TLS")
        if scheduler and not tls:
            nets = svc.get("networks") or ["default"]
            if any(not (networks.get(n) or {}).get("internal") for n in nets):
                problems.append(f"{name}: the Dask scheduler is on a network that is not internal")
        published_service |= bool(ports & SERVICE_PORTS)
    if published_service:
        for name, svc in services.items():
            command = " ".join(str(c) for c in (svc.get("command") or []) + (svc.get("entrypoint") or []))
            env = svc.get("environment") or {}
            entrypoint = svc.get("entrypoint")
            serves = entrypoint is None or entrypoint[0] == "tilewise"  # the image's: tilewise serve
            if "tilewise" not in str(svc.get("image", "")) or not serves:
                continue
            if _true(env.get("TILEWISE_ALLOW_ANONYMOUS", "")) or "--allow-anonymous" in command:
                problems.append(f"{name} serves a published port anonymously by default")
            if "TILEWISE_API_KEY" not in env and "TILEWISE_API_KEYS" not in env:
                problems.append(f"{name} is given no way to receive an API key")
    for name, text in dockerfiles.items():
        text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        if re.search(r"TILEWISE_ALLOW_ANONYMOUS\s*=\s*[\"']?(1|true|yes|on)", text, re.I):
            problems.append(f"{name} makes the image anonymous by default")
        if "--allow-anonymous" in text:
            problems.append(f"{name} starts the server with --allow-anonymous")
    return problems


def _dockerfiles() -> dict[str, str]:
    return {name: (DOCKER / name).read_text() for name in ("Dockerfile", "Dockerfile.cuda")}


def test_nothing_is_published_without_a_key_or_tls() -> None:
    compose = load_compose()
    assert exposure_problems(compose, _dockerfiles()) == []
    scheduler = compose["services"]["dask-scheduler"]
    assert "ports" not in scheduler and scheduler["networks"] == ["dask"]
    assert compose["networks"]["dask"]["internal"] is True
    for name in ("tilewise", "tilewise-gpu"):
        env = compose["services"][name]["environment"]
        assert not _true(env["TILEWISE_ALLOW_ANONYMOUS"]) and "TILEWISE_API_KEY" in env
        assert "dask" in compose["services"][name]["networks"]  # they reach the scheduler
    assert published_targets(compose["services"]["lb"]) == {8080}


def test_the_check_catches_what_it_guards_against() -> None:
    """Each unsafe change to the real files is caught (so the test above can fail)."""
    base = load_compose()
    published = copy.deepcopy(base)
    published["services"]["dask-scheduler"]["ports"] = ["8786:8786", "8787:8787"]
    assert any("publishes the Dask" in p for p in exposure_problems(published, {}))
    long_form = copy.deepcopy(base)
    long_form["services"]["dask-worker"]["ports"] = [{"target": 8787, "published": 8787}]
    assert exposure_problems(long_form, {})
    external = copy.deepcopy(base)
    external["networks"]["dask"] = {}
    assert any("not internal" in p for p in exposure_problems(external, {}))
    tls = copy.deepcopy(published)
    tls["networks"]["dask"] = {}
    tls["services"]["dask-scheduler"]["environment"] = {"DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True"}
    assert exposure_problems(tls, {}) == []  # with Dask's TLS a published scheduler is allowed
    anonymous = copy.deepcopy(base)
    anonymous["services"]["tilewise"]["environment"]["TILEWISE_ALLOW_ANONYMOUS"] = "true"
    assert any("anonymously" in p for p in exposure_problems(anonymous, {}))
    keyless = copy.deepcopy(base)
    del keyless["services"]["tilewise"]["environment"]["TILEWISE_API_KEY"]
    del keyless["services"]["tilewise"]["environment"]["TILEWISE_API_KEYS"]
    assert any("no way to receive" in p for p in exposure_problems(keyless, {}))
    image = _dockerfiles()["Dockerfile"] + "\nENV TILEWISE_ALLOW_ANONYMOUS=true\n"
    assert exposure_problems(base, {"Dockerfile": image}) == [
        "Dockerfile makes the image anonymous by default"
    ]
