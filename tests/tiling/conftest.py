"""Tiling-test helpers: one torch thread per test, and a recorder of the measured max abs differences.

The tiling tests run thousands of tiny forward passes; on a shared 2-core machine torch's intra-op
thread pool spends far more time synchronizing than computing on such small tensors (measured 40x
slower with 2 threads under load), so each test runs single-threaded and the setting is restored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

_MEASURED: dict[str, float] = {}
_FIGURES: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def record_diff() -> Callable[[str, object, object], float]:
    """``record_diff(family, got, want)``: max abs difference, kept per family for the summary."""

    def record(family: str, got: object, want: object) -> float:
        g = np.asarray(got, dtype=np.float64)
        w = np.asarray(want, dtype=np.float64)
        assert g.shape == w.shape, f"{family}: shape {g.shape} != expected {w.shape}"
        diff = float(np.max(np.abs(g - w))) if g.size else 0.0
        _MEASURED[family] = max(_MEASURED.get(family, 0.0), diff)
        return diff

    return record


@pytest.fixture
def record_figure() -> Callable[[str, str], None]:
    """``record_figure(name, text)``: a measured figure (e.g. peak memory) for the summary."""

    def record(name: str, text: str) -> None:
        _FIGURES[name] = text

    return record


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the largest difference measured in each family of exactness tests, and the figures."""
    if _MEASURED:
        terminalreporter.section("tiling: max abs difference per family")
        for family, diff in sorted(_MEASURED.items()):
            terminalreporter.write_line(f"{family:<40s} {diff:.3e}")
    if _FIGURES:
        terminalreporter.section("tiling: measured figures")
        for name, text in sorted(_FIGURES.items()):
            terminalreporter.write_line(f"{name}: {text}")
