"""What one forward pass costs, measured at warm-up: memory per voxel and time per voxel.

A network's working memory (activations, padding, im2col columns, oneDNN scratch, the output) and
its time grow with the voxels of the batch it is given. :func:`measure_footprint` runs a small and a
larger tile, ``S`` and ``L`` (``L``: the spec's default tile, at most :data:`MAX_VOXELS`; ``S``: half
of it per axis), each at batch 1 and at batch ``B`` (the spec's default batch, 2 to 4), and fits a
line through each pair of peaks::

    rise(V, b) = fixed + per_voxel * V * b   (b >= 2; V = tile voxels; bytes)
    per_voxel  = (rise(L, B) - rise(S, B)) / ((V_L - V_S) * B)
    rise(V, 1) = the line through rise(S, 1) and rise(L, 1) up to V_L, then + per_voxel per voxel

Batch 1 has its own line up to the larger tile because kernels split one small sample differently
from a batch (measured on 2 threads: ``gaussian-3d`` holds 36 MB on 64^3 at batch 1 and 38 MB at
batch 2; ``sobel-3d`` 12 and 42 MB); on larger tiles every batch settles to ``per_voxel`` per
voxel (the benchmarks' U-Net: 305 B per voxel at batch 1 on 128^3, 299 fitted at batch 2). Time is
a least-squares fit of the four runs,
``seconds(passes, voxels) = passes * seconds_per_pass + voxels * seconds_per_voxel``.

The peak is measured where the memory lives: on CUDA, for a torch backend,
``torch.cuda.max_memory_allocated`` above the allocation before the call; elsewhere the process's
resident memory (:func:`models.measure.rss.peak_rise`: the kernel's high-water mark, reset before the call,
after free heap pages went back to the OS). Each shape runs once unmeasured (lazy initialisation,
kernel choice) and twice measured; the larger rise counts (whether glibc hands a freed block of a
few MB back to the system or reuses it decides between two peaks: ``gaussian-3d`` on 64^3 at batch
1 rises by 20 MB or by 37 MB from one run to the next; the plan takes the upper one).
``rise`` includes the forward's output tensor but not its input batch.

E.g. the benchmarks' 3D U-Net (BasicUNet, features 8-64, batch norm, 2 CPU threads) measured on
48^3 and 96^3 at batch 2 predicts 1219 MB for 128^3 at batch 2 (measured 1180 MB) and 310 MB for
64^3 at batch 4 (measured 313 MB). Where this platform cannot measure (no ``/proc``), the figure is
an estimate: :data:`FALLBACK_COPIES` float32 copies of the input per voxel (``method="estimate"``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from models.measure.rss import peak_rise
from tiling.plan import round_up

__all__ = [
    "FALLBACK_COPIES",
    "Footprint",
    "MAX_VOXELS",
    "footprint_of",
    "measure_footprint",
    "measurement_tiles",
]

logger = logging.getLogger(__name__)

#: Largest tile measured at warm-up, voxels per batch item, by spatial dims.
MAX_VOXELS = {1: 2**20, 2: 2**20, 3: 2**21}
#: float32 copies of the input batch per voxel when nothing can be measured (analytic nets: ~22).
FALLBACK_COPIES = 24


@dataclass(frozen=True, slots=True)
class Footprint:
    """Memory and time of one forward pass as functions of the batch's voxels.

    Attributes:
        bytes_per_voxel: working memory per input voxel of a batch of 2 or more (bytes).
        fixed_bytes: working memory of a batch of 2 or more that does not grow with it (>= 0).
        bytes_per_voxel_1: working memory per voxel at batch 1, up to ``large_voxels``.
        fixed_bytes_1: working memory at batch 1 that does not grow with the tile.
        large_voxels: voxels of the larger measured tile (where the batch-1 line ends).
        seconds_per_voxel: forward time per input voxel of the batch.
        seconds_per_pass: forward time that does not grow with the batch (>= 0).
        method: ``cuda``, ``hwm``, ``sampled`` or ``estimate`` (see the module docstring).
        device: where the working memory lives (``cpu``, ``cuda``).
        measured: the ``(tile, batch, rise bytes, seconds)`` runs the fit came from.
    """

    bytes_per_voxel: float
    fixed_bytes: int
    bytes_per_voxel_1: float
    fixed_bytes_1: int
    large_voxels: int
    seconds_per_voxel: float
    seconds_per_pass: float
    method: str
    device: str = "cpu"
    measured: tuple[tuple[tuple[int, ...], int, int, float], ...] = ()

    @classmethod
    def estimate(cls, in_channels: int, device: str = "cpu") -> Footprint:
        """The unmeasured fallback: :data:`FALLBACK_COPIES` float32 copies of the input, 1 us/voxel."""
        per_voxel = float(FALLBACK_COPIES * 4 * in_channels)
        return cls(per_voxel, 0, per_voxel, 0, 1, 1e-6, 0.0, "estimate", device)

    def working_bytes(self, tile_voxels: int, batch: int) -> int:
        """Peak working memory of one forward pass of ``batch`` tiles of ``tile_voxels`` voxels."""
        if batch <= 1:
            inside = min(tile_voxels, self.large_voxels)
            beyond = max(0, tile_voxels - self.large_voxels)
            return int(self.fixed_bytes_1 + self.bytes_per_voxel_1 * inside + self.bytes_per_voxel * beyond)
        return int(self.fixed_bytes + self.bytes_per_voxel * tile_voxels * batch)

    def seconds(self, passes: int, voxels: int) -> float:
        """Network time of ``passes`` forward passes feeding ``voxels`` voxels in all."""
        return passes * self.seconds_per_pass + voxels * self.seconds_per_voxel

    def describe(self) -> dict[str, Any]:
        """The figures for logs and ``/readyz``."""
        return {
            "bytes_per_voxel": round(self.bytes_per_voxel, 1),
            "fixed_bytes": self.fixed_bytes,
            "bytes_per_voxel_batch_1": round(self.bytes_per_voxel_1, 1),
            "fixed_bytes_batch_1": self.fixed_bytes_1,
            "seconds_per_megavoxel": round(self.seconds_per_voxel * 1e6, 4),
            "seconds_per_pass": round(self.seconds_per_pass, 4),
            "method": self.method,
        }


def measurement_tiles(
    default_tile: Sequence[int], alignment: int, batch: int, *, fixed_tile: bool = False
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The small and larger tile measured, and the batch: ``(S, L, B)``.

    ``L`` is ``default_tile`` scaled down (same proportions) to at most :data:`MAX_VOXELS`, ``S`` is
    half of ``L`` per axis, both rounded up to the alignment (and ``S`` at least one step smaller
    on some axis); ``B`` is ``batch`` within 2..4. A network of one input size (``fixed_tile``, a
    transformer whose export pads smaller inputs to its window) is measured at ``default_tile`` and
    half of it (which it runs padded: the cost of its window).

    >>> measurement_tiles((96, 96, 96), 16, 1)
    ((48, 48, 48), (96, 96, 96), 2)
    >>> measurement_tiles((256, 256, 256), 32, 1)
    ((64, 64, 64), (128, 128, 128), 2)
    """
    ndim = len(default_tile)
    if fixed_tile:
        window = tuple(int(t) for t in default_tile)
        return tuple(max(1, t // 2) for t in window), window, min(4, max(2, int(batch)))
    tile = [max(int(t), alignment) for t in default_tile]
    shrink = min(1.0, (MAX_VOXELS[min(ndim, 3)] / math.prod(tile)) ** (1 / ndim))
    large = tuple(round_up(max(1, math.floor(t * shrink)), alignment) for t in tile)
    small = tuple(round_up(max(1, t // 2), alignment) for t in large)
    if small == large:
        large = tuple(s + alignment for s in small)
    return small, large, min(4, max(2, int(batch)))


def _measure_once(
    predictor: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, device: torch.device, cuda: bool
) -> tuple[int | None, str, float]:
    """``(rise, method, seconds)`` of one forward pass of ``x``."""

    def forward() -> None:
        with torch.inference_mode():
            predictor(x)
        if cuda:
            torch.cuda.synchronize(device)

    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        forward()
        seconds = time.perf_counter() - start
        return max(0, torch.cuda.max_memory_allocated(device) - base), "cuda", seconds
    start = time.perf_counter()
    rise, method, _ = peak_rise(forward)
    return rise, method, time.perf_counter() - start


def _line(points: Sequence[tuple[int, int]]) -> tuple[float, int]:
    """``(per_voxel, fixed)`` through two ``(voxels, rise)`` points; proportional when the fit is
    not physical (a falling line, or a negative intercept)."""
    (v_s, r_s), (v_l, r_l) = points
    per_voxel = (r_l - r_s) / (v_l - v_s)
    if per_voxel <= 0 or r_l - per_voxel * v_l < 0:
        return r_l / v_l, 0
    return per_voxel, int(r_l - per_voxel * v_l)


def measure_footprint(
    predictor: Callable[[torch.Tensor], torch.Tensor],
    *,
    in_channels: int,
    default_tile: Sequence[int],
    alignment: int = 1,
    batch: int = 1,
    device: torch.device | str = "cpu",
    torch_backend: bool = True,
    fixed_tile: bool = False,
) -> Footprint:
    """Measure the :class:`Footprint` of ``predictor`` (see the module docstring).

    Args:
        predictor: maps ``(B, C_in, *tile)`` float32 CPU batches to outputs.
        in_channels: ``C_in``.
        default_tile: the spec's default tile per axis (the larger measured tile, scaled down to
            at most :data:`MAX_VOXELS`).
        alignment: the network's size divisor.
        batch: the spec's default batch size (measured within 2..4).
        device: where the network runs; on CUDA with ``torch_backend`` the peak is the device's.
        torch_backend: whether the network's memory goes through torch's CUDA allocator.
        fixed_tile: the network takes only ``default_tile`` (:func:`measurement_tiles`).
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda" and torch_backend and torch.cuda.is_available()
    small, large, b = measurement_tiles(default_tile, alignment, batch, fixed_tile=fixed_tile)
    runs: list[tuple[tuple[int, ...], int, int, float]] = []
    methods: set[str] = set()
    for n in (1, b):
        for tile in (small, large):
            x = torch.rand((n, in_channels, *tile), generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                predictor(x)  # lazy initialisation, kernel choice, allocator pools
            both = [_measure_once(predictor, x, dev, cuda) for _ in range(2)]
            del x
            rises = [r for r, _, _ in both if r is not None]
            methods.update(m for _, m, _ in both)
            runs.append((tile, n, max(rises) if rises else -1, min(s for _, _, s in both)))
    voxels = [n * math.prod(t) for t, n, _, _ in runs]
    passes = torch.ones(len(runs), dtype=torch.float64)
    design = torch.stack([passes, torch.tensor(voxels, dtype=torch.float64)], dim=1)
    seconds = torch.tensor([s for *_, s in runs], dtype=torch.float64)[:, None]
    per_pass, per_voxel_s = (float(v) for v in torch.linalg.lstsq(design, seconds).solution[:, 0])
    if per_voxel_s <= 0 or per_pass < 0:  # a noisy machine: all of it per voxel
        per_voxel_s, per_pass = float(seconds.sum()) / sum(voxels), 0.0
    if any(r < 0 for _, _, r, _ in runs) or methods & {"none"}:
        measured = Footprint.estimate(in_channels, dev.type)
        result = Footprint(**{**_fields(measured), "measured": tuple(runs)})
    else:
        per_voxel_1, fixed_1 = _line([(voxels[0], runs[0][2]), (voxels[1], runs[1][2])])
        per_voxel, fixed = _line([(voxels[2], runs[2][2]), (voxels[3], runs[3][2])])
        method = "cuda" if cuda else ("sampled" if "sampled" in methods else "hwm")
        result = Footprint(
            per_voxel, fixed, per_voxel_1, fixed_1, voxels[1], per_voxel_s, per_pass, method, dev.type,
            tuple(runs),
        )  # fmt: skip
    logger.info(
        "footprint: batch %d: %.1f B/voxel + %.1f MiB; batch 1: %.1f B/voxel + %.1f MiB; "
        "%.3f s/Mvoxel + %.3f s/pass (%s; tiles %s and %s)",
        b,
        result.bytes_per_voxel,
        result.fixed_bytes / 2**20,
        result.bytes_per_voxel_1,
        result.fixed_bytes_1 / 2**20,
        result.seconds_per_voxel * 1e6,
        result.seconds_per_pass,
        result.method,
        small,
        large,
    )
    return result


#: Footprints measured in this process, by network (spec), device and torch threads.
_MEASURED: dict[tuple[str, str, int], Footprint] = {}
_MEASURED_LOCK = threading.Lock()


def footprint_of(spec: Any, predictor: Any) -> Footprint:
    """:func:`measure_footprint` of a model: its spec's default tile (rounded up to the alignment)
    and batch size, on the predictor's device; measured once per process for the same spec (file,
    checksum, parameters), device and number of torch threads."""
    key = (spec.model_dump_json(), str(predictor.device), torch.get_num_threads())
    with _MEASURED_LOCK:
        known = _MEASURED.get(key)
    if known is not None:
        return known
    measured = _measure_spec(spec, predictor)
    with _MEASURED_LOCK:
        return _MEASURED.setdefault(key, measured)


def _measure_spec(spec: Any, predictor: Any) -> Footprint:
    ndim = int(spec.spatial_dims)
    tile = spec.defaults.tile
    tile = (tile,) * ndim if isinstance(tile, int) else tuple(tile)
    return measure_footprint(
        predictor,
        in_channels=int(spec.in_channels),
        default_tile=tuple(round_up(int(t), spec.alignment_lcm) for t in tile),
        alignment=spec.alignment_lcm,
        batch=int(spec.defaults.batch_size or 1),
        device=predictor.device,
        torch_backend=str(spec.backend.value) != "onnx",
        fixed_tile=bool(getattr(spec, "fixed_tile", False)),
    )


def _fields(footprint: Footprint) -> dict[str, Any]:
    return {name: getattr(footprint, name) for name in Footprint.__slots__}
