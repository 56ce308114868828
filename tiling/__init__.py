"""tilewise's tiling engine: seam-free tiled inference for N-D images (no models, no service).

>>> import numpy as np
>>> x = np.arange(20, dtype=np.float32).reshape(1, 20)
>>> y = tiled_inference(x, lambda t: 2 * t, tile_shape=8, halo=2, overlap=2, blend="hann")
>>> bool(np.allclose(y, 2 * x))
True
"""

from __future__ import annotations

import typing

from tiling.errors import (
    AccumulatorStateError,
    CoverageError,
    GridError,
    RunCancelledError,
    ShapeMismatchError,
    TilingError,
)
from tiling.geometry import BlendMode, BorderMode, PaddingMode, Placement
from tiling.grid import AxisPlan, Tile, TileGrid
from tiling.plan import (
    aligned_extent,
    calibration_margin,
    cap_halo,
    context_halo,
    fits_one_tile,
    per_axis,
    round_up,
)
from tiling.resume import Resume, ResumePoint, resume_point

if typing.TYPE_CHECKING:  # the lazy names below, for type checkers only (no torch import at run time)
    from tiling.engine import tiled_inference
    from tiling.reuse import TileReuse
    from tiling.seam import SeamStats
    from tiling.windows import pad_to_fit, sample_windows, sliding_windows

__all__ = [
    "AccumulatorStateError",
    "AxisPlan",
    "BlendMode",
    "BorderMode",
    "CoverageError",
    "GridError",
    "PaddingMode",
    "Placement",
    "Resume",
    "ResumePoint",
    "RunCancelledError",
    "SeamStats",
    "ShapeMismatchError",
    "Tile",
    "TileGrid",
    "TileReuse",
    "TilingError",
    "aligned_extent",
    "calibration_margin",
    "cap_halo",
    "context_halo",
    "fits_one_tile",
    "pad_to_fit",
    "per_axis",
    "resume_point",
    "round_up",
    "sample_windows",
    "sliding_windows",
    "tiled_inference",
]

#: Names whose modules import torch, loaded on first use (PEP 562) so that the integer-only
#: planning (``TileGrid``, ``Placement``, ...) is usable without torch, e.g. by ``models.spec``.
_LAZY = {
    "tiled_inference": "tiling.engine",
    "SeamStats": "tiling.seam",
    "TileReuse": "tiling.reuse",
    "pad_to_fit": "tiling.windows",
    "sample_windows": "tiling.windows",
    "sliding_windows": "tiling.windows",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tiling' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
