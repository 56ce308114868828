"""Errors about the input's layout name the received shape (a missing channel axis, say)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiling import GridError, ShapeMismatchError, tiled_inference


def test_missing_channel_axis_names_the_shape() -> None:
    image = np.zeros((30, 40), dtype=np.float32)  # (H, W): the C axis is missing
    with pytest.raises(GridError, match=r"inputs of shape \(30, 40\) is read as \(C, \*spatial\)"):
        tiled_inference(image, lambda t: t, tile_shape=(16, 16))


def test_torch_input_without_batch_axis_names_the_shape() -> None:
    volume = torch.zeros((1, 30, 40))  # (C, H, W) as a tensor: torch inputs are (N, C, *spatial)
    with pytest.raises(GridError, match=r"inputs of shape \(1, 30, 40\) is read as \(N, C, \*spatial\)"):
        tiled_inference(volume, lambda t: t, tile_shape=(16, 16))
    with pytest.raises(ShapeMismatchError, match=r"inputs of shape \(30,\)"):
        tiled_inference(np.zeros(30, dtype=np.float32), lambda t: t, tile_shape=16)
