"""Coverage normalization: identity-like predictors reproduce their input, for any plan.

Oracle: the input itself (identity) or ``2 * input``. With abutting cores the output must be
bit-identical. With overlapping cores each voxel is ``sum_i w_i x / coverage``, which equals ``x``
up to fp32 rounding: every term has the sign of ``x``, so the relative error is at most about
``(n + 2) * 2**-24`` for ``n`` contributions; we allow ``rtol=1e-5`` (n up to ~150) and ``2e-5`` for
the 300-contribution test (n = 300, bound 1.8e-5).

``reduce`` (argmax to uint8 labels) must equal the argmax of the full (un-reduced) tiled result.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _tiling_nets import ConvStack
from hypothesis import given, settings
from hypothesis import strategies as st

from tiling import BlendMode, TileGrid, tiled_inference

BLENDS = [pytest.param(m.value, id=m.value) for m in BlendMode]
RTOL = 1e-5  # fp32 rounding of the weighted sum and the coverage division; see the module docstring


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def double(t: torch.Tensor) -> torch.Tensor:
    return 2 * t


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want) / np.maximum(np.abs(want), 1e-30)))


@pytest.mark.parametrize("blend", BLENDS)
@pytest.mark.parametrize(
    ("shape", "tile", "halo", "overlap"),
    [
        pytest.param((37, 41), (16, 12), 3, (1, 1), id="2d-ov1"),
        pytest.param((37, 41), (16, 12), 3, (6, 5), id="2d-ov-max"),
        pytest.param((37, 41), (16, 12), 0, (15, 11), id="2d-halo0-stride1"),
        pytest.param((11, 13, 9), (6, 7, 5), (1, 2, 0), (2, 1, 4), id="3d"),
        pytest.param((50,), 9, 2, 4, id="1d"),
    ],
)
def test_identity_every_blend_any_overlap(rng, record_diff, blend, shape, tile, halo, overlap):
    x = rng.standard_normal((2, *shape), dtype=np.float32)
    y = tiled_inference(x, identity, tile, halo=halo, overlap=overlap, blend=blend, batch_size=7)
    record_diff("identity-blends", y, x)
    assert _rel_err(y, x) <= RTOL
    y2 = tiled_inference(x, double, tile, halo=halo, overlap=overlap, blend=blend, batch_size=3)
    assert _rel_err(y2, 2 * x) <= RTOL


@pytest.mark.parametrize("blend", BLENDS)
def test_identity_without_overlap_is_bit_exact(rng, blend):
    x = rng.standard_normal((1, 29, 31), dtype=np.float32)
    y = tiled_inference(x, identity, (10, 9), halo=(2, 3), overlap=0, blend=blend)
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("blend", BLENDS)
def test_four_spatial_axes(rng, record_diff, blend):
    x = rng.standard_normal((1, 9, 8, 7, 6), dtype=np.float32)
    y = tiled_inference(x, double, (4, 5, 3, 6), halo=1, overlap=(0, 1, 0, 1), blend=blend, batch_size=8)
    record_diff("identity-blends", y, 2 * x)
    assert y.shape == x.shape and _rel_err(y, 2 * x) <= RTOL


@pytest.mark.parametrize("blend", BLENDS)
def test_300_contributions_normalize_to_identity(rng, record_diff, blend):
    # Tile 20x15 with overlap 19x14 and no halo: stride 1 on both axes, so every voxel at least 19
    # (resp. 14) from the edges lies in 20 * 15 = 300 tiles.
    shape, tile = (45, 40), (20, 15)
    grid = TileGrid.plan(shape, tile, 0, overlap=(19, 14), blend=blend)
    assert grid.stride == (1, 1) and grid.n_tiles == 26 * 26
    count = np.zeros(shape, dtype=np.int64)
    for t in grid.tiles():
        count[t.write] += 1
    assert count.max() == 300 and (count[19:26, 14:26] == 300).all()
    x = rng.uniform(0.5, 2.0, size=(1, *shape)).astype(np.float32)
    y = tiled_inference(x, identity, tile, halo=0, overlap=(19, 14), blend=blend, batch_size=128)
    record_diff("identity-300-contributions", y, x)
    assert _rel_err(y, x) <= 2e-5  # n = 300: (300 + 2) * 2**-24 = 1.8e-5, see the module docstring


@st.composite
def identity_cases(draw):
    ndim = draw(st.integers(1, 3))
    shape, tile, halo, overlap, align = [], [], [], [], []
    for _ in range(ndim):
        a = draw(st.integers(1, 4))
        t = a * draw(st.integers(1, 24 // a))
        h = draw(st.integers(0, max(0, (t - a) // 2)))
        o = draw(st.integers(0, max(0, t - 2 * h - a)))
        shape.append(draw(st.integers(1, 40 if ndim < 3 else 14)))
        tile.append(t), halo.append(h), overlap.append(o), align.append(a)
    return dict(
        shape=tuple(shape),
        tile_shape=tuple(tile),
        halo=tuple(halo),
        overlap=tuple(overlap),
        alignment=tuple(align),
        blend=draw(st.sampled_from([m.value for m in BlendMode])),
        border=draw(st.sampled_from(["clip", "pad"])),
        padding_mode=draw(st.sampled_from(["constant", "reflect", "replicate"])),
        batch_size=draw(st.integers(1, 5)),
        channels=draw(st.integers(1, 3)),
        fixed_tile_shape=draw(st.booleans()),
    )


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(identity_cases())
def test_property_identity(case):
    shape, channels = case.pop("shape"), case.pop("channels")
    x = np.random.default_rng(0).uniform(-2, 2, size=(channels, *shape)).astype(np.float32)
    y = tiled_inference(x, identity, **case)
    assert y.shape == x.shape
    assert _rel_err(y, x) <= RTOL, case
    if all(o == 0 for o in case["overlap"]):
        np.testing.assert_array_equal(y, x)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(identity_cases())
def test_property_double_torch(case):
    shape, channels = case.pop("shape"), case.pop("channels")
    x = torch.from_numpy(
        np.random.default_rng(1).uniform(-2, 2, size=(2, channels, *shape)).astype(np.float32)
    )
    y = tiled_inference(x, double, **case)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape
    assert _rel_err(y.numpy(), 2 * x.numpy()) <= RTOL, case


# --- reduce -------------------------------------------------------------------------------------


def argmax_u8(region: torch.Tensor) -> torch.Tensor:
    return region.argmax(dim=0, keepdim=True).to(torch.uint8)


@pytest.mark.parametrize(
    ("overlap", "blend"),
    [
        pytest.param(0, "constant", id="abutting"),
        pytest.param(3, "gaussian", id="overlap3-gaussian"),
        pytest.param((5, 2), "hann", id="overlap5x2-hann"),
    ],
)
def test_reduce_argmax_matches_full_result(rng, overlap, blend):
    net = ConvStack(2, 1, 3)
    x = rng.standard_normal((1, 43, 37), dtype=np.float32)
    kwargs = dict(halo=3, overlap=overlap, blend=blend, batch_size=3)
    full = tiled_inference(x, net, (16, 14), **kwargs)
    labels = tiled_inference(x, net, (16, 14), reduce=argmax_u8, **kwargs)
    assert labels.dtype == np.uint8 and labels.shape == (1, 43, 37)
    np.testing.assert_array_equal(labels[0], full.argmax(axis=0))
    assert len(np.unique(labels)) == 3, "all three classes occur, so the check is not vacuous"


def test_reduce_into_out_memmap(tmp_path, rng):
    net = ConvStack(3, 1, 3)
    x = rng.standard_normal((1, 17, 12, 14), dtype=np.float32)
    out = np.memmap(tmp_path / "labels.dat", dtype=np.uint8, mode="w+", shape=(1, 17, 12, 14))
    got = tiled_inference(x, net, 8, halo=3, overlap=1, blend="triangular", out=out, reduce=argmax_u8)
    assert got is out
    full = tiled_inference(x, net, 8, halo=3, overlap=1, blend="triangular")
    np.testing.assert_array_equal(np.asarray(out[0]), full.argmax(axis=0))


def test_reduce_torch_batch(rng):
    net = ConvStack(2, 1, 3)
    x = torch.from_numpy(rng.standard_normal((2, 1, 25, 21), dtype=np.float32))
    labels = tiled_inference(x, net, 12, halo=3, overlap=2, blend="hann", reduce=argmax_u8)
    full = tiled_inference(x, net, 12, halo=3, overlap=2, blend="hann")
    assert labels.dtype == torch.uint8 and labels.shape == (2, 1, 25, 21)
    assert torch.equal(labels[:, 0].long(), full.argmax(dim=1))


def test_reduce_300_contributions(rng):
    # Three constant-per-voxel channels through 300 overlapping tiles: the labels are unchanged.
    x = rng.standard_normal((3, 45, 40), dtype=np.float32)
    labels = tiled_inference(x, identity, (20, 15), overlap=(19, 14), blend="gaussian", batch_size=256,
                             reduce=argmax_u8)  # fmt: skip
    np.testing.assert_array_equal(labels[0], x.argmax(axis=0))
