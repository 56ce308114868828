"""tilewise models: specs, backends (eager, TorchScript, ONNX Runtime), built-ins, receptive fields.

Names are imported on first use (PEP 562), so the light modules (``models.planning.params``,
``models.errors``, ``models.spec``) load without torch: the batch client validates its options with
:class:`InferenceParams` and never imports torch.

>>> from models import InferenceParams, ModelRepository
>>> repo = ModelRepository(models_dir="/nonexistent")  # built-ins only
>>> "gaussian-3d" in repo.names()
True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from models.backends import BasePredictor, Predictor, load_predictor, resolve_device
    from models.errors import (
        BackendError,
        BackendUnavailableError,
        ChecksumMismatchError,
        DeviceOutOfMemoryError,
        ExportError,
        ImportRefusedError,
        IncompatibleWeightsError,
        InferenceError,
        InputError,
        ModelError,
        ModelUnavailableError,
        ParamError,
        RegistryError,
        SpecError,
        UnknownModelError,
        WeightsError,
    )
    from models.measure.calibration import HaloCalibrator
    from models.measure.receptive import (
        HaloCalibration,
        ReceptiveField,
        calibrate_halo,
        probe_receptive_field,
    )
    from models.model import Model
    from models.planning.params import InferenceParams, parse_params
    from models.planning.plan import RunPlan
    from models.repository import DEFAULT_MODELS_DIR, ModelRepository
    from models.spec import ModelSpec, PreprocessStep, load_spec, spec_from_mapping

#: Public name -> the module that defines it.
_SOURCES = {
    "BackendError": "models.errors",
    "BackendUnavailableError": "models.errors",
    "BasePredictor": "models.backends",
    "ChecksumMismatchError": "models.errors",
    "DEFAULT_MODELS_DIR": "models.repository",
    "DeviceOutOfMemoryError": "models.errors",
    "ExportError": "models.errors",
    "ImportRefusedError": "models.errors",
    "HaloCalibration": "models.measure.receptive",
    "HaloCalibrator": "models.measure.calibration",
    "IncompatibleWeightsError": "models.errors",
    "InferenceError": "models.errors",
    "InferenceParams": "models.planning.params",
    "InputError": "models.errors",
    "Model": "models.model",
    "ModelError": "models.errors",
    "ModelUnavailableError": "models.errors",
    "ModelRepository": "models.repository",
    "ModelSpec": "models.spec",
    "ParamError": "models.errors",
    "Predictor": "models.backends",
    "PreprocessStep": "models.spec",
    "ReceptiveField": "models.measure.receptive",
    "RegistryError": "models.errors",
    "RunPlan": "models.planning.plan",
    "SpecError": "models.errors",
    "UnknownModelError": "models.errors",
    "WeightsError": "models.errors",
    "calibrate_halo": "models.measure.receptive",
    "load_predictor": "models.backends",
    "load_spec": "models.spec",
    "parse_params": "models.planning.params",
    "probe_receptive_field": "models.measure.receptive",
    "resolve_device": "models.backends",
    "spec_from_mapping": "models.spec",
}

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "BasePredictor",
    "ChecksumMismatchError",
    "DEFAULT_MODELS_DIR",
    "DeviceOutOfMemoryError",
    "ExportError",
    "HaloCalibration",
    "HaloCalibrator",
    "ImportRefusedError",
    "IncompatibleWeightsError",
    "InferenceError",
    "InferenceParams",
    "InputError",
    "Model",
    "ModelError",
    "ModelRepository",
    "ModelSpec",
    "ModelUnavailableError",
    "ParamError",
    "Predictor",
    "PreprocessStep",
    "ReceptiveField",
    "RegistryError",
    "RunPlan",
    "SpecError",
    "UnknownModelError",
    "WeightsError",
    "calibrate_halo",
    "load_predictor",
    "load_spec",
    "parse_params",
    "probe_receptive_field",
    "resolve_device",
    "spec_from_mapping",
]


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
