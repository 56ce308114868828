"""Targets, the Markdown tables and the speed-against-seam plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.acceptance import issue15_targets
from benchmarks.rows import Row


def find_row(rows: Sequence[Row], case: str, prefix: str) -> Row | None:
    return next(
        (r for r in rows if r.case == case and r.contender.startswith(prefix) and r.status == "ok"), None
    )


def evaluate_targets(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value, the threshold and whether it is met."""
    out: list[dict[str, Any]] = []
    tw = find_row(rows, "3d-batch", "tilewise halo")
    for mode in ("constant", "gaussian"):
        mo = find_row(rows, "3d-batch", f"MONAI {mode}")
        if tw is None or mo is None:
            continue
        t = tw.get("time_s") / mo.get("time_s")
        p = tw.get("peak_mb") / max(mo.get("peak_mb"), 1e-9)
        out.append(
            {
                "target": f"same tile and stride vs MONAI {mode}: time <= 0.9x",
                "value": round(t, 3),
                "threshold": 0.9,
                "met": t <= 0.9,
            }
        )
        out.append(
            {
                "target": f"same tile and stride vs MONAI {mode}: peak memory <= 0.5x",
                "value": round(p, 3),
                "threshold": 0.5,
                "met": p <= 0.5,
            }
        )
        out.append(
            {
                "target": f"same tile and stride vs MONAI {mode}: smaller seam error (max abs)",
                "value": f"{tw.get('max_abs'):.3g} vs {mo.get('max_abs'):.3g}",
                "threshold": "<",
                "met": tw.get("max_abs") < mo.get("max_abs"),
            }
        )
    points = seam_points(rows)
    monai_pts = [p for p in points if p[0] == "MONAI"]
    tw_pts = [p for p in points if p[0] == "tilewise"]
    if monai_pts and tw_pts:
        undominated = [p[1] for p in monai_pts if not any(q[2] <= p[2] and q[3] <= p[3] for q in tw_pts)]
        out.append(
            {
                "target": "every MONAI point dominated by a tilewise point (no slower, no larger seam)",
                "value": f"{len(monai_pts) - len(undominated)}/{len(monai_pts)} dominated"
                + (f"; not: {', '.join(undominated)}" if undominated else ""),
                "threshold": "all",
                "met": not undominated,
            }
        )
    sh = find_row(rows, "shallow", "tilewise")
    wh = find_row(rows, "shallow", "whole")
    if sh is not None and wh is not None:
        out.append(
            {
                "target": 'shallow net (log-3d), halo="auto": seam error <= 1e-5',
                "value": f"{sh.get('max_abs'):.3g}",
                "threshold": 1e-5,
                "met": sh.get("max_abs") <= 1e-5,
            }
        )
        r = sh.get("time_s") / wh.get("time_s")
        out.append(
            {
                "target": 'shallow net (log-3d), halo="auto": time <= 1.3x whole volume',
                "value": round(r, 3),
                "threshold": 1.3,
                "met": r <= 1.3,
            }
        )
    disk = {
        r.params.get("size"): r
        for r in rows
        if r.case == "scaling" and "on-disk" in r.contender and r.status == "ok"
    }
    monai = {
        r.params.get("size"): r
        for r in rows
        if r.case == "scaling" and "MONAI" in r.contender and r.status == "ok"
    }
    sizes = sorted(disk)
    if len(sizes) >= 2:
        lo = 128 if 128 in disk else sizes[0]
        hi = sizes[-1]
        g = disk[hi].get("peak_mb") / max(disk[lo].get("peak_mb"), 1e-9)
        detail = f"{disk[lo].get('peak_mb'):.0f} MB at {lo}^3 -> {disk[hi].get('peak_mb'):.0f} MB at {hi}^3"
        if lo in monai and hi in monai:
            gm = monai[hi].get("peak_mb") / max(monai[lo].get("peak_mb"), 1e-9)
            detail += (
                f"; MONAI {monai[lo].get('peak_mb'):.0f} -> {monai[hi].get('peak_mb'):.0f} MB ({gm:.1f}x)"
            )
        out.append(
            {
                "target": f"on-disk out: peak memory grows < 1.3x from {lo}^3 to {hi}^3",
                "value": f"{g:.2f}x ({detail})",
                "threshold": 1.3,
                "met": g < 1.3,
            }
        )
    inproc = find_row(rows, "service", "in process")
    http = find_row(rows, "service", "HTTP")
    if inproc is not None and http is not None:
        r = http.get("time_s") / inproc.get("time_s")
        out.append(
            {
                "target": "service overhead <= 10% over in process",
                "value": f"{100 * (r - 1):.1f}%",
                "threshold": "10%",
                "met": r <= 1.1,
            }
        )
    return out + issue15_targets(rows)


