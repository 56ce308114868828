"""Helpers of the jobs tests: the MNI152 T1 at 2 mm, server-sent events, metrics, CPU time."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import nibabel as nib
import numpy as np

#: Response headers that differ between two runs of the same request.
VOLATILE_HEADERS = {"date", "etag", "last-modified", "x-request-id", "x-tilewise-seconds"}


def mni152_2mm(source: Path, dest: Path) -> Path:
    """nilearn's MNI152 T1 (1 mm, 197x233x189 uint8) at 2 mm: every other voxel (99x117x95), the
    affine's voxel axes doubled. Written as ``.nii.gz``."""
    image = nib.load(source)
    data = np.asarray(image.dataobj)[::2, ::2, ::2]
    affine = image.affine.copy()
    affine[:3, :3] *= 2
    nib.save(nib.Nifti1Image(data, affine, image.header), dest)
    return dest


def nifti(shape: tuple[int, ...], seed: int = 0) -> bytes:
    """A deterministic float32 NIfTI-1 volume, uncompressed."""
    data = np.random.default_rng(seed).random(shape, dtype=np.float32)
    return nib.Nifti1Image(data, np.diag([1.5, 1.5, 2.0, 1.0])).to_bytes()


def read_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """``(event, data)`` of a ``text/event-stream`` answer read to its end."""
    events = []
    name, data = "message", ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = line[len("data: ") :]
        elif line == "" and data:
            events.append((name, json.loads(data)))
            name, data = "message", ""
    return events


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the server's ``/metrics`` (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{re.escape('{' + want + '}') if want else ''} ([0-9.e+]+)$"
    match = re.search(pattern, text, re.M)
    return float(match[1]) if match else 0.0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
