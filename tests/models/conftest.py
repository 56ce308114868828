"""Fixtures for the model tests: real data from installed packages and the loaded text detector
(its folder, ``text_det_dir``, and the wheel, ``wheel_path``, are the root conftest's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest


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
