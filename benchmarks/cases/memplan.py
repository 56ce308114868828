"""The memory plan: the dry run's ``peak_bytes`` against the measured peak, and a budget that fits.

For each size (64^3, 192^3, 384^3 by default) one worker process (``benchmarks.memplan``) runs a
``gaussian-3d`` request with its default plan at batch 1 and batch 4, and, at 192^3, with a 300 MB
``TILEWISE_MEMORY_BUDGET``: predicted against measured peak, and the dry run's ``eta_s`` against the
run's time (the request's, decode and encode included; ``eta_s`` is the network's alone).
"""

from __future__ import annotations

from benchmarks.config import MB
from benchmarks.harness import Bench
from benchmarks.rows import Row

BUDGET = 300 * 10**6


def case_memplan(bench: Bench) -> None:
    m = bench.mode
    for size in m.memplan_sizes:
        cases = [({"batch_size": str(b), "format": "npy"}, None) for b in (1, 4)]
        if size == 192:
            cases.append(({"format": "npy"}, BUDGET))
        try:
            result = bench.worker(
                {
                    "kind": "memplan",
                    "model_name": "gaussian-3d",
                    "size": size,
                    "cases": cases,
                    "out_path": str(bench.work / "memplan"),
                }  # fmt: skip
            )
        except RuntimeError as exc:
            bench.add("memplan", f"{size}^3", {}, skip=f"worker failed: {exc}")
            continue
        for case in result["cases"]:
            bench.rows.append(_row(size, case))
            bench.log(f"memplan / {bench.rows[-1].contender}: {bench.rows[-1].note}")
    bench.notes.append(
        "memplan case: `gaussian-3d` on random float32 NIfTI volumes, its default plan (tile 128, halo "
        "8) at batch 1 and 4, and a 300 MB TILEWISE_MEMORY_BUDGET at 192^3; peak = the rise of the "
        "worker's VmHWM over the request (decode, run, encode), predicted = the dry run's peak_bytes."
    )


def _row(size: int, case: dict) -> Row:
    query, budget = case["query"], case["budget"]
    label = f"{size}^3, " + (f"budget {budget / 1e6:.0f} MB" if budget else f"batch {query['batch_size']}")
    predicted, measured = case["predicted"] / MB, case["measured"] / MB
    note = (
        f"peak predicted {predicted:.1f} MB, measured {measured:.1f} MB (ratio {predicted / measured:.2f}); "
        f"eta {case['eta_s']:.1f} s (network), request {case['seconds']:.1f} s; {case['plan']}, "
        f"batch {case['batch_size']}"
    )
    result = {"time_s": case["seconds"], "peak_mb": measured, "predicted_mb": predicted,
              "ratio": predicted / measured, "budget": budget, "eta_s": case["eta_s"]}  # fmt: skip
    return Row("memplan", label, {"size": size, **query}, result, "ok", note)
