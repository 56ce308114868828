"""Who may do what (issue 24 items 5 and 6): named API keys own their jobs, the admin key sees
all, reload needs the admin key; unknown ``Host`` names and cross-site state-changing requests
are refused; ``tilewise serve`` will not expose a keyless server by accident.

Against a real server on 127.0.0.1 (``uvicorn --factory``) with a ``TILEWISE_API_KEYS`` file of
three keys (one stored hashed)."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from _jobs_helpers import nifti, wait_for
from _svc_helpers import REPO, Server, clean_env, start_server, stop_server

from service.commands.serve import exposure_check, is_loopback
from service.guard import host_allowed, host_name
from service.security import KeyRing, Principal
from service.settings import Settings

ALICE, BOB, ADMIN = "alice-key-0123456789", "bob-key-0123456789ab", "admin-key-0123456789"
MODEL = "gaussian-3d"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("access")
    keys = root / "keys.txt"
    admin_hash = hashlib.sha256(ADMIN.encode()).hexdigest()
    keys.write_text(f"# tilewise keys\nalice:{ALICE}\n\nbob:{BOB}\nadmin:sha256:{admin_hash}\n")
    srv = start_server(
        root,
        api_keys=str(keys),
        allowed_hosts="tilewise.example.org",
        jobs_dir=str(root / "jobs"),
        queue_size="4",
        warmup="false",
    )
    yield srv
    stop_server(srv)


def _submit(
    server: Server, key: str, *, seed: int = 0, headers: dict[str, str] | None = None
) -> httpx.Response:
    body = nifti((12, 11, 7), seed=seed)
    return httpx.post(
        f"{server.url}/v1/jobs",
        params={"model": MODEL},
        content=body,
        headers={**_auth(key), **(headers or {})},
        timeout=60,
    )


def _done(server: Server, key: str, job_id: str) -> dict:
    def check():
        status = httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=_auth(key), timeout=30).json()
        return status if status["state"] in ("done", "failed", "cancelled") else None

    return wait_for(check, 120, f"job {job_id} finished")


def test_two_keys_never_see_each_others_jobs_and_admin_sees_both(server: Server) -> None:
    a = _submit(server, ALICE, seed=1)
    b = _submit(server, BOB, seed=2)
    assert a.status_code == b.status_code == 202, (a.text, b.text)
    a_id, b_id = a.json()["id"], b.json()["id"]
    assert _done(server, ALICE, a_id)["state"] == "done"
    assert _done(server, BOB, b_id)["state"] == "done"
    url = server.url
    for key, own, other in ((ALICE, a_id, b_id), (BOB, b_id, a_id)):
        listed = [j["id"] for j in httpx.get(f"{url}/v1/jobs", headers=_auth(key), timeout=60).json()]
        assert own in listed and other not in listed
        for path in (f"/v1/jobs/{other}", f"/v1/jobs/{other}/result", f"/v1/jobs/{other}/events"):
            answer = httpx.get(url + path, headers=_auth(key), timeout=60)
            assert answer.status_code == 404 and answer.json()["error"] == "unknown_job", path
        cancel = httpx.delete(f"{url}/v1/jobs/{other}", headers=_auth(key), timeout=60)
        assert cancel.status_code == 404
        assert httpx.get(f"{url}/v1/jobs/{own}/result", headers=_auth(key), timeout=60).status_code == 200
    listed = [j["id"] for j in httpx.get(f"{url}/v1/jobs", headers=_auth(ADMIN), timeout=60).json()]
    assert a_id in listed and b_id in listed
    for job_id in (a_id, b_id):
        assert (
            httpx.get(f"{url}/v1/jobs/{job_id}/result", headers=_auth(ADMIN), timeout=60).status_code == 200
        )
    assert httpx.get(f"{url}/v1/jobs", headers=_auth("not-a-key-at-all-xx"), timeout=60).status_code == 401
    assert httpx.get(f"{url}/v1/jobs", timeout=60).status_code == 401


def test_one_idempotency_key_of_two_owners_makes_two_jobs(server: Server) -> None:
    key = {"Idempotency-Key": "same-key-for-both"}
    a = _submit(server, ALICE, headers=key)
    b = _submit(server, BOB, headers=key)
    again = _submit(server, ALICE, headers=key)
    assert a.status_code == b.status_code == again.status_code == 202
    assert a.json()["id"] != b.json()["id"] and again.json()["id"] == a.json()["id"]


def test_reload_needs_the_admin_key(server: Server) -> None:
    refused = httpx.post(f"{server.url}/v1/models/reload", headers=_auth(ALICE), timeout=60)
    assert refused.status_code == 403 and refused.json()["error"] == "forbidden"
    assert httpx.post(f"{server.url}/v1/models/reload", timeout=60).status_code == 401
    done = httpx.post(f"{server.url}/v1/models/reload", headers=_auth(ADMIN), timeout=120)
    assert done.status_code == 200 and any(m["name"] == MODEL for m in done.json())


def test_unknown_hosts_are_refused_but_probes_answer(server: Server) -> None:
    evil = {"Host": "rebind.attacker.example"}
    answer = httpx.get(f"{server.url}/v1/models", headers={**evil, **_auth(ALICE)}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"] == "bad_host"
    assert httpx.get(f"{server.url}/healthz", headers=evil, timeout=60).status_code == 200
    named = httpx.get(
        f"{server.url}/v1/models", headers={"Host": "tilewise.example.org:8080", **_auth(ALICE)}, timeout=60
    )
    assert named.status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "multipart/form-data; boundary=x", None])
def test_cross_site_posts_are_refused_whatever_their_content_type(server: Server, content_type) -> None:
    headers = {"Origin": "https://attacker.example", **_auth(ADMIN)}
    if content_type:
        headers["Content-Type"] = content_type
    for path in ("/v1/models/reload", f"/v1/jobs?model={MODEL}", f"/v1/models/{MODEL}/infer"):
        answer = httpx.post(server.url + path, content=b"x", headers=headers, timeout=60)
        assert answer.status_code == 403 and answer.json()["error"] == "cross_origin", path
    fetch = {"Sec-Fetch-Site": "cross-site", **_auth(ADMIN)}
    assert httpx.post(f"{server.url}/v1/models/reload", headers=fetch, timeout=60).status_code == 403
    assert (
        "access-control-allow-origin"
        not in httpx.get(f"{server.url}/v1/models", headers=headers, timeout=60).headers
    )


def test_same_origin_pages_and_plain_clients_pass(server: Server) -> None:
    same = _submit(server, ALICE, headers={"Origin": server.url, "Sec-Fetch-Site": "same-origin"})
    assert same.status_code == 202, same.text
    behind_proxy = _submit(server, ALICE, headers={"Origin": "https://tilewise.example.org:8443",
                                                   "Host": "tilewise.example.org"})  # fmt: skip
    assert behind_proxy.status_code == 202, behind_proxy.text


# -- units ------------------------------------------------------------------------------------------


def test_key_files_are_checked_and_hashed_keys_match(tmp_path: Path) -> None:
    good = tmp_path / "keys"
    hashed = hashlib.sha256(b"carol-secret-0123456789").hexdigest()
    good.write_text(f"alice:{ALICE}\ncarol:sha256:{hashed}\nadmin:{ADMIN}\n")
    ring = KeyRing("single-key", good)
    assert ring.names() == ["default", "alice", "carol", "admin"]
    assert ring.identify("carol-secret-0123456789") == Principal("carol", admin=False)
    assert ring.identify(ALICE) == Principal("alice", admin=False)
    assert ring.identify(ADMIN) == Principal("admin", admin=True)
    assert ring.identify("single-key") == Principal("default", admin=True)
    assert ring.identify(hashed) is None and ring.identify("") is None  # the hash is no key
    for text, fault in (
        ("alice\n", "line 1"),
        ("alice:short\n", "shorter than 16"),
        ("bad name:0123456789abcdef0\n", "line 1"),
        (f"x:sha256:{hashed[:10]}\n", "64 hex"),
        (f"alice:{ALICE}\nalice:{BOB}\n", "used twice"),
    ):
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(ValueError, match=fault) as caught:
            KeyRing(None, bad)
        assert ALICE not in str(caught.value) and BOB not in str(caught.value)  # keys never said


def test_hosts_and_loopback() -> None:
    assert host_name("[::1]:8000") == "::1" and host_name("Example.ORG:80") == "example.org"
    assert host_allowed("localhost", []) and host_allowed("a.example.org", [".example.org"])
    assert host_allowed("example.org", [".example.org"]) and not host_allowed(
        "badexample.org", [".example.org"]
    )
    assert host_allowed("anything", ["*"]) and not host_allowed("", ["*"])
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("tilewise.example")


def test_serve_refuses_a_keyless_public_address_unless_told(caplog: pytest.LogCaptureFixture) -> None:
    bare = Settings(_env_file=None)
    with caplog.at_level(logging.WARNING):
        assert exposure_check(bare, "0.0.0.0") is None
    assert "refusing to serve on 0.0.0.0 without an API key" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        allowed = exposure_check(Settings(_env_file=None, allow_anonymous=True), "0.0.0.0")
    assert allowed is not None and allowed.allowed_hosts is None and "WITHOUT an API key" in caplog.text
    keyed = exposure_check(Settings(_env_file=None, api_key="k" * 20), "0.0.0.0")
    assert keyed is not None and keyed.allowed_hosts is None
    local = exposure_check(bare, "127.0.0.1")
    assert local is not None and set(local.allowed_hosts) == {"localhost", "127.0.0.1", "::1"}


def test_tilewise_serve_exits_2_on_a_keyless_public_address(tmp_path: Path) -> None:
    env = clean_env()
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--host", "0.0.0.0", "--port", "1", "--no-warmup"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "TILEWISE_ALLOW_ANONYMOUS" in done.stderr + done.stdout
