"""``tiled_inference``: plan, read tiles lazily, batch, predict, crop the halo, blend, write."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from tiling.accumulate import SlabAccumulator
from tiling.errors import GridError, ShapeMismatchError
from tiling.geometry import PaddingMode, parse_enum
from tiling.grid import Tile, TileGrid
from tiling.io import read_region
from tiling.sink import Sink

logger = logging.getLogger(__name__)

__all__ = ["tiled_inference"]

Predictor = Callable[[torch.Tensor], Any]
Reducer = Callable[[torch.Tensor], torch.Tensor]


def tiled_inference(
    inputs: Any,
    predictor: Predictor,
    tile_shape: int | Sequence[int],
    halo: int | Sequence[int] = 0,
    overlap: int | Sequence[int] = 0,
    blend: str = "constant",
    border: str = "clip",
    padding_mode: str = "constant",
    alignment: int | Sequence[int] = 1,
    scale: float | Fraction | Sequence[float | Fraction] = 1,
    batch_size: int = 1,
    device: str | torch.device | None = None,
    out: Any = None,
    reduce: Reducer | None = None,
    progress: bool = False,
) -> Any:
    """Run ``predictor`` over overlapping tiles and reassemble by coverage-normalized overlap-add.

    For a translation-equivariant network, with ``border="clip"``, ``halo`` at least the
    receptive-field radius and ``alignment`` its total stride, the result equals one whole-image
    forward pass (with zero padding to a multiple of ``alignment``) to float tolerance.

    Args:
        inputs: ``(C, *spatial)`` numpy array, ``numpy.memmap`` or array-like with ``shape`` and
            ``__getitem__`` (e.g. nibabel's ``ArrayProxy``), or an ``(N, C, *spatial)`` torch
            tensor. Tiles are read lazily, one batch at a time.
        predictor: maps a float32 ``(B, C_in, *tile)`` tensor on ``device`` to
            ``(B, C_out, *(tile * scale))``.
        tile_shape: network input size per axis (voxels); int or one per axis.
        halo: voxels discarded on each side of a tile's output (kept at the image border).
        overlap: voxels shared by neighbouring cores, blended with ``blend``.
        blend: ``"constant"``, ``"gaussian"``, ``"hann"`` or ``"triangular"``.
        border: ``"clip"`` (tiles stop at the image edge) or ``"pad"`` (the image is padded by the
            halo with ``padding_mode``).
        padding_mode: ``"constant"`` (zeros), ``"reflect"`` or ``"replicate"``; also used to round
            the image up to a multiple of ``alignment``.
        alignment: tile origins and sizes are multiples of it (the network's total stride).
        scale: output voxels per input voxel, per axis.
        batch_size: tiles per predictor call.
        device: where the predictor runs; tiles are moved there and outputs back. Default: the
            input tensor's device, else the CPU.
        out: optional ``(C_out, *out_spatial)`` array (numpy, memmap, torch; ``(N, ...)`` for
            torch inputs) to fill and return; memmaps are flushed slab by slab.
        reduce: maps each finalized region ``(C_out, *region)`` (float32 torch) to
            ``(C_red, *region)`` before it is written, e.g. argmax to uint8 labels.
        progress: show a tqdm progress bar over tiles.

    Returns:
        ``(C_out or C_red, *ceil(spatial * scale))`` of the input's array type (numpy for numpy,
        memmap and array-likes; a torch tensor on the input's device, with a leading ``N``, for
        torch inputs), or ``out``.

    Raises:
        GridError: invalid tile/halo/overlap/alignment/scale/mode for this input.
        ShapeMismatchError: an input with too few dimensions, an ``out`` of the wrong shape, or a
            predictor output whose shape is not ``(B, C_out, *(tile * scale))``.
    """
    pad_mode = PaddingMode(parse_enum(PaddingMode, padding_mode, "padding_mode"))
    if isinstance(batch_size, bool) or int(batch_size) < 1:
        raise GridError(f"batch_size={batch_size} must be >= 1")
    is_torch = isinstance(inputs, torch.Tensor)
    shape = tuple(int(s) for s in inputs.shape)
    lead = 2 if is_torch else 1
    if len(shape) < lead + 1:
        expected = "(N, C, *spatial)" if is_torch else "(C, *spatial)"
        raise ShapeMismatchError(
            f"inputs of shape {shape} has {len(shape)} dimensions; expected {expected} with at "
            "least one spatial axis"
        )
    layout = "(N, C, *spatial)" if is_torch else "(C, *spatial)"
    try:
        grid = TileGrid.plan(
            shape[lead:], tile_shape, halo, overlap=overlap, alignment=alignment, scale=scale,
            border=border, blend=blend,
        )  # fmt: skip
    except GridError as exc:  # name the received shape: a missing C axis shows up as an axis count
        raise GridError(f"{exc} (inputs of shape {shape}, read as {layout})") from exc
    logger.info("tiled inference plan: %s", grid.summary())
    run_device = torch.device(device) if device is not None else (
        inputs.device if is_torch else torch.device("cpu")
    )  # fmt: skip
    acc_device = inputs.device if is_torch else torch.device("cpu")
    bar = tqdm(total=grid.n_tiles * (shape[0] if is_torch else 1), disable=not progress, unit="tile",
               desc="tiles")  # fmt: skip
    try:
        if not is_torch:
            sink = Sink(out, grid.out_shape, like="numpy")
            _run_one(inputs, grid, predictor, pad_mode, int(batch_size), run_device, acc_device, sink,
                     reduce, bar)  # fmt: skip
            return sink.result()
        results = []
        for n in range(shape[0]):
            sink = Sink(None if out is None else out[n], grid.out_shape, like="torch", device=acc_device)
            _run_one(inputs[n], grid, predictor, pad_mode, int(batch_size), run_device, acc_device, sink,
                     reduce, bar)  # fmt: skip
            results.append(sink.result())
        return out if out is not None else torch.stack(results)
    finally:
        bar.close()


def _run_one(
    source: Any,
    grid: TileGrid,
    predictor: Predictor,
    pad_mode: PaddingMode,
    batch_size: int,
    run_device: torch.device,
    acc_device: torch.device,
    sink: Sink,
    reduce: Reducer | None,
    bar: Any,
) -> None:
    tiles = list(grid.tiles())
    weights = _weights(grid, acc_device)
    acc: SlabAccumulator | None = None
    rows_left: dict[int, int] = {}
    for t in tiles:
        rows_left[t.index[0]] = rows_left.get(t.index[0], 0) + 1
    axis0 = grid.axes[0]
    pin = run_device.type == "cuda" and not (isinstance(source, torch.Tensor) and source.is_cuda)
    c_out: int | None = None
    for b in range(0, len(tiles), batch_size):
        batch_tiles = tiles[b : b + batch_size]
        batch = torch.stack([_read(source, grid, t, pad_mode) for t in batch_tiles])
        if pin:
            batch = batch.pin_memory()
        batch = batch.to(run_device, non_blocking=True)
        with torch.inference_mode():
            pred = predictor(batch)
        pred = _check_output(pred, len(batch_tiles), grid, c_out)
        c_out = int(pred.shape[1])
        pred = pred.to(acc_device, torch.float32)
        logger.debug("batch %d: %d tiles -> %s", b // batch_size, len(batch_tiles), tuple(pred.shape))
        for k, t in enumerate(batch_tiles):
            values = pred[k][(slice(None), *t.crop)]
            if not grid.blended:
                sink.write(t.write, _reduce(values, reduce))
            else:
                if acc is None:
                    acc = SlabAccumulator(c_out, grid.out_shape, [a.coverage for a in grid.axes],
                                          acc_device)  # fmt: skip
                acc.add(t.write, values, _tile_weight(weights, t))
                row = t.index[0]
                rows_left[row] -= 1
                if rows_left[row] == 0 and row + 1 < axis0.n_tiles:
                    # No local name keeps the released slab alive while the next one is allocated.
                    _write_slab(sink, *acc.release(axis0.writes[row + 1][0]), reduce)
                    sink.flush()
        bar.update(len(batch_tiles))
    if acc is not None:
        _write_slab(sink, *acc.finalize(), reduce)
    sink.flush()


def _read(source: Any, grid: TileGrid, tile: Tile, pad_mode: PaddingMode) -> torch.Tensor:
    starts = [s - a.pad_lo for s, a in zip(tile.starts, grid.axes, strict=True)]
    stops = [s + a.tile for s, a in zip(starts, grid.axes, strict=True)]
    return read_region(source, starts, stops, grid.spatial_shape, pad_mode)


def _check_output(pred: Any, n: int, grid: TileGrid, c_out: int | None) -> torch.Tensor:
    if isinstance(pred, np.ndarray):
        pred = torch.from_numpy(pred)
    if not isinstance(pred, torch.Tensor):
        raise ShapeMismatchError(f"predictor returned {type(pred).__name__}; expected a torch.Tensor")
    expected = (n, "C_out" if c_out is None else c_out, *grid.out_tile_shape)
    got = tuple(pred.shape)
    ok = (
        len(got) == len(expected)
        and got[0] == n
        and (c_out is None or got[1] == c_out)
        and got[2:] == grid.out_tile_shape
    )
    if not ok:
        raise ShapeMismatchError(
            f"predictor output has shape {got}; expected (B, C_out, *tile * scale) = {expected} "
            f"for input tiles of shape {(n, '*', *grid.used_tile_shape)}"
        )
    return pred


def _weights(grid: TileGrid, device: torch.device) -> list[tuple[torch.Tensor, ...] | None]:
    return [
        None if a.weights is None else tuple(torch.from_numpy(w).to(device) for w in a.weights)
        for a in grid.axes
    ]


def _tile_weight(weights: list[tuple[torch.Tensor, ...] | None], tile: Tile) -> torch.Tensor | None:
    total: torch.Tensor | None = None
    ndim = len(weights)
    for axis, (w, i) in enumerate(zip(weights, tile.index, strict=True)):
        if w is None:
            continue
        shape = [1] * ndim
        shape[axis] = w[i].shape[0]
        vec = w[i].reshape(shape)
        total = vec if total is None else total * vec
    return total


def _reduce(values: torch.Tensor, reduce: Reducer | None) -> torch.Tensor:
    return values if reduce is None else reduce(values)


def _write_slab(sink: Sink, lo: int, region: torch.Tensor, reduce: Reducer | None) -> None:
    if region.shape[1] == 0:
        return
    write = (slice(lo, lo + region.shape[1]),) + tuple(slice(None) for _ in region.shape[2:])
    sink.write(write, _reduce(region, reduce))
