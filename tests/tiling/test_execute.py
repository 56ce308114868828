"""Execution: reusable batch buffers, the prefetch thread, and the one-copy reader.

Oracles: :func:`tiling.io.read_region` / ``numpy.pad`` for buffer contents, the same run without
prefetch (bit-identical results), and explicit thread hand-shakes (``threading.Event``) rather than
timings to show that reading the next batch overlaps the predictor.
"""

from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest
import torch
from _tiling_nets import ConvStack, whole

from tiling import TileGrid, tiled_inference
from tiling.execute import TileReader, Transfers
from tiling.geometry import PaddingMode
from tiling.io import read_into, read_region

CPU = torch.device("cpu")
PREFETCH = pytest.mark.parametrize(
    "prefetch", [pytest.param(True, id="prefetch"), pytest.param(False, id="inline")]
)
NP_MODE = {PaddingMode.CONSTANT: "constant", PaddingMode.REFLECT: "reflect", PaddingMode.REPLICATE: "edge"}


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tilewise-prefetch"]


@PREFETCH
@pytest.mark.parametrize("mode", [pytest.param(m, id=m.value) for m in PaddingMode])
def test_reader_fills_reused_buffers_with_each_tile(rng, prefetch, mode):
    x = rng.standard_normal((2, 13, 11), dtype=np.float32)
    grid = TileGrid.plan(x.shape[1:], (8, 6), 2, border="pad")
    ptrs = set()
    seen = []
    with TileReader(x, grid, mode, 3, prefetch=prefetch) as reader:
        assert reader.n_slots == (2 if prefetch else 1)
        for batch in reader:
            ptrs.add(batch.data.data_ptr())
            for k, tile in enumerate(batch.tiles):
                starts = [s - a.pad_lo for s, a in zip(tile.starts, grid.axes, strict=True)]
                stops = [s + a.tile for s, a in zip(starts, grid.axes, strict=True)]
                want = read_region(x, starts, stops, x.shape[1:], mode)
                torch.testing.assert_close(batch.data[k], want, rtol=0, atol=0)
                seen.append(tile.index)
            reader.release(batch)
    assert seen == [t.index for t in grid.tiles()], "every tile once, in grid order"
    assert len(ptrs) <= reader.n_slots < reader.n_batches, "buffers are reused, not allocated per batch"
    assert not _prefetch_threads()


@PREFETCH
def test_results_do_not_depend_on_prefetch(rng, prefetch):
    net = ConvStack(3, 1, 2)
    x = rng.standard_normal((1, 19, 14, 12), dtype=np.float32)
    kwargs = dict(
        halo=3, overlap=(2, 0, 1), blend="gaussian", batch_size=3, border="pad", padding_mode="reflect"
    )
    y = tiled_inference(x, net, (10, 9, 8), prefetch=prefetch, **kwargs)
    ref = tiled_inference(x, net, (10, 9, 8), prefetch=not prefetch, **kwargs)
    np.testing.assert_array_equal(y, ref)
    padded = np.pad(x, [(0, 0)] + [(3, 3)] * 3, mode="reflect")
    want = whole(net, padded)[:, 3:-3, 3:-3, 3:-3]
    assert np.abs(y - want).max() <= 1e-5  # fp32 rounding only, see test_exactness


class HandshakeSource:
    """A ``(1, 24, 8)`` array-like; reading a region of the second batch sets ``second_read``."""

    shape = (1, 24, 8)

    def __init__(self, second_batch_rows: int) -> None:
        self.data = np.arange(24 * 8, dtype=np.float32).reshape(self.shape)
        self.second_batch_rows = second_batch_rows
        self.second_read = threading.Event()
        self.threads: set[str] = set()

    def __getitem__(self, key):
        self.threads.add(threading.current_thread().name)
        if key[1].start >= self.second_batch_rows:
            self.second_read.set()
        return self.data[key]


@PREFETCH
def test_next_batch_is_read_while_the_predictor_runs(prefetch):
    # Tiles of 8 rows, 3 tiles, batch size 1. The predictor of the first batch waits until the
    # source was asked for the second batch's rows: only a prefetching reader can do that meanwhile.
    source = HandshakeSource(second_batch_rows=8)
    overlapped = []

    def predictor(t):
        if not overlapped:
            overlapped.append(source.second_read.wait(timeout=2 if not prefetch else 30))
        return 2 * t

    y = tiled_inference(source, predictor, (8, 8), batch_size=1, prefetch=prefetch)
    np.testing.assert_array_equal(y, 2 * source.data)
    assert overlapped == [prefetch]
    assert ("tilewise-prefetch" in source.threads) == prefetch


