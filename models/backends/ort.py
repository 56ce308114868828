"""ONNX Runtime backend: provider choice, IO binding on CUDA, exception translation.

Providers are chosen from what the installed onnxruntime offers, in the order TensorRT, CUDA,
CPU (or as configured). onnxruntime-gpu silently falls back to the CPU when a provider cannot
start, so the providers a session really obtained are logged and exposed in :meth:`describe`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from models.backends.base import BasePredictor
from models.errors import (
    BackendError,
    BackendUnavailableError,
    DeviceOutOfMemoryError,
    InferenceError,
    ModelError,
    WeightsError,
)
from models.spec import ModelSpec
from models.weights import require_file, verify_checksum

__all__ = ["ORT_ERROR_MAP", "OrtPredictor", "choose_providers", "translate_ort_errors"]

logger = logging.getLogger(__name__)

PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
#: onnxruntime exception class name -> our class (checked complete by a meta-test).
ORT_ERROR_MAP: dict[str, type[ModelError]] = {
    "DeviceReset": InferenceError,
    "EPFail": BackendUnavailableError,
    "EngineError": InferenceError,
    "Fail": InferenceError,
    "InvalidArgument": InferenceError,
    "InvalidGraph": WeightsError,
    "InvalidProtobuf": WeightsError,
    "ModelLoadCanceled": BackendError,
    "ModelLoaded": BackendError,
    "ModelRequiresCompilation": BackendError,
    "NoModel": WeightsError,
    "NoSuchFile": WeightsError,
    "NotFound": BackendError,
    "NotImplemented": BackendUnavailableError,
    "RuntimeException": InferenceError,
}


def _ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailableError(
            "onnxruntime is not installed: install tilewise[cpu] or tilewise[gpu]"
        ) from exc
    return onnxruntime


@contextlib.contextmanager
def translate_ort_errors(model: str, action: str) -> Iterator[None]:
    """Translate onnxruntime exceptions into :mod:`models.errors`, chaining the original."""
    try:
        yield
    except ModelError:
        raise
    except Exception as exc:
        cls = ORT_ERROR_MAP.get(type(exc).__name__)
        if cls is None and type(exc).__module__.startswith("onnxruntime"):
            cls = InferenceError
        if cls is None:
            raise
        text = str(exc)
        if cls is InferenceError and (
            "out of memory" in text.lower() or "failed to allocate" in text.lower()
        ):
            cls = DeviceOutOfMemoryError
        raise cls(f"model {model!r}: onnxruntime failed to {action}: {text}") from exc


def choose_providers(device: torch.device, requested: Sequence[str] | None = None) -> list[str]:
    """Execution providers for ``device``: ``requested`` (all must exist) or the preferred ones.

    Raises:
        BackendUnavailableError: a requested provider is not available in this onnxruntime.
    """
    available = list(_ort().get_available_providers())
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise BackendUnavailableError(f"execution providers {missing} unavailable (have {available})")
        return list(requested)
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    return [p for p in PREFERRED_PROVIDERS if p in available] or ["CPUExecutionProvider"]


class OrtPredictor(BasePredictor):
    """An ONNX model run by onnxruntime behind :class:`Predictor`.

    Args:
        spec: an ``onnx`` spec (``spec.file`` is read and its checksum verified).
        device: a CPU or CUDA device; providers follow it unless ``providers`` is given.
        providers: explicit execution providers in order of preference.
        model_bytes: a serialized model to use instead of ``spec.file`` (graph rewrites).
        threads: intra-op threads (0: onnxruntime's default).
    """

    def __init__(
        self,
        spec: ModelSpec,
        device: torch.device,
        *,
        providers: Sequence[str] | None = None,
        model_bytes: bytes | None = None,
        threads: int = 0,
    ) -> None:
        super().__init__(spec, device)
        ort = _ort()
        source: Any = model_bytes
        if model_bytes is None:
            path = require_file(spec.file, spec.name)
            digest = verify_checksum(path, spec.sha256, spec.name)
            source = str(path)
            logger.info("model %s: loading %s (sha256 %s)", spec.name, path, digest)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = threads
        wanted = choose_providers(device, providers)
        with translate_ort_errors(spec.name, "load the model"):
            self.session = ort.InferenceSession(source, options, providers=wanted)
        self.providers = list(self.session.get_providers())
        logger.info(
            "model %s: onnxruntime providers requested %s, obtained %s", spec.name, wanted, self.providers
        )
        if wanted[0] not in self.providers:
            logger.warning(
                "model %s: provider %s unavailable, running on %s", spec.name, wanted[0], self.providers
            )
        inputs = self.session.get_inputs()
        self.input_name = inputs[0].name
        self.output_name = self.session.get_outputs()[0].name
        self.extra_feeds: dict[str, np.ndarray[Any, Any]] = {}
        self.on_cuda = device.type == "cuda" and self.providers[0] != "CPUExecutionProvider"
        if not self.on_cuda:
            self.device = torch.device("cpu")  # batches stay on the host for a CPU session

    def describe(self) -> dict[str, Any]:
        """Backend, device and the execution providers really obtained."""
        return {**super().describe(), "providers": self.providers}

    def set_extra_feeds(self, feeds: Mapping[str, np.ndarray[Any, Any]]) -> None:
        """Constant extra inputs fed with every batch (e.g. global-pooling statistics)."""
        self.extra_feeds = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in feeds.items()}

    def _forward(self, batch: torch.Tensor) -> torch.Tensor:
        if self.on_cuda and batch.is_cuda:
            return self._forward_bound(batch)
        array = batch.detach().cpu().numpy()
        with translate_ort_errors(self.name, "run a batch"):
            out = self.session.run([self.output_name], {self.input_name: array, **self.extra_feeds})[0]
        return torch.from_numpy(np.asarray(out, dtype=np.float32)).to(batch.device)

    def _forward_bound(self, batch: torch.Tensor) -> torch.Tensor:
        """CUDA path: bind the torch tensors' device memory, no host round trip."""
        spatial = [s * self.scale for s in batch.shape[2:]]
        out = torch.empty((batch.shape[0], self.out_channels, *spatial), device=batch.device)
        index = batch.device.index or 0
        with translate_ort_errors(self.name, "run a batch"):
            binding = self.session.io_binding()
            binding.bind_input(
                self.input_name, "cuda", index, np.float32, tuple(batch.shape), batch.data_ptr()
            )
            for name, value in self.extra_feeds.items():
                binding.bind_cpu_input(name, value)
            binding.bind_output(self.output_name, "cuda", index, np.float32, tuple(out.shape), out.data_ptr())
            torch.cuda.current_stream(batch.device).synchronize()
            self.session.run_with_iobinding(binding)
        return out
