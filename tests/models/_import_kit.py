"""Helpers of the import-model tests: optional packages (MONAI, nnU-Net) that CI must have."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def need(module: str) -> ModuleType:
    """Import ``module`` (of the ``import`` extra); skip locally without it, fail in CI (``CI`` set)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        reason = f"{module} is not installed (pip install -e '.[import]'): {exc}"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: acceptance tests must not skip)", pytrace=False)
        pytest.skip(reason)
