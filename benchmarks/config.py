"""Benchmark modes (sizes, contenders, cases) and the stride arithmetic shared by the cases."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


RESULT_PREFIX = "RESULT "

UNET_FEATURES = (8, 8, 16, 32, 64, 8)

UNET_ALIGNMENT = 16  # BasicUNet has four 2x poolings

TEXT_DET = "text-det-2d"

MB = 1024 * 1024


@dataclass(frozen=True)
class Mode:
    """Sizes and contender sets of one benchmark mode."""

    name: str
    spacing_mm: float  # MNI152 (1 mm) resampled to this voxel size for the 3D case
    tile: int
    halo: int
    repeats: int
    sweep_repeats: int
    torchio_modes: tuple[str, ...]
    instance_torchio_modes: tuple[str, ...]
    monai_modes: tuple[str, ...]
    sweep_halos: tuple[int, ...]
    sweep_overlaps: tuple[float, ...]
    auto_tolerances: tuple[float, ...]
    shallow_tiles: tuple[int, ...]
    interleave_cases: tuple[str, ...]  # cases whose timed runs go round robin over contenders
    scaling_sizes: tuple[int, ...]
    scaling_kinds: tuple[str, ...]
    scaling_tile: int
    scaling_halo: int
    tile2d: int
    halo2d: int
    cases: tuple[str, ...]
    prefetch_spacing_mm: float = 1.0  # the prefetch case's MNI152 voxel size
    prefetch_tile: int = 96
    prefetch_halo: int = 12
    prefetch_threads: int = 1  # network threads: on 2 cores, one is left for the reading thread
    prefetch_sleep_s: float = 0.2  # the simulated accelerator's time per tile (holds no CPU)
    auto_spacing_mm: float = 1.0  # the auto case's MNI152 voxel size (the case: 1 mm)
    auto_tile: int = 96  # its tile limit
    auto_case_tolerances: tuple[float, ...] = (1e-4, 1e-12)  # met, and never met (the largest halo)
    memplan_sizes: tuple[int, ...] = (64, 192, 384)


FULL = Mode(
    name="full",
    spacing_mm=1.75,
    tile=96,
    halo=12,
    repeats=3,
    sweep_repeats=1,
    torchio_modes=("crop", "average", "hann"),
    instance_torchio_modes=("hann",),
    monai_modes=("constant", "gaussian"),
    sweep_halos=(0, 8, 16, 32),
    sweep_overlaps=(0.5, 0.75),
    auto_tolerances=(1e-3, 1e-5),
    shallow_tiles=(64, 96),
    interleave_cases=("3d-batch", "auto"),
    scaling_sizes=(64, 128, 192, 256, 384),
    scaling_kinds=("memory", "disk", "monai"),
    scaling_tile=96,
    scaling_halo=12,
    tile2d=512,
    halo2d=64,
    # Cases in order of priority (--max-minutes skips what is left when time runs out).
    cases=("3d", "auto", "shallow", "memplan", "prefetch", "scaling", "service", "sweep", "instance", "2d"),
)


QUICK = Mode(
    name="quick",
    spacing_mm=3.0,
    tile=48,
    halo=8,
    repeats=3,
    sweep_repeats=1,
    torchio_modes=("crop",),
    instance_torchio_modes=("crop",),
    monai_modes=("constant",),
    sweep_halos=(),
    sweep_overlaps=(),
    auto_tolerances=(),
    shallow_tiles=(48,),
    interleave_cases=(),
    scaling_sizes=(48, 64),
    scaling_kinds=("disk", "monai"),
    scaling_tile=48,
    scaling_halo=8,
    tile2d=512,
    halo2d=64,
    cases=("3d", "auto", "shallow", "scaling", "prefetch"),
    prefetch_spacing_mm=2.5,
    prefetch_tile=48,
    prefetch_halo=6,
    prefetch_sleep_s=0.01,
    auto_spacing_mm=3.0,
    auto_tile=32,
    auto_case_tolerances=(1e-4,),
    memplan_sizes=(64,),
)


def aligned_stride(tile: int, halo: int, alignment: int, overlap: int = 0) -> int:
    """tilewise's stride: ``(tile - 2 * halo - overlap)`` rounded down to the alignment."""
    return (tile - 2 * halo - overlap) // alignment * alignment


def monai_passes(shape: Sequence[int], tile: int, overlap: float) -> int:
    """Windows of MONAI's ``sliding_window_inference`` (its ``_get_scan_interval`` arithmetic)."""
    interval = max(1, int(tile * (1 - overlap)))
    return math.prod(1 if n <= tile else -(-(n - tile) // interval) + 1 for n in shape)


def monai_overlap_for(tile: int, stride: int) -> float:
    """The MONAI ``overlap`` fraction whose scan interval ``int(tile * (1 - overlap))`` is ``stride``."""
    overlap = 1.0 - (stride + 0.5) / tile
    if int(tile * (1.0 - overlap)) != stride:  # pragma: no cover - arithmetic guard
        raise ValueError(f"no MONAI overlap gives stride {stride} for tile {tile}")
    return overlap
