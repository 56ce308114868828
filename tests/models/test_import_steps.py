"""Preprocessing steps that import-model writes equal their sources: MONAI's transforms, nnU-Net's."""

from __future__ import annotations

import numpy as np
import pytest
from _import_kit import need

from models import SpecError, spec_from_mapping
from models.transforms.preprocess import preprocess

BASE = {"name": "x", "backend": "analytic", "architecture": "gaussian", "spatial_dims": 3, "out_channels": 1}


def _run(steps: list, x: np.ndarray) -> np.ndarray:
    return preprocess(x, spec_from_mapping({**BASE, "in_channels": x.shape[0], "preprocess": steps}))


@pytest.fixture
def ct(rng: np.random.Generator) -> np.ndarray:
    """Two channels of HU-like values with a zero border (the non-zero masks matter)."""
    x = (rng.standard_normal((2, 9, 8, 7)) * 300).astype(np.float32)
    x[:, :2] = 0
    return x


@pytest.mark.parametrize("clip", [pytest.param(True, id="clip"), pytest.param(False, id="no-clip")])
def test_scale_range_is_monai_scale_intensity_range(ct: np.ndarray, clip: bool) -> None:
    transforms = need("monai.transforms")
    step = {"type": "scale_range", "a_min": -57, "a_max": 164, "b_min": 0.0, "b_max": 1.0, "clip": clip}
    expected = np.asarray(transforms.ScaleIntensityRange(-57, 164, 0.0, 1.0, clip=clip)(ct))
    np.testing.assert_array_equal(_run([step], ct), expected)  # same float32 operations, same order


@pytest.mark.parametrize("channel_wise", [True, False])
@pytest.mark.parametrize("nonzero", [True, False])
def test_zscore_options_are_monai_normalize_intensity(
    ct: np.ndarray, channel_wise: bool, nonzero: bool
) -> None:
    transforms = need("monai.transforms")
    step = {"type": "zscore", "channel_wise": channel_wise, "nonzero": nonzero}
    expected = np.asarray(transforms.NormalizeIntensity(nonzero=nonzero, channel_wise=channel_wise)(ct))
    # MONAI sums in float32, tilewise in float64: the statistics differ in the 7th digit
    np.testing.assert_allclose(_run([step], ct), expected, atol=1e-6)
    if nonzero:
        assert np.all(_run([step], ct)[:, :2] == 0)  # zero voxels are kept


def test_clip_then_normalize_is_nnunet_ct_normalization(ct: np.ndarray) -> None:
    normalization = need("nnunetv2.preprocessing.normalization.default_normalization_schemes")
    props = {"mean": 12.5, "std": 80.0, "percentile_00_5": -200.0, "percentile_99_5": 250.0}
    expected = normalization.CTNormalization(intensityproperties=props).run(ct[:1].copy())
    steps = [{"type": "clip", "lo": -200.0, "hi": 250.0}, {"type": "normalize", "mean": 12.5, "std": 80.0}]
    np.testing.assert_allclose(_run(steps, ct[:1]), expected, atol=1e-6)
    zscore = normalization.ZScoreNormalization(use_mask_for_norm=False, intensityproperties={})
    expected = np.stack([zscore.run(c[None].copy())[0] for c in ct])
    np.testing.assert_allclose(_run([{"type": "zscore", "channel_wise": True}], ct), expected, atol=1e-6)


def test_step_parameters_are_checked() -> None:
    with pytest.raises(SpecError, match="field 'scale_range.clip' must be bool"):
        _run(
            [{"type": "scale_range", "a_min": 0, "a_max": 1, "b_min": 0, "b_max": 1, "clip": 1}],
            np.zeros((1, 2, 2, 2)),
        )
    with pytest.raises(SpecError, match="field 'zscore.nonzro' is unknown; did you mean 'nonzero'"):
        _run([{"type": "zscore", "nonzro": True}], np.zeros((1, 2, 2, 2)))
    with pytest.raises(SpecError, match="field 'hi' is required for clip"):
        _run([{"type": "clip", "lo": 0}], np.zeros((1, 2, 2, 2)))
