"""This process's resident memory and its peak around a call (Linux ``/proc``; no torch).

:func:`peak_rise` answers "how many bytes above the level before did ``fn()`` hold at its peak", the
quantity a memory plan adds up. Methods, best first:

- ``hwm``: free heap pages are returned first (glibc ``malloc_trim(0)``), the kernel's peak RSS
  (``VmHWM``) is reset to the current RSS (``/proc/self/clear_refs`` ``5``, Linux 4.0+), ``fn()``
  runs, and the rise is ``VmHWM`` minus the RSS before. Exact (the kernel sees every page, from
  torch, oneDNN's scratch buffers or ONNX Runtime's arenas alike) and free of sampling gaps.
- ``sampled``: where ``clear_refs`` is not writable, a thread reads ``VmRSS`` every millisecond;
  a peak shorter than that can be missed.
- ``None`` when neither works (no ``/proc``: macOS, Windows).

Allocation hooks (``tracemalloc``) do not see torch's allocations, and torch's profiler misses what
oneDNN and ONNX Runtime allocate for themselves (the 3D U-Net of the benchmarks: 225 MB of tensors,
389 MB of resident memory at its peak on a 96^3 tile), so neither measures what a request costs.
The rise is process-wide: another thread allocating meanwhile counts too (measure at warm-up).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "MMAP_THRESHOLD_BYTES",
    "fix_mmap_threshold",
    "memory_limit_bytes",
    "peak_rise",
    "peak_rss_bytes",
    "release_free_memory",
    "reset_peak_rss",
    "rss_bytes",
]

#: glibc's mmap threshold set by :func:`fix_mmap_threshold` (the benchmarks' too).
MMAP_THRESHOLD_BYTES = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status(key: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes() -> int | None:
    """Resident memory of this process (bytes), or ``None`` without ``/proc``."""
    return _status("VmRSS")


@lru_cache(maxsize=1)
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _malloc_trim() -> Callable[[int], int] | None:
    trim: Callable[[int], int] | None = getattr(_libc(), "malloc_trim", None)
    return trim


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every allocation of ``threshold`` bytes or more with its own ``mmap`` (glibc).

    By default glibc raises this threshold after large frees (up to 32 MiB), so later buffers of a
    few MiB come from the heap, where freed memory may or may not go back to the system: the same
    forward pass then peaks 20 or 37 MB higher from one run to the next (``gaussian-3d`` on 64^3,
    batch 1), 21 or 108 MB (``log-3d``). A fixed threshold makes a run's peak the sum of what it
    holds (as :mod:`models.measure.footprint` measures it) and lets an idle process shrink back. The
    service sets it at start-up (``TILEWISE_MMAP_THRESHOLD_BYTES``; 0 leaves glibc's default).
    Returns ``False`` where ``mallopt`` is missing (musl, macOS) or ``threshold`` is 0.
    """
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None or threshold <= 0:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def release_free_memory() -> bool:
    """Return free heap pages to the OS (glibc ``malloc_trim(0)``); ``False`` where unsupported."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def memory_limit_bytes() -> int:
    """The memory this process may use: its cgroup's limit (a container's) when one is set, else
    the machine's physical memory; 8 GiB when neither can be read."""
    physical = 8 * 2**30
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < physical:
            return int(text)
    return int(physical)


def peak_rss_bytes() -> int | None:
    """The kernel's peak resident memory of this process since start or :func:`reset_peak_rss`."""
    return _status("VmHWM")


def reset_peak_rss() -> bool:
    """Reset the kernel's peak resident memory to the current (``False`` where not allowed)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def peak_rise(fn: Callable[[], Any]) -> tuple[int | None, str, Any]:
    """Run ``fn()``; return ``(rise, method, result)``: its peak resident memory above the level
    before the call (bytes; ``None`` when this platform cannot tell), the method (``hwm``,
    ``sampled`` or ``none``) and what ``fn`` returned."""
    release_free_memory()
    before = rss_bytes()
    if before is None:
        return None, "none", fn()
    if reset_peak_rss():
        result = fn()
        peak = peak_rss_bytes()
        if peak is not None:
            return max(0, peak - before), "hwm", result
    top = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            now = rss_bytes()
            if now is not None and now > top[0]:
                top[0] = now
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, name="tilewise-rss-sampler", daemon=True)
    sampler.start()
    try:
        result = fn()
    finally:
        done.set()
        sampler.join()
    after = rss_bytes() or before
    return max(0, max(top[0], after) - before), "sampled", result
