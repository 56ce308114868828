"""A failing checkpoint start releases what prepare opened (review item 10): the slide or the
inflated NIfTI, the output target and the temporary folder. Checked on the process itself: no
file descriptor or memory mapping of this process still names a file of the test's folders, and
no ``.tilewise-*`` temporary is left.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
from _slides import write_svs

from models import ModelRepository
from models.planning.params import parse_params
from service.pipeline import Limits, prepare_file


class _StartFails:
    """A job checkpoint whose start fails (a full disk, a corrupt partial file)."""

    def start(self, plan: Any, shape: tuple[int, ...], dtype: Any, order: str = "C") -> Any:
        raise OSError("the checkpoint cannot be opened")


def _held(folder: Path) -> list[str]:
    """Files under ``folder`` this process still holds open or mapped."""
    root = str(folder.resolve())
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(root):
            held.append(target)
    with open("/proc/self/maps", encoding="utf-8") as fh:
        held += [line.split()[-1] for line in fh if root in line]
    return held


@pytest.mark.parametrize("kind", ["nifti-gz", "slide"])
def test_a_failing_checkpoint_start_closes_the_source_and_removes_the_temporaries(
    tmp_path: Path, kind: str
) -> None:
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    outputs.mkdir()
    repo = ModelRepository(None, device="cpu")
    if kind == "slide":
        source = write_svs(inputs / "slide.svs", (768, 1024), n_levels=2, mpp=0.25)
        model, params = repo.get("gaussian-2d"), parse_params({"tile": "256"})
    else:
        source = inputs / "ct.nii.gz"
        data = np.random.default_rng(2).integers(-1000, 1000, (37, 41, 29)).astype(np.int16)
        nib.save(nib.Nifti1Image(data, np.diag([0.7, 0.9, 2.5, 1.0])), source)
        model, params = repo.get("gaussian-3d"), parse_params({"tile": "32"})
    ok = prepare_file(model, source, outputs / "ok", params, limits=Limits())
    assert ok is not None  # the input streams: prepare opens a region source
    ok.close()
    assert _held(tmp_path) == [] and list(outputs.iterdir()) == []
    with pytest.raises(OSError, match="checkpoint cannot be opened"):
        prepare_file(model, source, outputs / "failed", params, limits=Limits(), checkpoint=_StartFails())
    assert _held(tmp_path) == []
    assert sorted(p.name for p in outputs.iterdir()) == []
