"""A device that runs out of memory: the run halves the batch, then the tile, and gives the same output.

The predictor is ``gaussian-3d`` (exact with its halo 8 at any tile) behind a wrapper that raises
what the backends raise for ``torch.cuda.OutOfMemoryError`` (:class:`DeviceOutOfMemoryError`) for
batches above a size, or tiles above a voxel count.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import InferenceParams, ModelRepository
from models.backends import BasePredictor
from models.errors import DeviceOutOfMemoryError
from models.execution.options import RunOptions
from models.measure.footprint import Footprint
from models.model import Model


class OutOfMemoryAbove(BasePredictor):
    """``inner`` that raises :class:`DeviceOutOfMemoryError` above ``max_batch`` or ``max_voxels``."""

    def __init__(self, inner: BasePredictor, *, max_batch: int = 10**9, max_voxels: int = 10**12) -> None:
        super().__init__(inner.spec, inner.device)
        self.inner = inner
        self.receptive_field = inner.receptive_field
        self.max_batch, self.max_voxels = max_batch, max_voxels
        self.batches: list[tuple[int, ...]] = []

    def _forward(self, batch: torch.Tensor) -> torch.Tensor:
        self.batches.append(tuple(batch.shape))
        if batch.shape[0] > self.max_batch or batch[0, 0].numel() > self.max_voxels:
            raise DeviceOutOfMemoryError(
                f"model {self.name!r}: CUDA out of memory (simulated, {batch.shape})"
            )
        return self.inner(batch)


def _model(**limits: int) -> tuple[Model, OutOfMemoryAbove]:
    model = ModelRepository("/nonexistent", device="cpu").get("gaussian-3d")
    wrapped = OutOfMemoryAbove(model.predictor, **limits)
    return Model(model.spec, wrapped), wrapped


@pytest.fixture(scope="module")
def volume() -> np.ndarray:
    return np.random.default_rng(3).random((1, 48, 40, 36), dtype=np.float32)


@pytest.fixture(scope="module")
def reference(volume: np.ndarray) -> np.ndarray:
    model, _ = _model()
    return model.run(volume, InferenceParams(tile=32, batch_size=1))


def test_out_of_memory_above_a_batch_size_halves_the_batch_with_the_same_output(
    volume: np.ndarray, reference: np.ndarray
) -> None:
    model, predictor = _model(max_batch=1)
    seen = []
    x = model.preprocess(volume)
    plan = model.plan(x.shape[1:], InferenceParams(tile=32, batch_size=4), footprint=Footprint.estimate(1))
    out = model.execute(x, plan, options=RunOptions(replanned=seen.append))
    np.testing.assert_array_equal(out, reference)
    assert [p.batch_size for p in seen] == [2, 1]
    assert all(p.grid.used_tile_shape == plan.grid.used_tile_shape for p in seen)
    assert predictor.batches[0][0] == 4 and all(b[0] == 1 for b in predictor.batches[-plan.grid.n_tiles :])


def test_out_of_memory_at_batch_1_halves_the_tile_with_the_same_output(
    volume: np.ndarray, reference: np.ndarray
) -> None:
    model, predictor = _model(max_batch=1, max_voxels=30**3)
    seen = []
    out = model.run(volume, InferenceParams(tile=48, batch_size=2))
    np.testing.assert_allclose(out, reference, rtol=0, atol=1e-6)  # halo 8 = the radius: exact
    x = model.preprocess(volume)
    plan = model.plan(x.shape[1:], InferenceParams(tile=48, batch_size=2), footprint=Footprint.estimate(1))
    assert plan.grid.n_tiles == 1  # one 48x40x36 tile: batch 1 already, so the tile halves
    model.execute(x, plan, options=RunOptions(replanned=seen.append))
    assert [p.batch_size for p in seen] == [1]
    assert seen[-1].grid.used_tile_shape == (24, 20, 18) and seen[-1].halo == plan.halo
    assert max(int(np.prod(b[2:])) for b in predictor.batches[-seen[-1].grid.n_tiles :]) <= 30**3


def test_out_of_memory_at_the_least_tile_and_batch_fails(volume: np.ndarray) -> None:
    model, _ = _model(max_batch=1, max_voxels=8**3)  # the core must keep more than 2 * halo
    with pytest.raises(DeviceOutOfMemoryError):
        model.run(volume, InferenceParams(tile=32, batch_size=2))
