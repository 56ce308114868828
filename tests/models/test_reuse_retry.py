"""Reuse counts after an out-of-memory retry (review item 12): the retried run counts its tiles
once, as a run planned at the smaller batch from the start does, not the failed attempt's too.

The predictor is ``gaussian-3d`` behind a wrapper that runs out of memory (what the backends
raise for ``torch.cuda.OutOfMemoryError``) on a batch of more than one tile holding a tile that
is not constant, so the first attempt reuses constant tiles before it fails.
"""

from __future__ import annotations

import numpy as np
import torch

from models import InferenceParams, ModelRepository
from models.backends import BasePredictor
from models.errors import DeviceOutOfMemoryError
from models.execution.options import RunOptions
from models.measure.footprint import Footprint
from models.model import Model
from tiling import TileReuse


class OutOfMemoryOnVariedBatches(BasePredictor):
    def __init__(self, inner: BasePredictor) -> None:
        super().__init__(inner.spec, inner.device)
        self.inner = inner
        self.receptive_field = inner.receptive_field
        self.failures = 0

    def _forward(self, batch: torch.Tensor) -> torch.Tensor:
        varied = bool((batch.amax(dim=(1, 2, 3, 4)) != batch.amin(dim=(1, 2, 3, 4))).any())
        if batch.shape[0] > 1 and varied:
            self.failures += 1
            raise DeviceOutOfMemoryError(f"model {self.name!r}: CUDA out of memory (simulated)")
        return self.inner(batch)


def test_skipped_after_an_out_of_memory_retry_equal_a_run_at_the_smaller_batch() -> None:
    base = ModelRepository("/nonexistent", device="cpu").get("gaussian-3d")
    wrapped = OutOfMemoryOnVariedBatches(base.predictor)
    model = Model(base.spec, wrapped)
    volume = np.zeros((1, 97, 37, 29), np.float32)  # constant but for the last slices
    volume[0, 80:] = np.random.default_rng(5).random((17, 37, 29), dtype=np.float32)
    x = model.preprocess(volume)
    big = model.plan(x.shape[1:], InferenceParams(tile=24, batch_size=4), footprint=Footprint.estimate(1))
    seen: list = []
    retried = TileReuse()
    out = model.execute(x, big, options=RunOptions(replanned=seen.append, reuse=retried))
    assert wrapped.failures >= 1 and seen and seen[-1].batch_size < big.batch_size
    alone = TileReuse()
    small = model.plan(
        x.shape[1:], InferenceParams(tile=24, batch_size=seen[-1].batch_size), footprint=Footprint.estimate(1)
    )
    reference = model.execute(x, small, options=RunOptions(reuse=alone))
    np.testing.assert_array_equal(out, reference)
    assert alone.n_reused > 0 and alone.n_tiles == small.grid.n_tiles
    assert (retried.n_tiles, retried.n_reused, retried.n_filled) == (
        alone.n_tiles,
        alone.n_reused,
        alone.n_filled,
    )
