"""Lazy region reads: every source type and padding mode agrees with ``numpy.pad`` (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiling.geometry import PaddingMode
from tiling.io import read_region, source_indices

NP_MODE = {PaddingMode.CONSTANT: "constant", PaddingMode.REFLECT: "reflect", PaddingMode.REPLICATE: "edge"}
MODES = [pytest.param(m, id=m.value) for m in PaddingMode]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("length", [pytest.param(n, id=f"len{n}") for n in (1, 2, 3, 7)])
def test_source_indices_match_numpy_pad(mode, length):
    pad = 20  # wider than the image: numpy repeats the reflection
    base = np.arange(length)
    kwargs = {"constant_values": -1} if mode is PaddingMode.CONSTANT else {}
    padded = np.pad(base, pad, mode=NP_MODE[mode], **kwargs)
    idx = source_indices(-pad, length + pad, length, mode)
    np.testing.assert_array_equal(idx, padded)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("numpy", id="numpy"),
        pytest.param("memmap", id="memmap"),
        pytest.param("torch", id="torch"),
    ],
)
@pytest.mark.parametrize(
    ("starts", "stops"),
    [
        pytest.param((-3, -5), (4, 6), id="top-left"),
        pytest.param((2, 1), (9, 7), id="inside"),
        pytest.param((5, -1), (17, 13), id="past-both-ends"),
        pytest.param((-12, 4), (-2, 6), id="entirely-outside"),
    ],
)
def test_read_region_matches_numpy_pad(tmp_path, rng, mode, kind, starts, stops):
    shape = (2, 8, 11)
    x = rng.standard_normal(shape, dtype=np.float32)
    if kind == "memmap":
        mm = np.memmap(tmp_path / "x.dat", dtype=np.float32, mode="w+", shape=shape)
        mm[:] = x
        source = mm
    elif kind == "torch":
        source = torch.from_numpy(x.copy())
    else:
        source = x
    pad = 12
    padded = np.pad(x, [(0, 0), (pad, pad), (pad, pad)], mode=NP_MODE[mode])
    want = padded[(slice(None), *(slice(a + pad, b + pad) for a, b in zip(starts, stops, strict=True)))]
    got = read_region(source, starts, stops, shape[1:], mode)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.is_contiguous()
    np.testing.assert_array_equal(got.numpy(), want)


def test_read_region_casts_integer_sources_to_float32():
    x = np.arange(24, dtype=np.uint16).reshape(1, 4, 6)
    got = read_region(x, (0, 0), (4, 6), (4, 6), PaddingMode.CONSTANT)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), x.astype(np.float32))


def test_read_region_reads_only_the_needed_slice():
    class Recorder:
        shape = (1, 100, 100)

        def __init__(self):
            self.keys = []
            self.data = np.ones(self.shape, np.float32)

        def __getitem__(self, key):
            self.keys.append(key)
            return self.data[key]

    src = Recorder()
    read_region(src, (10, -3), (20, 5), (100, 100), PaddingMode.REFLECT)
    (key,) = src.keys
    assert key == (slice(None), slice(10, 20), slice(0, 5)), "a small contiguous slice, not the image"


@pytest.mark.parametrize(
    "region", [pytest.param(((0, 0), (8, 11)), id="whole"), pytest.param(((2, 0), (5, 11)), id="rows")]
)
def test_read_only_sources_do_not_warn_or_alias(tmp_path, rng, region):
    # Contiguous regions of read-only sources (memmap mode="r", non-writeable arrays) come back as
    # writeable copies: torch.from_numpy would warn on them (an error under filterwarnings=error).
    x = rng.standard_normal((1, 8, 11), dtype=np.float32)
    mm = np.memmap(tmp_path / "x.dat", dtype=np.float32, mode="w+", shape=x.shape)
    mm[:] = x
    mm.flush()
    ro = x.copy()
    ro.setflags(write=False)
    for source in (np.memmap(tmp_path / "x.dat", dtype=np.float32, mode="r", shape=x.shape), ro):
        got = read_region(source, *region, (8, 11), PaddingMode.CONSTANT)
        block = got.numpy()
        assert block.flags.writeable and not np.shares_memory(block, source)
        (a0, a1), (b0, b1) = region
        np.testing.assert_array_equal(block, x[:, a0:b0, a1:b1])
