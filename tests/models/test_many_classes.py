"""More than 255 classes (issue 23 item 7): labels keep their ids (uint16 up to 65,536 classes,
uint32 beyond); PNG holds 16-bit labels and refuses wider ones by name; NIfTI and TIFF hold them.

A TorchScript 1x1x1 conv of 300 and 70,000 output channels end to end, and the pieces a labels run
goes through: the tiled pass's reduce (argmax), mapping back to the input grid
(:func:`models.geometry.resample.from_model_labels`) and the encoders; read back by nibabel, Pillow and
tifffile. Label 264 came back as 8 before.
"""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from models.geometry.model_grid import plan_geometry
from models.geometry.resample import from_model_labels
from models.transforms.preprocess import label_dtype, make_reduce
from service.codecs import DecodedVolume, encode
from service.errors import BadParameterError


def _logits(
    n_classes: int, shape: tuple[int, ...], rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """One-hot-ish logits whose argmax is a random label map reaching the top class."""
    truth = rng.integers(0, n_classes, size=shape)
    truth.flat[0] = n_classes - 1
    truth.flat[1] = 264
    logits = np.zeros((n_classes, *shape), np.float32)
    np.put_along_axis(logits, truth[None], 5.0, axis=0)
    return logits, truth


@pytest.mark.parametrize(("n_classes", "dtype"), [(300, np.uint16), (70_000, np.uint32)])
def test_reduce_and_mapping_back_keep_the_ids(rng: np.random.Generator, n_classes: int, dtype: type) -> None:
    logits, truth = _logits(n_classes, (3, 4, 5), rng)
    assert label_dtype(n_classes) == np.dtype(dtype)
    reduced = make_reduce("softmax", "labels")(torch.from_numpy(logits)).numpy()[0]  # type: ignore[misc]
    np.testing.assert_array_equal(reduced.astype(dtype), truth)
    plan = plan_geometry((3, 4, 5), np.diag([-1.0, 1.0, 1.0, 1.0]), orientation="RAS", spacing_mm=(1, 1, 1))
    back = from_model_labels(logits[:, ::-1].copy(), plan, activation="softmax")
    assert back.dtype == dtype
    np.testing.assert_array_equal(back, truth)


def _volume_2d(shape: tuple[int, int]) -> DecodedVolume:
    return DecodedVolume(data=np.zeros((1, *shape), np.uint8), kind="png", header=None, affine=None, info={})


def test_encoders_hold_or_refuse_wide_labels(tmp_path: Path, rng: np.random.Generator) -> None:
    labels16 = rng.integers(0, 300, size=(7, 9)).astype(np.uint16)
    labels16[0, 0] = 264
    volume = _volume_2d((7, 9))
    encode(volume, labels16, "png", tmp_path / "l.png")
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "l.png")), labels16)
    encode(volume, labels16, "tiff", tmp_path / "l.tiff")
    np.testing.assert_array_equal(tifffile.imread(tmp_path / "l.tiff"), labels16)
    labels32 = labels16.astype(np.uint32) * 250  # up to 74,750
    with pytest.raises(BadParameterError, match="format=png holds labels up to 65535"):
        encode(volume, labels32, "png", tmp_path / "w.png")
    encode(volume, labels32, "tiff", tmp_path / "w.tiff")
    np.testing.assert_array_equal(tifffile.imread(tmp_path / "w.tiff"), labels32)
    vol3 = DecodedVolume(
        data=np.zeros((1, 3, 4, 5), np.float32), kind="tiff", header=None, affine=None, info={}
    )
    big = rng.integers(0, 70_000, size=(3, 4, 5)).astype(np.uint32)
    encode(vol3, big, "nii.gz", tmp_path / "l.nii.gz")
    np.testing.assert_array_equal(np.asarray(nib.load(tmp_path / "l.nii.gz").dataobj), big)


@pytest.mark.filterwarnings("ignore:.*torch.jit.*is deprecated:DeprecationWarning")
@pytest.mark.parametrize(("n_classes", "dtype"), [(300, np.uint16), (70_000, np.uint32)])
def test_a_torchscript_model_of_many_classes_end_to_end(tmp_path: Path, n_classes: int, dtype: type) -> None:
    """A 1x1x1 TorchScript conv with ``n_classes`` outputs in a temporary models folder, through
    :func:`service.pipeline.run_file` to NIfTI: positive voxels are the top class, negative 0."""
    import hashlib

    from models import ModelRepository, parse_params
    from service.pipeline import run_file

    conv = torch.nn.Conv3d(1, n_classes, 1)
    with torch.no_grad():
        conv.weight.zero_()
        conv.bias.zero_()
        conv.weight[:, 0, 0, 0, 0] = torch.linspace(-1, 1, n_classes)
    torch.jit.trace(conv, torch.zeros(1, 1, 2, 2, 2)).save(str(tmp_path / "wide.pt"))
    sha = hashlib.sha256((tmp_path / "wide.pt").read_bytes()).hexdigest()
    (tmp_path / "wide.yaml").write_text(
        f'name: wide\nbackend: torchscript\nfile: wide.pt\nsha256: "{sha}"\nspatial_dims: 3\n'
        f"in_channels: 1\nout_channels: {n_classes}\nreceptive_field: 1\n"
        "output: {activation: softmax, kind: labels, dtype: float32}\n"
        "defaults: {tile: 16, halo: 0, overlap: 0, blend: constant, batch_size: 1}\n"
    )
    x = np.where(np.arange(5 * 6 * 7).reshape(5, 6, 7) % 3 == 0, 1.0, -1.0).astype(np.float32)
    nib.save(nib.Nifti1Image(x, np.eye(4)), tmp_path / "in.nii.gz")
    model = ModelRepository(str(tmp_path), device="cpu").get("wide")
    result = run_file(model, tmp_path / "in.nii.gz", tmp_path / "out", parse_params({}))
    out = np.asarray(nib.load(result.path).dataobj)
    assert out.dtype == dtype and result.output_dtype == np.dtype(dtype).name
    np.testing.assert_array_equal(out, np.where(x > 0, n_classes - 1, 0))
