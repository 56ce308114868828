"""The service's overhead: HTTP against in process, with a TorchScript U-Net."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.config import ROOT, UNET_ALIGNMENT, Mode
from benchmarks.data import mni_volume
from benchmarks.env import service_missing
from benchmarks.harness import Bench, Row
from benchmarks.nets import build_unet


def case_service(bench: Bench) -> None:
    m = bench.mode
    why = service_missing()
    if why:
        bench.notes.append(f"service case skipped: {why}")
        bench.add("service", "all", {}, skip=why)
        return
    service_case(bench, m)


def service_case(bench: Bench, m: Mode) -> None:
    import nibabel as nib
    import numpy as np

    models_dir = bench.work / "service-models"
    models_dir.mkdir(exist_ok=True)
    name = "bench-unet-3d"
    try:
        write_unet_spec(models_dir, name)
    except Exception as exc:  # noqa: BLE001 - any export problem skips the case with its reason
        bench.add("service", "all", {}, skip=f"cannot write the U-Net model spec: {exc}")
        return
    vol = np.load(mni_volume(bench.cache, spacing_mm=m.spacing_mm))[0]
    affine = np.diag([m.spacing_mm] * 3 + [1.0])
    nii = bench.work / "service_in.nii"
    nib.save(nib.Nifti1Image(vol, affine), nii)
    warm = bench.work / "service_warm.nii"
    nib.save(nib.Nifti1Image(np.ascontiguousarray(vol[: m.tile, : m.tile, : m.tile]), affine), warm)
    query = {"tile": str(m.tile), "halo": str(m.halo), "overlap": "0", "format": "nii"}
    params = {"model": name, "tile": m.tile, "halo": m.halo, "format": "nii"}
    row = bench.add(
        "service",
        "in process (service.pipeline.run_file)",
        {
            **params,
            "kind": "inprocess",
            "model_name": name,
            "models_dir": str(models_dir),
            "data": str(nii),
            "warm_data": str(warm),
            "query": query,
            "out_path": str(bench.work / "inproc_out"),
        },
    )
    if row.status != "ok":
        return
    from tiling import TileGrid

    # Both rows run the same plan (explicit halo: tiles sized to the grid); its work, from the plan.
    plan_work = TileGrid.plan(vol.shape, m.tile, m.halo, alignment=UNET_ALIGNMENT).work
    row.result["work"] = plan_work
    port = _free_port()
    log = open(bench.work / "serve.log", "w")  # noqa: SIM115 - closed in finally
    env = {**bench.env, "TILEWISE_MODELS_DIR": str(models_dir)}
    cmd = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--models",
        str(models_dir),
    ]
    server = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
    )
    srow = Row("service", "HTTP POST /v1/models/{name}/infer", params)
    bench.rows.append(srow)
    try:
        url = f"http://127.0.0.1:{port}"
        if not _wait_ready(url, server, timeout=120):
            srow.status, srow.note = "failed", "server not ready: " + _tail(bench.work / "serve.log")
            return
        body = nii.read_bytes()
        target = f"{url}/v1/models/{name}/infer?" + "&".join(f"{k}={v}" for k, v in query.items())
        for _ in range(2):  # warm-up, as in process
            _post(target, warm.read_bytes())
        times = []
        size = 0
        for _ in range(m.repeats):
            t0 = time.perf_counter()
            size = len(_post(target, body))
            times.append(time.perf_counter() - t0)
        srow.result = {
            "times_s": times,
            "time_s": statistics.median(times),
            "response_bytes": size,
            "request_bytes": len(body),
            "work": plan_work,
        }
        bench.log(f"service / HTTP: {srow.result['time_s']:.2f} s")
    except (OSError, urllib.error.URLError) as exc:
        srow.status, srow.note = "failed", f"{exc}: " + _tail(bench.work / "serve.log")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def write_unet_spec(models_dir: Path, name: str) -> None:
    """TorchScript of the batch-norm U-Net plus its spec YAML, for the service case."""
    import torch
    import yaml

    net = build_unet("batch")
    torch.jit.script(net).save(str(models_dir / f"{name}.pt"))
    spec = {
        "name": name,
        "backend": "torchscript",
        "file": f"{name}.pt",
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 2,
        "alignment": UNET_ALIGNMENT,
        "scale": 1,
        "output": {"activation": "none", "kind": "probabilities", "dtype": "float32"},
        "defaults": {"tile": 96, "halo": 12, "overlap": 0, "blend": "constant", "batch_size": 1},
    }
    (models_dir / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[Any], timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    return False


def _post(url: str, body: bytes) -> bytes:
    req = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/octet-stream"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return bytes(resp.read())


def _tail(path: Path, n: int = 5) -> str:
    try:
        return " | ".join(path.read_text().strip().splitlines()[-n:])
    except OSError:
        return ""
