"""Import boundaries, checked in fresh interpreters (DESIGN.md: tiling imports neither models nor
service nor FastAPI; the batch client imports neither torch nor FastAPI)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _imported_after(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def _hits(modules: set[str], roots: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in roots)


def test_tiling_imports_no_fastapi_models_or_service():
    modules = _imported_after("tiling.engine")  # tiling's __init__ loads the engine on first use
    assert "tiling.engine" in modules  # sanity: the probe really imported the engine
    hits = _hits(modules, ("fastapi", "starlette", "uvicorn", "models", "service"))
    assert not hits, f"import tiling pulled in {hits}"


def test_batch_client_imports_no_torch_or_fastapi():
    if importlib.util.find_spec("service") is None or not (REPO / "service" / "client").exists():
        pytest.skip("service.client does not exist yet")
    modules = _imported_after("service.client")
    hits = _hits(modules, ("torch", "fastapi", "starlette", "uvicorn"))
    assert not hits, f"import service.client pulled in {hits}"


def test_tiling_planning_needs_no_torch():
    """``models.spec`` (and the batch client's light imports) use tiling's integer-only planning."""
    modules = _imported_after("tiling")
    assert "tiling.grid" in modules and not _hits(modules, ("torch",))
