"""Peak anonymous resident memory of a worker, sampled by a thread (``RssAnon``)."""

from __future__ import annotations

import threading


def rss_anon() -> int:
    """Anonymous resident memory of this process in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class AnonPeak:
    """Context manager: peak ``RssAnon`` above the level at entry, sampled by a thread."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.base = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> AnonPeak:
        self.base = rss_anon()
        self.peak = self.base
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = max(self.peak, rss_anon())
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def above_base(self) -> int:
        return max(0, self.peak - self.base)
