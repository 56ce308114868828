"""A MONAI bundle on an input whose spacing is not the bundle's places its grid as MONAI does (issue 23).

Oracle: the bundle's own MONAI pipeline, read by MONAI's ``ConfigParser``: its preprocessing
(``Orientationd`` + ``Spacingd``: ``round((n - 1) * zoom / pixdim + 1)`` voxels, half to even, the first
voxel centres kept), its ``SlidingWindowInferer``, then its post-transforms ``Activationsd`` and
``Invertd`` (back to the input's grid). Inputs: crops of nilearn's 1 mm MNI152 T1 and a 1x1x3 mm copy
(every third slice; one in LPS), through 2 mm and 1.5 mm bundles, so that the model grid is below, on and
above the 32-voxel window.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
import torch
from _import_kit import need, write_monai_bundle

from models import ModelRepository, parse_params
from models.geometry.mapping import run_mapped
from models.geometry.model_grid import plan_geometry
from models.geometry.resample import to_model
from service.cli import main

pytestmark = [
    pytest.mark.filterwarnings("ignore:NvImgCodecPydicomReader:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*Orientationd.__init__.labels.:FutureWarning"),
]

ROI = (32, 32, 32)


def _bundle(root: Path, pixdim: list[float]) -> None:
    """The kit's bundle with an instance-norm UNet (tile-dependent), roi 32 and ``Spacingd(pixdim)``."""
    nets = need("monai.networks.nets")
    write_monai_bundle(root, roi=ROI, norm="instance", seed=1)
    arch = {"spatial_dims": 3, "in_channels": 1, "out_channels": 3, "channels": [4, 8, 16], "strides": [2, 2],
            "num_res_units": 1, "norm": "instance"}  # fmt: skip
    torch.manual_seed(1)
    torch.save(nets.UNet(**arch).state_dict(), root / "models" / "model.pt")
    path = root / "configs" / "inference.json"
    config = json.loads(path.read_text())
    config["network_def"] = {"_target_": "UNet", **arch}
    config["inferer"]["mode"] = "constant"  # gaussian: MONAI floors its N-D weights at 1e-3 (see bundle.py)
    for step in config["preprocessing"]["transforms"]:
        if step["_target_"] == "Spacingd":
            step["pixdim"] = pixdim
        if step["_target_"] == "ScaleIntensityRanged":
            step["a_max"] = 1.0  # the template's range
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module", params=[2.0, 1.5], ids=["2mm", "1.5mm"])
def bundle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    need("monai")
    mm = float(request.param)
    root = tmp_path_factory.mktemp("bundles") / f"at{mm}"
    _bundle(root, [mm, mm, mm])
    folder = tmp_path_factory.mktemp("models")
    assert main(["import-model", str(root), "--models", str(folder), "--name", "spaced"]) == 0
    model = ModelRepository(folder, device="cpu").get("spaced")
    assert model.spec.resampling.value == "corners" and model.spec.spacing == (mm, mm, mm)
    return root, model


def _monai_pipeline(bundle: Path, path: Path) -> np.ndarray:
    """MONAI's own run: preprocessing, inferer, then the post-transforms Activationsd + Invertd."""
    from monai.bundle import ConfigParser
    from monai.transforms import Compose

    parser = ConfigParser()
    parser.read_meta(str(bundle / "configs" / "metadata.json"))
    parser.read_config(str(bundle / "configs" / "inference.json"))
    parser["bundle_root"] = str(bundle)
    network = parser.get_parsed_content("network_def")
    network.load_state_dict(torch.load(bundle / "models" / "model.pt", weights_only=True))
    data = parser.get_parsed_content("preprocessing")({"image": str(path)})
    with torch.no_grad():
        data["pred"] = parser.get_parsed_content("inferer")(data["image"][None], network.eval())[0]
    post = parser.get_parsed_content("postprocessing")
    names = [type(t).__name__ for t in post.transforms]
    assert names[:2] == ["Activationsd", "Invertd"]
    out = Compose(post.transforms[:2])(data)["pred"]
    return np.asarray(out.detach().cpu().numpy() if hasattr(out, "detach") else out)


