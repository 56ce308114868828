"""Progress of a batch run: a tqdm bar on a terminal, one log line per file otherwise.

The bar counts input bytes of finished files (so its rate and ETA follow real throughput), shows
``done/total files`` as its description and the files in flight as its postfix, with the tiles
done of each file sent as a job (``scan.nii.gz 12/40 tiles``). Log lines go
through :mod:`logging` (configured by :mod:`service.log`), never ``print``.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Protocol, TextIO

from service.client.report import FileResult, Status

__all__ = ["BarProgress", "LogProgress", "Progress", "make_progress"]

logger = logging.getLogger(__name__)


def _size(n: float) -> str:
    """Human-readable byte count (``1.6 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


class Progress(Protocol):
    """What the runner reports while it works."""

    def start(self, n_files: int, n_bytes: int) -> None:
        """The run sends ``n_files`` files of ``n_bytes`` bytes in all."""

    def file_started(self, rel: str) -> None:
        """A file's request begins."""

    def file_finished(self, result: FileResult) -> None:
        """A file is done or failed."""

    def file_progress(self, rel: str, tiles_done: int, tiles_total: int | None) -> None:
        """A file sent as a job has ``tiles_done`` of its ``tiles_total`` tiles done."""

    def close(self) -> None:
        """The run is over."""


class LogProgress:
    """One INFO line per finished file (WARNING for a failure), for logs and pipes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n_files = 0
        self._finished = 0

    def start(self, n_files: int, n_bytes: int) -> None:
        self._n_files = n_files
        logger.info("sending %d files (%s)", n_files, _size(n_bytes))

    def file_started(self, rel: str) -> None:
        logger.debug("start %s", rel)

    def file_progress(self, rel: str, tiles_done: int, tiles_total: int | None) -> None:
        logger.debug("%s: %d/%s tiles", rel, tiles_done, tiles_total if tiles_total is not None else "?")

    def file_finished(self, result: FileResult) -> None:
        with self._lock:
            self._finished += 1
            k = self._finished
        if result.status is Status.FAILED:
            logger.warning(
                "[%d/%d] failed %s after %d attempt(s): %s",
                k,
                self._n_files,
                result.input,
                result.attempts,
                result.error,
            )
        else:
            logger.info(
                "[%d/%d] %s %s -> %s (%.1f s, %s)",
                k,
                self._n_files,
                result.status.value,
                result.input,
                result.output,
                result.seconds,
                _size(result.bytes_in),
            )

    def close(self) -> None:
        pass


class BarProgress:
    """A tqdm bar over input bytes, with files done and files in flight."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stderr
        self._lock = threading.Lock()
        self._bar: Any = None
        self._redirect: Any = None
        self._in_flight: list[str] = []
        self._tiles: dict[str, str] = {}
        self._n_files = 0
        self._finished = 0
        self._failed = 0

    def start(self, n_files: int, n_bytes: int) -> None:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._n_files = n_files
        self._bar = tqdm(
            total=n_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"0/{n_files} files",
            file=self._stream,
            dynamic_ncols=True,
        )
        # Log records (retries, failures) print above the bar instead of through it.
        self._redirect = logging_redirect_tqdm()
        self._redirect.__enter__()

    def _postfix(self) -> None:
        names = ", ".join(f"{rel} {self._tiles.get(rel, '')}".rstrip() for rel in self._in_flight)
        self._bar.set_postfix_str(names if len(names) <= 60 else names[:57] + "...", refresh=True)

    def file_started(self, rel: str) -> None:
        with self._lock:
            self._in_flight.append(rel)
            self._postfix()

    def file_progress(self, rel: str, tiles_done: int, tiles_total: int | None) -> None:
        with self._lock:
            self._tiles[rel] = f"{tiles_done}/{tiles_total if tiles_total is not None else '?'} tiles"
            self._postfix()

    def file_finished(self, result: FileResult) -> None:
        with self._lock:
            self._tiles.pop(result.input, None)
            if result.input in self._in_flight:
                self._in_flight.remove(result.input)
            self._finished += 1
            if result.status is Status.FAILED:
                self._failed += 1
                logger.warning("failed %s: %s", result.input, result.error)
            failed = f", {self._failed} failed" if self._failed else ""
            self._bar.set_description_str(f"{self._finished}/{self._n_files} files{failed}", refresh=False)
            self._bar.n += result.bytes_in  # update() would refresh before the postfix changes
            self._postfix()

    def close(self) -> None:
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def make_progress(mode: str = "auto", stream: TextIO | None = None) -> Progress:
    """``bar`` (tqdm), ``log`` (lines), or ``auto``: a bar when ``stream`` (stderr) is a terminal."""
    stream = stream or sys.stderr
    if mode == "bar" or (mode == "auto" and stream.isatty()):
        return BarProgress(stream)
    if mode not in ("auto", "log"):
        raise ValueError(f"progress={mode!r} is not one of 'auto', 'bar', 'log'")
    return LogProgress()
