"""`__all__` of `models` and of each of its modules is complete, sorted and resolvable (httpx)."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import models
import models.backends

MODULES = sorted(
    ["models", "models.backends"]
    + [f"models.{m.name}" for m in pkgutil.iter_modules(models.__path__) if not m.ispkg]
    + [f"models.backends.{m.name}" for m in pkgutil.iter_modules(models.backends.__path__)]
)


@pytest.mark.parametrize("name", MODULES)
def test_module_all(name: str) -> None:
    module = importlib.import_module(name)
    exported = module.__all__
    assert exported == sorted(exported) and len(set(exported)) == len(exported)
    assert all(hasattr(module, n) for n in exported)
    defined = {
        n
        for n, obj in vars(module).items()
        if not n.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and getattr(obj, "__module__", None) == module.__name__
    }
    assert defined <= set(exported)


def test_contract_names() -> None:
    for name in (
        "ModelSpec",
        "ModelRepository",
        "Model",
        "InferenceParams",
        "RunPlan",
        "DEFAULT_MODELS_DIR",
        "SpecError",
        "InputError",
        "UnknownModelError",
        "BackendUnavailableError",
        "DeviceOutOfMemoryError",
    ):
        assert name in models.__all__, name
    assert models.DEFAULT_MODELS_DIR == Path("~/.cache/tilewise/models").expanduser()


def test_models_never_imports_service_or_fastapi() -> None:
    """DESIGN.md: ``models`` never imports ``service`` (nor the web stack), checked in a fresh interpreter."""
    code = (
        "import json, sys, models, models.repository, models.model, models.zoo.textdet, models.export; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "models.repository" in loaded  # sanity: the probe really imported the package
    roots = {"service", "fastapi", "starlette", "uvicorn"}
    hits = sorted(m for m in loaded if m.split(".")[0] in roots)
    assert not hits, f"import models pulled in {hits}"
