"""Peak resident memory of ``tilewise infer`` on large inputs, and the output against scipy (issue 20).

Usage::

    python -m benchmarks.stream_rss make DIR [--quick]      # the inputs (CT volumes, big TIFFs, a PNG)
    python -m benchmarks.stream_rss measure MODEL INPUT OUTPUT [--max-image-pixels N] [--windows N]
    python -m benchmarks.stream_rss table DIR [--quick]      # every case: one JSON line each
    python -m benchmarks.stream_rss http MODEL INPUT [--job]  # the same through a server

``measure`` runs in a fresh process what ``tilewise infer`` runs (admission, then
:func:`service.pipeline.run_file`), after warming the process up (model loaded, footprint
measured, one small run), and reports the rise of the kernel's peak resident memory (``VmHWM``,
reset after the warm-up) above the resident memory before the run, and the largest absolute
difference from ``scipy.ndimage.gaussian_filter`` (the gaussian models' oracle: sigma 2,
truncate 4, mode constant) on random windows of the output (each window's oracle is computed on
the window plus the radius, clipped to the image, so it is exact).

Inputs (``make``): ``ct400.nii``/``.nii.gz`` (512x512x400 int16, a smooth phantom plus noise),
``ct800.nii`` (512x512x800), ``slide40k.tif`` (40,000 x 40,000 grey uint8 tiled BigTIFF, written
tile by tile), ``page12k.tif`` (12,000 x 12,000 grey uint8, striped), ``page12k.png``.
``--quick`` makes them 4x smaller per axis (for the tests).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RADIUS = 8  # sigma 2 * truncate 4
SIGMA = 2.0


def _phantom_slab(shape_xy: tuple[int, int], z0: int, z1: int, seed: int) -> np.ndarray:
    """``(X, Y, z1 - z0)`` int16: a body-like ellipse with organs, plus noise (HU-like)."""
    x, y = shape_xy
    gx, gy = np.meshgrid(np.linspace(-1, 1, x, dtype=np.float32), np.linspace(-1, 1, y, dtype=np.float32),
                         indexing="ij")  # fmt: skip
    rng = np.random.default_rng(seed + z0)
    out = np.empty((x, y, z1 - z0), np.int16)
    for k in range(z1 - z0):
        z = (z0 + k) / 100.0
        body = (gx / 0.8) ** 2 + (gy / 0.6) ** 2 < 1
        organ = ((gx - 0.2 * np.sin(z)) / 0.25) ** 2 + (gy / 0.2) ** 2 < 1
        plane = np.where(body, 40.0, -1000.0) + np.where(organ, 60.0, 0.0)
        plane += rng.normal(0, 20, (x, y)).astype(np.float32)
        out[:, :, k] = plane.astype(np.int16)
    return out


def _ct(path: Path, shape: tuple[int, int, int]) -> None:
    import nibabel as nib

    x, y, z = shape
    header = nib.Nifti1Header()
    header.set_data_shape(shape)
    header.set_data_dtype(np.int16)
    header.set_zooms((0.8, 0.8, 1.25))
    header.set_qform(np.diag([0.8, 0.8, 1.25, 1.0]), 1)
    header.set_sform(np.diag([0.8, 0.8, 1.25, 1.0]), 1)
    data = np.memmap(path.with_suffix(".raw"), np.int16, "w+", shape=shape, order="F")
    for z0 in range(0, z, 32):
        data[:, :, z0 : min(z, z0 + 32)] = _phantom_slab((x, y), z0, min(z, z0 + 32), 0)
    data.flush()
    nib.save(nib.Nifti1Image(data, None, header), path)
    del data
    path.with_suffix(".raw").unlink()


def _page(x: int, y0: int, y1: int) -> np.ndarray:
    """Rows ``y0:y1`` of a ``(rows, x)`` uint8 grey document-like image (text-like stripes, noise)."""
    rows = np.arange(y0, y1)[:, None]
    cols = np.arange(x)[None, :]
    ink = ((rows // 7) % 5 == 0) & ((cols // 11) % 3 != 0)
    rng = np.random.default_rng(y0)
    base = 230 - 180 * ink + rng.integers(0, 12, (y1 - y0, x))
    return base.astype(np.uint8)


def _tiled_tiff(path: Path, size: int, tile: int = 512) -> None:
    import tifffile

    def tiles() -> Any:
        for ty in range(0, size, tile):
            band = _page(size, ty, min(size, ty + tile))
            band = np.pad(band, ((0, tile - band.shape[0]), (0, 0)))
            for tx in range(0, size, tile):
                block = band[:, tx : tx + tile]
                yield np.pad(block, ((0, 0), (0, tile - block.shape[1])))

    tifffile.imwrite(path, tiles(), shape=(size, size), dtype=np.uint8, tile=(tile, tile), bigtiff=True,
                     compression="zlib", photometric="minisblack")  # fmt: skip


def _striped_tiff(path: Path, size: int) -> None:
    import tifffile

    data = _page(size, 0, size)
    tifffile.imwrite(path, data, rowsperstrip=64, compression="zlib", photometric="minisblack")


def make(folder: Path, quick: bool) -> None:
    """Write the inputs of the table into ``folder``."""
    import gzip
    import shutil

    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    n = 4 if quick else 1
    _ct(folder / "ct400.nii", (512 // n, 512 // n, 400 // n))
    with open(folder / "ct400.nii", "rb") as src, gzip.open(folder / "ct400.nii.gz", "wb", 1) as dst:
        shutil.copyfileobj(src, dst, 16 << 20)
    _ct(folder / "ct800.nii", (512 // n, 512 // n, 800 // n))
    _tiled_tiff(folder / "slide40k.tif", 40_000 // n // (4 if quick else 1))
    _striped_tiff(folder / "page12k.tif", 12_000 // n)
    Image.fromarray(_page(12_000 // n, 0, 12_000 // n)).save(folder / "page12k.png")


def _window_diff(output: Path, source: Path, windows: int, seed: int = 0) -> float:
    """Largest |output - scipy oracle| over ``windows`` random windows (32 per axis at most)."""
    import scipy.ndimage as ndi

    from service.codecs import decode, probe
    from service.regions import open_regions

    header = probe(source)
    tmp = output.parent / ".oracle"
    tmp.mkdir(exist_ok=True)
    regions: Any = (
        decode(source).data if header.kind in ("png", "jpeg") else open_regions(source, header, tmp)
    )
    out = _open_output(output)
    spatial = tuple(int(n) for n in header.spatial_shape)
    rng = np.random.default_rng(seed)
    worst = 0.0
    for _ in range(windows):
        size = [min(32, n) for n in spatial]
        lo = [int(rng.integers(0, n - s + 1)) for n, s in zip(spatial, size, strict=True)]
        a = [max(0, lo_ - RADIUS) for lo_ in lo]
        b = [min(n, lo_ + s + RADIUS) for lo_, s, n in zip(lo, size, spatial, strict=True)]
        block = regions[(slice(None), *(slice(i, j) for i, j in zip(a, b, strict=True)))][0].astype(
            np.float64
        )
        ref = ndi.gaussian_filter(block, SIGMA, truncate=4.0, mode="constant")
        crop = tuple(slice(lo_ - i, lo_ - i + s) for lo_, i, s in zip(lo, a, size, strict=True))
        got = np.asarray(out[tuple(slice(lo_, lo_ + s) for lo_, s in zip(lo, size, strict=True))], np.float64)
        worst = max(worst, float(np.abs(got - ref[crop]).max()))
    return worst


def _open_output(path: Path) -> Any:
    name = path.name
    if name.endswith((".nii", ".nii.gz")):
        import nibabel as nib

        return nib.load(str(path)).dataobj
    if name.endswith(".npy"):
        return np.load(path, mmap_mode="r")
    import tifffile
    import zarr

    return zarr.open(tifffile.imread(path, aszarr=True), mode="r")


def measure(
    model_name: str, source: Path, output: Path, max_image_pixels: int | None, windows: int
) -> dict[str, Any]:
    """The figures of one case, measured in this process (see the module docstring)."""
    from models import ModelRepository
    from models.measure.rss import (
        fix_mmap_threshold,
        peak_rss_bytes,
        release_free_memory,
        reset_peak_rss,
        rss_bytes,
    )
    from models.planning.params import parse_params

    try:
        from service.admission import admit
    except ImportError:  # a tilewise from before admission (the "before" figures)
        admit = None
    from service.codecs import configure_pillow
    from service.pipeline import Limits, run_file
    from service.settings import Settings

    settings = Settings(_env_file=None)
    pixels = max_image_pixels or settings.max_image_pixels
    configure_pillow(pixels)
    fix_mmap_threshold()
    repository = ModelRepository(None, device="cpu")
    model = repository.get(model_name)
    model.footprint()
    fmt = {".nii": "nii", ".gz": "nii.gz", ".tif": "tiff", ".npy": "npy"}[output.suffix]
    params = parse_params({"format": fmt})
    limits = Limits(max_image_pixels=pixels, memory_budget=settings.memory_budget)
    warm = output.parent / f".warm-{output.name}"
    small = np.zeros((1, 40, 40, 40) if model.spec.spatial_dims == 3 else (1, 64, 64), np.float32)
    model.run(small, parse_params({}))
    release_free_memory()
    base = rss_bytes()
    reset_peak_rss()
    started = time.perf_counter()
    answer: dict[str, Any] = {"model": model_name, "input": source.name, "output": output.name}
    try:
        if admit is not None:
            admit(repository, model_name, source, params, limits)
        suffix = ".nii.gz" if output.name.endswith(".nii.gz") else output.suffix
        stem = output.with_name(output.name[: -len(suffix)])
        result = run_file(model, source, stem, params, limits=limits)
    except Exception as exc:  # noqa: BLE001 - reported as the case's figure
        from service.http_errors import classify

        info = classify(exc)
        if info.status >= 500:
            raise
        answer.update(refused=info.status, error=info.code, detail=info.detail)
        return answer
    finally:
        answer["peak_mib"] = round(((peak_rss_bytes() or 0) - (base or 0)) / 2**20, 1)
        answer["seconds"] = round(time.perf_counter() - started, 1)
        warm.unlink(missing_ok=True)
    answer.update(plan=result.plan.header(), size_mib=round(result.size_bytes / 2**20, 1),
                  input_mib=round(source.stat().st_size / 2**20, 1))  # fmt: skip
    if output.suffix == ".tif":
        import tifffile

        with tifffile.TiffFile(result.path) as tif:
            answer.update(tiled=tif.pages.first.is_tiled, bigtiff=tif.is_bigtiff,
                          compression=str(tif.pages.first.compression.name))  # fmt: skip
    if windows:
        answer["max_abs_diff"] = _window_diff(result.path, source, windows)
    return answer


def http(model_name: str, source: Path, job: bool, folder: Path) -> dict[str, Any]:
    """The rise of a ``tilewise serve`` process's peak resident memory (``VmHWM``, reset after a
    warm-up request) while it answers ``source`` through ``POST /v1/models/MODEL/infer`` or a job
    (the upload streamed from this process, the answer streamed to a file)."""
    import os
    import socket

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "TILEWISE_TMP_DIR": str(folder), "TILEWISE_JOBS_DIR": str(folder / "jobs")}
    server = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--device", "cpu"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    status = Path(f"/proc/{server.pid}/status")

    def kib(field: str) -> int:
        line = next(ln for ln in status.read_text().splitlines() if ln.startswith(field))
        return int(line.split()[1])

    try:
        with httpx.Client(base_url=base_url, timeout=3600) as client:
            for _ in range(600):
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            small = np.zeros((40, 40, 40) if model_name.endswith("3d") else (64, 64), np.float32)
            import nibabel as nib

            warm = nib.Nifti1Image(small if small.ndim == 3 else small[..., None], np.eye(4)).to_bytes()
            client.post(f"/v1/models/{model_name}/infer", content=warm)
            Path(f"/proc/{server.pid}/clear_refs").write_text("5")
            base = kib("VmRSS:")
            started = time.perf_counter()
            with open(source, "rb") as body:
                if job:
                    answer = client.post(f"/v1/jobs?model={model_name}", content=body)
                    job_id = answer.json()["id"]
                    while client.get(f"/v1/jobs/{job_id}").json()["state"] in ("queued", "running"):
                        time.sleep(1)
                    url = f"/v1/jobs/{job_id}/result"
                else:
                    answer = None
                    url = None
                size = 0
                if url is None:
                    with client.stream("POST", f"/v1/models/{model_name}/infer", content=body) as resp:
                        code, plan = resp.status_code, resp.headers.get("X-Tilewise-Plan", "")
                        for chunk in resp.iter_bytes(1 << 20):
                            size += len(chunk)
                else:
                    with client.stream("GET", url) as resp:
                        code, plan = resp.status_code, resp.headers.get("X-Tilewise-Plan", "")
                        for chunk in resp.iter_bytes(1 << 20):
                            size += len(chunk)
            peak = kib("VmHWM:")
        return {"model": model_name, "input": source.name, "route": "job" if job else "sync", "status": code,
                "peak_mib": round((peak - base) / 1024, 1), "size_mib": round(size / 2**20, 1), "plan": plan,
                "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    finally:
        server.terminate()
        server.wait(60)


CASES = [
    ("gaussian-3d", "ct400.nii", "out-ct400.nii.gz"),
    ("gaussian-3d", "ct400.nii.gz", "out-ct400gz.nii.gz"),
    ("gaussian-3d", "ct800.nii", "out-ct800.nii.gz"),
    ("gaussian-2d", "slide40k.tif", "out-slide40k.tif"),
    ("gaussian-2d", "page12k.tif", "out-page12k.tif"),
    ("gaussian-2d", "page12k.png", "out-page12k.tif"),
]


def table(folder: Path, windows: int) -> list[dict[str, Any]]:
    """Every case, each in a fresh process; one JSON line each on stdout."""
    rows = []
    for model, source, output in CASES:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.stream_rss", "measure", model, str(folder / source),
             str(folder / output), "--windows", str(windows)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
        row = json.loads(line) if proc.returncode == 0 else {"input": source, "failed": proc.stderr[-2000:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (folder / output).unlink(missing_ok=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stream_rss", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("folder", type=Path)
    mk.add_argument("--quick", action="store_true")
    me = sub.add_parser("measure")
    me.add_argument("model")
    me.add_argument("input", type=Path)
    me.add_argument("output", type=Path)
    me.add_argument("--max-image-pixels", type=int, default=None)
    me.add_argument("--windows", type=int, default=20)
    ht = sub.add_parser("http")
    ht.add_argument("model")
    ht.add_argument("input", type=Path)
    ht.add_argument("--job", action="store_true")
    ta = sub.add_parser("table")
    ta.add_argument("folder", type=Path)
    ta.add_argument("--windows", type=int, default=20)
    args = parser.parse_args(argv)
    if args.command == "make":
        make(args.folder, args.quick)
    elif args.command == "measure":
        print(json.dumps(measure(args.model, args.input, args.output, args.max_image_pixels, args.windows)))
    elif args.command == "http":
        print(json.dumps(http(args.model, args.input, args.job, args.input.parent)))
    else:
        table(args.folder, args.windows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
