"""Non-finite input voxels (issue 23 item 3): statistics ignore them, they become 0 after
preprocessing, the output is finite and differs from the clean input's only within the receptive
field of the bad voxels, and the service counts them in ``X-Tilewise-Warning``.

Oracles: numpy's ``nanmean`` / ``nanstd`` / ``nanpercentile`` (the statistics) and
``scipy.ndimage.gaussian_filter`` (the built-in ``gaussian-3d``: radius 8 voxels).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
from scipy import ndimage

from models import ModelRepository, parse_params, spec_from_mapping
from models.transforms.preprocess import count_nonfinite, preprocess
from service.pipeline import run_file

SHAPE = (37, 41, 29)
TILE = 16


def _spec(steps: list[Any]) -> Any:
    return spec_from_mapping(
        {"name": "p", "backend": "analytic", "architecture": "gaussian", "spatial_dims": 3,
         "in_channels": 1, "out_channels": 1, "preprocess": steps}
    )  # fmt: skip


def _bad(kind: str) -> tuple[slice, ...]:
    if kind == "border":
        return (slice(0, 1), slice(0, 2), slice(28, 29))
    if kind == "middle":
        return (slice(18, 20), slice(20, 21), slice(14, 16))
    return (slice(16, 32), slice(16, 32), slice(0, 16))  # a whole tile of the 16^3 grid


@pytest.fixture
def image(rng: np.random.Generator) -> np.ndarray:
    return rng.normal(100.0, 20.0, (1, *SHAPE)).astype(np.float32)


@pytest.mark.parametrize("where", ["border", "middle", "tile"])
def test_statistics_ignore_non_finite_voxels(image: np.ndarray, where: str) -> None:
    x = image.copy()
    x[(0, *_bad(where))] = np.nan
    x[0, 5, 5, 5] = np.inf
    bad = ~np.isfinite(x)
    z = preprocess(x, _spec(["zscore"]))
    expected = (x - np.nanmean(np.where(bad, np.nan, x))) / np.nanstd(np.where(bad, np.nan, x))
    np.testing.assert_allclose(z[~bad], expected[~bad], atol=1e-4)
    assert (z[bad] == 0).all()
    p = preprocess(x, _spec([{"type": "percentile", "lo": 1, "hi": 99}]))
    lo, hi = np.nanpercentile(np.where(bad, np.nan, x), [1, 99])
    np.testing.assert_allclose(p[~bad], np.clip((x[~bad] - lo) / (hi - lo), 0, 1), atol=1e-5)
    assert np.isfinite(p).all() and (p[bad] == 0).all()
    assert count_nonfinite(x) == int(bad.sum())


@pytest.mark.parametrize("where", ["border", "middle", "tile"])
def test_nan_stays_within_the_receptive_field(image: np.ndarray, where: str) -> None:
    gauss = ModelRepository("/nonexistent", device="cpu").get("gaussian-3d")
    params = parse_params({"tile": str(TILE + 16), "halo": "8"})  # cores of 16
    clean = gauss.run(image, params)[0]
    x = image.copy()
    x[(0, *_bad(where))] = np.nan
    got = gauss.run(x, params)[0]
    assert np.isfinite(got).all()
    oracle = ndimage.gaussian_filter(np.nan_to_num(x[0], nan=0.0), 2.0, truncate=4.0, mode="constant")
    np.testing.assert_allclose(got, oracle, atol=1e-3)
    mask = np.zeros(SHAPE, bool)
    mask[_bad(where)] = True
    near = ndimage.binary_dilation(mask, np.ones((17, 17, 17), bool))
    np.testing.assert_array_equal(got[~near], clean[~near])


def test_the_answer_counts_them(image: np.ndarray, tmp_path: Path) -> None:
    x = image[0].copy()
    x[_bad("middle")] = np.nan
    x[0, 0, 0] = -np.inf
    nib.save(nib.Nifti1Image(x, np.eye(4)), tmp_path / "nan.nii.gz")
    gauss = ModelRepository("/nonexistent", device="cpu").get("gaussian-3d")
    result = run_file(gauss, tmp_path / "nan.nii.gz", tmp_path / "out", parse_params({}))
    assert result.plan.warning is not None and "5 non-finite input voxel(s)" in result.plan.warning
    assert np.isfinite(np.asarray(nib.load(result.path).dataobj)).all()
