"""The benchmark cases, one module each; ``CASES`` maps a ``--cases`` name to its function."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.cases.autohalo import case_auto
from benchmarks.cases.images2d import case_2d
from benchmarks.cases.memplan import case_memplan
from benchmarks.cases.prefetch import case_prefetch
from benchmarks.cases.scaling import case_scaling
from benchmarks.cases.service import case_service
from benchmarks.cases.shallow import case_shallow
from benchmarks.cases.sweep import case_sweep
from benchmarks.cases.volume3d import case_3d, case_instance
from benchmarks.harness import Bench

CASES: dict[str, Callable[[Bench], None]] = {
    "3d": case_3d,
    "auto": case_auto,
    "shallow": case_shallow,
    "memplan": case_memplan,
    "prefetch": case_prefetch,
    "scaling": case_scaling,
    "service": case_service,
    "sweep": case_sweep,
    "instance": case_instance,
    "2d": case_2d,
}
