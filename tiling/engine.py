"""``tiled_inference``: plan, read tiles lazily, batch, predict, crop the halo, blend, write."""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from tiling.errors import GridError, RunCancelledError, ShapeMismatchError
from tiling.execute import Batch, Staged, TileReader, Transfers
from tiling.geometry import PaddingMode, as_ints, parse_enum
from tiling.grid import TileGrid
from tiling.merge import Merger, Reducer, make_merger
from tiling.resume import Resume, RowTracker, resume_point
from tiling.reuse import TileReuse
from tiling.seam import SeamMeter, SeamStats
from tiling.sink import Sink

logger = logging.getLogger(__name__)

__all__ = ["tiled_inference"]

Predictor = Callable[[torch.Tensor], Any]


def tiled_inference(
    inputs: Any,
    predictor: Predictor,
    tile_shape: int | Sequence[int] | None = None,
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
    progress: bool | Callable[[int], object] = False,
    *,
    fixed_tile_shape: bool = False,
    placement: str | Sequence[str] = "end",
    prefetch: bool = True,
    should_stop: Callable[[], bool] | None = None,
    resume: Resume | None = None,
    seam: SeamStats | None = None,
    grid: TileGrid | None = None,
    reuse: TileReuse | None = None,
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
        tile_shape: network input size per axis (voxels); int or one per axis. Optional when
            ``grid`` is given (then it must equal ``grid.tile_shape`` if given).
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
        progress: show a tqdm progress bar over tiles; or a callable, called with the number of
            tiles of each batch once it is merged (e.g. a metrics counter's ``inc``).
        fixed_tile_shape: feed every tile at exactly ``tile_shape`` (the last one shifted back to the
            image edge), for engines compiled for one input shape (TensorRT). By default tiles are
            sized to the grid: the same number of tiles, each the smallest multiple of ``alignment``
            that still covers the image, origins spread evenly (see :mod:`tiling.grid`), so fewer
            voxels go through the network. Either way tiles exceed the image only when
            ``tile_shape`` does, and then shrink to the (aligned) image.
        placement: ``"end"`` (tilewise's grid), ``"centred-monai"`` or ``"centred-nnunet"``: the
            source framework's window placement and padding (:class:`~tiling.geometry.Placement`);
            one, or one per axis.
        prefetch: read and pad the next batch in a background thread while the predictor runs on
            the current one (default). ``False`` reads each batch just before it is predicted
            (e.g. to measure what the overlap gains, or for a source that is not thread-safe).
        should_stop: called before each batch is predicted; when it returns true the run stops
            there with :class:`~tiling.errors.RunCancelledError` (e.g. the client went away). It
            must be cheap and thread-safe (``threading.Event.is_set``).
        resume: continue a run whose output rows are partly final in ``out`` (see
            :mod:`tiling.resume`): the tile rows before ``resume.rows_done`` (along axis 0) are
            neither run nor written, and ``resume.on_rows`` hears of every row that becomes final.
            Needs a ``(C, *spatial)`` (non-torch) input and ``out``.
        seam: a :class:`~tiling.seam.SeamStats` that receives the disagreement between overlapping
            tiles' predictions where they overlap, measured during the run (see
            :mod:`tiling.seam`; memory about that of the slab merger again; a resumed run measures
            the tiles it runs). ``None``: not measured.
        grid: the :class:`~tiling.grid.TileGrid` to run, as planned by the caller (e.g.
            :meth:`TileGrid.plan` in a request's plan); its tile, halo, overlap, alignment, scale,
            border, blend and ``fixed_tile_shape`` replace the keyword arguments of the same name,
            which must then be left at their defaults or agree with it. ``None``: planned here.
        reuse: which tiles are not run (see :mod:`tiling.reuse`), and the counts of those that were
            not. ``None``: a fresh :class:`~tiling.reuse.TileReuse` (constant tiles reused, nothing
            skipped). A tile whose whole input is one value per channel runs once per value; a
            ``reuse.skip`` rule feeds the tiles it names as its fill values, unread.

    Returns:
        ``(C_out or C_red, *ceil(spatial * scale))`` of the input's array type (numpy for numpy,
        memmap and array-likes; a torch tensor on the input's device, with a leading ``N``, for
        torch inputs), or ``out``.

    Raises:
        GridError: invalid tile/halo/overlap/alignment/scale/mode for this input; a ``grid``
            planned for another spatial shape, or that disagrees with a given ``tile_shape``.
        ShapeMismatchError: an input with too few dimensions, an ``out`` of the wrong shape, or a
            predictor output whose shape is not ``(B, C_out, *(tile * scale))``.
        RunCancelledError: ``should_stop()`` returned true before a batch.
    """
    pad_mode = PaddingMode(parse_enum(PaddingMode, padding_mode, "padding_mode"))
    if isinstance(batch_size, bool) or int(batch_size) < 1:
        raise GridError(f"batch_size={batch_size} must be >= 1")
    is_torch = isinstance(inputs, torch.Tensor)
    shape = tuple(int(s) for s in inputs.shape)
    lead = 2 if is_torch else 1
    if resume is not None and (is_torch or out is None):
        raise GridError("resume needs a (C, *spatial) numpy or array-like input and an out array")
    if grid is None:
        if tile_shape is None:
            raise GridError("give tile_shape, or a planned grid (grid=TileGrid.plan(...))")
        _check_layout(shape, is_torch, tile_shape=tile_shape, halo=halo, overlap=overlap,
                      alignment=alignment, scale=scale)  # fmt: skip
        grid = TileGrid.plan(
            shape[lead:], tile_shape, halo, overlap=overlap, alignment=alignment, scale=scale,
            border=border, blend=blend, fixed_tile_shape=fixed_tile_shape, placement=placement,
        )  # fmt: skip
    else:
        _check_layout(shape, is_torch)
        _check_grid(grid, shape[lead:], tile_shape)
    logger.info("tiled inference plan: %s", grid.summary())
    run_device = torch.device(device) if device is not None else (
        inputs.device if is_torch else torch.device("cpu")
    )  # fmt: skip
    acc_device = inputs.device if is_torch else torch.device("cpu")
    transfers = Transfers(run_device, acc_device)
    total = grid.n_tiles * (shape[0] if is_torch else 1)
    bar: Any = (
        _Counter(progress) if callable(progress)
        else tqdm(total=total, disable=not progress, unit="tile", desc="tiles")
    )  # fmt: skip
    reuse = TileReuse() if reuse is None else reuse
    reuse.forget()  # predictions of another grid's tiles never answer this one's
    try:
        if not is_torch:
            resume = resume or Resume()
            start = resume_point(grid, resume.rows_done, int(batch_size))
            sink = Sink(out, grid.out_shape, like="numpy", floor=start.floor)
            rows = RowTracker(grid, start.rows_done, resume.on_rows, sink.flush)
            _run_one(inputs, grid, predictor, pad_mode, int(batch_size), transfers, sink, reduce, prefetch,
                     bar, should_stop, start.first_tile, start.origin, rows, seam, reuse=reuse)  # fmt: skip
            return sink.result()
        results = []
        for n in range(shape[0]):
            sink = Sink(None if out is None else out[n], grid.out_shape, like="torch", device=acc_device)
            _run_one(inputs[n], grid, predictor, pad_mode, int(batch_size), transfers, sink, reduce,
                     prefetch, bar, should_stop, seam=seam, reuse=reuse)  # fmt: skip
            results.append(sink.result())
        return out if out is not None else torch.stack(results)
    finally:
        bar.close()


def _check_grid(grid: TileGrid, spatial: tuple[int, ...], tile_shape: Any) -> None:
    """A handed-down grid must be the one for this input.

    Raises:
        GridError: ``grid`` was planned for another spatial shape, or ``tile_shape`` is given and
            differs from the grid's.
    """
    if not isinstance(grid, TileGrid):
        raise GridError(f"grid must be a tiling.TileGrid, got {type(grid).__name__}")
    if tuple(grid.spatial_shape) != tuple(spatial):
        raise GridError(
            f"the grid was planned for spatial shape {grid.spatial_shape}; the input's is {spatial} "
            "(plan the grid on the array that is run)"
        )
    if tile_shape is not None:
        wanted = as_ints(tile_shape, len(spatial), "tile_shape", minimum=1)
        if wanted != tuple(grid.tile_shape):
            raise GridError(f"tile_shape={wanted} disagrees with the grid's tile_shape {grid.tile_shape}")


class _Counter:
    """A progress "bar" that hands each batch's tile count to a callback."""

    def __init__(self, callback: Callable[[int], object]) -> None:
        self.callback = callback

    def update(self, n: int) -> None:
        self.callback(n)

    def close(self) -> None:
        pass


def _check_layout(shape: tuple[int, ...], is_torch: bool, **per_axis: object) -> None:
    """Check the input's rank and the axis count of every per-axis parameter, naming the shape.

    Raises:
        ShapeMismatchError: fewer dimensions than the layout needs.
        GridError: a per-axis tuple whose length differs from the input's spatial axis count.
    """
    layout = "(N, C, *spatial) (a torch tensor)" if is_torch else "(C, *spatial) (numpy or array-like)"
    lead = 2 if is_torch else 1
    if len(shape) < lead + 1:
        raise ShapeMismatchError(
            f"inputs of shape {shape} has {len(shape)} dimensions; expected {layout} with at "
            "least one spatial axis"
        )
    ndim = len(shape) - lead
    for name, value in per_axis.items():
        if isinstance(value, Sequence) and not isinstance(value, str) and len(value) != ndim:
            raise GridError(
                f"{name}={tuple(value)} has {len(value)} axes but the input has {ndim} spatial axes: "
                f"inputs of shape {shape} is read as {layout}, spatial shape {shape[lead:]}"
            )


def _run_one(
    source: Any,
    grid: TileGrid,
    predictor: Predictor,
    pad_mode: PaddingMode,
    batch_size: int,
    transfers: Transfers,
    sink: Sink,
    reduce: Reducer | None,
    prefetch: bool,
    bar: Any,
    should_stop: Callable[[], bool] | None = None,
    first: int = 0,
    origin: int = 0,
    rows: RowTracker | None = None,
    seam: SeamStats | None = None,
    *,
    reuse: TileReuse,
) -> None:
    """Stream the tiles of one ``(C, *spatial)`` source through ``predictor`` into ``sink``, from
    tile ``first`` (grid C order) on; ``origin`` is the first output row (axis 0) written; ``reuse``
    is :func:`tiled_inference`'s (always set there)."""
    merger = make_merger(grid, sink, reduce, transfers.merge_device, origin=origin)
    meter = None if seam is None else SeamMeter(grid, seam, transfers.merge_device)
    pin = transfers.run_device.type == "cuda"
    c_out: int | None = None
    in_flight: deque[tuple[Batch, Staged]] = deque()
    with TileReader(source, grid, pad_mode, batch_size, pin=pin, prefetch=prefetch, first=first,
                    reuse=reuse) as reader:  # fmt: skip
        # a predictor that queues work (``submit(x) -> handle``, a shared batcher's client) gets the
        # next batch before the current one is merged, when the reader has a buffer for it
        submit = getattr(predictor, "submit", None) if reader.n_slots > 1 else None
        lag = max(transfers.lag, 1 if callable(submit) else 0)
        for b, batch in enumerate(reader):
            if should_stop is not None and should_stop():
                raise RunCancelledError(
                    f"stopped by the caller before tile {first + b * batch_size} of {grid.n_tiles}"
                )
            keys = reuse.keys(batch.data, batch.filled)
            x = transfers.to_device(batch, reader)
            if callable(submit) and all(key is None for key in keys):  # no tile to answer from a copy
                reuse.n_tiles += len(keys)
                in_flight.append((batch, _Submitted(submit(x), len(batch.tiles), grid, transfers)))
            else:
                with torch.inference_mode():
                    check = functools.partial(_check_output, grid=grid, c_out=c_out)
                    pred = reuse.predict(predictor, x, keys, check)
                c_out = int(pred.shape[1])
                logger.debug("batch %d: %d tiles -> %s", b, len(batch.tiles), tuple(pred.shape))
                in_flight.append((batch, transfers.from_device(pred)))
            while len(in_flight) > lag:  # on CUDA, or with a queued predictor, the next batch goes first
                _merge(merger, reader, *in_flight.popleft(), rows, meter)
            bar.update(len(batch.tiles))
        while in_flight:
            _merge(merger, reader, *in_flight.popleft(), rows, meter)
    merger.finish()
    if rows is not None:
        rows.finished()


class _Submitted(Staged):
    """A batch handed to a queued predictor (``submit``); :meth:`wait` checks and stages its output."""

    def __init__(self, handle: Any, n: int, grid: TileGrid, transfers: Transfers) -> None:
        super().__init__(torch.empty(0))
        self.handle, self.n, self.grid, self.transfers = handle, n, grid, transfers

    def wait(self) -> torch.Tensor:
        """The handle's result, checked and moved to the merge device."""
        pred = _check_output(self.handle.result(), self.n, self.grid, None)
        return self.transfers.from_device(pred).wait()


def _merge(
    merger: Merger,
    reader: TileReader,
    batch: Batch,
    staged: Staged,
    rows: RowTracker | None,
    meter: SeamMeter | None,
) -> None:
    values = staged.wait()
    for k, tile in enumerate(batch.tiles):
        if meter is not None:
            meter.add(tile, values[k])
        merger.add(tile, values[k][(slice(None), *tile.crop)])
        if rows is not None:
            rows.merged(tile)
    reader.release(batch)  # after merging: the prediction may be a view of the batch


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
