"""Fixtures of the service tests: real data files, the text detector, real uvicorn servers.

Servers run as subprocesses (``python -m uvicorn --factory service.app:create_app``) on a free
port of 127.0.0.1, configured through ``TILEWISE_*`` variables, and are ready once ``/readyz``
answers 200.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _svc_helpers import GREY_ONLY_SPEC, Server, start_server, stop_server


def _site_file(package: str, *parts: str) -> Path:
    module = pytest.importorskip(package)
    path = Path(module.__file__).parent.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"{path} is not shipped by this {package} installation")
    return path


@pytest.fixture(scope="session")
def mni152_path() -> Path:
    """nilearn's MNI152 T1 template (1 mm, 197x233x189 uint8, .nii.gz)."""
    return _site_file("nilearn", "datasets", "data", "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz")


@pytest.fixture(scope="session")
def anatomical_path() -> Path:
    """nibabel's ``anatomical.nii`` (33x41x25 big-endian int16, uncompressed)."""
    return _site_file("nibabel", "tests", "data", "anatomical.nii")


@pytest.fixture(scope="session")
def text_det_onnx(text_det_dir: Path) -> Path:
    """The PP-OCRv4 detector's ONNX file, in a session folder (never the user's model cache)."""
    from models.zoo.textdet import TEXT_DET_FILE

    return text_det_dir / TEXT_DET_FILE


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder with a one-channel 2D model that converts nothing (``grey-only-2d``)."""
    folder = tmp_path_factory.mktemp("models")
    (folder / "grey-only-2d.yaml").write_text(GREY_ONLY_SPEC, encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def text_models_dir(tmp_path_factory: pytest.TempPathFactory, text_det_onnx: Path) -> Path:
    """A model folder holding ``text-det-2d`` (its ONNX file linked) and ``grey-only-2d``."""
    folder = tmp_path_factory.mktemp("models-text")
    (folder / "grey-only-2d.yaml").write_text(GREY_ONLY_SPEC, encoding="utf-8")
    try:
        (folder / text_det_onnx.name).symlink_to(text_det_onnx)
    except OSError:
        shutil.copy2(text_det_onnx, folder / text_det_onnx.name)
    return folder


@pytest.fixture(scope="session")
def server_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working and temporary-file folder of the shared server."""
    return tmp_path_factory.mktemp("server")


@pytest.fixture(scope="session")
def server(server_tmp: Path, text_models_dir: Path) -> Iterator[Server]:
    """The shared server: built-ins, ``text-det-2d`` and ``grey-only-2d``; 8 MiB upload limit."""
    srv = start_server(
        server_tmp,
        models_dir=str(text_models_dir),
        queue_size="4",
        max_upload_bytes=str(8 * 2**20),
    )
    yield srv
    stop_server(srv)


@pytest.fixture()
def client(server: Server) -> Iterator[httpx.Client]:
    """An HTTP client for the shared server (checks after each test that it is still alive)."""
    with httpx.Client(base_url=server.url, timeout=600.0) as http:  # loaded CI machines are slow
        yield http
    assert server.alive(), server.log_tail()
