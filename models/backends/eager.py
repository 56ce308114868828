"""PyTorch backends: eager modules (architecture in code + weights), TorchScript and analytic nets."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from models.backends.base import BasePredictor
from models.errors import DeviceOutOfMemoryError, InferenceError, SpecError, WeightsError
from models.spec import ModelSpec
from models.weights import load_weights, require_file, verify_checksum
from models.zoo.analytic import DEFAULT_SIGMA, DEFAULT_TRUNCATE, AnalyticNet

__all__ = ["EagerPredictor", "load_eager_module", "translate_torch_errors"]

logger = logging.getLogger(__name__)

_AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@contextlib.contextmanager
def translate_torch_errors(model: str) -> Iterator[None]:
    """Translate exceptions raised during a torch forward into :mod:`models.errors`."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        raise DeviceOutOfMemoryError(f"model {model!r}: device out of memory: {exc}") from exc
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        if "out of memory" in str(exc).lower():
            raise DeviceOutOfMemoryError(f"model {model!r}: out of memory: {exc}") from exc
        raise InferenceError(f"model {model!r}: forward failed: {exc}") from exc


def load_eager_module(spec: ModelSpec) -> nn.Module:
    """Build the module of an ``analytic``, ``eager`` or ``torchscript`` spec on the CPU.

    Raises:
        SpecError: unknown architecture or analytic kind, parameters that do not fit.
        WeightsError: missing or unreadable file (``ChecksumMismatchError``,
            ``IncompatibleWeightsError`` for the specific cases).
    """
    where = spec.where
    if spec.backend == "analytic":
        kind = spec.architecture or str(spec.params.get("kind", ""))
        params = {k: v for k, v in spec.params.items() if k != "kind"}  # checked by ModelSpec
        try:
            return AnalyticNet(
                kind,
                spec.spatial_dims,
                sigma=float(params.pop("sigma", DEFAULT_SIGMA)),
                truncate=float(params.pop("truncate", DEFAULT_TRUNCATE)),
            )
        except (TypeError, ValueError) as exc:
            raise SpecError(f"{where}: invalid analytic model: {exc}") from exc
    path = require_file(spec.file, spec.name)
    digest = verify_checksum(path, spec.sha256, spec.name)
    if spec.backend == "torchscript":
        try:
            with warnings.catch_warnings():
                # TorchScript is deprecated upstream but remains a supported input format here.
                warnings.filterwarnings("ignore", message=".*torch.jit.*", category=DeprecationWarning)
                module: nn.Module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
        except (RuntimeError, ValueError) as exc:
            raise WeightsError(f"model {spec.name!r}: {path} is not a TorchScript file: {exc}") from exc
    else:
        from models.zoo.nets import build_architecture

        assert spec.architecture is not None  # spec validation requires it for eager
        module = build_architecture(
            spec.architecture,
            spec.spatial_dims,
            spec.in_channels,
            spec.out_channels,
            dict(spec.params),
            where,
        )
        load_weights(module, path, spec.name)
    logger.info("model %s: loaded %s (%s, sha256 %s)", spec.name, path, spec.backend, digest)
    return module


class EagerPredictor(BasePredictor):
    """A torch module (eager, TorchScript or analytic) behind :class:`Predictor`.

    The module is put in ``eval()`` mode and run under ``torch.inference_mode()``. On CUDA:
    ``cudnn.benchmark`` (tiles have fixed shapes), optional autocast (``spec.precision`` fp16/bf16)
    and channels-last memory format (``spec.channels_last``).
    """

    def __init__(self, spec: ModelSpec, device: torch.device, module: nn.Module) -> None:
        super().__init__(spec, device)
        self.module = module.eval().to(device)
        self.amp_dtype = _AMP_DTYPES.get(spec.precision) if device.type == "cuda" else None
        self.memory_format: Any = None
        radius = getattr(module, "radius", None)
        if spec.backend == "analytic" and isinstance(radius, int):
            self.receptive_field = (radius,) * spec.spatial_dims  # follows sigma/truncate in params
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True
            if spec.channels_last and spec.spatial_dims in (2, 3):
                self.memory_format = torch.channels_last if spec.spatial_dims == 2 else torch.channels_last_3d
                self.module = self.module.to(memory_format=self.memory_format)  # type: ignore[call-overload]
        logger.info(
            "model %s: %s on %s (autocast %s, channels_last %s)",
            spec.name,
            spec.backend,
            device,
            self.amp_dtype,
            self.memory_format is not None,
        )

    def describe(self) -> dict[str, Any]:
        """Backend, device and precision."""
        return {**super().describe(), "precision": str(self.amp_dtype or torch.float32)}

    def _forward(self, batch: torch.Tensor) -> torch.Tensor:
        if self.memory_format is not None:
            batch = batch.contiguous(memory_format=self.memory_format)
        amp = (
            torch.autocast(device_type="cuda", dtype=self.amp_dtype)
            if self.amp_dtype is not None
            else contextlib.nullcontext()
        )
        with translate_torch_errors(self.name), torch.inference_mode(), amp:
            out = self.module(batch)
        if not isinstance(out, torch.Tensor):
            raise InferenceError(f"model {self.name!r}: forward returned {type(out).__name__}, not a tensor")
        return out.float()
