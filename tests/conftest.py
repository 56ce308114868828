"""Shared fixtures: seeded RNGs, tiny 2-D/3-D arrays, environment scrubbing, a settings factory.

Every test is deterministic: ``rng`` is ``np.random.default_rng(0)`` and torch's global generator is
re-seeded with 0 before each test (when torch is loaded). ``TILEWISE_*`` variables of the developer's
shell never leak into a test. Tests marked ``gpu`` are skipped unless CUDA is present.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _scrub_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every ``TILEWISE_*`` environment variable for the duration of a test."""
    for name in list(os.environ):
        if name.startswith("TILEWISE_"):
            monkeypatch.delenv(name)


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
