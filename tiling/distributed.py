"""One volume across many Dask workers: overlapping blocks of a chunked array, one model per worker.

Shape symbols: ``C`` input channels, ``C_out`` predictor output channels (``C_red`` after
``reduce``), ``S`` spatial axes (array-axis order, e.g. ``D, H, W``).

Flow::

    zarr / dask (C, *S), chunks from plan_chunks
      --> blocks (C, *(chunk + depth on each inner side)), boundary="none"
            zarr input:  each block read straight from the zarr array by its own task ("read")
            dask input:  dask.array.map_overlap assembles it from neighbouring chunks
      --> tiled_inference on the worker, with this worker's predictor --> (C_out, *block)
      --> trim the depth (dask.array.overlap.trim_internal, as map_overlap's trim=True does)
      --> (C_out, *chunk) --> zarr (C_out, *S) (dask.array.to_zarr / store)

Why two ways to build the blocks. ``map_overlap`` holds, on each worker, every chunk whose
neighbours are not done yet: in C order that is about two slabs of chunks across the volume, so its
memory grows with the volume's cross-section. Reading each block with its depth from the zarr array
makes every task independent: nothing is kept between tasks, no slices travel between workers, and
a block read decodes at most ``3 ** len(S)`` zarr chunks. The price is decoding the neighbouring
zarr chunks for the thin depth slabs. Measured (``benchmarks/dask_scaling.py``: chunk 96, tile 48,
a 1 -> 2 -> 1 channel conv stack, one worker; the peak RSS rise of the worker during the run):
``map_overlap`` 61 MiB at 192^3 and 186 MiB at 384^3 (Dask-managed data alone 28 and 107 MiB);
``read`` 50 and 71 MiB, for 12% more worker CPU (58.9 s against 52.6 s at 384^3). Both give the
same result; ``blocks_from`` chooses.

Why it is exact. ``depth`` is the halo rounded *up* to the network's alignment, and every chunk but
the last on an axis is a multiple of the alignment, so every block (chunk plus depth, cut at the
array border) starts on the network's stride grid. A voxel kept after the trim lies at least
``depth >= halo >= receptive-field radius`` voxels from any block edge that is not the array
border, so the network never sees that edge; at the array border the block edge *is* the border,
padded exactly as a whole-volume pass pads it (the last block of an axis is rounded up to the
alignment at its end, where the whole volume is rounded up too). Inside a block the existing
:func:`tiling.tiled_inference` tiles the block (so a chunk larger than the tile is itself tiled) with
the same guarantee. For translation-equivariant networks the result therefore equals the
single-process :func:`tiling.tiled_inference` and a whole-volume pass to float tolerance.

Tile-dependent networks (instance norm, attention, global pooling) are *refused* when the array has
more than one chunk: every chunk border would be a seam that no depth removes, and the trim keeps
each side's output unblended. See :class:`TileDependentError`.

Errors (``tiling.errors`` tree)::

    TilingError
      GridError(TilingError, ValueError)          invalid halo/tile/chunk/alignment/scale (client side)
      DistributedError(TilingError, ValueError)   the run cannot go to the cluster as asked
        TileDependentError(DistributedError)      a tile-dependent network over several chunks

This module imports without Dask installed (``tiling`` must); Dask, ``distributed`` and ``zarr``
(the ``distributed`` extra: ``pip install 'tilewise[distributed]'``) are imported when a function
needs them.

Modules: this one is the public entry point (validation, the graph, the write);
:mod:`tiling._dask_chunks` plans chunks and builds blocks; :mod:`tiling._dask_worker` holds the
per-worker predictor and the per-block runner.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from tiling._dask_chunks import (
    _as_dask,
    _block_lengths,
    _blocks_mode,
    _in_memory,
    _input_chunks,
    _read_blocks,
    _store,
    _validate_blocks,
    plan_chunks,
)
from tiling._dask_worker import (
    ModelFactory,
    PredictorPlugin,
    Reducer,
    _BlockRunner,
    _plugin_name,
    _probe,
)
from tiling.errors import (
    DistributedError,
    GridError,
    RunCancelledError,
    ShapeMismatchError,
    TileDependentError,
)
from tiling.geometry import as_fractions, as_ints
from tiling.grid import TileGrid

logger = logging.getLogger(__name__)

__all__ = [
    "DaskPlan",
    "DistributedError",
    "PredictorPlugin",
    "TileDependentError",
    "plan_chunks",
    "plan_dask",
    "release_predictor",
    "tiled_inference_dask",
]

_EXTRA_HINT = "tiling.distributed needs the `distributed` extra: pip install 'tilewise[distributed]'"


@dataclass(frozen=True, slots=True)
class DaskPlan:
    """The plan :func:`tiled_inference_dask` runs: chunks, their depth, and the tiles of every block.

    Attributes:
        chunks: chunk lengths per axis (voxels), as :func:`plan_chunks` gives them.
        depth: voxels each block takes from each neighbour, per axis (0 on a one-chunk axis).
        blocks: block lengths per axis (chunk plus depth on each inner side).
        n_tiles: tiles summed over every block's own grid (what the network is fed).
        work: voxels fed to the network per input voxel (every block's tiles).
    """

    chunks: tuple[tuple[int, ...], ...]
    depth: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    n_tiles: int
    work: float

    @property
    def n_chunks(self) -> int:
        """Chunks (one task each)."""
        return math.prod(len(c) for c in self.chunks)


def plan_dask(
    spatial_shape: Sequence[int],
    *,
    halo: int | Sequence[int],
    tile_shape: int | Sequence[int] | None = None,
    alignment: int | Sequence[int] = 1,
    chunk_shape: int | Sequence[int] = 128,
    overlap: int | Sequence[int] = 0,
    border: str = "clip",
    blend: str = "constant",
) -> DaskPlan:
    """The chunks, depth and tiles :func:`tiled_inference_dask` runs for these arguments (pure
    arithmetic: no Dask needed).

    Raises:
        GridError: invalid halo, tile, chunk, alignment or blend parameters for this input.

    >>> p = plan_dask((100, 60), halo=4, tile_shape=32, chunk_shape=48)
    >>> p.chunks, p.depth, p.n_tiles
    (((48, 48, 4), (48, 12)), (4, 4), 15)
    """
    spatial = tuple(int(s) for s in spatial_shape)
    ndim = len(spatial)
    halos = as_ints(halo, ndim, "halo", minimum=0)
    aligns = as_ints(alignment, ndim, "alignment", minimum=1)
    tiles = None if tile_shape is None else as_ints(tile_shape, ndim, "tile_shape", minimum=1)
    overlaps = as_ints(overlap, ndim, "overlap", minimum=0)
    depth = tuple(-(-h // a) * a for h, a in zip(halos, aligns, strict=True))
    chunks = plan_chunks(spatial, chunk_shape, depth=depth, alignment=aligns)
    depth = tuple(0 if len(c) == 1 else d for c, d in zip(chunks, depth, strict=True))
    blocks = tuple(_block_lengths(c, d) for c, d in zip(chunks, depth, strict=True))
    _validate_blocks(blocks, tiles, halos, overlaps, aligns, border, blend)
    # per axis: (tiles, voxels fed) of each distinct block length, times how many blocks have it
    per_axis = []
    for axis, lengths in enumerate(blocks):
        counts = []
        for length, times in Counter(lengths).items():
            tile = tiles[axis] if tiles is not None else -(-length // aligns[axis]) * aligns[axis]
            grid = TileGrid.plan((length,), tile, halos[axis], overlap=overlaps[axis],
                                 alignment=aligns[axis], border=border, blend=blend)  # fmt: skip
            counts.append((grid.n_tiles * times, grid.n_tiles * grid.used_tile_shape[0] * times))
        per_axis.append((sum(n for n, _ in counts), sum(v for _, v in counts)))
    n_tiles = math.prod(n for n, _ in per_axis)
    work = math.prod(v for _, v in per_axis) / math.prod(spatial)
    return DaskPlan(chunks, depth, blocks, n_tiles, work)


def tiled_inference_dask(
    array: Any,
    model_factory: ModelFactory,
    *,
    halo: int | Sequence[int],
    tile_shape: int | Sequence[int] | None = None,
    alignment: int | Sequence[int] = 1,
    chunk_shape: int | Sequence[int] | None = None,
    overlap: int | Sequence[int] = 0,
    blend: str = "constant",
    border: str = "clip",
    padding_mode: str = "constant",
    scale: float | Fraction | Sequence[float | Fraction] = 1,
    batch_size: int = 1,
    device: str | None = None,
    reduce: Reducer | None = None,
    out: str | os.PathLike[str] | Any | None = None,
    overwrite: bool = False,
    client: Any = None,
    resources: Mapping[str, float] | None = None,
    tile_dependent: bool = False,
    keep_loaded: bool = False,
    blocks_from: str = "auto",
    progress: bool = False,
    should_stop: Callable[[], bool] | None = None,
) -> Any:
    """Run a predictor over a chunked ``(C, *S)`` array on a Dask cluster; write a zarr array.

    Each chunk plus ``depth`` voxels from each neighbour (``depth`` = ``halo`` rounded up to
    ``alignment``; none beyond the array border, ``boundary="none"``) goes through
    :func:`tiling.tiled_inference` on a worker; the depth is trimmed and the chunk written to
    ``out`` (see the module docstring for why this is exact). The model is built once per worker
    by a :class:`PredictorPlugin`, not once per task.

    Args:
        array: ``(C, *S)`` input: a ``zarr.Array`` (read by the workers: keep it in a folder they
            all see), a ``dask.array.Array``, or any array-like (embedded in the task graph: small
            arrays only). Any dtype; blocks are read as float32.
        model_factory: picklable callable with no arguments returning the predictor, which maps a
            float32 ``(B, C, *tile)`` tensor on ``device`` to ``(B, C_out, *tile)``; called once
            per worker (and once more for a probe, on one worker). For a tilewise model pass an
            object holding the model name and the models folder, importable on the workers.
        halo: context margin per side (voxels, int or one per axis), at least the network's
            receptive-field radius for an exact result; also the halo inside each block.
        tile_shape: network input per axis (voxels), a multiple of ``alignment``; ``None``: each
            block is one tile (memory then follows ``chunk + 2 * depth``).
        alignment: the network's total stride per axis (voxels).
        chunk_shape: chunk size per axis (voxels), adjusted by :func:`plan_chunks`; ``None``: the
            input's own chunking (zarr or dask), else 128.
        overlap, blend, border, padding_mode, batch_size, device, reduce: as in
            :func:`tiling.tiled_inference`, applied inside each block. ``reduce`` must act voxel
            by voxel (e.g. argmax to uint8 labels).
        scale: must be 1 (outputs are written on the input's chunk grid).
        out: where the result goes: a folder path for a new zarr array (created by this process;
            every worker must be able to write it at the same path), or an existing ``zarr.Array``
            of shape ``(C_out, *S)``; ``None``: an in-memory zarr array (only without a distributed
            client, like any in-memory ``out``).
        overwrite: replace an existing array at the ``out`` path (otherwise that is an error).
        client: a ``distributed.Client``; ``None``: the default client if one exists, else Dask's
            local scheduler in this process (the model is then loaded once, here).
        resources: worker resources every task of the run needs, e.g. ``{"GPU": 1}`` (workers
            started with ``--resources GPU=1``); needs a client.
        tile_dependent: the network is tile-dependent (its spec says so). Such a network is run
            only if the whole array is one chunk; otherwise :class:`TileDependentError`.
        keep_loaded: keep the predictor loaded on the workers after the run (under a name derived
            from ``model_factory``'s Dask token, so a later call with an equal factory reuses it);
            otherwise it is dropped when the run ends.
        blocks_from: how each block (chunk plus depth) is built: ``"read"`` reads it straight from
            the zarr input in its own task (memory per worker: one block), ``"map_overlap"``
            assembles it from neighbouring chunks with ``dask.array.map_overlap`` (memory per
            worker: about two slabs of chunks across the volume); ``"auto"``: ``"read"`` for a
            ``zarr.Array``, ``"map_overlap"`` otherwise. See the module docstring.
        progress: show Dask's own progress bar (``distributed.progress`` with a client,
            ``dask.diagnostics.ProgressBar`` without), on stdout.
        should_stop: asked every :data:`STOP_POLL_S` seconds while the cluster runs (before every
            task without a client); when it returns true the run's tasks are cancelled and
            :class:`RunCancelledError` is raised (the ``out`` array is then incomplete).

    Returns:
        ``zarr.Array`` of shape ``(C_out or C_red, *S)``, chunked like the plan (``out`` itself
        when it was a ``zarr.Array``; opened read-only from the path when it was a path).

    Raises:
        ImportError: Dask, ``distributed`` or ``zarr`` is missing.
        GridError: invalid halo, tile, chunk, alignment or blend parameters for this input (checked
            on the client, before any task runs), ``scale`` other than 1, or a ``blocks_from``
            that is unknown or ``"read"`` for an input that is not a ``zarr.Array``.
        ShapeMismatchError: an input with no spatial axis, an ``out`` array of the wrong shape, or
            a predictor output that does not fit (raised by the probe).
        TileDependentError: ``tile_dependent=True`` and more than one chunk.
        DistributedError: ``out=None`` or an in-memory zarr ``out`` with a distributed client
            (workers cannot write into this process's memory), or ``resources`` without a client.
        RunCancelledError: ``should_stop()`` returned true.
        Exception: whatever ``model_factory`` or the predictor raises, re-raised from the worker.

    Notes:
        Per task a worker holds the block, ``C * prod(chunk + 2 * depth) * 4`` bytes, its output,
        ``C_out * prod(chunk + 2 * depth) * 4`` bytes, and the predictor's activations for one
        batch of tiles: memory follows the chunk and the tile, not the volume (with
        ``blocks_from="read"``; see the module docstring for ``map_overlap``). With
        ``chunk = 96``, ``depth = 16``, ``C = 1``, ``C_out = 3`` in 3-D a block (128^3) is 8 MiB in
        and 24 MiB out. Activations can dominate: PyTorch's CPU ``Conv3d`` unfolds its input into
        ``27 * C_in * voxels * 4`` bytes, 216 MB for 2 channels over one 100^3 tile, so on CPU give
        a ``tile_shape`` rather than one tile per block. A worker killed mid-run is handled by Dask: the
        scheduler re-runs its tasks elsewhere (``distributed.scheduler.allowed-failures`` bounds
        how often one task may take a worker down), and chunks are written whole, so a re-run
        overwrites a partial chunk.

    Source:
        ``dask.array.map_overlap`` (Dask documentation, "Overlapping Computations"); the
        overlap-tile strategy of Ronneberger et al., "U-Net", MICCAI 2015 (arXiv:1505.04597).

    Example:
        >>> import numpy as np, torch  # doctest: +SKIP
        >>> from distributed import Client, LocalCluster  # doctest: +SKIP
        >>> client = Client(LocalCluster(n_workers=2, threads_per_worker=1))  # doctest: +SKIP
        >>> y = tiled_inference_dask(zarr.open_array("in.zarr"), MyFactory("tissue-3d", "/models"),
        ...                          halo=16, tile_shape=96, chunk_shape=128, out="out.zarr",
        ...                          client=client)  # doctest: +SKIP
    """
    da, zarr = _import_dask()
    shape = tuple(int(s) for s in array.shape)
    if len(shape) < 2:
        raise ShapeMismatchError(
            f"array of shape {shape} has {len(shape)} dimensions; expected (C, *spatial) with at least "
            "one spatial axis"
        )
    c_in, spatial = shape[0], shape[1:]
    ndim = len(spatial)
    scales = as_fractions(scale, ndim, "scale")
    if any(s != 1 for s in scales):
        raise GridError(
            f"scale={tuple(str(s) for s in scales)}: tiled_inference_dask writes the output on the "
            "input's chunk grid, so only scale=1 is supported; run tiling.tiled_inference in process "
            "for super-resolution or strided heads"
        )
    halos = as_ints(halo, ndim, "halo", minimum=0)
    aligns = as_ints(alignment, ndim, "alignment", minimum=1)
    tiles = None if tile_shape is None else as_ints(tile_shape, ndim, "tile_shape", minimum=1)
    overlaps = as_ints(overlap, ndim, "overlap", minimum=0)
    if isinstance(batch_size, bool) or int(batch_size) < 1:
        raise GridError(f"batch_size={batch_size} must be >= 1")
    depth = tuple(-(-h // a) * a for h, a in zip(halos, aligns, strict=True))
    asked = chunk_shape if chunk_shape is not None else _input_chunks(array, da, zarr, ndim)
    chunks = plan_chunks(spatial, asked, depth=depth, alignment=aligns)
    # One chunk on an axis: no neighbour to take depth from.
    depth = tuple(0 if len(c) == 1 else d for c, d in zip(chunks, depth, strict=True))
    n_chunks = math.prod(len(c) for c in chunks)
    if tile_dependent and n_chunks > 1:
        raise TileDependentError(
            f"a tile-dependent network (instance norm, attention or global pooling) cannot be split "
            f"into {n_chunks} chunks {tuple(len(c) for c in chunks)}: its output depends on the whole "
            "tile, so every chunk border would be a seam that no depth removes, and map_overlap keeps "
            "each side of it unblended. Run it in process with tiling.tiled_inference (overlap and a "
            f"blend window smooth its tile borders), or pass chunk_shape >= {spatial} (one chunk)"
        )
    blocks = tuple(_block_lengths(c, d) for c, d in zip(chunks, depth, strict=True))
    how = _blocks_mode(blocks_from, array, zarr)
    _validate_blocks(blocks, tiles, halos, overlaps, aligns, border, blend)

    if client is None:
        client = _default_client()
    if client is None and resources:
        raise DistributedError(f"resources={dict(resources)} need a distributed client")
    if client is not None and (out is None or _in_memory(out, zarr)):
        what = "out=None" if out is None else "out is an in-memory zarr array"
        raise DistributedError(
            f"{what}: with a distributed client the workers write the result, so pass out= a zarr "
            "path (or zarr.Array) in a folder every worker can write"
        )

    local = PredictorPlugin(model_factory) if client is None else None
    plugin_name = _plugin_name(model_factory, keep_loaded)
    runner = _BlockRunner(
        plugin_name=plugin_name, local=local, tile_shape=tiles, halo=halos, overlap=overlaps,
        alignment=aligns, blend=blend, border=border, padding_mode=padding_mode,
        batch_size=int(batch_size), device=device, reduce=reduce,
    )  # fmt: skip
    probe_tile = TileGrid.plan(
        tuple(max(b) for b in blocks), runner.tile_for(tuple(max(b) for b in blocks)), halos,
        overlap=overlaps, alignment=aligns, border=border, blend=blend,
    ).used_tile_shape  # fmt: skip
    work = math.prod(sum(b) for b in blocks) / math.prod(spatial)
    logger.info(
        "dask plan: %d chunks %s of %s, depth=%s, tile_shape=%s, work=%.2f, client=%s",
        n_chunks, tuple(c[0] for c in chunks), spatial, depth, tiles or "block", work, client,
    )  # fmt: skip

    if client is not None:
        plugin = PredictorPlugin(model_factory, idempotent=keep_loaded)
        client.register_plugin(plugin, name=plugin_name)
    try:
        if client is None:
            c_out, dtype = runner.probe(c_in, probe_tile)
        else:
            c_out, dtype = client.submit(
                _probe, runner, c_in, probe_tile, pure=False, resources=dict(resources or {})
            ).result()
        out_chunks = ((c_out,), *blocks)
        depth_axes = {0: 0, **{a + 1: d for a, d in enumerate(depth)}}
        meta = np.empty((0,) * (ndim + 1), dtype=dtype)
        if how == "read":
            y = _read_blocks(array, da, chunks, depth).map_blocks(
                runner, chunks=out_chunks, dtype=dtype, meta=meta
            )
            y = da.overlap.trim_internal(y, depth_axes, boundary="none")
        else:
            x = _as_dask(array, da, zarr, ((c_in,), *chunks))
            y = da.map_overlap(runner, x, depth=depth_axes, boundary="none", trim=True, chunks=out_chunks,
                               dtype=dtype, meta=meta)  # fmt: skip
        target, stored = _store(y, out, overwrite, da, zarr, (c_out, *spatial))
        bar = _progress_bar(progress, client)
        if client is None:
            with bar, _stop_callback(should_stop):
                stored.compute()
        else:
            future = client.compute(stored, resources=dict(resources or {}))
            if progress:
                from distributed import progress as distributed_progress

                with client.as_current():  # the bar finds its scheduler through the current client
                    distributed_progress(future)  # type: ignore[no-untyped-call]
            _wait(future, should_stop)
    finally:
        if client is not None and not keep_loaded:
            client.unregister_worker_plugin(plugin_name)
    return zarr.open_array(target, mode="r") if isinstance(target, str) else target


def release_predictor(client: Any, model_factory: ModelFactory) -> None:
    """Drop the predictor that ``keep_loaded=True`` left on the workers for ``model_factory``.

    Args:
        client: the ``distributed.Client`` of the run.
        model_factory: a factory equal (same Dask token) to the one the run was given.

    Raises:
        ValueError: no predictor of that factory is loaded on the cluster (from ``distributed``).
    """
    client.unregister_worker_plugin(_plugin_name(model_factory, keep_loaded=True))


def _import_dask() -> tuple[Any, Any]:
    try:
        import dask.array as da
        import zarr
    except ImportError as exc:  # pragma: no cover - exercised only where the extra is not installed
        raise ImportError(_EXTRA_HINT) from exc
    return da, zarr


def _default_client() -> Any:
    try:
        from distributed import default_client
    except ImportError:  # pragma: no cover - dask without distributed
        return None
    try:
        return default_client()  # type: ignore[no-untyped-call]
    except ValueError:
        return None


#: Seconds between two ``should_stop`` calls while a distributed run goes on.
STOP_POLL_S = 0.5


def _wait(future: Any, should_stop: Callable[[], bool] | None) -> None:
    """The future's result; with ``should_stop``, cancel it and raise once that returns true."""
    if should_stop is None:
        future.result()
        return
    while True:
        try:
            future.result(timeout=STOP_POLL_S)  # raises the task's error, if any
        except TimeoutError:
            if should_stop():
                future.cancel()
                raise RunCancelledError("the Dask run was stopped (should_stop returned true)") from None
            continue
        return


def _stop_callback(should_stop: Callable[[], bool] | None) -> Any:
    """Dask's local scheduler: raise :class:`RunCancelledError` before a task once asked to stop."""
    if should_stop is None:
        return nullcontext()
    from dask.callbacks import Callback

    def pretask(key: Any, dsk: Any, state: Any) -> None:  # noqa: ARG001 - the callback interface
        if should_stop():
            raise RunCancelledError("the Dask run was stopped (should_stop returned true)")

    return Callback(pretask=pretask)  # type: ignore[no-untyped-call]


def _progress_bar(progress: bool, client: Any) -> Any:
    if progress and client is None:
        from dask.diagnostics.progress import ProgressBar

        return ProgressBar()  # type: ignore[no-untyped-call]
    return nullcontext()
