"""Whole-image preprocessing steps and output reduction."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from models import InferenceParams, InputError, ModelRepository, spec_from_mapping
from models.transforms.preprocess import make_reduce, preprocess


def _spec(steps: list[Any], in_channels: int = 1) -> Any:
    return spec_from_mapping(
        {"name": "p", "backend": "analytic", "architecture": "gaussian", "spatial_dims": 2,
         "in_channels": in_channels, "out_channels": 1, "preprocess": steps}
    )  # fmt: skip


def test_ct_window_clips_then_scales() -> None:
    x = np.array([[[-2000, -1000, -300, 400, 3000]]], dtype=np.int16)
    got = preprocess(x, _spec([{"type": "ct_window", "lo": -1000, "hi": 400}]))
    np.testing.assert_allclose(got[0, 0], [0.0, 0.0, 0.5, 1.0, 1.0])


def test_zscore_is_over_the_whole_image(rng: np.random.Generator) -> None:
    x = rng.normal(5.0, 3.0, (1, 64, 64)).astype(np.float32)
    got = preprocess(x, _spec(["zscore"]))
    assert abs(float(got.mean())) < 1e-5 and abs(float(got.std()) - 1.0) < 1e-4


def test_percentile_scaling() -> None:
    x = np.arange(100, dtype=np.float32).reshape(1, 10, 10)
    got = preprocess(x, _spec([{"type": "percentile", "lo": 0, "hi": 100}]))
    assert got.min() == 0.0 and got.max() == 1.0


def test_text_det_style_pipeline() -> None:
    grey = np.full((1, 4, 4), 255, dtype=np.uint8)
    steps = ["grey_to_rgb", "rgb_to_bgr", "unit_range", {"type": "normalize", "mean": 0.5, "std": 0.5}]
    got = preprocess(grey, _spec(steps, in_channels=3))
    assert got.shape == (3, 4, 4) and np.all(got == 1.0)
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[0] = 255  # red; alpha dropped; BGR puts red last
    got = preprocess(rgba, _spec(steps, in_channels=3))
    assert np.all(got[2] == 1.0) and np.all(got[0] == -1.0)


def test_uint16_unit_range() -> None:
    x = np.array([[[0, 65535]]], dtype=np.uint16)
    np.testing.assert_allclose(preprocess(x, _spec(["unit_range"]))[0, 0], [0.0, 1.0])


def test_non_numeric_input_is_refused() -> None:
    with pytest.raises(InputError, match="numeric"):
        preprocess(np.array([[["a"]]]), _spec([]))


def test_reduce_softmax_labels_and_sigmoid() -> None:
    logits = torch.tensor([[[0.0, 3.0]], [[1.0, -3.0]]])  # (C=2, 1, 2)
    labels = make_reduce("softmax", "labels")(logits)  # type: ignore[misc]
    assert labels.dtype == torch.uint8 and labels.tolist() == [[[1, 0]]]
    probs = make_reduce("softmax", "probabilities")(logits)  # type: ignore[misc]
    torch.testing.assert_close(probs.sum(0), torch.ones(1, 2))
    mask = make_reduce("sigmoid", "labels")(torch.tensor([[[-1.0, 1.0]]]))  # type: ignore[misc]
    assert mask.tolist() == [[[0, 1]]]
    assert make_reduce("none", "probabilities") is None


def test_run_fills_out(rng: np.random.Generator) -> None:
    model = ModelRepository("/nonexistent-tilewise-models").get("sobel-2d")
    x = rng.random((1, 50, 60), dtype=np.float32)
    out = np.zeros((1, 50, 60), dtype=np.float32)
    assert model.run(x, InferenceParams(tile=32), out=out) is out
    np.testing.assert_allclose(out, model.run(x), atol=1e-6)


def test_float_unit_range_is_min_max_outside_unit_interval() -> None:
    """A float TIFF/NIfTI (here 0..4095 and -1000..3000) is min-max scaled over the whole image."""
    x = np.array([[[0.0, 1024.0, 4095.0]]], dtype=np.float32)
    np.testing.assert_allclose(preprocess(x, _spec(["unit_range"]))[0, 0], [0.0, 1024 / 4095, 1.0], rtol=1e-6)
    ct = np.array([[[-1000.0, 1000.0, 3000.0]]], dtype=np.float64)
    np.testing.assert_allclose(preprocess(ct, _spec(["unit_range"]))[0, 0], [0.0, 0.5, 1.0])


def test_float_unit_range_keeps_unit_data_and_ignores_non_finite() -> None:
    x = np.array([[[0.0, 0.25, 1.0]]], dtype=np.float32)
    np.testing.assert_array_equal(preprocess(x, _spec(["unit_range"]))[0, 0], x[0, 0])
    y = np.array([[[np.nan, 2.0, 6.0]]], dtype=np.float32)
    got = preprocess(y, _spec(["unit_range"]))[0, 0]
    assert got[0] == 0.0 and got[1:].tolist() == [0.0, 1.0]  # NaN: 0 after the steps (issue 23 item 3)
    flat = np.full((1, 2, 2), 7.0, dtype=np.float32)
    assert np.all(preprocess(flat, _spec(["unit_range"])) == 0.0)


def test_uint8_unit_range_is_by_dtype_not_min_max() -> None:
    x = np.array([[[10, 20]]], dtype=np.uint8)  # a dark image stays dark
    np.testing.assert_allclose(preprocess(x, _spec(["unit_range"]))[0, 0], [10 / 255, 20 / 255])
