"""Spec files: strict validation naming the file and the field; options; the repository."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from models import (
    InferenceOptions,
    InputError,
    ModelRepository,
    RegistryError,
    SpecError,
    UnknownModelError,
    load_spec,
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
    assert set(info["defaults"]) == {"tile", "halo", "overlap", "blend", "batch_size", "output", "format"}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        pytest.param({"colour": "red"}, "'colour' is unknown", id="unknown-field"),
        pytest.param({"in_channels": "one"}, "'in_channels' must be int", id="wrong-type"),
        pytest.param({"in_channels": True}, "'in_channels' must be int", id="bool-not-int"),
        pytest.param({"backend": "tensorflow"}, "'backend' must be one of", id="bad-choice"),
        pytest.param({"spatial_dims": 4}, "'spatial_dims' must be 1, 2 or 3", id="bad-dims"),
        pytest.param(
            {"defaults": {"tile": [32, 32]}}, "'tile' must be an int or a list of 3", id="tile-axes"
        ),
        pytest.param({"defaults": {"halo": "big"}}, "'halo' must be int or list", id="halo-string"),
        pytest.param({"output": {"kind": "masks"}}, "'kind' must be one of", id="output-kind"),
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
    assert repo.names() == ["gaussian-2d", "gaussian-3d", "log-2d", "log-3d", "sobel-2d", "sobel-3d"]
    with pytest.raises(UnknownModelError, match="did you mean 'sobel-2d'"):
        repo.get("sobel2d")
    with pytest.raises(LookupError):
        repo.get("nothing-like-it")


def test_repository_reads_folder_and_rejects_duplicates(tmp_path: Path) -> None:
    _write(tmp_path, GOOD, "a.yaml")
    assert "tiny-unet" in ModelRepository(tmp_path).names()
    _write(tmp_path, GOOD, "b.json")
    with pytest.raises(RegistryError, match="defined twice"):
        ModelRepository(tmp_path)


def test_repository_fails_on_invalid_spec(tmp_path: Path) -> None:
    _write(tmp_path, {**GOOD, "in_chanels": 1})
    with pytest.raises(SpecError, match="in_chanels"):
        ModelRepository(tmp_path)


def test_options_resolve_defaults(tmp_path: Path) -> None:
    spec = load_spec(_write(tmp_path, GOOD))
    resolved = InferenceOptions().resolve(spec)
    assert resolved.tile == (32, 32, 16) and resolved.halo == "auto" and resolved.output == "labels"
    resolved = InferenceOptions(tile=16, halo=(1, 2, 3), output="probabilities").resolve(spec)
    assert resolved.tile == (16, 16, 16) and resolved.halo == (1, 2, 3)
    with pytest.raises(GridError, match="halo"):
        InferenceOptions(halo=(1, 2)).resolve(spec)
    with pytest.raises(GridError, match="blend"):
        InferenceOptions(blend="cosine").resolve(spec)
    with pytest.raises(InputError, match="output"):
        InferenceOptions(output="boxes").resolve(spec)
