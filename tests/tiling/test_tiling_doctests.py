"""Run the doctests of every ``tiling`` module (pytest's addopts do not include --doctest-modules)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import tiling

MODULES = sorted(["tiling"] + [f"tiling.{m.name}" for m in pkgutil.iter_modules(tiling.__path__)])


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in MODULES])
def test_doctests(name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctests failed in {name}"


def test_doctests_exist():
    finder = doctest.DocTestFinder()
    examples = sum(len(t.examples) for n in MODULES for t in finder.find(importlib.import_module(n)))
    assert examples >= 8, "the public examples of tiling are doctested"
