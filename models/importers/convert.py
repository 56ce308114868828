"""Convert an imported network to TorchScript or ONNX with a parity check; write the spec and weights.

Shapes: ``B`` batch, ``C`` input channels, ``S`` spatial axes in tilewise's array order (what the codecs
decode), ``S'`` the same axes in the order the network was trained on.

The exported file is all that serving needs: the wrappers below are plain tensor code, scripted into
the TorchScript file or traced into the ONNX graph, so neither MONAI nor nnU-Net is imported at
serving time.

- :class:`PadToShape` reproduces what MONAI's ``SlidingWindowInferer`` and nnU-Net's predictor do
  with an input smaller than their window: zero-pad it, centred, to the window (``roi_size``,
  ``patch_size``) and crop the output back. Tiles at least as large pass through untouched.
- :class:`PermuteAxes` runs a network trained on another axis order (nnU-Net's SimpleITK order
  ``(z, y, x)`` and ``transpose_forward``) on tilewise's arrays and permutes the output back.
- :class:`MeanOfNets` averages the logits of several networks (nnU-Net's folds), as nnU-Net's
  predictor does before the softmax.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn

from models.errors import ExportError, ImportRefusedError, ModelError, SpecError
from models.spec import ModelSpec, load_spec
from models.weights import sha256_file

__all__ = [
    "FORMATS",
    "MeanOfNets",
    "PadToShape",
    "PermuteAxes",
    "WrittenModel",
    "error_summary",
    "export_network",
    "export_tolerance",
    "model_name",
    "refusing",
    "write_model",
]

logger = logging.getLogger(__name__)

#: Export formats and the suffix of the weights file each writes.
FORMATS = {"torchscript": ".pt", "onnx": ".onnx"}

#: The parity tolerance :func:`export_network` uses when not given one (``import-model --atol``).
_ATOL: ContextVar[float] = ContextVar("tilewise_export_atol", default=1e-4)


@contextlib.contextmanager
def export_tolerance(atol: float) -> Iterator[None]:
    """Within the block, :func:`export_network` accepts max-abs differences up to ``atol`` by default.

    Raises:
        ImportRefusedError: ``atol`` is negative or not finite.
    """
    if not 0 <= atol < float("inf"):
        raise ImportRefusedError(f"--atol must be a finite number >= 0, got {atol}")
    token = _ATOL.set(float(atol))
    try:
        yield
    finally:
        _ATOL.reset(token)


def error_summary(exc: BaseException, limit: int = 300) -> str:
    """One line naming the cause of ``exc``: for a TorchScript or ONNX Runtime traceback (thousands of
    characters of serialized code), its last ``...Error: ...`` line; else the first line.
    """
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    errors = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b:?", line)]
    line = errors[-1] if errors and len(lines) > 1 else lines[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


class PadToShape(nn.Module):
    """Zero-pad inputs smaller than ``min_shape``, centred, run ``net``, crop the output back.

    MONAI pads ``diff // 2`` before and the rest after (``sliding_window_inference``); nnU-Net's
    ``pad_nd_image`` does the same. Axes already at least ``min_shape`` are not padded.
    """

    def __init__(self, net: nn.Module, min_shape: Sequence[int]) -> None:
        super().__init__()
        self.net = net
        self.min_shape = [int(s) for s in min_shape]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, *S)`` -> ``(B, C_out, *S)``."""
        nd = len(self.min_shape)
        pads: list[int] = []
        for k in range(nd - 1, -1, -1):  # F.pad lists the last axis first
            diff = max(self.min_shape[k] - x.shape[2 + k], 0)
            pads.append(diff // 2)
            pads.append(diff - diff // 2)
        y: torch.Tensor = self.net(torch.nn.functional.pad(x, pads))
        for k in range(nd):
            y = y.narrow(2 + k, pads[2 * (nd - 1 - k)], x.shape[2 + k])
        return y


class PermuteAxes(nn.Module):
    """Run ``net`` on the spatial axes in another order: ``x.permute(0, 1, *2 + order)``, then back."""

    def __init__(self, net: nn.Module, order: Sequence[int]) -> None:
        super().__init__()
        self.net = net
        self.forward_dims = [0, 1] + [2 + int(a) for a in order]
        inverse = [0] * len(order)
        for i, a in enumerate(order):
            inverse[int(a)] = i
        self.backward_dims = [0, 1] + [2 + a for a in inverse]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, *S)`` -> ``(B, C_out, *S)``; the network sees ``(B, C, *S')``."""
        out: torch.Tensor = self.net(x.permute(self.forward_dims))
        return out.permute(self.backward_dims)


class MeanOfNets(nn.Module):
    """The mean of several networks' outputs (logits), e.g. the folds of an nnU-Net model."""

    def __init__(self, nets: Sequence[nn.Module]) -> None:
        super().__init__()
        self.nets = nn.ModuleList(nets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, *S)`` -> ``(B, C_out, *S)``: the running sum over the nets, then ``/ len(nets)``."""
        total: torch.Tensor = self.nets[0](x)
        for net in self.nets[1:]:
            total = total + net(x)
        return total / len(self.nets)


@contextlib.contextmanager
def refusing(where: str) -> Iterator[None]:
    """Turn what a malformed source raises while it is read into a refusal naming ``where``.

    MONAI's parser evaluates ``$`` expressions (any exception) and hands back whatever a field
    holds (``None``, numbers, strings where components or sizes belong); nnU-Net's plans handler
    indexes what ``plans.json`` holds. ``tilewise import-model`` answers every refusal with one line
    and exit status 2, never a traceback. A :class:`~models.errors.ModelError` passes unchanged.

    Raises:
        ImportRefusedError: anything else raised inside the block, with its type and message.
    """
    try:
        yield
    except ModelError:
        raise
    except Exception as exc:  # the config's own expressions and values raise any type
        cause = exc.__cause__ if isinstance(exc, RuntimeError) and exc.__cause__ is not None else None
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        if cause is not None:
            detail += f" ({type(cause).__name__}: {' '.join(str(cause).split())})"
        raise ImportRefusedError(f"{where}: {detail}") from exc


def model_name(text: str) -> str:
    """A spec name (``[a-z0-9][a-z0-9._-]*``) from free text such as a file or folder name."""
    name = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")
    return name or "imported-model"


def _random_input(in_channels: int, shape: Sequence[int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((1, in_channels, *shape), generator=generator)


def _trace(core: nn.Module, example: torch.Tensor) -> Any:
    """TorchScript of ``core``: traced (conv nets trace shape-generically)."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # TracerWarnings and TorchScript deprecation notices
        return torch.jit.trace(core, example)  # type: ignore[no-untyped-call]


def _script(module: nn.Module) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript deprecation notices
        return torch.jit.script(module)


def _load_torchscript(path: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]


def export_network(
    core: nn.Module,
    path: Path,
    *,
    fmt: str,
    in_channels: int,
    core_shape: Sequence[int],
    check_shapes: Sequence[Sequence[int]],
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    atol: float | None = None,
    name: str = "model",
) -> float:
    """Write ``wrap(core)`` as TorchScript or ONNX to ``path`` and check it against eager PyTorch.

    Args:
        core: the network in eval mode, ``(B, C, *S')`` -> ``(B, C_out, *S')``.
        path: the file to write.
        fmt: ``torchscript`` (``core`` traced, the wrappers scripted around it) or ``onnx``
            (dynamic batch and spatial axes).
        in_channels: ``C``.
        core_shape: a spatial shape ``core`` accepts (trace example; multiples of its alignment).
        check_shapes: spatial shapes of the parity inputs (tilewise order), at least one.
        wrap: the wrappers around ``core`` (:class:`PadToShape`, :class:`PermuteAxes`), or none.
        atol: largest max-abs difference accepted between the file and eager PyTorch (default:
            :func:`export_tolerance`'s, else 1e-4).
        name: model name for messages.

    Returns:
        The largest max-abs difference over ``check_shapes``.

    Raises:
        ExportError: the export failed or a parity check exceeded ``atol``.
    """
    atol = _ATOL.get() if atol is None else atol
    core = core.eval()
    eager = wrap(core) if wrap is not None else core
    path.parent.mkdir(parents=True, exist_ok=True)
    run: Callable[[torch.Tensor], Any]
    try:
        if fmt == "torchscript":
            if isinstance(core, torch.jit.ScriptModule):
                traced = core
            else:
                traced = _trace(core, _random_input(in_channels, core_shape, 1))
            module = _script(wrap(traced)) if wrap is not None else traced
            module.save(str(path))
            loaded = _load_torchscript(path)

            def run_script(x: torch.Tensor) -> Any:
                with torch.inference_mode():
                    return loaded(x).numpy()

            run = run_script
        elif isinstance(core, torch.jit.ScriptModule):  # torch.export takes no ScriptModule
            scripted = _script(wrap(core)) if wrap is not None else core
            run = _export_onnx(scripted, path, in_channels, core_shape, name)
        else:
            run = _export_onnx(eager, path, in_channels, core_shape, name)
    except ModelError:
        raise
    except Exception as exc:  # torch.jit / torch.export raise many types
        raise ExportError(f"{name}: {fmt} export failed: {error_summary(exc)}") from exc
    worst = 0.0
    for seed, shape in enumerate(check_shapes):
        x = _random_input(in_channels, shape, seed)
        with torch.inference_mode():
            expected = eager(x).float().numpy()
        try:
            got = np.asarray(run(x), dtype=np.float32)
        except Exception as exc:  # onnxruntime / TorchScript runtime errors
            raise ExportError(
                f"{name}: the {fmt} file fails on input {tuple(shape)}: {error_summary(exc)}"
            ) from exc
        if got.shape != expected.shape:
            raise ExportError(f"{name}: {fmt} output {got.shape} != eager {expected.shape} on {tuple(shape)}")
        diff = float(np.abs(got - expected).max())
        logger.info("%s: %s parity on %s: max abs difference %.3g", name, fmt, tuple(shape), diff)
        if not diff <= atol:
            raise ExportError(
                f"{name}: {fmt} differs from eager by {diff:.3g} > {atol:g} on {tuple(shape)} "
                "(a looser tolerance: --atol)"
            )
        worst = max(worst, diff)
    return worst


def _export_onnx(
    module: nn.Module, path: Path, in_channels: int, shape: Sequence[int], name: str
) -> Callable[[torch.Tensor], Any]:
    from torch.export import Dim

    try:
        import onnxruntime as ort
    except ImportError as exc:  # pragma: no cover - the cpu/gpu extra is installed with tilewise
        raise ImportRefusedError(f"{name}: ONNX export needs onnxruntime (tilewise[cpu])") from exc
    example = torch.zeros((1, in_channels, *shape))
    axes = (0, *range(2, 2 + len(shape)))
    auto = {axis: Dim.AUTO for axis in axes}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.export / onnxscript notices about their internals
        if isinstance(module, torch.jit.ScriptModule):  # torch.export takes no ScriptModule
            dynamic = {axis: f"axis{axis}" for axis in axes}
            torch.onnx.export(
                module,
                (example,),
                str(path),
                dynamo=False,
                input_names=["input"],
                output_names=["output"],
                dynamic_axes={"input": dynamic, "output": dynamic},
                opset_version=18,
            )
            return _ort_runner(ort, path)
        program = torch.onnx.export(
            module,
            (example,),
            None,
            input_names=["input"],
            output_names=["output"],
            opset_version=18,
            dynamo=True,
            dynamic_shapes=(auto,),
            external_data=False,
            verbose=False,
        )
        if program is None:
            raise ExportError(f"{name}: torch.onnx.export returned no program")
        program.save(str(path), external_data=False)
    return _ort_runner(ort, path)


def _ort_runner(ort: Any, path: Path) -> Callable[[torch.Tensor], Any]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name

    def run(x: torch.Tensor) -> Any:
        return session.run(None, {input_name: x.numpy()})[0]

    return run


@dataclass(frozen=True, slots=True)
class WrittenModel:
    """An imported model on disk: its spec file, the validated spec and the YAML text."""

    spec_path: Path
    spec: ModelSpec
    text: str


def write_model(mapping: Mapping[str, Any], weights: Path, models_dir: Path, comment: str) -> WrittenModel:
    """Write ``DIR/NAME.yaml`` for ``mapping`` (its ``file`` is ``weights``, already in ``DIR``).

    The sha256 of ``weights`` is recorded; the file is then read back with :func:`load_spec`, so a
    spec that tilewise would refuse at start-up is never left behind.

    Raises:
        ImportRefusedError: the spec does not validate (a mapping this importer got wrong).
    """
    data = {**mapping, "file": weights.name, "sha256": sha256_file(weights)}
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    text = header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)
    path = models_dir / f"{data['name']}.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        spec = load_spec(path)
    except SpecError as exc:
        path.unlink(missing_ok=True)
        raise ImportRefusedError(f"the spec written for {data['name']!r} is invalid: {exc}") from exc
    return WrittenModel(path, spec, text)
