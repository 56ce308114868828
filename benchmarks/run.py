#!/usr/bin/env python
"""Compatibility entry point: ``python benchmarks/run.py ...`` is ``python -m benchmarks ...``."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this folder would come first on sys.path and its modules (config, data, env, ...)
# could shadow top-level packages of the same name: put the repository root there instead.
sys.path[0] = str(ROOT)

from benchmarks.cli import main  # noqa: E402 - after the sys.path fix above

if __name__ == "__main__":
    sys.exit(main())
