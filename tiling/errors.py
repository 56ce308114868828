"""Exceptions raised by :mod:`tiling`.

Hierarchy (each class also inherits the builtin it refines, so ``except ValueError`` keeps working)::

    TilingError(Exception)
      GridError(TilingError, ValueError)             invalid tile/halo/overlap/stride for this input
      ShapeMismatchError(TilingError, ValueError)    input or predictor output of the wrong shape
      CoverageError(TilingError, RuntimeError)       a roi voxel received zero total weight (engine bug)
      AccumulatorStateError(TilingError, RuntimeError)  add() after finalize(), etc.
      RunCancelledError(TilingError)                 the caller's should_stop() said stop (between batches)
      DistributedError(TilingError, ValueError)      tiled_inference_dask cannot run as asked
        TileDependentError(DistributedError)         a tile-dependent network over several chunks
"""

from __future__ import annotations

__all__ = [
    "AccumulatorStateError",
    "CoverageError",
    "DistributedError",
    "GridError",
    "RunCancelledError",
    "ShapeMismatchError",
    "TileDependentError",
    "TilingError",
]


class TilingError(Exception):
    """Root of every error raised by :mod:`tiling`."""


class GridError(TilingError, ValueError):
    """A tile, halo, overlap, stride, alignment or scale that cannot tile this input."""


class ShapeMismatchError(TilingError, ValueError):
    """An input, ``out`` array or predictor output whose shape does not fit the plan."""


class CoverageError(TilingError, RuntimeError):
    """A voxel of the region of interest received zero total blend weight (an engine bug)."""


class AccumulatorStateError(TilingError, RuntimeError):
    """The accumulator was used out of order, e.g. ``add()`` after ``finalize()``."""


class RunCancelledError(TilingError):
    """The run was stopped because its ``should_stop`` callback returned true (checked before each
    batch); the output is incomplete and must be discarded."""


class DistributedError(TilingError, ValueError):
    """The run cannot be spread over the cluster as asked (e.g. no shared ``out`` for the workers)."""


class TileDependentError(DistributedError):
    """A tile-dependent network would be split at chunk borders, where its tiles disagree."""
