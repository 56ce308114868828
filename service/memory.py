"""Giving freed heap memory back to the operating system after each inference; how much there is.

glibc keeps freed blocks in its arenas (and raises its mmap threshold after large frees), so a
server that decoded a 500 MB volume would otherwise stay 500 MB larger while idle.
``malloc_trim(0)`` returns the free pages; elsewhere (musl, macOS) this is a no-op. The functions
live in :mod:`models.measure.rss` (torch-free), which measures a network's footprint with them.
"""

from __future__ import annotations

from models.measure.rss import fix_mmap_threshold, memory_limit_bytes, release_free_memory

__all__ = ["fix_mmap_threshold", "memory_limit_bytes", "release_free_memory"]
