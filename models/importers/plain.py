"""Import a bare TorchScript or ONNX file: probe what it does not say, write a spec with ``halo: auto``.

A TorchScript file is a zip archive holding ``code/`` (``torch.jit.save``); a ``torch.save`` state
dict is refused (it has no architecture: write an eager spec, README "Serve your own model"). An
ONNX file is a protobuf ``ModelProto``. The layout hints are the ONNX graph's input shape, or the
first convolution weight ``(C_out, C_in, *k)`` of a TorchScript module; the probes check them.
The output activation is ``--activation``'s, else chosen from the outputs on random inputs
(:mod:`models.importers.activation`), and said in the spec's description and comment.
"""

from __future__ import annotations

import logging
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.errors import ImportRefusedError
from models.importers.activation import ActivationChoice, choose_activation
from models.importers.convert import FORMATS, WrittenModel, model_name, write_model
from models.importers.probe import NetworkFacts, probe_network

__all__ = ["default_tile", "import_file", "is_torchscript", "spec_mapping"]

logger = logging.getLogger(__name__)


def is_torchscript(path: Path) -> bool:
    """Whether ``path`` is a ``torch.jit.save`` archive (a zip with a ``code/`` folder)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any("/code/" in f"/{n}" for n in archive.namelist())


def _load(path: Path, kind: str) -> tuple[Any, int | None, int | None]:
    """The forward function of the file, and the spatial dims and input channels it declares."""
    if kind == "onnx":
        import onnxruntime as ort

        try:
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime's own exception types
            raise ImportRefusedError(f"{path}: not a readable ONNX model: {exc}") from exc
        inputs = session.get_inputs()
        if len(inputs) != 1:
            names = [i.name for i in inputs]
            raise ImportRefusedError(f"{path}: the graph takes {len(inputs)} inputs {names}; one image input")
        shape = list(inputs[0].shape)
        dims = len(shape) - 2 if 3 <= len(shape) <= 5 else None
        channels = shape[1] if dims and isinstance(shape[1], int) else None
        name = inputs[0].name

        def run_onnx(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(session.run(None, {name: x.numpy()})[0])

        return run_onnx, dims, channels
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript deprecation notices
        try:
            module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
        except RuntimeError as exc:
            raise ImportRefusedError(f"{path}: not a loadable TorchScript file: {exc}") from exc
    module.eval()
    dims = channels = None
    for param in module.parameters():
        if 3 <= param.ndim <= 5:  # the first convolution: (C_out, C_in, *kernel)
            dims, channels = param.ndim - 2, int(param.shape[1])
            break

    def run_script(x: torch.Tensor) -> torch.Tensor:
        return module(x)  # type: ignore[no-any-return]

    return run_script, dims, channels


def default_tile(spatial_dims: int, alignment: int) -> int:
    """Default tile per axis: 96 in 3-D, 256 in 1-D/2-D, rounded up to ``alignment``."""
    tile = 96 if spatial_dims == 3 else 256
    return -(-tile // alignment) * alignment


def spec_mapping(
    facts: NetworkFacts,
    name: str,
    backend: str,
    description: str,
    activation: ActivationChoice | None = None,
) -> dict[str, Any]:
    """The spec of a probed network: measured facts, ``halo: auto`` for local networks.

    ``activation`` (when given) becomes ``output.activation`` and is said in the description.

    A tile-dependent network gets no halo (no halo makes it exact) but overlapping tiles blended
    with linear ramps (``triangular``), which agree with the whole-image pass better than nnU-Net's
    peaked gaussian (see :mod:`models.importers.nnunet_folder`).
    """
    tile = default_tile(facts.spatial_dims, facts.alignment)
    if facts.tile_dependent:
        defaults: dict[str, Any] = {"tile": tile, "halo": 0, "overlap": tile // 4, "blend": "triangular"}
    else:
        defaults = {"tile": tile, "halo": "auto"}
    mapping: dict[str, Any] = {
        "name": name,
        "description": description,
        "backend": backend,
        "spatial_dims": facts.spatial_dims,
        "in_channels": facts.in_channels,
        "out_channels": facts.out_channels,
        "alignment": facts.alignment,
        "scale": facts.scale,
    }
    if facts.receptive_field is not None:
        mapping["receptive_field"] = list(facts.receptive_field)
    mapping["tile_dependent"] = facts.tile_dependent
    if activation is not None:
        mapping["output"] = {"activation": activation.activation, "kind": "probabilities"}
        what = "probabilities" if activation.probabilities else "raw values (logits), not probabilities"
        mapping["description"] = f"{description}; output activation {activation.activation}: {what}"
    mapping["defaults"] = defaults
    return mapping


def _sample_outputs(run: Any, facts: NetworkFacts) -> list[np.ndarray]:
    """The network's outputs on three random inputs of a small aligned size (for the activation)."""
    size = -(-(32 if facts.spatial_dims == 3 else 64) // facts.alignment) * facts.alignment
    outputs = []
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn((1, facts.in_channels, *[size] * facts.spatial_dims), generator=generator)
        with torch.inference_mode():
            outputs.append(np.asarray(run(x), dtype=np.float32))
    return outputs


def _probe_summary(facts: NetworkFacts) -> str:
    reach = "unbounded within the probes" if facts.receptive_field is None else list(facts.receptive_field)
    return (
        f"measured: alignment {facts.alignment}, scale {facts.scale}, receptive-field radius {reach}, "
        f"{'tile-dependent' if facts.tile_dependent else 'local (tiles with halo >= radius are exact)'} "
        f"({facts.seconds:.1f} s of probes)"
    )


def import_file(
    source: Path, *, name: str | None, models_dir: Path, fmt: str | None, activation: str | None = None
) -> WrittenModel:
    """Import a TorchScript (``.pt``, ``.ts``) or ONNX (``.onnx``) file into ``models_dir``.

    Args:
        source: the file.
        name: the model name (default: from the file name).
        models_dir: where ``NAME.yaml`` and the weights go.
        fmt: ``torchscript`` or ``onnx``; ``None`` keeps the file's own format (copied as is).
        activation: ``softmax``, ``sigmoid`` or ``none``; ``None``: chosen from the outputs
            (:func:`models.importers.activation.choose_activation`).

    Raises:
        ImportRefusedError: not TorchScript/ONNX, a state dict, an ONNX file asked for as
            TorchScript, a network the probes cannot make sense of, or an ``activation`` that would
            squash outputs already in [0, 1].
        ExportError: the TorchScript-to-ONNX conversion failed or lost parity.
    """
    if source.suffix.lower() == ".onnx":
        kind = "onnx"
    elif is_torchscript(source):
        kind = "torchscript"
    elif zipfile.is_zipfile(source) or source.suffix.lower() in (".pt", ".pth", ".ts"):
        raise ImportRefusedError(
            f"{source}: not TorchScript (no code/ in the archive; a state dict has no architecture): save "
            "it with torch.jit.save, or write an eager spec (README, 'Serve your own model')"
        )
    else:
        raise ImportRefusedError(f"{source}: neither TorchScript (.pt, .ts) nor ONNX (.onnx)")
    target = fmt or kind
    if kind == "onnx" and target == "torchscript":
        raise ImportRefusedError(f"{source}: ONNX cannot be converted to TorchScript; use --format onnx")
    name = name or model_name(source.stem)
    run, dims, channels = _load(source, kind)
    facts = probe_network(run, name=name, spatial_dims=dims, in_channels=channels)
    chosen = choose_activation(_sample_outputs(run, facts), activation, name)
    models_dir.mkdir(parents=True, exist_ok=True)
    weights = models_dir / f"{name}{FORMATS[target]}"
    if target == kind == "onnx":  # one self-contained file: external data (x.onnx.data) folded in
        import onnx

        graph = onnx.load(str(source), load_external_data=True)
        onnx.save_model(graph, str(weights), save_as_external_data=False)
    elif target == kind:
        if source.resolve() != weights.resolve():
            shutil.copyfile(source, weights)
    else:
        from models.importers.convert import export_network

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript deprecation notices
            module = torch.jit.load(str(source), map_location="cpu")  # type: ignore[no-untyped-call]
        shape = [default_tile(facts.spatial_dims, facts.alignment)] * facts.spatial_dims
        export_network(
            module,
            weights,
            fmt="onnx",
            in_channels=facts.in_channels,
            core_shape=shape,
            check_shapes=[[s + facts.alignment for s in shape]],
            name=name,
        )
    description = f"{source.name}, imported by tilewise import-model"
    mapping = spec_mapping(facts, name, target, description, chosen)
    comment = f"tilewise import-model {source.name}\n{_probe_summary(facts)}\nactivation: {chosen.reason}"
    return write_model(mapping, weights, models_dir, comment)
