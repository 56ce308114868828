"""``tilewise infer`` in process: same codecs and pipeline as the server, so identical outputs."""

from __future__ import annotations

from pathlib import Path

import httpx
import nibabel as nib
import numpy as np
import pytest
import tifffile
from PIL import Image

from service.cli import main
from service.commands.infer import format_from_suffix


def test_infer_equals_the_server_on_a_nifti(
    client: httpx.Client, anatomical_path: Path, tmp_path: Path
) -> None:
    target = tmp_path / "out" / "anat.nii.gz"
    assert (
        main(["infer", str(anatomical_path), str(target), "--model", "gaussian-3d", "--device", "cpu"]) == 0
    )
    response = client.post("/v1/models/gaussian-3d/infer", content=anatomical_path.read_bytes())
    served = tmp_path / "served.nii.gz"
    served.write_bytes(response.content)
    mine, theirs = nib.load(target), nib.load(served)
    assert np.array_equal(np.asarray(mine.dataobj), np.asarray(theirs.dataobj))
    assert mine.header.binaryblock == theirs.header.binaryblock
    assert [p.name for p in target.parent.iterdir()] == ["anat.nii.gz"]  # no partial file left


def test_infer_equals_the_server_on_a_jpeg(
    client: httpx.Client, text_models_dir: Path, tmp_path: Path
) -> None:
    skimage_data = pytest.importorskip("skimage.data")
    page = tmp_path / "page.jpg"
    Image.fromarray(skimage_data.page()).save(page, quality=90)
    target = tmp_path / "page.tiff"
    args = ["infer", str(page), str(target), "--model", "text-det-2d", "--models", str(text_models_dir)]
    assert main([*args, "--device", "cpu"]) == 0
    response = client.post("/v1/models/text-det-2d/infer", files={"file": ("page.jpg", page.read_bytes())})
    assert response.status_code == 200
    served = tmp_path / "served.tiff"
    served.write_bytes(response.content)
    assert np.array_equal(tifffile.imread(target), tifffile.imread(served))


def test_infer_options_formats_and_failures(anatomical_path: Path, tmp_path: Path) -> None:
    base = ["--model", "gaussian-3d", "--device", "cpu"]
    npy = tmp_path / "a.npy"
    assert main(["infer", str(anatomical_path), str(npy), *base, "--tile", "24", "--halo", "8"]) == 0
    assert np.load(npy).shape == (1, 33, 41, 25)
    labels = tmp_path / "labels.bin"
    assert (
        main(["infer", str(anatomical_path), str(labels), *base, "--format", "nii", "--output", "labels"])
        == 0
    )
    assert nib.Nifti1Image.from_bytes(labels.read_bytes()).get_data_dtype() == np.uint8
    bad = tmp_path / "bad.nii.gz"
    bad.write_bytes(b"\x1f\x8b" + b"\0" * 30)
    out_dir = tmp_path / "failures"
    assert main(["infer", str(bad), str(out_dir / "x.nii.gz"), *base]) == 1
    assert main(["infer", str(anatomical_path), str(out_dir / "x.png"), *base]) == 1  # png for 3D
    assert main(["infer", str(anatomical_path), str(out_dir / "y.nii"), *base, "--tile", "0"]) == 1
    assert main(["infer", str(anatomical_path), str(out_dir / "z.nii"), "--model", "nope"]) == 2
    assert main(["infer", str(tmp_path / "missing.nii"), str(out_dir / "w.nii"), *base]) == 2
    assert not out_dir.exists() or not list(out_dir.iterdir())


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("a.nii.gz", "nii.gz"),
        ("A.NII", "nii"),
        ("b.png", "png"),
        ("c.tif", "tiff"),
        ("d.tiff", "tiff"),
        ("e.npy", "npy"),
        ("f.jpg", None),
        ("g", None),
    ],  # fmt: skip
)
def test_format_from_suffix(name: str, fmt: str | None) -> None:
    assert format_from_suffix(Path(name)) == fmt
