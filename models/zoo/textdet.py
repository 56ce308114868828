"""``text-det-2d``: the PP-OCRv4 DBNet text detector, taken from the rapidocr-onnxruntime wheel.

Only ``rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx`` is extracted (Apache-2.0); the
wheel's dependencies are not ours and are never installed. The file is verified against
:data:`TEXT_DET_SHA256` and written with a spec YAML next to it in the model folder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from models.spec import ModelSpec, spec_from_mapping
from models.zoo.wheels import WheelMember, extract_member

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
_WHEEL = WheelMember(
    TEXT_DET_NAME,
    WHEEL_REQUIREMENT,
    "rapidocr_onnxruntime-*.whl",
    WHEEL_MEMBER,
    TEXT_DET_FILE,
    TEXT_DET_SHA256,
)


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

    extract_member(_WHEEL, models_dir, wheel=wheel, force=force)
    spec_path = models_dir.expanduser() / f"{TEXT_DET_NAME}.yaml"
    spec_path.write_text(
        "# Written by `tilewise setup-models`; the ONNX file is never committed.\n"
        + yaml.safe_dump(text_det_mapping(), sort_keys=False),
        encoding="utf-8",
    )
    return spec_path