def ratios(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Ratios measured in this run (no thresholds): plan v2 against v1, tilewise against MONAI,
    prefetch on against off."""
    out: list[dict[str, Any]] = []

    def add(name: str, num: Row | None, den: Row | None, key: str = "time_s", detail: str = "") -> None:
        if num is None or den is None or num.get(key) is None or not den.get(key):
            return
        out.append({"ratio": name, "value": round(num.get(key) / den.get(key), 3), "detail": detail})

    ok = [r for r in rows if r.status == "ok"]
    for case in ("3d-batch", "shallow"):
        for sized in (r for r in ok if r.case == case and r.contender.startswith("tilewise")):
            if "fixed tile shape" in sized.contender or (
                case == "3d-batch" and sized.params.get("tolerance")
            ):
                continue
            same = ("tile", "halo")
            fixed = next(
                (r for r in ok if r.case == case and r.params.get("fixed_tile_shape")
                 and all(r.params.get(k) == sized.params.get(k) for k in same)),
                None,
            )  # fmt: skip
            if fixed is None:
                continue
            what = f"{case} {sized.contender}"
            detail = f"work {fmt(sized.get('work'), '.2f')} vs {fmt(fixed.get('work'), '.2f')}"
            add(f"{what}: work, sized tiles / fixed tile shape", sized, fixed, "work")
            add(f"{what}: time, sized tiles / fixed tile shape", sized, fixed, detail=detail)
    tw = find_row(rows, "3d-batch", "tilewise halo")
    for mode in ("constant", "gaussian"):
        mo = find_row(rows, "3d-batch", f"MONAI {mode}")
        if tw is not None and mo is not None:
            detail = f"work {fmt(tw.get('work'), '.2f')} vs {fmt(mo.get('work'), '.2f')}"
            add(f"3d-batch: time, tilewise / MONAI {mode}", tw, mo, detail=detail)
    add("shallow: time, tilewise (default plan) / whole volume", find_row(rows, "shallow", "tilewise"),
        find_row(rows, "shallow", "whole"))  # fmt: skip
    for source in ("npy memmap", "nii.gz", "nii.gz, simulated accelerator"):
        on = find_row(rows, "prefetch", f"{source}: tilewise prefetch on")
        off = find_row(rows, "prefetch", f"{source}: tilewise prefetch off")
        read = find_row(rows, "prefetch", f"{source}: read and pad only")
        net = find_row(rows, "prefetch", f"{source}: network only")
        detail = ""
        if read is not None and net is not None:
            r, n = read.get("time_s"), net.get("time_s")
            detail = f"read {r:.2f} s, network {n:.2f} s: ideal overlap {max(r, n) / (r + n):.3f}"
        add(f"prefetch, {source}: time, on / off", on, off, detail=detail)
    return out


def seam_points(rows: Sequence[Row]) -> list[tuple[str, str, float, float]]:
    """``(tool, label, time_s, max_abs)`` of the U-Net (batch norm) runs for the speed/seam plot."""
    pts = []
    for r in rows:
        if r.status != "ok" or r.case not in ("3d-batch", "sweep") or "max_abs" not in r.result:
            continue
        tool = (
            "MONAI"
            if r.contender.startswith("MONAI")
            else "tilewise"
            if r.contender.startswith("tilewise")
            else "TorchIO"
            if r.contender.startswith("TorchIO")
            else ""
        )
        if tool:
            pts.append((tool, r.contender, float(r.get("time_s")), float(r.get("max_abs"))))
    return pts


def plot_speed_vs_seam(rows: Sequence[Row], path: Path) -> Path | None:
    pts = seam_points(rows)
    if not pts:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    colours = {"tilewise": "tab:blue", "MONAI": "tab:red", "TorchIO": "tab:green"}
    markers = {"tilewise": "o", "MONAI": "s", "TorchIO": "^"}
    fig, ax = plt.subplots(figsize=(8, 5.5))
    floor = 1e-9
    for tool in colours:
        sel = [p for p in pts if p[0] == tool]
        if not sel:
            continue
        ax.scatter(
            [p[2] for p in sel],
            [max(p[3], floor) for p in sel],
            c=colours[tool],
            marker=markers[tool],
            label=tool,
            s=40,
        )
        for p in sel:
            label = p[1].replace("tilewise ", "").replace("MONAI ", "").replace("TorchIO ", "")
            ax.annotate(
                label, (p[2], max(p[3], floor)), fontsize=7, xytext=(4, 3), textcoords="offset points"
            )
    whole = find_row(rows, "3d-batch", "whole")
    if whole is not None:
        ax.axvline(whole.get("time_s"), color="grey", linestyle="--", linewidth=1)
        ax.annotate(
            "whole volume (no seams)",
            (whole.get("time_s"), 0.5),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            rotation=90,
            color="grey",
            xytext=(3, 0),
            textcoords="offset points",
        )
    ax.set_yscale("log")
    ax.set_xlabel("wall time (s, median)")
    ax.set_ylabel("seam error: max abs difference to the whole volume")
    ax.set_title("3D U-Net (BasicUNet, batch norm): speed against seam error")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"## tilewise benchmarks ({report['mode']} mode)", ""]
    mach = report["machine"]
    lines.append(
        f"Machine: {mach['cpu']} x {mach['nproc']} cores, {mach['ram_gb']:.0f} GB RAM, {mach['os']}; "
        f"load average at the end {mach['loadavg']}. Threads: {report['config']['threads']}; "
        f"median of {report['config']['repeats']} runs (sweep: {report['config']['sweep_repeats']})."
    )
    lines.append("Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".")
    lines.append("")
    lines.append(
        "Columns: passes = tiles through the network (last run); work = voxels fed to the network / image "
        "voxels; time = median wall time (min s: the fastest run); x whole = time / the whole-image pass "
        "of the same case; peak MB = peak RssAnon above the level before the call (median over runs); "
        "max/mean abs diff = to the whole-image output (the seam error)."
    )
    lines.append("")
    cases: dict[str, list[dict[str, Any]]] = {}
    for r in report["results"]:
        cases.setdefault(r["case"], []).append(r)
    header = (
        "| contender | passes | work | time s | min s | x whole | us/voxel | peak MB | max abs diff | "
        "mean abs diff | note |"
    )
    for case, rs in cases.items():
        lines += [f"### {case}", "", header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rs:
            note = r.get("note", "")
            if r["status"] != "ok":
                note = f"{r['status']}: {note}"
            extra = []
            if "tile_disagreement_max" in r:
                extra.append(
                    f"tile disagreement max {r['tile_disagreement_max']:.3g} / mean "
                    f"{r['tile_disagreement_mean']:.3g}"
                )
            if "plan" in r:
                extra.append(
                    f"tile {r['plan']['tile']}, calibrated halo {r['plan']['halo']}; warm-up "
                    f"(receptive-field probe + halo calibration) {r['warmup_s']:.1f} s"
                )
            if "calibration_s" in r:
                extra.append(f"calibration {r['calibration_s']:.1f} s (once per model and tile)")
            if "times_s" in r and len(r["times_s"]) > 1:
                order = " (interleaved with the other contenders)" if r.get("interleaved") else ""
                extra.append("runs " + "/".join(f"{t:.2f}" for t in r["times_s"]) + order)
            note = "; ".join(filter(None, [note.replace("|", "/"), *extra]))
            lines.append(
                f"| {r['contender']} | {r.get('forward_passes') or '-'} | {fmt(r.get('work'), '.2f')} | "
                f"{fmt(r.get('time_s'), '.2f')} | {fmt(r.get('min_s'), '.2f')} | "
                f"{fmt(r.get('ratio_whole'), '.2f')} | {fmt(r.get('us_per_voxel'), '.2f')} | "
                f"{fmt(r.get('peak_mb'), '.0f')} | {fmt(r.get('max_abs'), '.3g')} | "
                f"{fmt(r.get('mean_abs'), '.3g')} | {note} |"
            )
        lines.append("")
    if report["targets"]:
        lines += ["### Targets", "", "| target | measured | threshold | met |", "|---|---|---|---|"]
        for t in report["targets"]:
            lines.append(
                f"| {t['target']} | {t['value']} | {t['threshold']} | {'yes' if t['met'] else 'NO'} |"
            )
        lines.append("")
    if report.get("ratios"):
        lines += ["### Ratios (measured in this run)", "", "| ratio | value | detail |", "|---|---:|---|"]
        lines += [f"| {r['ratio']} | {r['value']} | {r['detail']} |" for r in report["ratios"]]
        lines.append("")
    if report["notes"]:
        lines += ["### Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    lines.append(f"Total benchmark time: {report['total_s']:.0f} s.")
    return "\n".join(lines) + "\n"
