"""Exceptions raised by :mod:`models`.

One root, :class:`ModelError`; each class also inherits the builtin it refines, so a generic
``except ValueError`` or ``except LookupError`` keeps working::

    ModelError(Exception)
      UnknownModelError(ModelError, LookupError)   name not registered; message lists close matches
      RegistryError(ModelError, RuntimeError)      duplicate registration
      SpecError(ModelError, ValueError)            invalid spec file: names the file and the field
      InputError(ModelError, ValueError)           input the model cannot take (channels, dimensions)
      ParamError(ModelError, ValueError)           unknown inference parameter or invalid value
      WeightsError(ModelError)                     weights file missing or unreadable
        ChecksumMismatchError(WeightsError)        SHA-256 differs from the spec's
        IncompatibleWeightsError(WeightsError)     missing/unexpected keys, shape mismatch
      BackendError(ModelError)                     runtime could not build a session
        BackendUnavailableError(BackendError)      optional package or execution provider missing
        InferenceError(BackendError)               backend failed during forward; original chained
          DeviceOutOfMemoryError(InferenceError)
      ExportError(ModelError)                      export failed or parity exceeded the tolerance
      ImportRefusedError(ModelError, ValueError)   import-model cannot map a source (names what)
      ModelUnavailableError(ModelError)            a model listed as unavailable (its spec failed to load)
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "ChecksumMismatchError",
    "DeviceOutOfMemoryError",
    "ExportError",
    "ImportRefusedError",
    "IncompatibleWeightsError",
    "InferenceError",
    "InputError",
    "ModelError",
    "ModelUnavailableError",
    "ParamError",
    "RegistryError",
    "SpecError",
    "UnknownModelError",
    "WeightsError",
]


class ModelError(Exception):
    """Root of every error raised by :mod:`models`."""


class UnknownModelError(ModelError, LookupError):
    """A model name that is not registered; the message lists close matches."""


class RegistryError(ModelError, RuntimeError):
    """Two specs register the same model name."""


class SpecError(ModelError, ValueError):
    """A model spec file is invalid; the message names the file and the field."""


class InputError(ModelError, ValueError):
    """Input the model cannot take: wrong channel count or number of spatial dimensions."""


class ParamError(ModelError, ValueError):
    """An unknown inference parameter or an invalid value (the message names both)."""


class WeightsError(ModelError):
    """A weights file is missing, unreadable or not of the expected format."""


class ChecksumMismatchError(WeightsError):
    """A weights file's SHA-256 differs from the one its spec records."""


class IncompatibleWeightsError(WeightsError):
    """A state dict does not fit the architecture (missing/unexpected keys, shapes)."""


class BackendError(ModelError):
    """A runtime (PyTorch, TorchScript, onnxruntime) could not build a predictor."""


class BackendUnavailableError(BackendError):
    """An optional package or execution provider is missing."""


class InferenceError(BackendError):
    """The backend failed during a forward pass; the original exception is chained."""


class DeviceOutOfMemoryError(InferenceError):
    """The device ran out of memory during a forward pass (try a smaller tile or batch)."""


class ExportError(ModelError):
    """Export failed, or the exported model differs from eager by more than the tolerance."""


class ImportRefusedError(ModelError, ValueError):
    """``tilewise import-model`` cannot map a source; the message names the field or transform."""


class ModelUnavailableError(ModelError):
    """The model is listed but failed to load at start-up; the message gives the reason."""
