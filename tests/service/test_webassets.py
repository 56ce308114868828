"""``tilewise setup-web``: NiiVue's bundle from the pinned npm tarball, checksums enforced.

The real tarball is fetched once per session (``npm pack``, or the registry's URL without npm);
without the network these tests skip locally and fail in CI.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import certifi
import httpx
import pytest

from service import webassets
from service.cli import main
from service.webassets import NIIVUE_FILE, NIIVUE_SHA256, WebAssetError, setup_niivue

REGISTRY_URL = "https://registry.npmjs.org/@niivue/niivue/-/niivue-0.69.0.tgz"


@pytest.fixture(scope="session")
def niivue_tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("npm")
    try:
        return webassets._npm_pack(folder) if shutil.which("npm") else webassets._download(folder)
    except WebAssetError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the NiiVue tarball cannot be fetched in CI: {exc}", pytrace=False)
        pytest.skip(f"the NiiVue tarball cannot be fetched: {exc}")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No npm and no network: any attempt to fetch fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"unexpected download {args}")

    monkeypatch.setattr(webassets.shutil, "which", lambda name: None)
    monkeypatch.setattr(webassets.httpx, "stream", refuse)


def test_bundle_from_tarball_then_kept(tmp_path: Path, niivue_tarball: Path, monkeypatch) -> None:
    path = setup_niivue(tmp_path / "web", tarball=niivue_tarball)
    assert path == tmp_path / "web" / NIIVUE_FILE and _digest(path) == NIIVUE_SHA256
    assert path.read_bytes().startswith(b"(function(")  # the UMD wrapper
    assert sorted(p.name for p in path.parent.iterdir()) == [NIIVUE_FILE]  # only the bundle
    _offline(monkeypatch)
    assert setup_niivue(tmp_path / "web") == path  # verified: nothing fetched


def test_changed_bundle_is_replaced(tmp_path: Path, niivue_tarball: Path) -> None:
    (tmp_path / NIIVUE_FILE).write_text("tampered")
    setup_niivue(tmp_path, tarball=niivue_tarball)
    assert _digest(tmp_path / NIIVUE_FILE) == NIIVUE_SHA256


def test_tampered_tarball_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "niivue-0.69.0.tgz"
    fake.write_bytes(b"\x1f\x8b not the published tarball")
    with pytest.raises(WebAssetError, match="SHA-256 .* is not the pinned"):
        setup_niivue(tmp_path / "web", tarball=fake)
    assert not (tmp_path / "web" / NIIVUE_FILE).exists()


def test_without_npm_the_registry_tarball_is_downloaded(
    tmp_path: Path, niivue_tarball: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry's URL, through a transport that serves the tarball (and a 404 elsewhere)."""
    asked = []

    def serve(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        if str(request.url) != REGISTRY_URL:
            return httpx.Response(404)
        return httpx.Response(200, content=niivue_tarball.read_bytes())

    @contextlib.contextmanager
    def stream(method: str, url: str, **kwargs: object) -> Iterator[httpx.Response]:
        with httpx.Client(transport=httpx.MockTransport(serve)) as client:
            with client.stream(method, url) as answer:
                yield answer

    monkeypatch.setattr(webassets.shutil, "which", lambda name: None)
    monkeypatch.setattr(webassets.httpx, "stream", stream)
    monkeypatch.delenv("npm_config_registry", raising=False)
    setup_niivue(tmp_path, force=True)
    assert asked == [REGISTRY_URL]
    assert _digest(tmp_path / NIIVUE_FILE) == NIIVUE_SHA256
    monkeypatch.setenv("npm_config_registry", "https://npm.example.org/")
    with pytest.raises(WebAssetError, match="cannot download https://npm.example.org/@niivue"):
        setup_niivue(tmp_path, force=True)
    assert _digest(tmp_path / NIIVUE_FILE) == NIIVUE_SHA256


def test_download_trusts_the_system_bundle_without_ca_variables(
    tmp_path: Path, niivue_tarball: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in a container build: no SSL_CERT_FILE/PIP_CERT, only the system's CA bundle on disk.

    Where HTTPS passes a TLS-inspecting proxy, certifi alone refuses its certificate (the image
    build failed so); the system bundle that pip trusts is loaded too.
    """
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR", "PIP_CERT", "REQUESTS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("npm_config_registry", raising=False)
    try:
        tarball = webassets._download(tmp_path)
    except WebAssetError as exc:
        try:  # reachable with the environment's own CA settings, unreachable without: the bug
            httpx.head(REGISTRY_URL, timeout=10, verify=certifi.where())
        except httpx.ConnectError as reach:
            if "CERTIFICATE_VERIFY_FAILED" in str(reach):
                raise AssertionError(f"the system CA bundle was not used: {exc}") from exc
        pytest.skip(f"registry unreachable: {exc}")
    assert _digest(tarball) == _digest(niivue_tarball)


def test_failing_npm_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    npm = bin_dir / "npm"
    npm.write_text("#!/bin/sh\necho 'npm ERR! 404 Not Found' >&2\nexit 7\n")
    npm.chmod(npm.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(WebAssetError, match="exited with 7: npm ERR! 404 Not Found"):
        setup_niivue(tmp_path / "web")


def test_setup_web_command(tmp_path: Path, niivue_tarball: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.tgz"
    bad.write_bytes(b"nope")
    assert main(["setup-web", "--web", str(tmp_path / "a"), "--niivue-tarball", str(bad)]) == 1
    assert main(["setup-web", "--web", str(tmp_path / "b"), "--niivue-tarball", str(niivue_tarball)]) == 0
    assert f"niivue ready: {tmp_path / 'b' / NIIVUE_FILE}" in capsys.readouterr().out


def test_setup_models_runs_the_web_step(
    tmp_path: Path, niivue_tarball: Path, wheel_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``setup-models`` fills TILEWISE_WEB_DIR too (the conftest points it at a session folder)."""
    web = tmp_path / "web"
    monkeypatch.setenv("TILEWISE_WEB_DIR", str(web))
    args = ["setup-models", "--models", str(tmp_path / "m"), "--wheel", str(wheel_path)]
    assert main([*args, "--niivue-tarball", str(niivue_tarball)]) in (0, 1)  # brain-mask may lack its wheel
    assert _digest(web / NIIVUE_FILE) == NIIVUE_SHA256
