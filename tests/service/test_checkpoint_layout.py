"""A job's checkpoint is kept in the memory order of its output, so that the finish stage copies it
slab by slab and its resident memory does not grow with the volume (issue 20: the job route's
peak was 1.31x for 800 vs 400 CT slices, the CLI's 1.08x).

Before, the checkpoint was C-ordered and a NIfTI output Fortran-ordered: every block of the copy
touched 64 whole rows of the checkpoint along the first axis, ``64 * Y * Z * 4`` bytes, which
grows with the number of slices ``Z``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from models import ModelRepository
from models.planning.params import parse_params
from service.jobs.checkpoint import SlabCheckpoint
from service.paged import open_paged
from service.pipeline import Limits, prepare_file
from service.stages import COPY_BYTES, _copy_slabs, execute, finish

ROOT = Path(__file__).resolve().parents[2]


def _checkpoint(path: Path, saved: dict | None = None) -> SlabCheckpoint:
    return SlabCheckpoint(path, saved, lambda record: None, lambda plan, point: None)


@pytest.mark.parametrize("fmt, order", [("nii.gz", "F"), ("nii", "F"), ("npy", "C")])
def test_the_checkpoint_takes_the_outputs_order_and_the_result_equals_a_run_without_it(
    tmp_path: Path, fmt: str, order: str
) -> None:
    source = tmp_path / "ct.nii.gz"
    data = np.random.default_rng(3).integers(-1000, 1000, (37, 23, 61)).astype(np.int16)  # odd sizes
    nib.save(nib.Nifti1Image(data, np.diag([0.7, 0.9, 2.5, 1.0])), source)
    model = ModelRepository(None, device="cpu").get("gaussian-3d")
    params = parse_params({"tile": "24", "format": fmt})
    plain = prepare_file(model, source, tmp_path / "plain", params, limits=Limits())
    execute(plain)
    reference = finish(plain)
    job = prepare_file(model, source, tmp_path / "job", params, limits=Limits(),
                       checkpoint=_checkpoint(tmp_path / "partial.npy"))  # fmt: skip
    assert job.kept is not None
    assert job.kept.flags.f_contiguous == (order == "F") and job.kept.flags.c_contiguous == (order == "C")
    execute(job)
    result = finish(job)
    if fmt == "npy":
        np.testing.assert_array_equal(np.load(result.path), np.load(reference.path))
    else:
        np.testing.assert_array_equal(nib.load(result.path).get_fdata(), nib.load(reference.path).get_fdata())


def test_a_saved_checkpoint_of_another_order_is_started_over(tmp_path: Path) -> None:
    path = tmp_path / "partial.npy"
    records: list[dict] = []
    first = SlabCheckpoint(path, None, records.append, lambda plan, point: None)
    from tiling import TileGrid

    class _Plan:
        grid = TileGrid.plan((20, 20, 20), (10, 10, 10))
        batch_size = 1
        flips = ((),)

        def header(self) -> str:
            return "tile=10,10,10"

    shape, dtype = (1, 20, 20, 20), np.dtype(np.float32)
    out, _ = first.start(_Plan(), shape, dtype, order="C")
    out[:] = 7
    out.flush()
    saved = {**records[-1], "rows_done": 1}
    again, resume = SlabCheckpoint(path, saved, records.append, lambda plan, point: None).start(
        _Plan(), shape, dtype, order="F"
    )
    assert again.flags.f_contiguous and not again.flags.c_contiguous
    assert resume.rows_done == 0 and records[-1]["key"]["order"] == "F"
    saved = {**records[-1], "rows_done": 1}
    same, resume = SlabCheckpoint(path, saved, records.append, lambda plan, point: None).start(
        _Plan(), shape, dtype, order="F"
    )
    assert resume.rows_done == 1 and same.flags.f_contiguous


def _plan_of(shape: tuple[int, ...], tile: tuple[int, ...]):
    from tiling import TileGrid

    class _Plan:
        grid = TileGrid.plan(shape, tile)
        batch_size = 1
        flips = ((),)

        def header(self) -> str:
            return "tile=" + ",".join(map(str, tile))

    return _Plan()


def test_a_record_saved_before_the_order_was_kept_resumes_in_c_order(tmp_path: Path) -> None:
    path, records = tmp_path / "partial.npy", []
    plan, shape, dtype = _plan_of((20, 20, 20), (10, 10, 10)), (1, 20, 20, 20), np.dtype(np.float32)
    SlabCheckpoint(path, None, records.append, lambda plan, point: None).start(plan, shape, dtype)
    old = {"key": {k: v for k, v in records[-1]["key"].items() if k != "order"}, "rows_done": 1}
    _, resume = SlabCheckpoint(path, old, records.append, lambda plan, point: None).start(plan, shape, dtype)
    assert resume.rows_done == 1
    _, resume = SlabCheckpoint(path, old, records.append, lambda plan, point: None).start(
        plan, shape, dtype, order="F"
    )
    assert resume.rows_done == 0  # the file is C-ordered: a Fortran run starts over


@pytest.mark.parametrize("order", ["C", "F"])
def test_a_checkpoint_with_one_long_axis_resumes_in_either_order(tmp_path: Path, order: str) -> None:
    """A labels output of shape ``(1, 37)`` is both C- and Fortran-contiguous: it still resumes."""
    path, records = tmp_path / "partial.npy", []
    plan, shape, dtype = _plan_of((1, 37), (1, 16)), (1, 37), np.dtype(np.uint8)
    SlabCheckpoint(path, None, records.append, lambda plan, point: None).start(
        plan, shape, dtype, order=order
    )
    saved = {**records[-1], "rows_done": 1}
    _, resume = SlabCheckpoint(path, saved, records.append, lambda plan, point: None).start(
        plan, shape, dtype, order=order
    )
    assert resume.rows_done == 1


@pytest.mark.parametrize("channels", [1, 3])
def test_a_fortran_copy_matches_into_a_nifti_like_target(tmp_path: Path, channels: int) -> None:
    spatial = (13, 7, 29)
    values = np.random.default_rng(0).random((channels, *spatial), np.float32)
    source = np.lib.format.open_memmap(tmp_path / "s.npy", "w+", np.float32, values.shape, fortran_order=True)
    source[:] = values
    root = open_paged(tmp_path / "t.raw", np.float32, (*spatial, channels), mode="w+", order="F")
    target = np.moveaxis(root, -1, 0)  # as service.writers opens a NIfTI of several channels
    _copy_slabs(source, target, 1)
    np.testing.assert_array_equal(np.asarray(target), values)


_WORKER = """
import json, sys
import numpy as np
from models.measure.rss import fix_mmap_threshold, peak_rss_bytes, release_free_memory
from models.measure.rss import reset_peak_rss, rss_bytes
from service.paged import open_paged, paged
from service.stages import _copy_slabs
fix_mmap_threshold()
folder, order = sys.argv[1], sys.argv[2]
shape = (1, 64, 64, 4096)  # 64 MiB of float32: a long, thin volume
fortran = order == "F"
source = np.lib.format.open_memmap(folder + "/partial.npy", "w+", np.float32, shape, fortran_order=fortran)
for z in range(0, shape[-1], 256):
    source[..., z : z + 256] = z
source.flush()
del source
source = paged(np.lib.format.open_memmap(folder + "/partial.npy", "r"))
target = open_paged(folder + "/out.raw", np.float32, shape[1:], mode="w+", order="F")[None]
release_free_memory()
base = rss_bytes()
reset_peak_rss()
_copy_slabs(source, target, 1)
print(json.dumps({"rise": peak_rss_bytes() - base, "last": float(target[0, -1, -1, -1])}))
"""


@pytest.mark.parametrize("order", ["F"])
def test_the_finish_copy_of_a_fortran_checkpoint_holds_two_slabs(tmp_path: Path, order: str) -> None:
    """Measured in a fresh process (``VmHWM`` reset before the copy): 64 MiB copied with at most two
    slabs of :data:`~service.stages.COPY_BYTES` resident (the C-ordered checkpoint of before rose
    by the whole 64 MiB here)."""
    proc = subprocess.run([sys.executable, "-c", _WORKER, str(tmp_path), order], capture_output=True,
                          text=True, cwd=ROOT, check=True, timeout=300)  # fmt: skip
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["last"] == 3840.0, row
    assert row["rise"] <= 2 * COPY_BYTES + (8 << 20), row
