"""The page's third-party viewers: NiiVue's and OpenSeadragon's browser bundles, from npm at setup.

NiiVue (``@niivue/niivue``, BSD-2-Clause, the niivue authors) draws the volume views of the page
(``GET /``). Its self-contained UMD bundle ``package/dist/niivue.umd.js`` is taken from the npm
tarball of one pinned version, whose SHA-256 (and the bundle's) are checked, and written to the web
folder (``TILEWISE_WEB_DIR``, default :data:`DEFAULT_WEB_DIR`). It is never committed and never
loaded from a CDN: the page makes no request outside its own server. Without the file the page
still works for 2D images and says how to install the viewer for volumes.

OpenSeadragon (``openseadragon``, BSD-3-Clause, the OpenSeadragon contributors) draws slides and
large 2D results from the deep-zoom tiles of a job (``/v1/jobs/{id}/dzi/``): its minified bundle
``package/build/openseadragon/openseadragon.min.js`` is taken the same way (:func:`setup_openseadragon`).

The tarball comes from ``npm pack`` when npm is installed, else straight from the npm registry
(``$npm_config_registry``, default ``https://registry.npmjs.org/``), or from a local file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import ssl
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import certifi
import httpx

__all__ = [
    "DEFAULT_WEB_DIR",
    "NIIVUE_FILE",
    "NIIVUE_VERSION",
    "OPENSEADRAGON",
    "OPENSEADRAGON_FILE",
    "OPENSEADRAGON_VERSION",
    "NpmAsset",
    "WebAssetError",
    "niivue_path",
    "openseadragon_path",
    "setup_niivue",
    "setup_openseadragon",
    "web_dir_of",
]

logger = logging.getLogger(__name__)

#: Where ``tilewise setup-web`` puts the viewer when neither ``--web`` nor ``TILEWISE_WEB_DIR`` says.
DEFAULT_WEB_DIR = Path("~/.cache/tilewise/web").expanduser()
NIIVUE_PACKAGE = "@niivue/niivue"
NIIVUE_VERSION = "0.69.0"
#: The file name in the web folder (and under ``/static/vendor/`` on the server).
NIIVUE_FILE = "niivue.umd.js"
_MEMBER = "package/dist/niivue.umd.js"
#: SHA-256 of ``npm pack @niivue/niivue@0.69.0`` (the registry's tarball) and of the bundle in it.
NIIVUE_TARBALL_SHA256 = "6e9a6a471b428eb3b258a0086beca9187d95e43a781a39e8a519c6da246af485"
NIIVUE_SHA256 = "47b896b77ec4a5be3ef1949c33ad393b6f45629921f326c279000bcf51bdb4af"
_TIMEOUT_S = 120.0

OPENSEADRAGON_VERSION = "6.1.1"
#: The file name in the web folder (and under ``/static/vendor/`` on the server).
OPENSEADRAGON_FILE = "openseadragon.min.js"


@dataclass(frozen=True, slots=True)
class NpmAsset:
    """One file of one pinned npm tarball, with the SHA-256 of both."""

    package: str
    version: str
    member: str
    file: str
    tarball_sha256: str
    sha256: str


_NIIVUE = NpmAsset(NIIVUE_PACKAGE, NIIVUE_VERSION, _MEMBER, NIIVUE_FILE, NIIVUE_TARBALL_SHA256, NIIVUE_SHA256)
#: ``npm pack openseadragon@6.1.1`` (the registry's tarball) and its minified bundle.
OPENSEADRAGON = NpmAsset(
    "openseadragon",
    OPENSEADRAGON_VERSION,
    "package/build/openseadragon/openseadragon.min.js",
    OPENSEADRAGON_FILE,
    "b4ab2942f33b90e0448e4d20fc5ed14cee049f1f3ae49d70afd4b05e9a2f92d0",
    "14d587cd3ee7c4861f1a41077ce642029364a21029956ba635bd8fb1202cf9ad",
)


class WebAssetError(RuntimeError):
    """The viewer cannot be downloaded, read or verified (the message says which and why)."""


def web_dir_of(web_dir: Path | None) -> Path:
    """``web_dir``, else ``TILEWISE_WEB_DIR``, else :data:`DEFAULT_WEB_DIR` (user folder expanded)."""
    if web_dir is not None:
        return web_dir.expanduser()
    env = os.environ.get("TILEWISE_WEB_DIR")
    return Path(env).expanduser() if env else DEFAULT_WEB_DIR


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def niivue_path(web_dir: Path) -> Path | None:
    """The installed bundle in ``web_dir`` if it is there (its checksum is checked at setup)."""
    path = web_dir / NIIVUE_FILE
    return path if path.is_file() else None


def openseadragon_path(web_dir: Path) -> Path | None:
    """The installed OpenSeadragon bundle in ``web_dir`` if it is there (checked at setup)."""
    path = web_dir / OPENSEADRAGON_FILE
    return path if path.is_file() else None


def _npm_pack(folder: Path, asset: NpmAsset = _NIIVUE) -> Path:
    """``npm pack PACKAGE@VERSION`` into ``folder``; the tarball's path."""
    spec = f"{asset.package}@{asset.version}"
    cmd = ["npm", "pack", spec, "--pack-destination", str(folder), "--ignore-scripts", "--silent"]
    try:
        done = subprocess.run(
            cmd, cwd=folder, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WebAssetError(f"npm pack {spec} failed: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise WebAssetError(f"npm pack {spec} exited with {done.returncode}: {' / '.join(tail)}")
    tarballs = sorted(folder.glob("*.tgz"))
    if len(tarballs) != 1:
        raise WebAssetError(f"npm pack {spec} left {len(tarballs)} tarballs in {folder}")
    return tarballs[0]


# Where Debian, Ubuntu and Alpine keep the system's CA bundle (with a site's own proxy CA, once
# ``update-ca-certificates`` has run); Fedora and RHEL keep theirs in the second.
_SYSTEM_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")


def _ssl_context() -> ssl.SSLContext:
    """certifi's CAs, the system's and those named by ``SSL_CERT_FILE`` / ``PIP_CERT``.

    httpx alone trusts certifi's bundle, which lacks a site's TLS-inspecting proxy CA; pip here
    trusts the system bundle (``PIP_CERT``), so a build that can ``pip install`` can fetch NiiVue
    too. The tarball's SHA-256 is checked after the download in any case.
    """
    context = ssl.create_default_context(cafile=certifi.where())
    context.load_default_certs()
    named = (os.environ.get("SSL_CERT_FILE"), os.environ.get("PIP_CERT"), *_SYSTEM_BUNDLES)
    for bundle in dict.fromkeys(b for b in named if b):
        if Path(bundle).is_file():
            try:
                context.load_verify_locations(cafile=bundle)
            except (ssl.SSLError, OSError) as exc:
                logger.warning("CA bundle %s not loaded: %s", bundle, exc)
    return context


def _download(folder: Path, asset: NpmAsset = _NIIVUE) -> Path:
    """The registry's tarball of the pinned version, fetched over HTTPS (no npm installed)."""
    registry = os.environ.get("npm_config_registry") or "https://registry.npmjs.org/"
    name = asset.package.split("/")[-1]
    url = f"{registry.rstrip('/')}/{asset.package}/-/{name}-{asset.version}.tgz"
    target = folder / f"{name}-{asset.version}.tgz"
    logger.info("npm not found: downloading %s", url)
    try:  # httpx: *_PROXY from the environment; CAs from certifi and the system (_ssl_context)
        answers = httpx.stream("GET", url, timeout=_TIMEOUT_S, follow_redirects=True, verify=_ssl_context())
        with answers as answer, target.open("wb") as sink:
            answer.raise_for_status()
            for block in answer.iter_bytes(1 << 20):
                sink.write(block)
    except (httpx.HTTPError, OSError) as exc:
        raise WebAssetError(f"cannot download {url}: {exc}") from exc
    return target


def _extract(tarball: Path, target: Path, asset: NpmAsset = _NIIVUE) -> None:
    """Write the bundle member of ``tarball`` to ``target`` (atomically), checking both digests."""
    found = _sha256(tarball)
    if found != asset.tarball_sha256:
        raise WebAssetError(
            f"{tarball.name}: SHA-256 {found} is not the pinned {asset.tarball_sha256} of "
            f"{asset.package}@{asset.version}"
        )
    member_name = asset.member
    partial = target.with_name(target.name + ".partial")
    try:
        with tarfile.open(tarball, "r:gz") as archive:
            member = archive.getmember(member_name)
            source = archive.extractfile(member)
            if source is None:
                raise WebAssetError(f"{tarball.name}: {member_name} is not a regular file")
            with source, partial.open("wb") as sink:
                shutil.copyfileobj(source, sink)
    except (KeyError, tarfile.TarError, OSError) as exc:
        partial.unlink(missing_ok=True)
        raise WebAssetError(f"{tarball.name}: cannot read {member_name}: {exc}") from exc
    found = _sha256(partial)
    if found != asset.sha256:
        partial.unlink(missing_ok=True)
        raise WebAssetError(f"{member_name}: SHA-256 {found} is not the pinned {asset.sha256}")
    partial.replace(target)


def setup_niivue(web_dir: Path, *, tarball: Path | None = None, force: bool = False) -> Path:
    """Put NiiVue's verified browser bundle into ``web_dir``; its path.

    Args:
        web_dir: the web folder (created if needed).
        tarball: a local ``niivue-0.69.0.tgz`` (as ``npm pack`` writes it); default: ``npm pack``
            (or the registry's tarball over HTTPS when npm is not installed).
        force: take the tarball again even if a verified bundle is there.

    Raises:
        WebAssetError: the tarball cannot be had, or a checksum differs from the pinned one.
    """
    web_dir.mkdir(parents=True, exist_ok=True)
    target = web_dir / NIIVUE_FILE
    if not force and target.is_file() and _sha256(target) == NIIVUE_SHA256:
        logger.info("NiiVue %s: %s already present and verified", NIIVUE_VERSION, target)
        return target
    if tarball is not None:
        _extract(tarball.expanduser(), target)
    else:
        with tempfile.TemporaryDirectory(prefix="tilewise-npm-") as tmp:
            folder = Path(tmp)
            source = _npm_pack(folder) if shutil.which("npm") else _download(folder)
            _extract(source, target)
    logger.info("NiiVue %s: %s written and verified", NIIVUE_VERSION, target)
    return target


def setup_openseadragon(web_dir: Path, *, tarball: Path | None = None, force: bool = False) -> Path:
    """Put OpenSeadragon's verified minified bundle into ``web_dir``; its path.

    Args and errors as :func:`setup_niivue` (``tarball``: a local ``openseadragon-6.1.1.tgz``).
    """
    web_dir.mkdir(parents=True, exist_ok=True)
    target = web_dir / OPENSEADRAGON_FILE
    asset = OPENSEADRAGON
    if not force and target.is_file() and _sha256(target) == asset.sha256:
        logger.info("OpenSeadragon %s: %s already present and verified", asset.version, target)
        return target
    if tarball is not None:
        _extract(tarball.expanduser(), target, asset)
    else:
        with tempfile.TemporaryDirectory(prefix="tilewise-npm-") as tmp:
            folder = Path(tmp)
            source = _npm_pack(folder, asset) if shutil.which("npm") else _download(folder, asset)
            _extract(source, target, asset)
    logger.info("OpenSeadragon %s: %s written and verified", asset.version, target)
    return target