def _crop(mni152: np.ndarray, shape: tuple[int, ...], step: int) -> np.ndarray:
    """A centred crop of the template, every ``step``-th slice along the last axis."""
    full = mni152[:, :, ::step]
    start = [(f - s) // 2 for f, s in zip(full.shape, shape, strict=True)]
    return np.ascontiguousarray(full[tuple(slice(a, a + s) for a, s in zip(start, shape, strict=True))])


CASES = [
    pytest.param((41, 50, 37), 1, "RAS", id="1mm-below"),
    pytest.param((63, 47, 63), 1, "RAS", id="1mm-on"),
    pytest.param((101, 81, 70), 1, "RAS", id="1mm-above"),
    pytest.param((45, 38, 13), 3, "RAS", id="1x1x3-below"),
    pytest.param((70, 66, 22), 3, "LPS", id="1x1x3-above-lps"),
]


@pytest.mark.parametrize(("shape", "step", "codes"), CASES)
def test_resampled_input_equals_the_bundle_pipeline(
    bundle: tuple[Path, Any],
    mni152: np.ndarray,
    tmp_path: Path,
    shape: tuple[int, ...],
    step: int,
    codes: str,
) -> None:
    root, model = bundle
    volume = _crop(mni152, shape, step)
    affine = np.diag([1.0, 1.0, float(step), 1.0])
    affine[:3, 3] = [-20.0, -30.0, -10.0]
    if codes == "LPS":  # world unchanged: x and y stored reversed
        volume = np.ascontiguousarray(volume[::-1, ::-1])
        affine[:2] *= -1.0
    path = tmp_path / "input.nii.gz"
    nib.save(nib.Nifti1Image(volume, affine), path)
    expected = _monai_pipeline(root, path)
    got = run_mapped(model, volume[None], affine, parse_params({"output": "probabilities"}))
    spacing = model.spec.spacing
    grid = plan_geometry(shape, affine, orientation="RAS", spacing_mm=spacing, resampling="corners")
    assert got.mapping.model_shape == grid.model_shape
    assert got.result.shape == expected.shape == (3, *shape)
    assert np.abs(got.result - expected).max() <= 1e-4


def test_model_grid_shape_is_monai_spacing_shape() -> None:
    """``corners`` gives the shape and the sampled points of MONAI's ``Spacing`` (off the half voxel)."""
    need("monai")
    from monai.data import MetaTensor
    from monai.transforms import Spacing

    rng = np.random.default_rng(0)
    for shape, zooms, pixdim in [((23, 17, 11), (1.0, 1.0, 3.0), (2.0, 2.0, 2.0)),
                                 ((20, 9, 31), (0.7, 1.1, 1.0), (1.3, 0.7, 2.2))]:  # fmt: skip
        x = rng.random((1, *shape)).astype(np.float32)
        affine = np.diag([*zooms, 1.0])
        expected = Spacing(pixdim=pixdim, mode="bilinear")(
            MetaTensor(torch.from_numpy(x), affine=torch.from_numpy(affine))
        )
        plan = plan_geometry(shape, affine, spacing_mm=pixdim, resampling="corners")
        assert plan.model_shape == tuple(expected.shape[1:])
        np.testing.assert_allclose(plan.model_affine, expected.affine.numpy(), atol=1e-9)
        assert np.abs(to_model(x, plan) - expected.numpy()).max() <= 1e-5


@pytest.mark.slow  # ~20 s: the import measures the network's receptive field
@pytest.mark.parametrize("shape", [pytest.param((61, 47, 90), id="below-on")])
def test_local_bundle_at_2mm_equals_the_bundle_pipeline(
    mni152: np.ndarray, tmp_path: Path, shape: tuple[int, ...]
) -> None:
    """The kit's own bundle (batch norm, roi 48, gaussian) with Spacingd 2 mm on 1 mm crops."""
    need("monai")
    root = tmp_path / "local"
    write_monai_bundle(root, roi=(48, 48, 48))
    path = root / "configs" / "inference.json"
    config = json.loads(path.read_text())
    for step in config["preprocessing"]["transforms"]:
        if step["_target_"] == "Spacingd":
            step["pixdim"] = [2.0, 2.0, 2.0]
        if step["_target_"] == "ScaleIntensityRanged":
            step["a_max"] = 1.0
    path.write_text(json.dumps(config))
    assert main(["import-model", str(root), "--models", str(tmp_path / "m"), "--name", "local"]) == 0
    model = ModelRepository(tmp_path / "m", device="cpu").get("local")
    volume = _crop(mni152, shape, 1)
    affine = np.diag([1.0, 1.0, 1.0, 1.0])
    nib.save(nib.Nifti1Image(volume, affine), tmp_path / "input.nii.gz")
    expected = _monai_pipeline(root, tmp_path / "input.nii.gz")
    got = run_mapped(model, volume[None], affine, parse_params({"output": "probabilities"})).result
    assert got.shape == expected.shape == (3, *shape)
    assert np.abs(got - expected).max() <= 1e-4


@pytest.mark.parametrize(
    ("option", "value"),
    [("scale_extent", True), ("align_corners", True), ("padding_mode", "zeros"), ("diagonal", True)],
)
def test_spacingd_options_tilewise_cannot_place_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: Any
) -> None:
    need("monai")
    write_monai_bundle(tmp_path / "b", roi=(32, 32, 32))
    path = tmp_path / "b" / "configs" / "inference.json"
    config = json.loads(path.read_text())
    for step in config["preprocessing"]["transforms"]:
        if step["_target_"] == "Spacingd":
            step[option] = value
    path.write_text(json.dumps(config))
    assert main(["import-model", str(tmp_path / "b"), "--models", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"Spacingd({option}=" in err[0]


def test_extent_grid_is_nnunet_compute_new_shape() -> None:
    """nnU-Net folders keep nnU-Net's own rule: ``round(n * zoom / spacing)`` (``compute_new_shape``)."""
    resampling = need("nnunetv2.preprocessing.resampling.default_resampling")
    rng = np.random.default_rng(3)
    for _ in range(50):
        shape = tuple(int(n) for n in rng.integers(1, 300, 3))
        zooms = tuple(float(z) for z in rng.choice([0.5, 0.7, 0.8, 1.0, 1.25, 1.5, 3.0], 3))
        spacing = tuple(float(s) for s in rng.choice([0.5, 1.0, 1.5, 2.0, 3.0], 3))
        plan = plan_geometry(shape, zooms_mm=zooms, spacing_mm=spacing)  # extent: the default
        expected = resampling.compute_new_shape(shape, zooms, spacing)
        assert plan.model_shape == tuple(max(1, int(n)) for n in expected), (shape, zooms, spacing)