@pytest.mark.parametrize(
    "where", [pytest.param("source", id="source-fails"), pytest.param("predictor", id="predictor-fails")]
)
def test_errors_propagate_and_stop_the_thread(where):
    class Failing:
        shape = (1, 40, 8)

        def __init__(self):
            self.reads = 0

        def __getitem__(self, key):
            self.reads += 1
            if where == "source" and self.reads == 3:
                raise OSError("disk gone")
            return np.zeros((1, key[1].stop - key[1].start, key[2].stop - key[2].start), np.float32)

    def predictor(t):
        if where == "predictor":
            raise KeyError("network failed")
        return t

    with pytest.raises(OSError if where == "source" else KeyError):
        tiled_inference(Failing(), predictor, (8, 8), batch_size=1, prefetch=True)
    assert not _prefetch_threads(), "the prefetch thread ends with the call"


def test_caller_in_inference_mode(rng):
    # Buffers allocated under the caller's inference mode are inference tensors; the prefetch thread
    # must still be able to fill them, and a torch result must still be usable afterwards.
    net = ConvStack(2, 1, 1)
    x = torch.from_numpy(rng.standard_normal((1, 1, 30, 20), dtype=np.float32))
    with torch.inference_mode():
        y = tiled_inference(x, net, 12, halo=3, overlap=2, blend="hann", prefetch=True)
        want = net(x)
    assert (y - want).abs().max().item() <= 1e-5
    z = tiled_inference(x.numpy()[0], net, 12, halo=3)
    y2 = torch.from_numpy(z)
    y2 += 1  # a normal (not inference) result can be modified in place
    assert np.isfinite(z).all()


def test_transfers_on_cpu_are_immediate():
    t = Transfers(CPU, CPU)
    assert t.lag == 0 and not t.async_d2h
    pred = torch.ones(2, 1, 3, dtype=torch.float16)
    staged = t.from_device(pred)
    assert staged.event is None and staged.wait().dtype == torch.float32


# --- read_into: one copy of the inside, padding strip by strip -----------------------------------


@pytest.mark.parametrize("mode", [pytest.param(m, id=m.value) for m in PaddingMode])
@pytest.mark.parametrize("kind", ["numpy", "torch", "big-endian-int"])
@pytest.mark.parametrize(
    ("starts", "stops"),
    [
        pytest.param((-3, -2, 4), (6, 5, 11), id="corner"),
        pytest.param((1, 2, 3), (4, 6, 6), id="inside"),
        pytest.param((-6, 1, -9), (-1, 6, 12), id="outside-on-axis0-wider-than-axis2"),
        pytest.param((2, -4, 0), (9, 9, 7), id="past-both-ends-axis1"),
    ],
)
def test_read_into_3d_matches_numpy_pad(rng, mode, kind, starts, stops):
    shape = (2, 5, 4, 7)
    x = rng.integers(-50, 50, size=shape).astype(">i2") if kind == "big-endian-int" else (
        rng.standard_normal(shape, dtype=np.float32)
    )  # fmt: skip
    source = torch.from_numpy(x.copy()) if kind == "torch" else x
    pad = 12
    padded = np.pad(x.astype(np.float32), [(0, 0)] + [(pad, pad)] * 3, mode=NP_MODE[mode])
    want = padded[(slice(None), *(slice(a + pad, b + pad) for a, b in zip(starts, stops, strict=True)))]
    buffer = torch.full((3, 2, *(b - a for a, b in zip(starts, stops, strict=True))), float("nan"))
    read_into(source, starts, stops, shape[1:], mode, buffer[1])
    np.testing.assert_array_equal(buffer[1].numpy(), want)
    assert torch.isnan(buffer[0]).all() and torch.isnan(buffer[2]).all(), "only its slot is written"


@pytest.mark.parametrize("mode", [pytest.param(m, id=m.value) for m in PaddingMode])
def test_read_into_makes_no_tile_sized_temporaries(rng, mode):
    # A corner tile of 48^3 padded by 8 on every axis. The old reader concatenated and index-selected
    # a full tile per padded axis (6 tile copies); read_into copies the inside once into the buffer
    # and gathers only the padding strips (at most 3 * 8 / 48 = half the tile here).
    x = rng.standard_normal((1, 64, 64, 64), dtype=np.float32)
    dst = torch.empty((1, 48, 48, 48))
    tile_bytes = dst.numel() * 4
    tracemalloc.start()
    try:
        read_into(x, (-8, -8, -8), (40, 40, 40), x.shape[1:], mode, dst)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 0.5 * tile_bytes, f"peak numpy temporaries {peak} B for a {tile_bytes} B tile"
    want = np.pad(x, [(0, 0)] + [(8, 8)] * 3, mode=NP_MODE[mode])[:, :48, :48, :48]
    np.testing.assert_array_equal(dst.numpy(), want)
