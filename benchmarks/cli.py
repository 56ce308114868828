"""Command line: ``python -m benchmarks [--quick] [--cases ...]`` (and ``--worker JOB`` for workers)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.cases import CASES
from benchmarks.config import FULL, QUICK, ROOT, Mode
from benchmarks.harness import Bench
from benchmarks.worker import worker_main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small volumes and few contenders (under 2 minutes)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out"), help="folder for results.json/.md/.png")
    p.add_argument("--cache", default="~/.cache/tilewise/bench", help="folder for the prepared volumes")
    p.add_argument("--models", default="~/.cache/tilewise/models", help="model folder holding text-det-2d")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch.set_num_threads")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per contender (median reported)")
    p.add_argument(
        "--cases",
        default=None,
        help="comma-separated subset of: 3d,auto,shallow,memplan,prefetch,scaling,service,sweep,2d,instance",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="skip the contenders left when this much time has passed (cases run in priority order)",
    )
    p.add_argument("--profile", action="store_true", help="torch-profile the 3D contenders (one more run)")
    p.add_argument("--job-timeout", type=float, default=900.0, help="seconds per worker before it is killed")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="override a mode field, e.g. --set spacing_mm=2.0 --set 'scaling_sizes=[64,128]'",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    mode = QUICK if args.quick else FULL
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in Mode.__dataclass_fields__:
            print(
                f"--set: unknown field {key!r}; known: {', '.join(Mode.__dataclass_fields__)}",
                file=sys.stderr,
            )
            return 2
        parsed = json.loads(value) if value[:1] in "[{0123456789-tfn" else value
        overrides[key] = tuple(parsed) if isinstance(parsed, list) else parsed
    if args.repeats is not None:
        overrides["repeats"] = max(1, args.repeats)
    mode = Mode(**{**mode.__dict__, **overrides})
    cases = tuple(c.strip() for c in args.cases.split(",")) if args.cases else mode.cases
    bench = Bench(args, mode)
    bench.log(f"mode {mode.name}, cases {', '.join(cases)}, threads {args.threads}, work {bench.work}")
    for case in cases:
        method = CASES.get(case)
        if method is None:
            print(f"unknown case {case!r}", file=sys.stderr)
            return 2
        method(bench)
        bench.run_pending_rounds()
    bench.finish()
    return 0
