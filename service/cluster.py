"""The network's tiled passes on a Dask cluster: ``tilewise infer --dask`` and large jobs.

Everything around the network stays in this process, exactly as in process (decoding, geometry,
preprocessing, TTA averaging, output kind, mapping back, encoding: :func:`service.pipeline.run_file`);
only the tiled pass is swapped (:class:`models.model.TiledPass`), so the file written is the same
up to float rounding. One tiled pass (a ``tta=mirror`` plan makes one per flip)::

    preprocessed x (C, *S_m) float32, on the model grid, in this process
      --> zarr copy in a folder every worker reads (chunks of the plan below)
      --> tiling.distributed.tiled_inference_dask: one model per worker (WorkerModel: its name and
          the models folder), each chunk plus depth = halo run through tiling.tiled_inference
      --> zarr output --> (C_out, *S_m) float32 or (1, *S_m) uint8 labels here --> the pipeline

Chunks: by default ``tile - 2 * depth`` per axis (``depth`` = the halo rounded up to the network's
alignment), so each block (chunk plus depth on both sides) is one tile; ``chunk=`` overrides.

Tile-dependent networks (instance norm, attention) are refused with
:class:`tiling.distributed.TileDependentError` (HTTP 422 ``not_distributable``) unless the volume
is one chunk: ``tiled_inference_dask`` never blends across chunks. Global-pooling networks (whole-image
pool means prepared in process) are refused likewise (:class:`tiling.DistributedError`).

Addresses (:func:`dask_client`): ``local`` (a ``distributed.LocalCluster`` of 2 worker processes,
one thread each), ``local:N`` (N processes), or a scheduler address such as ``tcp://host:8786``.
Needs the ``distributed`` extra (``pip install 'tilewise[distributed]'``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from service.errors import BadParameterError, ClusterUnavailableError

if TYPE_CHECKING:
    from models.execution.options import RunOptions
    from models.model import Model
    from models.planning.params import InferenceParams
    from models.planning.plan import RunPlan

__all__ = ["LOCAL_WORKERS", "ClusterRoute", "DaskPass", "WorkerModel", "dask_client", "default_chunk"]

logger = logging.getLogger(__name__)

#: Worker processes of ``--dask local``.
LOCAL_WORKERS = 2
#: Seconds to wait for a scheduler to answer, and for a local cluster's workers to start.
CONNECT_TIMEOUT_S = 30


@dataclass(frozen=True)
class WorkerModel:
    """Builds a model's predictor on a Dask worker: picklable, a name and a models folder.

    Every worker must see ``models_dir`` at the same path (built-in models need nothing), and import
    the model's architecture.

    Attributes:
        name: the model's name, as the repository knows it.
        models_dir: the model folder (``None``: the default, :data:`models.DEFAULT_MODELS_DIR`).
        device: torch device on the worker (``None``: CUDA when available, else CPU).
        strict: the repository's ``strict``.
        torch_threads: ``torch.set_num_threads`` on the worker (``None``: torch's default).
    """

    name: str
    models_dir: str | None = None
    device: str | None = None
    strict: bool = False
    torch_threads: int | None = None

    def __call__(self) -> Callable[[Any], Any]:
        """The predictor: float32 ``(B, C_in, *tile)`` tensor -> ``(B, C_out, *tile)`` (logits)."""
        import torch

        from models import ModelRepository

        if self.torch_threads is not None:
            torch.set_num_threads(self.torch_threads)
        model = ModelRepository(self.models_dir, device=self.device, strict=self.strict).get(self.name)
        return model.predictor


def default_chunk(plan: RunPlan, alignment: tuple[int, ...]) -> tuple[int, ...]:
    """Chunk per axis (voxels) such that a block, chunk plus ``depth`` per side, is one tile.

    ``depth`` is the halo rounded up to ``alignment``; where ``tile - 2 * depth`` is below the
    alignment, the tile itself (each block is then a few tiles).
    """
    chunk = []
    for tile, halo, align in zip(plan.tile, plan.halo, alignment, strict=True):
        depth = -(-halo // align) * align
        inner = (tile - 2 * depth) // align * align
        chunk.append(inner if inner >= align else tile)
    return tuple(chunk)


@dataclass
class DaskPass:
    """A :class:`models.model.TiledPass` that runs on a Dask cluster (see the module docstring).

    Use as a context manager: the predictors it leaves loaded on the workers (one per worker, kept
    between the passes of one TTA run) are released on exit.

    Attributes:
        client: a connected ``distributed.Client``.
        workdir: a folder every worker reads and writes at the same path; each pass makes (and
            removes) a temporary folder in it for its zarr input and output.
        models_dir, device, strict, torch_threads: how workers load the model (:class:`WorkerModel`).
        chunk: chunk per axis (voxels); ``None``: :func:`default_chunk`.
        on_stage: called with a short description at each stage of a pass (a job's ``stage``).
        on_plan: called with the plan before the first pass (a job's ``tiles_total``).
        chunks_run: chunks of the last pass (for logs and tests).
    """

    client: Any
    workdir: Path
    models_dir: Path | None = None
    device: str | None = None
    strict: bool = False
    torch_threads: int | None = None
    chunk: int | tuple[int, ...] | None = None
    on_stage: Callable[[str], object] | None = None
    on_plan: Callable[[RunPlan], object] | None = None
    chunks_run: int = 0
    passes: int = 0
    _loaded: set[WorkerModel] = field(default_factory=set)

    def __enter__(self) -> DaskPass:
        return self

    def __exit__(self, *exc: object) -> None:
        from tiling.distributed import release_predictor

        for factory in self._loaded:
            with contextlib.suppress(Exception):  # a worker gone, or the cluster stopping
                release_predictor(self.client, factory)
        self._loaded.clear()

    def __call__(
        self,
        model: Model,
        x: npt.NDArray[np.float32],
        plan: RunPlan,
        reduce: Callable[[Any], Any] | None,
        options: RunOptions,
    ) -> tuple[npt.NDArray[Any], RunPlan]:
        """One tiled pass of ``plan`` over ``x`` ``(C_in, *S_m)`` float32 on the cluster.

        Returns:
            ``(C_out, *S_m)`` float32, or ``(C_red, *S_m)`` after ``reduce`` (uint8 labels); and
            the plan that ran: ``plan`` with its halo the chunks' depth and its
            :attr:`~models.planning.plan.RunPlan.chunked` (tiles summed over the chunks).

        Raises:
            DistributedError: a global-pooling network (its pool means are prepared in process).
            TileDependentError: a tile-dependent network over more than one chunk.
            GridError: a plan the chunks cannot run (e.g. ``scale`` other than 1).
            RunCancelledError: ``options.should_stop()`` returned true.
            Exception: what the model raises on a worker, re-raised here.
        """
        progress, should_stop = options.progress, options.should_stop
        import zarr

        from tiling.distributed import DistributedError, plan_dask, tiled_inference_dask

        spec = model.spec
        if model.context is not None:
            raise DistributedError(
                f"model {spec.name!r} pools over the whole image (its pool means are prepared in "
                "process): run it without --dask"
            )
        align = spec.alignment_per_axis
        asked = self.chunk if self.chunk is not None else default_chunk(plan, align)
        dask_plan = functools.partial(plan_dask, halo=plan.halo, tile_shape=plan.tile, alignment=align,
                                      overlap=plan.overlap, blend=plan.blend.value)  # fmt: skip
        chunks = dask_plan(x.shape[1:], chunk_shape=asked).chunks
        # what tiled_inference_dask plans from the chunk shape it is given below
        chunked = dask_plan(x.shape[1:], chunk_shape=tuple(c[0] for c in chunks))
        chunks = chunked.chunks
        ran = dataclasses.replace(plan, halo=chunked.depth, chunked=chunked)  # the plan that runs
        if self.passes == 0 and self.on_plan is not None:
            self.on_plan(ran)
        self.passes += 1
        self.chunks_run = chunked.n_chunks
        factory = WorkerModel(
            spec.name, None if self.models_dir is None else str(self.models_dir), self.device, self.strict,
            self.torch_threads,
        )  # fmt: skip
        self.workdir.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="tilewise-dask-", dir=self.workdir))
        try:
            self._stage(f"copying the input {tuple(x.shape)} to zarr")
            z = zarr.open_array(
                str(folder / "in.zarr"), mode="w", shape=x.shape, dtype=np.float32,
                chunks=(x.shape[0], *(c[0] for c in chunks)),
            )  # fmt: skip
            z[...] = x
            self._stage(f"running {self.chunks_run} chunks on the Dask cluster")
            self._loaded.add(factory)
            bar = progress is True
            with contextlib.redirect_stdout(sys.stderr) if bar else contextlib.nullcontext():
                y = tiled_inference_dask(
                    z, factory, halo=plan.halo, tile_shape=plan.tile, alignment=align,
                    chunk_shape=tuple(c[0] for c in chunks), overlap=plan.overlap,
                    blend=plan.blend.value, scale=spec.scale, batch_size=plan.batch_size,
                    reduce=reduce, out=folder / "out.zarr", client=self.client,
                    tile_dependent=bool(model.is_tile_dependent()), keep_loaded=True,
                    progress=bar, should_stop=should_stop,
                )  # fmt: skip
            self._stage("reading the output back")
            result = np.asarray(y[...])
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if callable(progress):
            progress(chunked.n_tiles)
        return result, ran

    def _stage(self, text: str) -> None:
        logger.info("dask: %s", text)
        if self.on_stage is not None:
            self.on_stage(f"dask: {text}")


@contextlib.contextmanager
def dask_client(address: str, *, timeout_s: float | None = None) -> Iterator[tuple[Any, int | None]]:
    """A ``distributed.Client`` for ``address``, closed (with its local cluster) on exit.

    Args:
        address: ``local`` (:data:`LOCAL_WORKERS` worker processes), ``local:N`` (``N >= 1``), or
            a scheduler address (``tcp://host:8786``, ``tls://...``).
        timeout_s: seconds to wait for the scheduler (or the local workers); default
            :data:`CONNECT_TIMEOUT_S`.

    Yields:
        ``(client, n_local)``: the client, and the local cluster's worker count (``None`` for a
        scheduler address).

    Raises:
        BadParameterError: ``local:N`` with ``N`` not a positive integer.
        ClusterUnavailableError: ``distributed`` is not installed, or the cluster cannot be
            reached or started within ``timeout_s``.
    """
    try:
        from distributed import Client, LocalCluster
    except ImportError as exc:
        from models.extras import install_hint

        raise ClusterUnavailableError(
            f"--dask needs the `distributed` extra: {install_hint('distributed')}"
        ) from exc
    n_local = _local_workers(address)
    timeout_s = CONNECT_TIMEOUT_S if timeout_s is None else timeout_s
    with contextlib.ExitStack() as stack:
        try:
            if n_local is not None:
                cluster = stack.enter_context(
                    LocalCluster(  # type: ignore[no-untyped-call]
                        n_workers=n_local, threads_per_worker=1, processes=True, dashboard_address=":0"
                    )
                )
                client = stack.enter_context(Client(cluster, set_as_default=False, timeout=timeout_s))  # type: ignore[no-untyped-call]
            else:
                client = stack.enter_context(Client(address, set_as_default=False, timeout=timeout_s))  # type: ignore[no-untyped-call]
        except (OSError, TimeoutError, RuntimeError) as exc:  # RuntimeError: "Nanny failed to start"
            raise ClusterUnavailableError(f"cannot reach the Dask cluster {address!r}: {exc}") from exc
        logger.info("dask: connected to %s (%s)", address, client.scheduler_info().get("address"))
        yield client, n_local


def _local_workers(address: str) -> int | None:
    kind, sep, count = address.strip().partition(":")
    if kind != "local":
        return None
    if not sep:
        return LOCAL_WORKERS
    if not count.isdigit() or int(count) < 1:
        raise BadParameterError(f"--dask {address!r}: use local, local:N (N >= 1) or tcp://host:port")
    return int(count)


def local_torch_threads(n_workers: int) -> int:
    """Torch threads per local worker process so that the workers share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // n_workers)


class ClusterRoute:
    """The jobs' way to the cluster: ``TILEWISE_DASK_SCHEDULER`` and ``TILEWISE_DASK_MIN_VOXELS``.

    A job whose input has more spatial voxels than ``dask_min_voxels`` (read from its header) runs its
    tiled passes on the cluster at ``dask_scheduler`` (:class:`DaskPass`); others run in process.
    One client per server process, connected on the first job that needs it, closed by :meth:`close`.

    Args:
        settings: the service settings (``dask_*``, ``models_dir``, ``device``, ``strict_models``).
    """

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.address: str | None = settings.dask_scheduler
        self._stack = contextlib.ExitStack()
        self._client: tuple[Any, int | None] | None = None
        self._lock = threading.Lock()

    def voxels_over(self, source: Path, params: InferenceParams | None = None) -> int | None:
        """The input's spatial voxel count when the job goes to the cluster, else ``None``.

        ``params`` (the job's): for a DICOM upload, its ``series`` (an upload may hold several) and
        ``tilt``, probed as the run will decode it.
        """
        if self.address is None:
            return None
        from service.codecs import probe
        from service.precheck import dicom_options

        voxels = math.prod(probe(source, dicom=dicom_options(params)).spatial_shape)
        return voxels if voxels > self.settings.dask_min_voxels else None

    def client(self) -> tuple[Any, int | None]:
        """The connected client and the local cluster's worker count (connects on first use).

        Raises:
            ClusterUnavailableError: the scheduler cannot be reached (or ``distributed`` is missing).
        """
        assert self.address is not None
        with self._lock:
            if self._client is None:
                self._client = self._stack.enter_context(dask_client(self.address))
            return self._client

    def dask_pass(self, folder: Path, **hooks: Any) -> DaskPass:
        """A :class:`DaskPass` for one job (zarr copies in ``TILEWISE_DASK_WORKDIR``, else ``folder``);
        ``hooks``: ``on_stage``, ``on_plan``."""
        client, n_local = self.client()
        settings = self.settings
        models_dir = None if settings.models_dir is None else Path(settings.models_dir).resolve()
        return DaskPass(
            client, Path(settings.dask_workdir or folder).resolve(), models_dir=models_dir,
            device=settings.device, strict=settings.strict_models,
            torch_threads=None if n_local is None else local_torch_threads(n_local), **hooks,
        )  # fmt: skip

    def close(self) -> None:
        """Close the client (and a local cluster)."""
        with self._lock:
            self._client = None
            self._stack.close()
