"""Analytic models against their exact scipy.ndimage oracles, whole-image and tiled, on real data.

Tolerances: float32 arithmetic on unit-range data; separable float32 passes differ from scipy's
(float64 accumulation, float32 storage between passes) by a few ulps of the largest partial sums,
so 1e-4 leaves two orders of magnitude of margin (DESIGN.md "Interfaces in detail").
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from scipy import ndimage as ndi

from models import InferenceParams, InputError, ModelRepository
from models.zoo.analytic import AnalyticNet, analytic_radius, gaussian_kernel1d

logger = logging.getLogger(__name__)


def oracle(kind: str, x: np.ndarray, sigma: float = 2.0) -> np.ndarray:
    if kind == "gaussian":
        out = ndi.gaussian_filter(x, sigma=sigma, truncate=4.0, mode="constant")
    elif kind == "log":
        out = ndi.gaussian_laplace(x, sigma=sigma, truncate=4.0, mode="constant")
    else:
        out = np.sqrt(sum(ndi.sobel(x, axis=a, mode="constant") ** 2 for a in range(x.ndim)))
    return np.asarray(out)


@pytest.fixture(scope="module")
def repo() -> ModelRepository:
    return ModelRepository("/nonexistent-tilewise-models", device="cpu")


@pytest.mark.parametrize("order", [0, 1, 2])
def test_kernel_matches_scipy_impulse_response(order: int) -> None:
    impulse = np.zeros(41)
    impulse[20] = 1.0
    response = ndi.gaussian_filter1d(impulse, 1.7, order=order, truncate=4.0, mode="constant")
    radius = int(4.0 * 1.7 + 0.5)
    # torch convolutions correlate: the correlation weights are the reversed impulse response
    np.testing.assert_allclose(
        gaussian_kernel1d(1.7, order, radius), response[20 - radius : 21 + radius][::-1], atol=1e-15
    )


@pytest.mark.parametrize("kind", ["gaussian", "sobel", "log"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_whole_image_equals_oracle(kind: str, ndim: int, rng: np.random.Generator) -> None:
    shape = {1: (300,), 2: (61, 70), 3: (23, 30, 27)}[ndim]
    x = rng.random(shape, dtype=np.float32)
    net = AnalyticNet(kind, ndim)
    with torch.inference_mode():
        got = net(torch.from_numpy(x)[None, None])[0, 0].numpy()
    assert np.abs(got - oracle(kind, x)).max() <= 1e-5
    assert net.radius == analytic_radius(kind)


def test_sigma_parameter_changes_radius() -> None:
    assert AnalyticNet("gaussian", 2, sigma=1.0).radius == 4
    assert AnalyticNet("log", 3, sigma=3.0).radius == 12
    with pytest.raises(ValueError, match="sigma"):
        AnalyticNet("gaussian", 2, sigma=0.0)


def test_tiled_gaussian_3d_on_mni152(repo: ModelRepository, mni152: np.ndarray) -> None:
    """Acceptance: tiled gaussian-3d on the real MNI152 T1 equals scipy within 1e-4, borders included."""
    model = repo.get("gaussian-3d")
    got = model.run(mni152[None], InferenceParams(tile=(96, 128, 96), batch_size=1))
    expected = ndi.gaussian_filter(mni152, sigma=2.0, truncate=4.0, mode="constant")
    assert got.shape == (1, *mni152.shape) and got.dtype == np.float32
    err = float(np.abs(got[0] - expected).max())
    logger.info("gaussian-3d MNI152 %s: max abs diff %.3g", mni152.shape, err)
    assert err <= 1e-4


def test_tiled_sobel_2d_on_radiograph(repo: ModelRepository, radiograph: np.ndarray) -> None:
    """Acceptance: tiled sobel-2d on the real radiograph RG1_UNCR.dcm matches scipy within 1e-4."""
    x = radiograph / np.float32(radiograph.max())  # unit range: the tolerance is for unit-range data
    got = repo.get("sobel-2d").run(x[None], InferenceParams(tile=256, overlap=8, blend="hann"))
    err = float(np.abs(got[0] - oracle("sobel", x)).max())
    logger.info("sobel-2d RG1_UNCR %s: max abs diff %.3g", x.shape, err)
    assert err <= 1e-4


def test_tiled_log_2d_halo_auto(repo: ModelRepository, rng: np.random.Generator) -> None:
    x = rng.random((300, 257), dtype=np.float32)
    model = repo.get("log-2d")
    got = model.run(x[None], InferenceParams(tile=64, halo="auto", halo_tolerance=1e-4))
    assert np.abs(got[0] - oracle("log", x)).max() <= 1e-4
    calibration = model.calibrate((64, 64), 1e-4)
    assert calibration.met and calibration.halo <= 8


def test_rgb_input_becomes_grey(repo: ModelRepository, rng: np.random.Generator) -> None:
    rgb = rng.integers(0, 256, (3, 40, 50), dtype=np.uint8)
    grey = np.tensordot(np.array([0.299, 0.587, 0.114], dtype=np.float32), rgb.astype(np.float32), axes=1)
    got = repo.get("gaussian-2d").run(rgb)
    assert np.abs(got[0] - oracle("gaussian", grey.astype(np.float32))).max() <= 1e-3  # 0..255 data


def test_wrong_channels_and_dims(repo: ModelRepository) -> None:
    model = repo.get("gaussian-3d")
    with pytest.raises(InputError, match="gaussian-3d.*1 channel"):
        model.run(np.zeros((2, 8, 8, 8), dtype=np.float32))
    with pytest.raises(InputError, match="gaussian-3d.*3 spatial axes"):
        model.run(np.zeros((1, 8, 8), dtype=np.float32))
    with pytest.raises(InputError, match="takes batches"):
        model.predictor(torch.zeros((1, 2, 8, 8, 8)))


def test_labels_output(repo: ModelRepository) -> None:
    x = np.zeros((1, 40, 40), dtype=np.float32)
    x[0, 10:30, 10:30] = 10.0
    labels = repo.get("gaussian-2d").run(x, InferenceParams(tile=32, output="labels"))
    assert labels.shape == (40, 40) and labels.dtype == np.uint8
    assert labels[20, 20] == 1 and labels[0, 0] == 0
