"""tilewise models: specs, backends (eager, TorchScript, ONNX Runtime), built-ins, receptive fields.

>>> from models import InferenceOptions, ModelRepository
>>> repo = ModelRepository(models_dir="/nonexistent")  # built-ins only
>>> "gaussian-3d" in repo.names()
True
"""

from __future__ import annotations

from models.backends import BasePredictor, Predictor, load_predictor, resolve_device
from models.errors import (
    BackendError,
    BackendUnavailableError,
    ChecksumMismatchError,
    DeviceOutOfMemoryError,
    ExportError,
    IncompatibleWeightsError,
    InferenceError,
    InputError,
    ModelError,
    RegistryError,
    SpecError,
    UnknownModelError,
    WeightsError,
)
from models.options import InferenceOptions, ResolvedOptions
from models.receptive import HaloCalibration, ReceptiveField, calibrate_halo, probe_receptive_field
from models.repository import DEFAULT_MODELS_DIR, Model, ModelRepository
from models.spec import ModelDefaults, ModelSpec, PreprocessStep, load_spec, spec_from_mapping

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "BasePredictor",
    "ChecksumMismatchError",
    "DEFAULT_MODELS_DIR",
    "DeviceOutOfMemoryError",
    "ExportError",
    "HaloCalibration",
    "IncompatibleWeightsError",
    "InferenceError",
    "InferenceOptions",
    "InputError",
    "Model",
    "ModelDefaults",
    "ModelError",
    "ModelRepository",
    "ModelSpec",
    "Predictor",
    "PreprocessStep",
    "ReceptiveField",
    "RegistryError",
    "ResolvedOptions",
    "SpecError",
    "UnknownModelError",
    "WeightsError",
    "calibrate_halo",
    "load_predictor",
    "load_spec",
    "probe_receptive_field",
    "resolve_device",
    "spec_from_mapping",
]
