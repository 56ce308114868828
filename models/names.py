"""Model names without loading anything: what a command line checks before it imports torch.

:func:`model_names` lists the names :class:`~models.ModelRepository` would register (built-ins,
the spec files of the model folder and of the user's folder, text-det-2d's file) by reading spec
files' ``name`` only; :func:`check_model_name` raises the repository's own
:class:`~models.errors.UnknownModelError` (with "did you mean"). Light: PyYAML, no torch, so a
mistyped name is answered in a fraction of a second.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import yaml

from models.errors import UnknownModelError

__all__ = ["SPEC_SUFFIXES", "check_model_name", "declared_name", "model_names"]

_BUILTIN_DIR = Path(__file__).parent / "builtin"
#: File suffixes of model specs in a models folder.
SPEC_SUFFIXES = (".yaml", ".yml", ".json")
#: :data:`models.zoo.textdet.TEXT_DET_NAME` and ``TEXT_DET_FILE`` (that module loads torch).
_TEXT_DET = ("text-det-2d", "ch_PP-OCRv4_det_infer.onnx")
_DEFAULT_USER_DIR = Path("~/.cache/tilewise/models")


def declared_name(path: Path) -> str:
    """The ``name`` a spec file declares, else its file stem (no torch imported)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        data = None
    name = data.get("name") if isinstance(data, dict) else None
    return name if isinstance(name, str) and name else path.stem


def _folder_names(folder: Path) -> set[str]:
    if not folder.is_dir():
        return set()
    names = {declared_name(p) for p in folder.iterdir() if p.suffix in SPEC_SUFFIXES and p.is_file()}
    if (folder / _TEXT_DET[1]).is_file():
        names.add(_TEXT_DET[0])
    return names


def model_names(models_dir: Path | str | None = None, user_models_dir: Path | str | None = None) -> list[str]:
    """The names of every model the repository of ``models_dir`` lists (ready or not), sorted.

    ``models_dir`` and ``user_models_dir`` default as :class:`~models.ModelRepository`'s do
    (``TILEWISE_MODELS_DIR``, ``TILEWISE_USER_MODELS_DIR``, else ``~/.cache/tilewise/models``).
    """
    default = os.environ.get("TILEWISE_MODELS_DIR") or _DEFAULT_USER_DIR
    user = user_models_dir or os.environ.get("TILEWISE_USER_MODELS_DIR") or _DEFAULT_USER_DIR
    names = {p.stem for p in _BUILTIN_DIR.glob("*.yaml")}
    names |= _folder_names(Path(models_dir or default).expanduser())
    names |= _folder_names(Path(user).expanduser())
    return sorted(names)


def check_model_name(name: str, models_dir: Path | str | None = None) -> None:
    """Raise :class:`~models.errors.UnknownModelError` (did you mean ...) unless ``name`` is listed.

    Raises:
        UnknownModelError: ``name`` is not one of :func:`model_names`.
    """
    names = model_names(models_dir)
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise UnknownModelError(f"unknown model {name!r}{hint} (known: {', '.join(names)})")
