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
