"""What the machine has: optional packages, model files, the service, versions."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.config import ROOT


def importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def shape_of(path: Path) -> str:
    import numpy as np

    return "x".join(str(s) for s in np.load(path, mmap_mode="r").shape[1:])


def text_det_missing(models_dir: Path) -> str | None:
    try:
        from models.zoo.textdet import TEXT_DET_FILE
    except ImportError as exc:
        return f"models package without text-det-2d support ({exc})"
    if not (models_dir / TEXT_DET_FILE).is_file():
        return f"{models_dir / TEXT_DET_FILE} is missing: run `tilewise setup-models` first"
    if not importable("onnxruntime"):
        return "onnxruntime is not installed"
    return None


def service_missing() -> str | None:
    for mod in ("service.app", "service.commands.serve", "models.repository"):
        try:
            __import__(mod)
        except Exception as exc:  # noqa: BLE001 - any import problem means "not there yet"
            return f"{mod} cannot be imported ({type(exc).__name__}: {exc})"
    return None


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    ram = 0.0
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) / 1024 / 1024
    return {
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "ram_gb": ram,
        "os": platform.platform(),
        "python": platform.python_version(),
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("torch", "numpy", "monai", "torchio", "onnxruntime", "nilearn", "scipy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out["tilewise commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
    return out
