"""Fixtures for the model tests: real data from installed packages and the text detector.

The text detector comes from the rapidocr-onnxruntime 1.4.4 wheel: a copy in ``/tmp/wheels`` (or
``$TILEWISE_TEST_WHEEL_DIR``) when present, else ``pip download`` into a temporary folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

WHEEL_GLOB = "rapidocr_onnxruntime-1.4.4-*.whl"


def _local_wheel() -> Path | None:
    for folder in (os.environ.get("TILEWISE_TEST_WHEEL_DIR"), "/tmp/wheels"):
        if folder:
            found = sorted(Path(folder).glob(WHEEL_GLOB))
            if found:
                return found[0]
    return None


@pytest.fixture(scope="session")
def wheel_path() -> Path | None:
    """A local copy of the rapidocr wheel, or ``None`` (setup then downloads it)."""
    return _local_wheel()


@pytest.fixture(scope="session")
def text_det_dir(tmp_path_factory: pytest.TempPathFactory, wheel_path: Path | None) -> Path:
    """A model folder holding text-det-2d (extracted once per session)."""
    from models.textdet import setup_text_det

    folder = tmp_path_factory.mktemp("models")
    setup_text_det(folder, wheel=wheel_path)
    return folder


@pytest.fixture(scope="session")
def text_det(text_det_dir: Path) -> Any:
    """The loaded text-det-2d model, shared so its probe and calibration run once."""
    from models import ModelRepository

    return ModelRepository(text_det_dir, device="cpu").get("text-det-2d")


@pytest.fixture(scope="session")
def mni152() -> np.ndarray:
    """nilearn's MNI152 T1 template (1 mm, 197x233x189), uint8 scaled to [0, 1] float32."""
    import nibabel as nib
    import nilearn

    path = (
        Path(nilearn.__file__).parent
        / "datasets"
        / "data"
        / "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz"
    )
    image: Any = nib.load(path)
    data = np.asarray(image.get_fdata(dtype=np.float32), dtype=np.float32)
    return data / np.float32(data.max())


@pytest.fixture(scope="session")
def radiograph() -> np.ndarray:
    """The real radiograph RG1_UNCR.dcm (pydicom-data), 1955x1841, raw 15-bit values as float32."""
    import pydicom
    from pydicom.data import get_testdata_file

    path = get_testdata_file("RG1_UNCR.dcm")
    assert path is not None
    return np.asarray(pydicom.dcmread(path).pixel_array, dtype=np.float32)
