"""Retry delays: capped exponential backoff with jitter, and ``Retry-After`` parsing.

Worked example with ``base_s=0.5``, ``max_s=30`` ("equal jitter": half fixed, half random, so
clients that failed together spread out yet never hammer the server)::

    retry      1          2          3          4          5
    ceiling    0.5 s      1 s        2 s        4 s        8 s
    delay      0.25-0.5   0.5-1      1-2        2-4        4-8       total 7.75-15.5 s

A ``Retry-After`` answer (503 from a full queue) replaces the ceiling when it is larger, still
capped at ``max_s``, plus up to 10 % jitter so that a crowd of waiting clients does not return in
the same millisecond.
"""

from __future__ import annotations

import email.utils
import random
import time

__all__ = ["backoff_delay", "parse_retry_after"]


def backoff_delay(
    retry: int,
    *,
    base_s: float,
    max_s: float,
    retry_after_s: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before retry number ``retry`` (1 for the first retry).

    Args:
        retry: 1-based retry number.
        base_s: ceiling of the first delay; the ceiling doubles with every retry.
        max_s: largest delay returned.
        retry_after_s: the server's ``Retry-After`` in seconds, if it sent one.
        rng: random source (tests pass a seeded one).

    Returns:
        delay in seconds, ``0 <= delay <= max_s``.
    """
    uniform = (rng or random).uniform
    ceiling = min(max_s, base_s * 2.0 ** (retry - 1))
    delay = ceiling / 2 + uniform(0.0, ceiling / 2)
    if retry_after_s is not None and retry_after_s > delay:
        delay = retry_after_s * (1.0 + uniform(0.0, 0.1))
    return min(max_s, max(0.0, delay))


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delta-seconds or an HTTP date.

    Returns:
        seconds (never negative), or ``None`` when the header is absent or unreadable.
    """
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
