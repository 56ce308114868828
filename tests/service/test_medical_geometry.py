"""Geometry (issue 12, item 1): inputs go to the model's orientation and spacing, outputs come back.

The model is ``smooth-tissue-3d`` (``_medical_nets``: a local, orientation-sensitive 3-class
network with ``spacing``, ``orientation: RAS`` and ``labels`` in its spec), run through
:func:`service.pipeline.run_file` (what the server and ``tilewise infer`` run) and over HTTP.
Data: nibabel's ``anatomical.nii`` (2 mm, LAS, big-endian int16) and nilearn's MNI152 T1 at 2 mm
(99x117x95, RAS).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
from _medical_nets import LABELS, NAME, write_model
from nibabel.orientations import io_orientation, ornt_transform

from models import ModelRepository, parse_params
from models.execution.options import RunOptions
from service.pipeline import run_file

logger = logging.getLogger(__name__)


def _model(folder: Path, **fields: Any) -> Any:
    write_model(folder, **fields)
    return ModelRepository(folder, device="cpu").get(NAME)


def _reoriented(img: nib.Nifti1Image, codes: str) -> nib.Nifti1Image:
    """``img`` with its array permuted and flipped to ``codes`` (affine to match: same world)."""
    target = nib.orientations.axcodes2ornt(tuple(codes))
    out = img.as_reoriented(ornt_transform(io_orientation(img.affine), target))
    assert "".join(nib.aff2axcodes(out.affine)) == codes
    return out


def _back(labels: np.ndarray, affine: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """``labels`` (on a grid with ``affine``) permuted and flipped to ``reference``'s axes."""
    img = nib.Nifti1Image(labels, affine).as_reoriented(
        ornt_transform(io_orientation(affine), io_orientation(reference))
    )
    return np.asarray(img.dataobj)


def _dice(a: np.ndarray, b: np.ndarray, label: int) -> float:
    x, y = a == label, b == label
    return float(2 * (x & y).sum() / (x.sum() + y.sum()))


@pytest.fixture(scope="module")
def mni2(tmp_path_factory: pytest.TempPathFactory) -> nib.Nifti1Image:
    """nilearn's MNI152 T1 at 2 mm (99x117x95, RAS, float32)."""
    from nilearn import datasets

    img = datasets.load_mni152_template(resolution=2)
    return nib.Nifti1Image(img.get_fdata(dtype=np.float32), img.affine)


def _run(model: Any, img: nib.Nifti1Image, folder: Path, name: str, **params: str) -> Any:
    source = folder / f"{name}.nii.gz"
    nib.save(img, source)
    result = run_file(model, source, folder / f"{name}-out", parse_params(params))
    return result, nib.load(result.path)


def test_anatomical_round_trip(anatomical_path: Path, tmp_path: Path) -> None:
    """2 mm LAS big-endian int16 in; uint8 labels out on its own grid: shape, affine, codes, zooms."""
    model = _model(tmp_path / "m")
    src = nib.load(anatomical_path)
    assert src.header.endianness == ">" and nib.aff2axcodes(src.affine) == ("L", "A", "S")
    result = run_file(model, anatomical_path, tmp_path / "out", parse_params({}))
    out = nib.load(result.path)
    assert out.shape == src.shape == (33, 41, 25) and out.get_data_dtype() == np.uint8
    assert np.array_equal(out.affine, src.affine) and nib.aff2axcodes(out.affine) == ("L", "A", "S")
    assert out.header.get_zooms() == src.header.get_zooms()
    assert [int(c) for c in out.header.get_qform(coded=True)[1:]] == [
        int(c) for c in src.header.get_qform(coded=True)[1:]
    ]
    assert int(out.header["sform_code"]) == int(src.header["sform_code"])
    assert result.model_shape == (66, 82, 50)  # RAS at 1 mm: x flipped, every axis doubled
    labels = np.asarray(out.dataobj)
    assert set(np.unique(labels)) <= set(LABELS) and len(np.unique(labels)) >= 2
    native = run_file(model, anatomical_path, tmp_path / "native", parse_params({"spacing": "native"}))
    assert native.model_shape == (33, 41, 25) and native.output_shape == (33, 41, 25)


def test_other_axis_codes_give_the_same_labels(mni2: nib.Nifti1Image, tmp_path: Path) -> None:
    """PIR and LPS copies of the RAS template (arrays permuted and flipped, affines to match) are
    reoriented to RAS before the network and back after it: the same labels, voxel for voxel."""
    model = _model(tmp_path / "m", spacing=[1.5, 1.5, 1.5])
    ras, ras_img = _run(model, mni2, tmp_path, "ras")
    reference = np.asarray(ras_img.dataobj)
    assert ras.model_shape == (132, 156, 127) and len(np.unique(reference)) == 3
    for codes in ("PIR", "LPS"):
        img = _reoriented(mni2, codes)
        result, out = _run(model, img, tmp_path, codes)
        assert out.shape == img.shape and np.array_equal(out.affine, img.affine)
        assert result.model_shape == ras.model_shape
        np.testing.assert_array_equal(_back(np.asarray(out.dataobj), out.affine, mni2.affine), reference)


