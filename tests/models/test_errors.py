"""Bad input gives a clear error naming the model and the problem; foreign errors are translated."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import models
from models import (
    ChecksumMismatchError,
    IncompatibleWeightsError,
    InferenceError,
    InputError,
    ModelError,
    ModelRepository,
    SpecError,
    WeightsError,
)
from models.backends.ort import ORT_ERROR_MAP, translate_ort_errors
from models.zoo.nets import UNet


def _write_spec(folder: Path, **fields: object) -> None:
    spec = {"name": "m", "spatial_dims": 2, "in_channels": 1, "out_channels": 2, **fields}
    (folder / "m.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")


def _eager(folder: Path, **fields: object) -> None:
    _write_spec(
        folder,
        backend="eager",
        architecture="unet",
        file="w.pt",
        params={"features": 2, "levels": 1},
        **fields,
    )


def test_missing_weights_file(tmp_path: Path) -> None:
    _eager(tmp_path)
    with pytest.raises(WeightsError, match=r"model 'm': weights file .*w\.pt does not exist"):
        ModelRepository(tmp_path).get("m")


def test_incompatible_weights(tmp_path: Path) -> None:
    torch.save(UNet(2, 1, 3, features=2, levels=1).state_dict(), tmp_path / "w.pt")  # 3 outputs, spec says 2
    _eager(tmp_path)
    with pytest.raises(IncompatibleWeightsError, match="(?s)model 'm'.*size mismatch"):
        ModelRepository(tmp_path).get("m")


def test_weights_that_are_not_a_state_dict(tmp_path: Path) -> None:
    torch.save([1, 2, 3], tmp_path / "w.pt")
    _eager(tmp_path)
    with pytest.raises(WeightsError, match="no state dict"):
        ModelRepository(tmp_path).get("m")


def test_checksum_mismatch(tmp_path: Path) -> None:
    torch.save(UNet(2, 1, 2, features=2, levels=1).state_dict(), tmp_path / "w.pt")
    _eager(tmp_path, sha256="0" * 64)
    with pytest.raises(ChecksumMismatchError, match="model 'm'.*expects 0000"):
        ModelRepository(tmp_path).get("m")


def test_unknown_architecture(tmp_path: Path) -> None:
    torch.save({}, tmp_path / "w.pt")
    _write_spec(tmp_path, backend="eager", architecture="resnet", file="w.pt")
    with pytest.raises(SpecError, match="'architecture' 'resnet' is unknown"):
        ModelRepository(tmp_path).get("m")


def test_onnx_file_that_is_not_onnx(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(b"this is not a protobuf")
    _write_spec(tmp_path, backend="onnx", file="m.onnx")
    with pytest.raises(WeightsError, match="model 'm': onnxruntime failed to load the model"):
        ModelRepository(tmp_path).get("m")


def test_torchscript_file_that_is_not_torchscript(tmp_path: Path) -> None:
    (tmp_path / "m.ts").write_bytes(b"garbage")
    _write_spec(tmp_path, backend="torchscript", file="m.ts")
    with pytest.raises(WeightsError, match="model 'm'.*not a TorchScript file"):
        ModelRepository(tmp_path).get("m")


def test_wrong_channel_count(tmp_path: Path) -> None:
    torch.save(UNet(2, 1, 2, features=2, levels=1).state_dict(), tmp_path / "w.pt")
    _eager(tmp_path, alignment=2)
    model = ModelRepository(tmp_path).get("m")
    with pytest.raises(InputError, match="model 'm' takes 1 channel"):
        model.run(np.zeros((3, 16, 16), dtype=np.uint8))
    assert model.run(np.zeros((1, 16, 16), dtype=np.uint8)).shape == (2, 16, 16)


def test_every_onnxruntime_exception_is_translated() -> None:
    """Meta-test: each exception class onnxruntime defines has a translation."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    defined = {
        name for name, obj in inspect.getmembers(state, inspect.isclass) if issubclass(obj, BaseException)
    }
    assert defined and defined <= set(ORT_ERROR_MAP)
    for name in defined:
        with pytest.raises(ORT_ERROR_MAP[name]) as info, translate_ort_errors("m", "run a batch"):
            raise getattr(state, name)("boom")
        assert "model 'm'" in str(info.value) and isinstance(info.value.__cause__, getattr(state, name))


def test_out_of_memory_is_specific() -> None:
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    with pytest.raises(models.DeviceOutOfMemoryError), translate_ort_errors("m", "run a batch"):
        raise state.RuntimeException("Failed to allocate memory for requested buffer of size 1")


def test_error_tree() -> None:
    assert issubclass(models.UnknownModelError, LookupError)
    assert issubclass(SpecError, ValueError) and issubclass(InputError, ValueError)
    assert issubclass(models.DeviceOutOfMemoryError, InferenceError)
    for name in models.__all__:
        obj = getattr(models, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, ModelError)


def test_analytic_param_typo_is_refused_at_load(tmp_path: Path) -> None:
    _write_spec(tmp_path, backend="analytic", architecture="gaussian", out_channels=1, params={"sgima": 3.0})
    with pytest.raises(SpecError, match=r"m\.yaml \(model 'm'\).*'params\.sgima' is unknown"):
        ModelRepository(tmp_path, strict=True)


def test_analytic_param_of_wrong_type(tmp_path: Path) -> None:
    _write_spec(tmp_path, backend="analytic", architecture="gaussian", out_channels=1, params={"sigma": "2"})
    with pytest.raises(SpecError, match="'params.sigma' must be int or float"):
        ModelRepository(tmp_path, strict=True)


def test_analytic_param_typo_in_a_spec_built_in_code() -> None:
    """A ModelSpec built in code is validated by the same schema as a spec file."""
    from pydantic import ValidationError

    from models import ModelSpec

    spec = ModelRepository("/nonexistent-tilewise-models").spec("gaussian-2d")
    fields = {**spec.model_dump(exclude={"source"}), "params": {"sigma": 2.0, "sgima": 3.0}}
    with pytest.raises(ValidationError, match=r"'params\.sgima' is unknown; did you mean 'sigma'"):
        ModelSpec(**fields)
