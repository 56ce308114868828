"""Issue 15's acceptance figures, from the rows of one run (ratios of that run; no timed pass/fail)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.rows import Row


def _find(rows: Sequence[Row], case: str, prefix: str) -> Row | None:
    return next(
        (r for r in rows if r.case == case and r.contender.startswith(prefix) and r.status == "ok"), None
    )


def _target(name: str, value: Any, threshold: Any, met: bool) -> dict[str, Any]:
    return {"target": name, "value": value, "threshold": threshold, "met": bool(met)}


def issue15_targets(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The U-Net case against MONAI, ``log-3d``'s default plan against the whole volume, ``halo="auto"``
    on the deep network against MONAI, and the dry run's memory against the measured peaks."""
    out: list[dict[str, Any]] = []
    tw = _find(rows, "3d-batch", "tilewise halo")
    for mode in ("constant", "gaussian"):
        mo = _find(rows, "3d-batch", f"MONAI {mode}")
        if tw is not None and mo is not None:
            r = tw.get("time_s") / mo.get("time_s")
            out.append(_target(f"3D U-Net, tile limit 96: time / MONAI {mode} (overlap 0.25) <= 0.85",
                               round(r, 3), 0.85, r <= 0.85))  # fmt: skip
    if tw is not None and tw.get("max_abs") is not None:
        out.append(
            _target(
                "3D U-Net: seam error <= 1e-5", f"{tw.get('max_abs'):.3g}", 1e-5, tw.get("max_abs") <= 1e-5
            )
        )
    default, whole = (
        _find(rows, "shallow", "tilewise Model.run, default plan"),
        _find(rows, "shallow", "whole"),
    )
    if default is not None and whole is not None:
        r = default.get("time_s") / whole.get("time_s")
        out.append(_target("log-3d default plan: time / whole volume <= 1.5", round(r, 3), 1.5, r <= 1.5))
    monai = [r for r in rows if r.case == "auto" and r.contender.startswith("MONAI") and r.status == "ok"]
    for auto in (
        r for r in rows if r.case == "auto" and r.contender.startswith("tilewise") and r.status == "ok"
    ):
        plan = auto.get("plan") or {}
        larger = any(t > int(auto.params.get("tile", 0)) for t in plan.get("tile", []))
        for mo in monai:
            what = f"{auto.contender} vs {mo.contender}"
            tiles, theirs = auto.get("forward_passes"), mo.get("forward_passes")
            value = f"{tiles} vs {theirs}" + (f", tile {plan.get('tile')}" if larger else "")
            out.append(
                _target(f"{what}: no more tiles (or a larger tile)", value, "<=", tiles <= theirs or larger)
            )
            seam, their_seam = auto.get("max_abs"), mo.get("max_abs")
            out.append(
                _target(
                    f"{what}: smaller seam error", f"{seam:.3g} vs {their_seam:.3g}", "<", seam < their_seam
                )
            )
            r = auto.get("time_s") / mo.get("time_s")
            out.append(_target(f"{what}: time <= MONAI's", round(r, 3), 1.0, r <= 1.0))
    for row in (r for r in rows if r.case == "memplan" and r.status == "ok"):
        ratio = row.get("ratio")
        name = f"dry run {row.contender}"
        out.append(_target(f"{name}: peak_bytes / measured within 25 %", round(ratio, 3), "0.75..1.25",
                           0.75 <= ratio <= 1.25))  # fmt: skip
        budget = row.get("budget")
        if budget:
            predicted, measured = row.get("predicted_mb") * 2**20, row.get("peak_mb") * 2**20
            value = f"{predicted / 2**20:.0f} / {measured / 2**20:.0f} MiB of {budget / 2**20:.0f} MiB"
            fits = predicted <= budget and measured <= budget
            out.append(_target(f"{name}: the plan fits the budget (predicted / measured)", value, "<=", fits))
    return out
