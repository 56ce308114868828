"""Resuming a tiled run (tiling.resume): a run stopped anywhere and resumed from its last recorded
tile row equals an uninterrupted run bit for bit, recomputing only what the module docstring says."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiling import GridError, Resume, RunCancelledError, TileGrid, resume_point, tiled_inference

SHAPE = (37, 11, 9)

CASES = [
    pytest.param(dict(tile_shape=(12, 8, 9), halo=(2, 1, 0)), id="abutting"),
    pytest.param(
        dict(tile_shape=(12, 8, 9), halo=(2, 1, 0), overlap=(3, 0, 0), blend="hann"), id="blend-axis0"
    ),
    pytest.param(
        dict(tile_shape=(12, 8, 9), halo=(2, 1, 0), overlap=(0, 2, 0), blend="gaussian"), id="blend-axis1"
    ),
]


def batch_dependent(batch: torch.Tensor) -> torch.Tensor:
    """A predictor whose output depends on the whole batch (as a backend's last bits may): the same
    tile in another batch gives another value, so only identical batches reproduce a run."""
    return torch.cat([batch * 2.0, batch.mean() + 0 * batch], dim=1)


def run(x, out, kwargs, batch_size, *, resume=None, stop_after=None, device="cpu"):
    """One run into ``out``; returns (tiles computed, rows recorded)."""
    computed = [0]
    rows: list[int] = []

    def progress(n: int) -> None:
        computed[0] += n

    def should_stop() -> bool:
        return stop_after is not None and computed[0] >= stop_after

    resume = Resume(resume or 0, rows.append)
    try:
        tiled_inference(
            x, batch_dependent, batch_size=batch_size, out=out, progress=progress, should_stop=should_stop,
            resume=resume, device=device, **kwargs,
        )  # fmt: skip
    except RunCancelledError:
        pass
    return computed[0], rows


@pytest.mark.parametrize("kwargs", CASES)
@pytest.mark.parametrize("batch_size", [1, 4])
# On CUDA a batch is merged once the next one is launched (Transfers.lag): rows end a batch later.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_resumed_run_equals_an_uninterrupted_one(rng, kwargs, batch_size, device):
    x = rng.standard_normal((1, *SHAPE), dtype=np.float32)
    full = np.zeros((2, *SHAPE), np.float32)
    n_full, rows_full = run(x, full, kwargs, batch_size, device=device)
    grid = TileGrid.plan(SHAPE, kwargs["tile_shape"], kwargs["halo"], overlap=kwargs.get("overlap", 0))
    n_rows, per_row = grid.axes[0].n_tiles, grid.n_tiles // grid.axes[0].n_tiles
    assert n_full == grid.n_tiles and rows_full == list(range(1, n_rows + 1))
    for stop_after in range(batch_size, grid.n_tiles, batch_size):
        out = np.full_like(full, np.nan)  # what the killed run did not finish is garbage
        computed, rows = run(x, out, kwargs, batch_size, stop_after=stop_after, device=device)
        assert computed == stop_after
        done = rows[-1] if rows else 0
        merged = stop_after - batch_size * (device == "cuda")  # the last batch is still in flight
        assert done == min(merged // per_row, n_rows - 1)  # every row whose last tile merged
        # A killed process loses what it did not flush: everything past the recorded rows.
        floor = grid.axes[0].writes[done][0] if done < n_rows else SHAPE[0]
        out[:, floor:] = np.nan
        again, rows_again = run(x, out, kwargs, batch_size, resume=done, device=device)
        np.testing.assert_array_equal(out, full)
        start = resume_point(grid, done, batch_size)
        assert again == grid.n_tiles - start.first_tile
        assert rows_again == list(range(done + 1, n_rows + 1))
        # Recomputed: the tiles of unrecorded rows plus, when rows blend along axis 0, one row more,
        # plus fewer than batch_size tiles to keep the batches of the uninterrupted run.
        blended0 = grid.axes[0].blended
        assert (
            computed + again - grid.n_tiles
            <= (stop_after - done * per_row) + per_row * blended0 + batch_size - 1
        )


def test_resume_point_arithmetic():
    grid = TileGrid.plan((100, 8), (32, 8), halo=(4, 0), overlap=(4, 0))
    assert resume_point(grid, 0, 3).first_tile == 0
    assert resume_point(grid, 5, 3) == resume_point(grid, 9, 3)  # clamped: everything is done
    assert resume_point(grid, 5, 3).first_tile == grid.n_tiles
    point = resume_point(grid, 3, 2)  # floor writes[3].lo = 56; row 2 reaches 60 > 56; tile 2 batch-aligned
    assert (point.floor, point.first_tile, point.origin) == (56, 2, 39)


def test_nothing_runs_when_every_row_is_done(rng):
    x = rng.standard_normal((1, *SHAPE), dtype=np.float32)
    out = np.full((2, *SHAPE), 7.0, np.float32)
    computed, rows = run(x, out, dict(tile_shape=(12, 8, 9), halo=(2, 1, 0)), 2, resume=99)
    assert computed == 0 and rows == []
    assert (out == 7.0).all()


def test_resume_needs_an_out_array_and_a_channel_first_input(rng):
    x = rng.standard_normal((1, 10, 10), dtype=np.float32)
    with pytest.raises(GridError, match="resume"):
        tiled_inference(x, lambda t: t, 4, resume=Resume(1))
    with pytest.raises(GridError, match="resume"):
        tiled_inference(
            torch.from_numpy(x)[None], lambda t: t, 4, out=torch.zeros(1, 1, 10, 10), resume=Resume(1)
        )
