"""Export eager models to ONNX (dynamic batch and spatial axes) or TorchScript, with a parity check."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from models.errors import BackendUnavailableError, ExportError
from models.spec import ModelSpec

__all__ = ["ExportReport", "alignment_note", "export_onnx", "export_torchscript", "onnx_spec_mapping"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExportReport:
    """Outcome of an export: where, parity against eager (max abs difference) and timing."""

    path: Path
    export_shape: tuple[int, ...]
    parity_shape: tuple[int, ...]
    max_abs_diff: float
    atol: float
    seconds: float


def alignment_note(alignment: int | Sequence[int], spatial_dims: int) -> str:
    """What sizes an exported file takes: ``"takes spatial sizes that are multiples of 16 per axis ..."``.

    ``alignment`` is the spec's (one int, or one per axis). A strided network's exported graph
    concatenates skip connections whose sizes only agree on its stride grid: other sizes fail in
    ONNX Runtime (a Concat error) or TorchScript (a size mismatch). tilewise pads tiles to the grid;
    a caller of the bare file must do the same.
    """
    per_axis = [int(alignment)] * spatial_dims if isinstance(alignment, int) else [int(a) for a in alignment]
    if all(a == 1 for a in per_axis):
        return "takes any spatial size (alignment 1)"
    grid = str(per_axis[0]) if len(set(per_axis)) == 1 else "x".join(str(a) for a in per_axis)
    example = "x".join(str(a * 3) for a in per_axis)
    odd = "x".join(str(a * 3 - 1) for a in per_axis)
    return (
        f"takes only spatial sizes that are multiples of {grid} per axis (alignment, the stride grid): "
        f"{example} runs, {odd} fails; pad inputs to the grid first"
    )


def _parity_input(in_channels: int, shape: Sequence[int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((2, in_channels, *shape), generator=generator)


def _check(report: ExportReport, name: str) -> ExportReport:
    logger.info(
        "exported %s to %s: max abs difference %.3g (atol %g) on %s",
        name,
        report.path,
        report.max_abs_diff,
        report.atol,
        report.parity_shape,
    )
    if not report.max_abs_diff <= report.atol:
        raise ExportError(
            f"{name}: exported model differs from eager by {report.max_abs_diff:.3g} > atol {report.atol:g} "
            f"on input {report.parity_shape}"
        )
    return report


def export_onnx(
    module: nn.Module,
    path: Path,
    *,
    in_channels: int,
    export_shape: Sequence[int],
    parity_shape: Sequence[int] | None = None,
    alignment: int = 1,
    atol: float = 1e-4,
    opset: int = 18,
    name: str = "model",
) -> ExportReport:
    """Export ``module`` to ONNX with dynamic batch and spatial axes, then check parity.

    The parity input is random ``(2, in_channels, *parity_shape)``; its default spatial shape is
    ``export_shape`` plus ``alignment`` on every axis, so the dynamic axes are exercised.

    Args:
        module: an eager module mapping ``(B, in_channels, *spatial)`` to ``(B, C_out, *spatial')``.
        path: the ``.onnx`` file to write (a single file, no external data).
        in_channels: input channels.
        export_shape: spatial shape of the example input used for tracing (voxels).
        parity_shape: spatial shape of the parity input (default: see above).
        alignment: the network's total stride.
        atol: max abs difference accepted between ONNX Runtime and eager.
        opset: ONNX opset version.
        name: model name for messages.

    Returns:
        The :class:`ExportReport`.

    Raises:
        ExportError: export failed, or parity exceeded ``atol`` (the file is kept for inspection).
        BackendUnavailableError: onnx, onnxscript or onnxruntime is missing.
    """
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise BackendUnavailableError(
            "ONNX export needs onnxruntime (tilewise[cpu]) for its parity check"
        ) from exc
    start = time.perf_counter()
    module = module.eval().cpu()
    export_shape = tuple(int(s) for s in export_shape)
    parity = tuple(parity_shape) if parity_shape is not None else tuple(s + alignment for s in export_shape)
    example = torch.zeros((1, in_channels, *export_shape))
    dims = {0: "batch", **{2 + i: f"spatial{i}" for i in range(len(export_shape))}}
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        from torch.export import Dim

        auto = {axis: Dim.AUTO for axis in dims}
        with warnings.catch_warnings():
            # torch.export and onnxscript emit Deprecation/FutureWarnings about their own internals.
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module,
                (example,),
                None,
                input_names=["input"],
                output_names=["output"],
                opset_version=opset,
                dynamo=True,
                dynamic_shapes={"x": auto} if _arg_name(module) == "x" else (auto,),
                external_data=False,
                verbose=False,
            )
            assert program is not None
            program.save(str(path), external_data=False)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"{name}: ONNX export needs onnx and onnxscript (tilewise[export])"
        ) from exc
    except Exception as exc:  # torch.export raises many types
        raise ExportError(f"{name}: ONNX export failed: {exc}") from exc
    x = _parity_input(in_channels, parity, seed=0)
    with torch.inference_mode():
        expected = module(x).float().numpy()
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    except Exception as exc:  # onnxruntime's own exception types
        raise ExportError(f"{name}: the exported model does not run in onnxruntime: {exc}") from exc
    if got.shape != expected.shape:
        raise ExportError(f"{name}: ONNX output shape {got.shape} != eager {expected.shape} on {parity}")
    diff = float(np.abs(got - expected).max())
    report = ExportReport(path, export_shape, parity, diff, atol, time.perf_counter() - start)
    return _check(report, name)


def _arg_name(module: nn.Module) -> str:
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return "x"
    return params[0] if params else "x"


def export_torchscript(
    module: nn.Module,
    path: Path,
    *,
    in_channels: int,
    export_shape: Sequence[int],
    atol: float = 1e-4,
    alignment: int = 1,
    name: str = "model",
) -> ExportReport:
    """Trace ``module`` to TorchScript (convolutional nets trace shape-generically) and check parity.

    Raises:
        ExportError: tracing failed or parity on a differently sized input exceeded ``atol``.
    """
    start = time.perf_counter()
    module = module.eval().cpu()
    export_shape = tuple(int(s) for s in export_shape)
    parity = tuple(s + alignment for s in export_shape)
    try:
        with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
            warnings.simplefilter("ignore")  # TracerWarnings and deprecation notices
            example = torch.zeros((1, in_channels, *export_shape))
            traced = torch.jit.trace(module, example)  # type: ignore[no-untyped-call]
            path.parent.mkdir(parents=True, exist_ok=True)
            traced.save(str(path))
            loaded = torch.jit.load(str(path))  # type: ignore[no-untyped-call]
    except Exception as exc:  # torch.jit raises many types
        raise ExportError(f"{name}: TorchScript export failed: {exc}") from exc
    x = _parity_input(in_channels, parity, seed=0)
    with torch.inference_mode():
        diff = float((loaded(x) - module(x)).abs().max())
    report = ExportReport(path, export_shape, parity, diff, atol, time.perf_counter() - start)
    return _check(report, name)


def onnx_spec_mapping(
    spec: ModelSpec, onnx_path: Path, sha256: str, *, name: str | None = None
) -> dict[str, Any]:
    """A spec mapping for the ONNX export of ``spec`` (same channels, preprocessing and defaults)."""
    return {
        "name": name or f"{spec.name}-onnx",
        "description": f"ONNX export of {spec.name}; {alignment_note(spec.alignment, spec.spatial_dims)}",
        "backend": "onnx",
        "file": onnx_path.name,
        "sha256": sha256,
        "spatial_dims": spec.spatial_dims,
        "in_channels": spec.in_channels,
        "out_channels": spec.out_channels,
        "alignment": list(spec.alignment) if isinstance(spec.alignment, tuple) else spec.alignment,
        "scale": spec.scale,
        "receptive_field": None if spec.receptive_field is None else list(spec.receptive_field),
        "tile_dependent": spec.tile_dependent,
        "spacing": None if spec.spacing is None else list(spec.spacing),
        "orientation": spec.orientation,
        "labels": None if spec.labels is None else dict(spec.labels),
        "mirror_axes": list(spec.mirror_axes or ()),
        "frame": None if spec.frame is None else spec.frame.model_dump(mode="json"),
        **({"padding": spec.padding.value} if spec.padding.value != "end" else {}),
        "preprocess": [step.to_spec() for step in spec.preprocess],
        "output": spec.output.model_dump(mode="json"),
        "defaults": spec.defaults.model_dump(mode="json", exclude_none=True),
    }
