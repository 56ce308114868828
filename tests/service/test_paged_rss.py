"""The resident pages of a streamed output or checkpoint stay under a fixed bound whatever the tile
shape (:data:`service.paged.HOLD_BYTES`, 16 MiB; issue 20, "peak memory follows the tile").

Before, a :class:`~service.paged.PagedMemmap` counted the 4 KiB pages a write holds, but the
kernel maps a faulted page's whole page-cache folio (up to 2 MiB when read-ahead is large): one
99 x 99 x 112 float32 tile written into a Fortran-ordered 512 x 512 x 400 NIfTI lies on about
22 MiB of pages and mapped 87 MiB, and the CLI's peak rose with smaller tiles (tile 116: +104 MiB file-backed,
tile 99: +186 MiB). Now every access counts the bytes it spans, and writes spanning more than
:data:`~service.paged.PIECE_BYTES` go in pieces.

Oracles: numpy's own assignment into an in-memory array (the values), ``VmHWM`` of a fresh
process (the bound), the real output and checkpoint arrays of :func:`service.pipeline.prepare_file`
written at the plan's own tile regions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import service.paged as paged_module
from service.paged import DROP_BYTES, HOLD_BYTES, PIECE_BYTES, _pieces, _span, open_paged

ROOT = Path(__file__).resolve().parents[2]


def _strided_views() -> list[np.ndarray]:
    base = np.zeros((7, 11, 13, 3), np.float32)
    return [
        base,
        np.asfortranarray(base),
        base.transpose(2, 0, 3, 1),
        base[::-2, 3:, ::3],
        np.moveaxis(np.asfortranarray(base), -1, 0)[:, 1:6, ::-1],
        base[:, 5, :, 1],
    ]


@pytest.mark.parametrize("budget", [4, 64, 500, 4096, 1 << 20])
def test_pieces_cover_each_element_once_and_span_at_most_the_budget(budget: int) -> None:
    for view in _strided_views():
        seen = np.zeros(view.shape, np.int32)
        for piece in _pieces(view.shape, view.strides, view.itemsize, budget):
            part = view[piece]
            assert _span(part.shape, part.strides, part.itemsize) <= max(budget, view.itemsize), (
                piece,
                budget,
            )
            seen[piece] += 1
        assert (seen == 1).all(), (view.shape, view.strides, budget)


def test_span_is_first_to_last_byte() -> None:
    a = np.zeros((5, 6, 7), np.float32, order="F")
    assert _span(a.shape, a.strides, a.itemsize) == a.nbytes
    sub = a[1:3, 2:4, 5:6]  # x contiguous: 2 floats of rows 2 and 3 of plane 5
    assert _span(sub.shape, sub.strides, sub.itemsize) == (1 * 4 + 1 * 20) + 4
    assert _span((0, 3), (12, 4), 4) == 0


def _writes() -> list[tuple[Any, Any]]:
    rng = np.random.default_rng(5)
    return [
        ((slice(1, 6), slice(2, 11), slice(0, 13)), rng.random((5, 9, 13))),  # a tile
        ((slice(None), slice(None), slice(3, 9)), rng.random((1, 7, 11, 6))),  # a leading length-1 axis
        ((slice(None, None, -2), 4, slice(1, None, 3)), 0.25),  # a scalar, reversed, a dropped axis
        ((Ellipsis, slice(5, 7)), rng.random((11, 1))),  # broadcast along an axis
        ((2, 3, 4), 7.5),  # one element
        ((np.array([0, 6]), slice(None), 2), rng.random((2, 11))),  # a fancy index
        ((slice(None), slice(None), slice(None)), rng.integers(0, 9, (7, 11, 13))),  # whole, int to float
    ]


@pytest.mark.parametrize("order, dtype", [("F", "<f4"), ("C", "<f4"), ("F", ">f4"), ("C", "<f8")])
def test_writes_in_pieces_equal_numpys_assignment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str, dtype: str
) -> None:
    """Pieces of 256 bytes and drops every 4 KiB (tiny bounds, so that every write is cut)."""
    monkeypatch.setattr(paged_module, "PIECE_BYTES", 256)
    monkeypatch.setattr(paged_module, "HOLD_BYTES", 4096)
    shape = (7, 11, 13)
    out = open_paged(tmp_path / "o.raw", np.dtype(dtype), shape, mode="w+", order=order)
    oracle = np.zeros(shape, np.dtype(dtype), order=order)
    for key, value in _writes():
        out[key] = value
        oracle[key] = value
        np.testing.assert_array_equal(np.asarray(out), oracle, err_msg=str(key))
    out[1:, :, :] = out[:-1, :, :]  # overlapping source and target
    oracle[1:, :, :] = oracle[:-1, :, :].copy()
    np.testing.assert_array_equal(np.asarray(out), oracle)
    out.flush()
    np.testing.assert_array_equal(
        np.fromfile(tmp_path / "o.raw", np.dtype(dtype)).reshape(shape, order=order), oracle
    )


def test_probabilities_stored_as_uint8_go_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_module, "PIECE_BYTES", 64)
    out = open_paged(tmp_path / "o.raw", np.uint8, (3, 17, 19), mode="w+", order="F")
    out._unit_to_uint8 = True
    values = np.random.default_rng(2).random((3, 17, 19)).astype(np.float32)
    values[0, 0, 0] = np.nan
    out[...] = values
    expected = np.rint(np.clip(np.nan_to_num(values), 0, 1) * 255).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(out), expected)


_WORKER = """
import json, sys
from pathlib import Path
import numpy as np
from models.measure.rss import fix_mmap_threshold, peak_rss_bytes, release_free_memory
from models.measure.rss import reset_peak_rss, rss_bytes
fix_mmap_threshold()
folder, fmt, kind = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
rows = {}
for tile in sys.argv[4:]:
    if fmt == "tiff":  # a 2D output's raw temporary, C order: (1, H, W) float32, 137 MiB
        from service.writers import open_output
        size, t = 6007, int(tile)
        target = open_output("tiff", folder / "o.tif", folder, (size, size), 1, np.float32, labels=False)
        out = target.array
        writes = [(slice(y, min(y + t, size)), slice(x, min(x + t, size)))
                  for y in range(0, size, t) for x in range(0, size, t)]
        values = np.ones((1, t, t), np.float32)
    else:  # the real path's arrays: 512 x 512 x 200 float32 (200 MiB), the plan's tile regions
        from models import ModelRepository
        from models.planning.params import parse_params
        from service.jobs.checkpoint import SlabCheckpoint
        from service.pipeline import Limits, prepare_file
        model = ModelRepository(None, device="cpu").get("gaussian-3d")
        checkpoint = None
        if kind == "checkpoint":
            checkpoint = SlabCheckpoint(folder / "partial.npy", None, lambda r: None, lambda p, q: None)
        params = parse_params({"tile": tile, "format": fmt})
        job = prepare_file(model, folder / "ct.nii", folder / "out", params, limits=Limits(),
                           checkpoint=checkpoint)
        target, grid = job.target, job.plan.grid
        out = job.kept if kind == "checkpoint" else target.array
        writes = [t.write for t in grid.tiles()]
        values = np.ones((out.shape[0], *grid.out_tile_shape), out.dtype)
    release_free_memory()
    base, held = rss_bytes(), 0
    reset_peak_rss()
    for write in writes:
        out[(slice(None), *write)] = values[(slice(None), *(slice(0, s.stop - s.start) for s in write))]
        held = max(held, rss_bytes() - base)  # between two writes (the engine computes tiles)
    last = float(out[(0, *(s.stop - 1 for s in writes[-1]))])
    rows[tile] = {"rise": peak_rss_bytes() - base, "held": held, "nbytes": int(out.nbytes),
                  "writes": len(writes), "last": last}
    del out
    target.close()
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def ct(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import nibabel as nib

    folder = tmp_path_factory.mktemp("ct")
    # 512 x 512 (powers of two: the page cache's large folios align with the output's planes)
    nib.save(nib.Nifti1Image(np.zeros((512, 512, 200), np.int16), np.eye(4)), folder / "ct.nii")
    return folder


@pytest.mark.parametrize(
    "fmt, kind, tiles",
    [
        ("nii", "output", ["99,99,112", "116,116,112"]),  # Fortran order: was +100 MiB
        ("nii", "checkpoint", ["99,99,112", "116,116,112"]),  # the job's Fortran checkpoint: was +100 MiB
        ("npy", "output", ["99,99,112", "116,116,112"]),
        ("npy", "checkpoint", ["61,61,200"]),
        ("tiff", "output", ["512", "333"]),
    ],
)
def test_streamed_outputs_keep_their_pages_under_the_bound_whatever_the_tile(
    ct: Path, tmp_path: Path, fmt: str, kind: str, tiles: list[str]
) -> None:
    """Peak RSS rise (``VmHWM``, fresh process) while the plan's tiles are written into outputs of
    137-200 MiB: at most :data:`~service.paged.HOLD_BYTES` (16 MiB) and 4 MiB, for each tile shape;
    between two writes (when the engine's own memory peaks) at most
    :data:`~service.paged.PIECE_BYTES` (8 MiB) and 4 MiB."""
    (tmp_path / "ct.nii").symlink_to(ct / "ct.nii")
    command = [sys.executable, "-c", _WORKER, str(tmp_path), fmt, kind, *tiles]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for tile, row in rows.items():
        assert row["nbytes"] > 2 * DROP_BYTES and row["writes"] > 8 and row["last"] == 1.0, (tile, row)
        assert row["rise"] <= HOLD_BYTES + (4 << 20), (fmt, kind, rows)
        assert row["held"] <= PIECE_BYTES + (4 << 20), (fmt, kind, rows)
