"""How one run is watched and where its tiled passes run: one object instead of parameters
threaded through every signature (issue 20).

:meth:`models.Model.execute`, :func:`models.execution.execute.execute_plan`,
:func:`models.geometry.mapping.run_mapped` and :class:`models.model.TiledPass` take a
:class:`RunOptions`; the service makes one per request (:mod:`service.stages`) and the run adds
what it owns (``resume``, ``seam``, ``replanned``) with :func:`dataclasses.replace`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from models.model import TiledPass
    from models.planning.plan import RunPlan
    from tiling import Resume, SeamStats, TileReuse

__all__ = ["RunOptions"]


@dataclass(frozen=True, slots=True)
class RunOptions:
    """One run's options (every field optional).

    Attributes:
        progress: show a bar of tiles on stderr, or a callable called with each batch's tile count.
        should_stop: asked before every batch; true stops the run (``tiling.RunCancelledError``).
            Cheap and thread-safe (``threading.Event.is_set``).
        on_plan: told the plan before its first tile runs (a job's ``tiles_total``).
        resume: with ``out``, continue a run stopped at a finished tile row (:mod:`tiling.resume`);
            a ``tta=mirror`` plan ignores it (its passes are averaged in memory).
        seam: gathers the disagreement of overlapping tiles (:meth:`models.Model.seam_stats`).
        replanned: told each smaller plan after the device ran out of memory, and the plan a
            :attr:`tiled` pass ran.
        tiled: runs each tiled pass elsewhere (:class:`models.model.TiledPass`, a Dask cluster);
            it takes neither :attr:`resume` nor :attr:`seam`.
        reuse: which tiles are not run and the count of those that were not
            (:class:`tiling.TileReuse`: constant tiles computed once, including a slide's
            background, which its region source returns as blank glass). ``None``: the engine's
            default (constant tiles reused).
    """

    progress: bool | Callable[[int], object] = False
    should_stop: Callable[[], bool] | None = None
    on_plan: Callable[[RunPlan], object] | None = None
    resume: Resume | None = None
    seam: SeamStats | None = None
    replanned: Callable[[RunPlan], object] | None = None
    tiled: TiledPass | None = None
    reuse: TileReuse | None = None
