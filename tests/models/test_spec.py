"""Spec files: strict validation naming the file and the field; options; the repository."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from models import (
    InferenceParams,
    InputError,
    ModelRepository,
    ParamError,
    RegistryError,
    SpecError,
    UnknownModelError,
    load_spec,
    parse_params,
)
from tiling.errors import GridError

GOOD = {
    "name": "tiny-unet",
    "backend": "eager",
    "architecture": "unet",
    "file": "tiny.pt",
    "spatial_dims": 3,
    "in_channels": 1,
    "out_channels": 2,
    "alignment": 4,
    "params": {"features": 4, "levels": 2},
    "preprocess": [{"type": "ct_window", "lo": -1000, "hi": 400}, "zscore"],
    "output": {"activation": "softmax", "kind": "labels"},
    "defaults": {"tile": [32, 32, 16], "halo": "auto", "batch_size": 2},
}


def _write(folder: Path, data: object, name: str = "m.yaml") -> Path:
    path = folder / name
    text = json.dumps(data) if path.suffix == ".json" else yaml.safe_dump(data)
    path.write_text(text, encoding="utf-8")
    return path


def test_good_spec_loads(tmp_path: Path) -> None:
    spec = load_spec(_write(tmp_path, GOOD))
    assert spec.file == (tmp_path / "tiny.pt").resolve()
    assert spec.defaults.tile == (32, 32, 16)
    assert spec.defaults.halo == "auto"
    assert spec.defaults.overlap == (0, 0, 0)
    assert spec.output_kind == "labels" and spec.defaults.output == "labels"
    assert [s.kind for s in spec.preprocess] == ["ct_window", "zscore"]
    info = spec.info()
    assert set(info) >= {
        "name",
        "spatial_dims",
        "in_channels",
        "out_channels",
        "backend",
        "alignment",
        "scale",
        "receptive_field",
        "params",
        "defaults",
    }
    assert set(info["defaults"]) == set(InferenceParams.model_fields)  # one schema, one serializer
    assert set(info["defaults"]) >= {"tile", "halo", "overlap", "blend", "batch_size", "output", "format"}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        pytest.param({"colour": "red"}, "'colour' is unknown", id="unknown-field"),
        pytest.param({"in_channels": "one"}, "'in_channels' must be a valid integer", id="wrong-type"),
        pytest.param({"in_channels": True}, "'in_channels' must be a valid integer", id="bool-not-int"),
        pytest.param({"backend": "tensorflow"}, "'backend' must be 'eager', 'torchscript'", id="bad-choice"),
        pytest.param({"spatial_dims": 4}, "'spatial_dims' must be 1, 2 or 3", id="bad-dims"),
        pytest.param(
            {"defaults": {"tile": [32, 32]}}, "'defaults.tile' must be an int or a list of 3", id="tile-axes"
        ),
        pytest.param({"defaults": {"halo": "big"}}, "halo='big' is not an integer", id="halo-string"),
        pytest.param({"defaults": {"tiles": 8}}, "'defaults.tiles' is unknown", id="defaults-typo"),
        pytest.param({"defaults": {"blend": "han"}}, "did you mean 'hann'", id="defaults-did-you-mean"),
        pytest.param(
            {"output": {"kind": "masks"}}, "'output.kind' must be 'probabilities'", id="output-kind"
        ),
        pytest.param({"preprocess": ["sharpen"]}, "unknown type 'sharpen'", id="unknown-step"),
        pytest.param({"preprocess": [{"type": "ct_window", "lo": 0}]}, "'hi' is required", id="step-param"),
        pytest.param({"sha256": "abc"}, "'sha256' must be 64", id="bad-sha"),
        pytest.param({"architecture": None}, "'architecture' is required", id="eager-needs-arch"),
    ],
)
def test_invalid_spec_names_file_and_field(tmp_path: Path, change: dict[str, Any], field: str) -> None:
    path = _write(tmp_path, {**GOOD, **change})
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert str(path) in message and "tiny-unet" in message
    assert field in message


def test_missing_required_field(tmp_path: Path) -> None:
    data = dict(GOOD)
    del data["out_channels"]
    with pytest.raises(SpecError, match="'out_channels' is required"):
        load_spec(_write(tmp_path, data))


def test_unparsable_spec(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: [unclosed\n", encoding="utf-8")
    with pytest.raises(SpecError, match="broken.yaml"):
        load_spec(path)


def test_repository_builtins_and_lookup(tmp_path: Path) -> None:
    repo = ModelRepository(tmp_path / "missing")
    assert repo.names() == [
        "gaussian-2d",
        "gaussian-3d",
        "log-2d",
        "log-3d",
        "sobel-2d",
        "sobel-3d",
        "tissue-3d",
    ]
    with pytest.raises(UnknownModelError, match="did you mean 'sobel-2d'"):
        repo.get("sobel2d")
    with pytest.raises(LookupError):
        repo.get("nothing-like-it")


def test_repository_reads_folder_and_rejects_duplicates(tmp_path: Path) -> None:
    _write(tmp_path, GOOD, "a.yaml")
    assert "tiny-unet" in ModelRepository(tmp_path).names()
    _write(tmp_path, GOOD, "b.json")
    with pytest.raises(RegistryError, match="defined twice"):
        ModelRepository(tmp_path, strict=True)
    assert "defined twice" in ModelRepository(tmp_path).unavailable()["tiny-unet"]  # not strict: listed


def test_repository_fails_on_invalid_spec(tmp_path: Path) -> None:
    _write(tmp_path, {**GOOD, "in_chanels": 1})
    with pytest.raises(SpecError, match="in_chanels"):
        ModelRepository(tmp_path, strict=True)
    assert "in_chanels" in ModelRepository(tmp_path).unavailable()["tiny-unet"]  # not strict: listed


def test_params_merge_over_spec_defaults(tmp_path: Path) -> None:
    spec = load_spec(_write(tmp_path, GOOD))
    merged = InferenceParams().merged(spec.defaults)
    assert merged.tile == (32, 32, 16) and merged.halo == "auto" and merged.output == "labels"
    merged = InferenceParams(tile=16, halo=(1, 2, 3), output="probabilities").merged(spec.defaults)
    assert merged.tile == 16 and merged.halo == (1, 2, 3) and merged.batch_size == 2
    with pytest.raises(ParamError, match="blend='cosine' is not one of"):
        parse_params({"blend": "cosine"})
    with pytest.raises(ParamError, match="did you mean 'labels'"):
        parse_params({"output": "label"})


def test_plan_resolves_once_per_request() -> None:
    """Model.plan resolves every parameter against the spec and plans the grid (no data needed)."""
    model = ModelRepository("/nonexistent-tilewise-models").get("gaussian-3d")
    plan = model.plan((200, 200, 200))  # defaults: tile 128, halo 8
    assert plan.tile == (128, 128, 128) and plan.halo == (8, 8, 8) and plan.overlap == (0, 0, 0)
    assert plan.n_tiles == 8 and plan.grid.grid_shape == (2, 2, 2) and plan.halo_source == "given"
    assert plan.tile_source == "default" and plan.batch_size == 1
    # the grid sizes its tiles to the image: 2 per axis need 108 voxels (108 - 2 * 8 = 92 of core)
    assert plan.header() == "tile=108,108,108; halo=8,8,8; overlap=0,0,0; tiles=8; work=1.26"  # 8*108**3/8e6
    with pytest.raises(GridError, match="halo"):
        model.plan((100, 100, 100), InferenceParams(halo=(1, 2)))
    with pytest.raises(InputError, match="3 spatial axes"):
        model.plan((100, 100))


def test_medical_fields_spacing_orientation_labels(tmp_path: Path) -> None:
    """DESIGN.md second wave: ``spacing`` (mm per axis), ``orientation`` (axis codes), ``labels``."""
    medical = {"spacing": [1, 1.5, 2], "orientation": "ras", "labels": {0: "bg", 1: "gm"}}
    path = _write(tmp_path, {**GOOD, **medical})
    spec = load_spec(path)
    assert spec.spacing == (1.0, 1.5, 2.0) and spec.orientation == "RAS" and spec.labels == {0: "bg", 1: "gm"}
    info = spec.info()
    assert info["spacing"] == [1.0, 1.5, 2.0] and info["orientation"] == "RAS"
    assert info["labels"] == {"0": "bg", "1": "gm"}
    assert info["tile_dependent"] is None  # absent: unknown until probed (the repository reports it then)
    assert load_spec(_write(tmp_path, {**GOOD, "tile_dependent": False})).info()["tile_dependent"] is False
    assert load_spec(_write(tmp_path, GOOD)).info()["spacing"] is None
    for bad, fragment in [
        ({"spacing": [1, 1]}, "field 'spacing' must list 3 values"),
        ({"spacing": [0, 1, 1]}, r"field 'spacing\[0\]' must be greater than 0"),
        ({"orientation": "RRS"}, "field 'orientation' must name each of L/R, P/A, I/S once"),
        ({"orientation": "RA"}, "field 'orientation' must give 3 axis codes"),
        ({"labels": {"grey": 1}}, "field 'labels.grey'"),
    ]:
        with pytest.raises(SpecError, match=fragment):
            load_spec(_write(tmp_path, {**GOOD, **bad}))
