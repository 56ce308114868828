"""The per-worker side of :func:`tiling.distributed.tiled_inference_dask`: one predictor per worker.

One job: load the predictor once per worker (:class:`PredictorPlugin`, a ``distributed.WorkerPlugin``,
or one local instance without ``distributed``) and run :func:`tiling.tiled_inference` over one block
with it (``_BlockRunner``, the small picklable callable every Dask task runs). Imports without Dask
installed.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tiling.engine import tiled_inference
from tiling.errors import DistributedError

if TYPE_CHECKING:
    from distributed import WorkerPlugin as _WorkerPluginBase
else:
    try:
        from distributed import WorkerPlugin as _WorkerPluginBase
    except ImportError:  # pragma: no cover - exercised only where the extra is not installed
        _WorkerPluginBase = object

logger = logging.getLogger("tiling.distributed")

__all__ = ["PredictorPlugin"]

Predictor = Callable[[torch.Tensor], Any]
Reducer = Callable[[torch.Tensor], torch.Tensor]
ModelFactory = Callable[[], Predictor]


class PredictorPlugin(_WorkerPluginBase):
    """A ``distributed.WorkerPlugin`` that keeps one predictor per worker, built by ``model_factory``.

    The model is built on the worker's first task that needs it (not in ``setup``: loading a model
    takes seconds, and ``setup`` runs on the worker's event loop, where it would stall heartbeats;
    a worker that never gets a task, e.g. one without the GPU resource asked for, never loads it),
    under a lock, so concurrent tasks of one worker share one load. Later tasks reuse it. When the
    plugin is removed or the worker closes, ``teardown`` drops the predictor. Pickling (to send the
    plugin to the workers) never carries a loaded predictor.

    Also used without ``distributed``: :func:`tiled_inference_dask` then holds one instance in the
    calling process, shared by the threads of Dask's local scheduler.

    Args:
        model_factory: picklable callable with no arguments that returns the predictor, a callable
            mapping a float32 ``(B, C, *tile)`` tensor to ``(B, C_out, *tile)``. It must be
            importable on every worker (a module-level function or a class instance, e.g. a model
            name plus the models folder).
        idempotent: keep an already registered plugin of the same name (and its loaded model)
            instead of replacing it.

    Attributes:
        n_loads: how many times this instance called ``model_factory`` (0 or 1 unless released).
    """

    def __init__(self, model_factory: ModelFactory, *, idempotent: bool = False) -> None:
        self.model_factory = model_factory
        self.idempotent = idempotent
        self.n_loads = 0
        self._predictor: Predictor | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_predictor=None, _lock=None, n_loads=0)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def teardown(self, worker: Any) -> None:  # noqa: ARG002 - the plugin interface
        """Drop the predictor (when the plugin is unregistered or the worker closes)."""
        self.release()

    def predictor(self) -> Predictor:
        """The predictor, built by ``model_factory`` on the first call."""
        with self._lock:
            if self._predictor is None:
                self._predictor = self.model_factory()
                self.n_loads += 1
                logger.info("predictor loaded in process %d by %r", os.getpid(), self.model_factory)
            return self._predictor

    def release(self) -> None:
        """Drop the predictor; the next :meth:`predictor` call loads it again."""
        with self._lock:
            self._predictor = None


@dataclass(frozen=True)
class _BlockRunner:
    """What each Dask task runs on one block; picklable, small (no model, no array)."""

    plugin_name: str
    local: PredictorPlugin | None  # set when running without distributed (nothing is pickled)
    tile_shape: tuple[int, ...] | None
    halo: tuple[int, ...]
    overlap: tuple[int, ...]
    alignment: tuple[int, ...]
    blend: str
    border: str
    padding_mode: str
    batch_size: int
    device: str | None
    reduce: Reducer | None

    def predictor(self) -> Predictor:
        if self.local is not None:
            return self.local.predictor()
        from distributed import get_worker

        plugin = get_worker().plugins.get(self.plugin_name)
        if not isinstance(plugin, PredictorPlugin):  # pragma: no cover - the scheduler sends it first
            raise DistributedError(f"worker plugin {self.plugin_name!r} is missing on this worker")
        return plugin.predictor()

    def tile_for(self, block_spatial: Sequence[int]) -> tuple[int, ...]:
        if self.tile_shape is not None:
            return self.tile_shape
        # No tile asked: the whole block is one tile (rounded up to the alignment).
        return tuple(-(-s // a) * a for s, a in zip(block_spatial, self.alignment, strict=True))

    def __call__(self, block: np.ndarray) -> np.ndarray:
        """Map one block ``(C, *block)`` to ``(C_out or C_red, *block)`` with ``tiled_inference``."""
        return tiled_inference(  # type: ignore[no-any-return]
            block, self.predictor(), self.tile_for(block.shape[1:]), halo=self.halo,
            overlap=self.overlap, blend=self.blend, border=self.border, padding_mode=self.padding_mode,
            alignment=self.alignment, batch_size=self.batch_size, device=self.device, reduce=self.reduce,
        )  # fmt: skip

    def probe(self, c_in: int, tile: Sequence[int]) -> tuple[int, str]:
        """Channels and dtype of the (reduced) output, from the engine run over one zero tile.

        Going through :func:`tiling.tiled_inference` checks the predictor's output shape as every
        block will (``ShapeMismatchError``), before any block task is scheduled.
        """
        zeros = np.zeros((c_in, *tile), dtype=np.float32)
        y = tiled_inference(
            zeros, self.predictor(), tuple(tile), halo=0, alignment=self.alignment, batch_size=1,
            device=self.device, reduce=self.reduce,
        )  # fmt: skip
        return int(y.shape[0]), str(y.dtype)


def _probe(runner: _BlockRunner, c_in: int, tile: Sequence[int]) -> tuple[int, str]:
    return runner.probe(c_in, tile)


def _plugin_name(model_factory: ModelFactory, keep_loaded: bool) -> str:
    if keep_loaded:
        from dask.base import tokenize

        return f"tilewise-predictor-{tokenize(model_factory)}"
    return f"tilewise-predictor-{uuid.uuid4().hex}"
