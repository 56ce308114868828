"""Backends: PyTorch eager, TorchScript, ONNX Runtime and analytic nets behind :class:`Predictor`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.backends.base import BasePredictor, PoolingContext, Predictor, resolve_device

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from models.spec import ModelSpec

__all__ = ["BasePredictor", "PoolingContext", "Predictor", "load_predictor", "resolve_device"]


def load_predictor(
    spec: ModelSpec,
    device: str | torch.device | None = None,
    *,
    providers: Sequence[str] | None = None,
) -> BasePredictor:
    """Build the predictor of ``spec`` on ``device`` (``None``: CUDA when available, else CPU).

    Args:
        spec: a validated model spec.
        device: torch device string; ONNX Runtime maps it to execution providers.
        providers: ONNX Runtime providers in order of preference (default: TensorRT, CUDA, CPU
            as available; CPU only when ``device`` is a CPU).

    Raises:
        WeightsError: the file is missing, unreadable or fails its checksum.
        BackendUnavailableError: the runtime or a requested provider is missing.
        BackendError: the runtime cannot build a session from the file.
    """
    dev = resolve_device(device)
    if spec.backend == "onnx":
        from models.backends.ort import OrtPredictor

        return OrtPredictor(spec, dev, providers=providers)
    from models.backends.eager import EagerPredictor, load_eager_module

    return EagerPredictor(spec, dev, load_eager_module(spec))