def test_anisotropic_copy_within_dice(mni2: nib.Nifti1Image, tmp_path: Path) -> None:
    """A 2 x 2 x 6 mm copy (every third slice, affine to match) is resampled to the model's 2 mm and
    back: its labels are within Dice 0.9 of the original's labels taken on the same slices."""
    model = _model(tmp_path / "m", spacing=[2.0, 2.0, 2.0])
    _, out = _run(model, mni2, tmp_path, "iso")
    thick = np.asarray(mni2.dataobj)[:, :, 1::3]
    affine = mni2.affine @ np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 3, 1], [0, 0, 0, 1]], float)
    result, copy = _run(model, nib.Nifti1Image(thick, affine), tmp_path, "thick")
    assert result.model_shape == (99, 117, 96) and copy.header.get_zooms() == pytest.approx((2, 2, 6))
    reference = np.asarray(out.dataobj)[:, :, 1::3]
    got = np.asarray(copy.dataobj)
    scores = [_dice(got, reference, label) for label in (1, 2)]
    logger.info("2 x 2 x 6 mm copy vs the 2 mm original's labels on its slices: Dice %s", scores)
    assert min(scores) >= 0.9, scores


def test_a_stopped_job_resumes_on_the_model_grid(anatomical_path: Path, tmp_path: Path) -> None:
    """A job's checkpoint holds the network's output on the model grid (1 mm probabilities, since
    the labels are made only after resampling back); a run stopped after some tiles continues from
    its last finished tile row and gives the uninterrupted run's labels."""
    from service.codecs import decode
    from service.jobs.checkpoint import SlabCheckpoint
    from service.pipeline import run_volume
    from tiling import RunCancelledError

    model = _model(tmp_path / "m", defaults={"tile": 32, "halo": 2, "batch_size": 1})
    volume = decode(anatomical_path)
    params = parse_params({})
    whole = run_volume(model, volume, params)
    records: list[dict[str, Any]] = []

    def checkpoint(saved: dict[str, Any] | None) -> SlabCheckpoint:
        return SlabCheckpoint(tmp_path / "partial.npy", saved, records.append, lambda plan, point: None)

    grid = whole.plan.grid
    per_row = grid.n_tiles // grid.grid_shape[0]
    calls = []

    def stop_in_the_second_row() -> bool:  # asked before each batch of one tile
        calls.append(1)
        return len(calls) > per_row + 1

    with pytest.raises(RunCancelledError):
        run_volume(model, volume, params, options=RunOptions(should_stop=stop_in_the_second_row),
                   checkpoint=checkpoint(None))  # fmt: skip
    partial = np.load(tmp_path / "partial.npy", mmap_mode="r")
    assert partial.shape == (3, 66, 82, 50) and partial.dtype == np.float32  # the model grid
    assert 0 < records[-1]["rows_done"] < 66
    batches: list[int] = []

    def count() -> bool:
        batches.append(1)
        return False

    resumed = run_volume(model, volume, params, options=RunOptions(should_stop=count),
                         checkpoint=checkpoint(records[-1]))  # fmt: skip
    assert len(batches) <= grid.n_tiles - per_row  # the finished tile row was not run again
    np.testing.assert_array_equal(resumed.result, whole.result)
    assert grid.grid_shape[0] >= 3 and resumed.plan.header() == whole.plan.header()


def test_2d_images_run_native_and_2d_niftis_are_resampled(tmp_path: Path) -> None:
    """A PNG has no voxel size: a 2D model with a ``spacing`` runs it on its own grid. A NIfTI
    ``(X, Y, 1)`` at 1 mm goes to the model's 0.5 mm and back."""
    import yaml
    from PIL import Image

    spec = {
        "name": "smooth-2d",
        "backend": "analytic",
        "architecture": "gaussian",
        "spatial_dims": 2,
        "in_channels": 1,
        "out_channels": 1,
        "params": {"kind": "gaussian", "sigma": 1.0, "truncate": 4.0},
        "spacing": [0.5, 0.5],
        "defaults": {"tile": 64, "halo": 4},
    }
    (tmp_path / "smooth-2d.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    model = ModelRepository(tmp_path, device="cpu").get("smooth-2d")
    pixels = (np.arange(40 * 30).reshape(40, 30) % 251).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "image.png")
    png = run_file(model, tmp_path / "image.png", tmp_path / "png-out", parse_params({}))
    assert png.model_shape == (40, 30) and png.output_shape == (1, 40, 30)
    nib.save(nib.Nifti1Image(pixels.T[:, :, None].astype(np.float32), np.eye(4)), tmp_path / "slice.nii.gz")
    nii = run_file(model, tmp_path / "slice.nii.gz", tmp_path / "nii-out", parse_params({}))
    assert nii.model_shape == (60, 80) and nib.load(nii.path).shape[:3] == (30, 40, 1)
