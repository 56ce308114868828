"""``text-det-2d``: the PP-OCRv4 DBNet text detector, taken from the rapidocr-onnxruntime wheel.

Only ``rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx`` is extracted (Apache-2.0); the
wheel's dependencies are not ours and are never installed. The file is verified against
:data:`TEXT_DET_SHA256` and written with a spec YAML next to it in the model folder.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from models.errors import ChecksumMismatchError, WeightsError
from models.spec import ModelSpec, spec_from_mapping
from models.weights import sha256_file

__all__ = [
    "TEXT_DET_FILE",
    "TEXT_DET_NAME",
    "TEXT_DET_SHA256",
    "WHEEL_MEMBER",
    "WHEEL_REQUIREMENT",
    "setup_text_det",
    "text_det_mapping",
    "text_det_spec",
]

logger = logging.getLogger(__name__)

TEXT_DET_NAME = "text-det-2d"
TEXT_DET_FILE = "ch_PP-OCRv4_det_infer.onnx"
WHEEL_REQUIREMENT = "rapidocr-onnxruntime==1.4.4"
WHEEL_MEMBER = "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"
#: SHA-256 of the ONNX file inside rapidocr_onnxruntime-1.4.4-py3-none-any.whl.
TEXT_DET_SHA256 = "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9"


def text_det_mapping() -> dict[str, Any]:
    """The spec of ``text-det-2d`` as a YAML-ready mapping (``file`` relative to the folder)."""
    return {
        "name": TEXT_DET_NAME,
        "description": (
            "PP-OCRv4 DBNet text detector (rapidocr-onnxruntime 1.4.4, Apache-2.0): "
            "text probability per pixel. Its squeeze-excitation blocks pool over the whole image."
        ),
        "backend": "onnx",
        "file": TEXT_DET_FILE,
        "sha256": TEXT_DET_SHA256,
        "spatial_dims": 2,
        "in_channels": 3,
        "out_channels": 1,
        "alignment": 32,
        "scale": 1,
        "global_pooling": True,
        # As rapidocr does it: BGR, scaled to [0, 1], then (x - 0.5) / 0.5.
        "preprocess": [
            "grey_to_rgb",
            "rgb_to_bgr",
            "unit_range",
            {"type": "normalize", "mean": 0.5, "std": 0.5},
        ],
        "output": {"activation": "none", "kind": "probabilities", "dtype": "float32"},
        "defaults": {"tile": 1024, "halo": "auto", "overlap": 0, "blend": "constant", "batch_size": 1},
    }


def text_det_spec(models_dir: Path) -> ModelSpec:
    """The ``text-det-2d`` spec with its file in ``models_dir``."""
    return spec_from_mapping(
        text_det_mapping(), source=models_dir / f"{TEXT_DET_NAME}.yaml", where=f"built-in {TEXT_DET_NAME}"
    )


def _download_wheel(dest: Path) -> Path:
    """``pip download --no-deps rapidocr-onnxruntime==1.4.4`` into ``dest``; returns the wheel."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(dest),
        WHEEL_REQUIREMENT,
    ]
    logger.info("downloading %s: %s", WHEEL_REQUIREMENT, " ".join(cmd))
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise WeightsError(f"model {TEXT_DET_NAME!r}: cannot download {WHEEL_REQUIREMENT}: {detail}") from exc
    wheels = sorted(dest.glob("rapidocr_onnxruntime-*.whl"))
    if not wheels:
        raise WeightsError(f"model {TEXT_DET_NAME!r}: pip download left no wheel in {dest}")
    return wheels[0]


def setup_text_det(models_dir: Path, *, wheel: Path | None = None, force: bool = False) -> Path:
    """Extract the text detector from its wheel into ``models_dir`` and write its spec.

    Args:
        models_dir: the model folder (created if missing).
        wheel: a local ``rapidocr_onnxruntime-1.4.4-*.whl``; default: ``pip download`` it into a
            temporary folder.
        force: extract again even when a verified file is already there.

    Returns:
        The path of the spec YAML (``models_dir / "text-det-2d.yaml"``).

    Raises:
        WeightsError: the wheel cannot be downloaded or read, or lacks the member.
        ChecksumMismatchError: the extracted file's SHA-256 is not :data:`TEXT_DET_SHA256`.
    """
    import yaml

    models_dir = models_dir.expanduser()
    models_dir.mkdir(parents=True, exist_ok=True)
    target = models_dir / TEXT_DET_FILE
    spec_path = models_dir / f"{TEXT_DET_NAME}.yaml"
    if force or not target.is_file() or sha256_file(target) != TEXT_DET_SHA256:
        with tempfile.TemporaryDirectory(prefix="tilewise-wheel-") as tmp:
            source = wheel.expanduser() if wheel is not None else _download_wheel(Path(tmp))
            partial = models_dir / f".{TEXT_DET_FILE}.part"
            try:
                with zipfile.ZipFile(source) as zf, zf.open(WHEEL_MEMBER) as src, partial.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except (OSError, KeyError, zipfile.BadZipFile) as exc:
                partial.unlink(missing_ok=True)
                raise WeightsError(
                    f"model {TEXT_DET_NAME!r}: cannot extract {WHEEL_MEMBER} from {source}: {exc}"
                ) from exc
            digest = sha256_file(partial)
            if digest != TEXT_DET_SHA256:
                partial.unlink(missing_ok=True)
                raise ChecksumMismatchError(
                    f"model {TEXT_DET_NAME!r}: {WHEEL_MEMBER} from {source} has SHA-256 {digest}, "
                    f"expected {TEXT_DET_SHA256}"
                )
            os.replace(partial, target)
        logger.info("model %s: wrote %s (sha256 %s)", TEXT_DET_NAME, target, TEXT_DET_SHA256)
    else:
        logger.info("model %s: %s already present and verified", TEXT_DET_NAME, target)
    spec_path.write_text(
        "# Written by `tilewise setup-models`; the ONNX file is never committed.\n"
        + yaml.safe_dump(text_det_mapping(), sort_keys=False),
        encoding="utf-8",
    )
    return spec_path
