"""`__all__` of `tiling` and of each of its modules is complete, sorted and resolvable (httpx)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import tiling

SUBMODULES = sorted(f"tiling.{m.name}" for m in pkgutil.iter_modules(tiling.__path__))


def _public_names(module) -> set[str]:
    """Public classes and functions defined in ``module`` itself (not imported into it)."""
    return {
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and getattr(obj, "__module__", None) == module.__name__
    }


def test_package_all_is_sorted_and_unique():
    assert tiling.__all__ == sorted(tiling.__all__)
    assert len(set(tiling.__all__)) == len(tiling.__all__)


def test_package_all_resolves():
    for name in tiling.__all__:
        assert hasattr(tiling, name), name


def test_package_all_is_complete():
    # Every public, non-module name bound in the package namespace is exported.
    bound = {
        name
        for name, obj in vars(tiling).items()
        if not name.startswith("_") and not inspect.ismodule(obj) and name != "annotations"
    }
    assert bound == set(tiling.__all__)


def test_contract_names_are_exported():
    for name in ("tiled_inference", "TileGrid", "BlendMode", "BorderMode"):
        assert name in tiling.__all__
    for name in ("TilingError", "GridError", "ShapeMismatchError", "CoverageError", "AccumulatorStateError"):
        assert name in tiling.errors.__all__ and issubclass(getattr(tiling.errors, name), Exception)
    assert issubclass(tiling.GridError, ValueError) and issubclass(tiling.ShapeMismatchError, ValueError)
    assert issubclass(tiling.CoverageError, RuntimeError) and issubclass(
        tiling.AccumulatorStateError, RuntimeError
    )


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in SUBMODULES])
def test_module_all(name):
    module = importlib.import_module(name)
    exported = module.__all__
    assert exported == sorted(exported), f"{name}.__all__ is not sorted"
    assert len(set(exported)) == len(exported)
    for attr in exported:
        assert hasattr(module, attr), f"{name}.__all__ names missing {attr}"
    missing = _public_names(module) - set(exported)
    assert not missing, f"{name} defines public {sorted(missing)} not in __all__"


def test_every_exported_object_is_reexported_from_its_package_or_module():
    # The package's exports come from its modules' exports (no private leak).
    module_exports = set()
    for name in SUBMODULES:
        module_exports |= set(importlib.import_module(name).__all__)
    assert set(tiling.__all__) <= module_exports
