"""The slab accumulator: hand-computed overlap-add fixtures, and its state errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiling import AccumulatorStateError
from tiling.accumulate import SlabAccumulator

CPU = torch.device("cpu")


def test_hand_computed_4x4_overlap_add():
    # Two 3x4 tiles on a 4x4 output, overlapping on rows 1..2, weights 1 and 3 along axis 0.
    cov0 = np.array([1, 4, 4, 3], np.float32)
    acc = SlabAccumulator(1, (4, 4), [cov0, None], CPU)
    a = torch.full((1, 3, 4), 2.0)
    b = torch.full((1, 3, 4), 6.0)
    acc.add((slice(0, 3), slice(0, 4)), a, torch.ones(3, 1))
    lo, first = acc.release(1)
    assert lo == 0
    np.testing.assert_array_equal(first.numpy(), np.full((1, 1, 4), 2.0))
    acc.add((slice(1, 4), slice(0, 4)), b, torch.full((3, 1), 3.0))
    lo, rest = acc.finalize()
    assert lo == 1
    # rows 1, 2: (2 * 1 + 6 * 3) / 4 = 5; row 3: 6 * 3 / 3 = 6
    np.testing.assert_array_equal(rest[0, :, 0].numpy(), [5.0, 5.0, 6.0])


def test_add_after_finalize_raises():
    acc = SlabAccumulator(1, (2, 2), [None, None], CPU)
    acc.add((slice(0, 2), slice(0, 2)), torch.ones(1, 2, 2), None)
    acc.finalize()
    with pytest.raises(AccumulatorStateError, match="after finalize"):
        acc.add((slice(0, 2), slice(0, 2)), torch.ones(1, 2, 2), None)
    with pytest.raises(AccumulatorStateError, match="after finalize"):
        acc.release(2)


def test_add_to_released_rows_raises():
    acc = SlabAccumulator(1, (4, 2), [None, None], CPU)
    acc.add((slice(0, 2), slice(0, 2)), torch.ones(1, 2, 2), None)
    acc.release(2)
    assert acc.lo == 2
    with pytest.raises(AccumulatorStateError, match="already released"):
        acc.add((slice(1, 3), slice(0, 2)), torch.ones(1, 2, 2), None)


def test_release_beyond_added_rows_raises():
    acc = SlabAccumulator(1, (4, 2), [None, None], CPU)
    acc.add((slice(0, 2), slice(0, 2)), torch.ones(1, 2, 2), None)
    with pytest.raises(AccumulatorStateError, match="never added"):
        acc.release(3)


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed{s}") for s in range(5)])
def test_random_row_sequence_matches_dense_overlap_add(seed):
    # Oracle: a dense float64 overlap-add over the whole output, divided by the dense coverage.
    # The accumulator reuses one buffer across rows; releasing after each row must hand back
    # exactly the dense result (fp32 sums of <= 4 terms: rtol 1e-6).
    rng = np.random.default_rng(seed)
    rows, cols = 60, 5
    starts = np.sort(rng.choice(np.arange(1, rows - 3), size=8, replace=False))
    starts = [0, *starts.tolist()]
    spans, prev_hi = [], 0
    for i, s in enumerate(starts):  # stops non-decreasing, reaching the next start: every row covered
        nxt = starts[i + 1] if i + 1 < len(starts) else rows
        hi = rows if i + 1 == len(starts) else min(rows, max(s + int(rng.integers(1, 20)), nxt, prev_hi))
        spans.append((s, hi))
        prev_hi = hi
    w0 = [rng.uniform(0.1, 1.0, size=hi - lo).astype(np.float32) for lo, hi in spans]
    cov0 = np.zeros(rows, np.float32)
    dense = np.zeros((2, rows, cols))
    dense_w = np.zeros(rows)
    values = [rng.standard_normal((2, hi - lo, cols)).astype(np.float32) for lo, hi in spans]
    for (lo, hi), w, v in zip(spans, w0, values, strict=True):
        cov0[lo:hi] += w
        dense[:, lo:hi] += v * w[None, :, None]
        dense_w[lo:hi] += w
    acc = SlabAccumulator(2, (rows, cols), [cov0, None], CPU)
    got = np.full((2, rows, cols), np.nan, np.float32)
    for i, ((lo, hi), w, v) in enumerate(zip(spans, w0, values, strict=True)):
        acc.add((slice(lo, hi), slice(0, cols)), torch.from_numpy(v), torch.from_numpy(w)[:, None])
        until = spans[i + 1][0] if i + 1 < len(spans) else None
        r0, region = acc.finalize() if until is None else acc.release(until)
        got[:, r0 : r0 + region.shape[1]] = region.numpy()
    np.testing.assert_allclose(got, dense / dense_w[None, :, None], rtol=1e-6, atol=1e-6)
