"""What importing a source would run: a MONAI bundle's ``$`` expressions and non-MONAI ``_target_``s.

Importing a MONAI bundle runs it: MONAI's ``ConfigParser`` evaluates every ``$`` expression it
resolves (Python ``eval``), imports what ``$import`` names and instantiates each ``_target_``
(any importable ``package.module.Class``). An nnU-Net ``plans.json`` names the network class that
is imported and built. :func:`untrusted_code` lists what in ``source`` would run code that is
not MONAI's or nnU-Net's own, read from the raw files *before* MONAI parses anything;
``tilewise import-model`` refuses such a source unless ``--trust`` is given.

Not code (accepted): ``@`` references, ``$`` expressions that are Python literals (``$None``,
``$[1, 2]``, ``$0.5``), ``_target_`` names MONAI resolves among its own modules (``UNet``,
``Compose``) or that start with ``monai.``, ``_mode_`` ``default`` and ``callable``. Code
(refused without ``--trust``): every other ``$`` expression (``$import os``, ``$torch.device(...)``,
``$@bundle_root + '/eval'``), any other ``_target_``, ``_mode_: debug`` (starts pdb), ``%`` macros
that read another file (not scanned here); in nnU-Net plans, a ``network_class_name`` or
``_kw_requires_import`` class outside ``dynamic_network_architectures``, ``nnunetv2`` and ``torch``.
"""

from __future__ import annotations

import ast
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

__all__ = ["untrusted_code"]

_CONFIG_SUFFIXES = (".json", ".yaml", ".yml")
_NNUNET_MODULES = ("dynamic_network_architectures.", "nnunetv2.", "torch.")


def _bundle_configs(source: Path) -> Iterator[tuple[str, str]]:
    """``(name, text)`` of ``configs/metadata.json`` and ``configs/inference.*`` of a folder or zip."""
    wanted = ("metadata.json", *(f"inference{s}" for s in _CONFIG_SUFFIXES))
    if source.is_dir():
        for file in wanted:
            path = source / "configs" / file
            if path.is_file():
                yield f"configs/{file}", path.read_text(encoding="utf-8", errors="replace")
        return
    with zipfile.ZipFile(source) as archive:
        for member in archive.namelist():
            parts = member.split("/")
            if len(parts) >= 2 and parts[-2] == "configs" and parts[-1] in wanted:
                yield member, archive.read(member).decode("utf-8", errors="replace")


def _parse(name: str, text: str) -> Any:
    try:
        return json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError):
        return None  # unreadable configs are refused by the importer itself, with their own message


def _is_literal(expression: str) -> bool:
    try:
        ast.literal_eval(expression.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return True


def _monai_target(target: str) -> bool:
    return "." not in target or target.startswith("monai.")


def _walk(node: Any, where: str, found: list[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{where}.{key}" if where else str(key)
            if key == "_target_" and isinstance(value, str) and not value.startswith("$"):
                if not _monai_target(value):
                    found.append(f"{path}: _target_ {value!r} (not MONAI's)")
                continue
            if key == "_mode_" and isinstance(value, str) and value not in ("default", "callable"):
                found.append(f"{path}: _mode_ {value!r}")
                continue
            _walk(value, path, found)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _walk(value, f"{where}[{i}]", found)
    elif isinstance(node, str):
        if node.startswith("$") and not _is_literal(node[1:]):
            shown = node if len(node) <= 60 else node[:57] + "..."
            found.append(f"{where}: expression {shown!r}")
        elif node.startswith("%") and any(s in node for s in _CONFIG_SUFFIXES):
            found.append(f"{where}: macro {node!r} reads another file")


def _nnunet(source: Path) -> list[str]:
    found: list[str] = []
    plans = source / "plans.json"
    text = plans.read_text(encoding="utf-8", errors="replace") if plans.is_file() else "null"
    data = _parse("plans.json", text)
    configurations = data.get("configurations") if isinstance(data, dict) else None
    for config_name, config in (configurations or {}).items():
        arch = config.get("architecture") if isinstance(config, dict) else None
        if not isinstance(arch, dict):
            continue
        names = [("network_class_name", arch.get("network_class_name"))]
        kwargs = arch["arch_kwargs"] if isinstance(arch.get("arch_kwargs"), dict) else {}
        for key in arch.get("_kw_requires_import") or ():
            names.append((f"arch_kwargs.{key}", kwargs.get(key)))
        for key, value in names:
            if isinstance(value, str) and not value.startswith(_NNUNET_MODULES):
                found.append(f"plans.json configurations.{config_name}.architecture.{key}: class {value!r}")
    return found


def untrusted_code(source: Path, kind: str) -> list[str]:
    """What importing ``source`` would run that is not MONAI's or nnU-Net's own, one line per item.

    Args:
        source: the import source (a bundle folder or zip, an nnU-Net folder, a file).
        kind: :func:`models.importers.source_kind`'s answer for ``source``.

    Returns:
        ``"FILE FIELD: what"`` lines, empty when nothing would run (always for TorchScript / ONNX
        files: loading them runs no Python).
    """
    if kind == "nnunet":
        return _nnunet(source)
    if kind != "monai-bundle":
        return []
    found: list[str] = []
    for name, text in _bundle_configs(source):
        items: list[str] = []
        _walk(_parse(name, text), "", items)
        found.extend(f"{name} {item}" for item in items)
    return found
