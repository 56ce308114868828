"""Giving freed heap memory back to the operating system after each inference; how much there is.

glibc keeps freed blocks in its arenas (and raises its mmap threshold after large frees), so a
server that decoded a 500 MB volume would otherwise stay 500 MB larger while idle.
``malloc_trim(0)`` returns the free pages; elsewhere (musl, macOS) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

__all__ = ["memory_limit_bytes", "release_free_memory"]

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


def release_free_memory() -> bool:
    """Return free heap pages to the OS; ``True`` when the C library supports it."""
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
