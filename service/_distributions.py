"""Start-up checks on the installed distributions."""

from __future__ import annotations

from importlib import metadata

_ORT_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu")


def installed_onnxruntime_distributions() -> list[str]:
    """Names of the onnxruntime distributions installed in this environment."""
    found = []
    for name in _ORT_DISTRIBUTIONS:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def check_onnxruntime_distributions() -> None:
    """Refuse to run when both ``onnxruntime`` and ``onnxruntime-gpu`` are installed.

    Both distributions install the same module folder ``onnxruntime``; pip lets the one installed
    last overwrite the other's files silently, which leaves a broken or CPU-only runtime.

    Raises:
        RuntimeError: when both distributions are present.
    """
    found = installed_onnxruntime_distributions()
    if len(found) > 1:
        raise RuntimeError(
            f"both {' and '.join(found)} are installed; they share the module folder 'onnxruntime' "
            "and the last one installed silently wins. Uninstall both, then install exactly one "
            "extra: tilewise[cpu] or tilewise[gpu]."
        )
