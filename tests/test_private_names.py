"""No private name crosses a package; no module but the app and the routes imports a route
(issue 20 item 6).

The abstract syntax tree of every module of ``tiling``, ``models`` and ``service`` is walked (no
import runs): every ``import`` and ``from ... import`` (relative ones resolved) that names a
private module or a private name (one leading underscore, dunders excepted) must come from a
module of the package that holds it (the same folder, not a sub- or parent package), and
``service.routes`` may be imported only by itself and by ``service.app`` (which mounts it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tiling", "models", "service")
ROUTE_IMPORTERS = ("service.app",)


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _package_of(module: str) -> str:
    path = MODULES[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imported(module: str, tree: ast.AST) -> list[tuple[str, int]]:
    """Dotted names that ``module`` imports (a module, or a module's attribute), with their line."""
    package = _package_of(module)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return [(name, line) for name, line in names if name.split(".")[0] in PACKAGES]


def violations(modules: dict[str, Path] | None = None) -> list[str]:
    """Every import that breaks the rules of the module docstring, one line each."""
    modules = modules or MODULES
    found = []
    for module, path in sorted(modules.items()):
        package = _package_of(module)
        for name, line in _imported(module, ast.parse(path.read_text(), str(path))):
            parts = name.split(".")
            for i, part in enumerate(parts):
                if _private(part):
                    holder = ".".join(parts[:i])
                    if holder in MODULES and MODULES[holder].name != "__init__.py":
                        holder = holder.rpartition(".")[0]  # a private name in a module: its package
                    if holder != package:
                        found.append(f"{module}:{line} imports {name}, private to {holder}")
                    break
            route = name == "service.routes" or name.startswith("service.routes.")
            if route and not (module in ROUTE_IMPORTERS or module.startswith("service.routes")):
                found.append(f"{module}:{line} imports the route module {name}")
    return found


def test_no_private_name_crosses_a_package_and_no_module_imports_a_route() -> None:
    assert violations() == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param("from models.planning.params import _hidden\n", "private to models.planning", id="name"),
        pytest.param("from ..planning import _hidden\n", "private to models.planning", id="relative"),
        pytest.param("import service._options\n", "private to service", id="module"),
        pytest.param("from service.routes.infer import router\n", "route module", id="route"),
    ],
)
def test_the_walk_finds_each_kind_of_crossing(tmp_path: Path, source: str, expected: str) -> None:
    """The rule can fail: a module of models.zoo that crosses a package is reported."""
    path = tmp_path / "probe.py"
    path.write_text(source)
    MODULES["models.zoo.probe"] = path
    try:
        found = violations({"models.zoo.probe": path})
    finally:
        del MODULES["models.zoo.probe"]
    assert len(found) == 1 and expected in found[0], found


def test_a_private_name_within_its_own_package_is_allowed(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text("from models.zoo.nets import _hidden\nfrom ._other import thing\n")
    MODULES["models.zoo.probe"] = path
    try:
        assert violations({"models.zoo.probe": path}) == []
    finally:
        del MODULES["models.zoo.probe"]
