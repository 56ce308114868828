"""Weights files: SHA-256 verification and strict state-dict loading."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.errors import ChecksumMismatchError, IncompatibleWeightsError, WeightsError

__all__ = ["load_state_dict", "load_weights", "require_file", "sha256_file", "verify_checksum"]

logger = logging.getLogger(__name__)


def sha256_file(path: Path, *, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in ``chunk_bytes`` chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(chunk_bytes), b""):
            digest.update(chunk)
    return digest.hexdigest()


def require_file(path: Path | None, model: str) -> Path:
    """Return ``path`` if it is an existing file, else raise :class:`WeightsError` naming ``model``."""
    if path is None:
        raise WeightsError(f"model {model!r}: the spec names no weights file")
    if not path.is_file():
        raise WeightsError(f"model {model!r}: weights file {path} does not exist")
    return path


def verify_checksum(path: Path, expected: str | None, model: str) -> str:
    """Compute the file's SHA-256 and compare it with ``expected`` (when given).

    Raises:
        ChecksumMismatchError: the digests differ.
    """
    actual = sha256_file(path)
    if expected is not None and actual != expected.lower():
        raise ChecksumMismatchError(
            f"model {model!r}: {path} has SHA-256 {actual}, the spec expects {expected}"
        )
    return actual


def _strip_prefix(state: Mapping[str, Any], prefix: str = "module.") -> dict[str, Any]:
    if state and all(key.startswith(prefix) for key in state):
        return {key[len(prefix) :]: value for key, value in state.items()}
    return dict(state)


def load_state_dict(path: Path, model: str) -> dict[str, torch.Tensor]:
    """Read a state dict from ``.safetensors`` or a ``torch.save`` file (``weights_only=True``).

    A checkpoint wrapping the weights under ``state_dict`` or ``model`` is unwrapped, and the
    ``module.`` prefix of ``DataParallel`` checkpoints is removed.

    Raises:
        WeightsError: unreadable file or no tensors in it.
    """
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch and safetensors raise many unrelated types
        raise WeightsError(f"model {model!r}: cannot read weights {path}: {exc}") from exc
    for key in ("state_dict", "model"):
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"model {model!r}: {path} holds no state dict of tensors")
    return _strip_prefix(state)


def load_weights(module: nn.Module, path: Path, model: str) -> None:
    """Load ``path`` into ``module`` strictly.

    Raises:
        IncompatibleWeightsError: missing or unexpected keys, or a shape mismatch (listed).
    """
    state = load_state_dict(path, model)
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise IncompatibleWeightsError(f"model {model!r}: weights {path} do not fit: {exc}") from exc
