"""A run that passes twice ``TILEWISE_MAX_REQUEST_SECONDS`` is stopped.

A plan predicted over the limit is refused before it is queued
(:meth:`service.budget.Budget.check_seconds`, 422 ``over_budget``). A plan predicted within it
can still run long (a loaded machine, a network slower on this shape than at warm-up):
:class:`RunDeadline` stops it before its next batch once it has run :data:`OVERRUN_FACTOR` times
the limit, counted from when it starts running (not from when it was queued). The request is
answered 422 ``over_budget`` (:class:`OverTimeError`: the same answer as a refused plan, so that a
client does not retry what will not finish; its slot is freed at once), and a job fails with that
error as its reason.

Example::

    deadline = RunDeadline(limits.budget.max_seconds if limits.budget else None)
    with deadline.running():
        stopper = deadline.should_stop(stop.is_set)
        run_file(model, source, stem, params, options=RunOptions(should_stop=stopper))
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from service.errors import OverBudgetError

__all__ = ["OVERRUN_FACTOR", "OverTimeError", "RunDeadline"]

#: A run is stopped once it has run this many times ``max_request_seconds``.
OVERRUN_FACTOR = 2.0


class OverTimeError(OverBudgetError):
    """A run stopped after twice ``max_request_seconds`` (422 ``over_budget``; names both figures)."""


class RunDeadline:
    """When a run must stop: ``factor * limit_s`` seconds after :meth:`running` began.

    Args:
        limit_s: ``max_request_seconds`` (``None``: never stops).
        factor: the overrun allowed before stopping.
        clock: monotonic seconds (tests give their own).
    """

    def __init__(
        self,
        limit_s: float | None,
        *,
        factor: float = OVERRUN_FACTOR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit_s = limit_s
        self.factor = factor
        self._clock = clock
        self._started: float | None = None

    @classmethod
    def of(cls, limits: Any) -> RunDeadline:
        """The deadline of a :class:`~service.precheck.Limits` (its budget's ``max_seconds``)."""
        budget = getattr(limits, "budget", None)
        return cls(getattr(budget, "max_seconds", None))

    def elapsed(self) -> float:
        """Seconds since :meth:`running` began (0 before)."""
        return 0.0 if self._started is None else self._clock() - self._started

    def expired(self) -> bool:
        """Whether the run has passed ``factor * limit_s``."""
        if self.limit_s is None or self._started is None:
            return False
        return self.elapsed() > self.factor * self.limit_s

    def should_stop(self, other: Callable[[], bool] | None = None) -> Callable[[], bool]:
        """A ``should_stop`` for a run's :class:`~models.execution.options.RunOptions`: ``other()``
        or :meth:`expired`."""

        def stop() -> bool:
            return (other is not None and other()) or self.expired()

        return stop

    @contextmanager
    def running(self) -> Iterator[RunDeadline]:
        """Start the clock; a run stopped (``tiling.RunCancelledError``) because the deadline passed
        becomes :class:`OverTimeError`.

        Raises:
            OverTimeError: the run was stopped by this deadline.
        """
        from tiling import RunCancelledError

        self._started = self._clock()
        try:
            yield self
        except RunCancelledError as exc:
            if not self.expired():
                raise
            raise OverTimeError(
                f"the run was stopped after {self.elapsed():.1f} s, over {self.factor:g} x "
                f"max_request_seconds={self.limit_s:g} (TILEWISE_MAX_REQUEST_SECONDS); its plan was "
                "predicted within the limit: the server is slower than predicted (loaded), or the "
                "network slower on this input; send a smaller image or fewer tiles"
            ) from exc
