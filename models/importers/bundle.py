"""Import a MONAI bundle (folder or zip): its metadata, inference config, and network.

Read with MONAI's own ``ConfigParser`` (references and expressions resolved as MONAI resolves them):

- ``configs/metadata.json``: input and output channels (``network_data_format``), label names
  (``outputs.pred.channel_def``), the bundle's name.
- ``configs/inference.json`` (or ``.yaml``): ``preprocessing`` (Orientationd -> ``orientation``, Spacingd
  -> ``spacing`` with ``resampling: corners`` (MONAI's grid: the first voxel centres kept, ``round((n-1)
  * zoom / pixdim + 1)`` voxels of exactly ``pixdim``), ScaleIntensityRanged -> ``scale_range``,
  NormalizeIntensityd -> ``zscore`` / ``normalize``; loading, channel-first and type conversions are what
  tilewise's codecs do anyway), ``inferer`` (``roi_size`` -> ``tile``, ``sw_batch_size`` ->
  ``batch_size``; for a tile-dependent network ``overlap`` and ``mode`` -> ``overlap``, ``blend``; a
  local one gets ``halo: auto`` instead, which makes the tiles exact), ``postprocessing`` (Activationsd
  -> ``output.activation``, AsDiscreted argmax -> ``output.kind: labels``; Invertd and SaveImaged are
  what tilewise does with every output).
- the network: ``network_def`` instantiated by the parser with ``models/model.pt`` loaded strictly,
  else ``models/model.ts``; exported wrapped in :class:`~models.importers.convert.PadToShape`
  (``roi_size``), since ``SlidingWindowInferer`` zero-pads smaller inputs, centred, to ``roi_size``.

Windows (``SlidingWindowInferer``): ``padding: centred-monai`` (:class:`tiling.Placement`) places the
image as ``sliding_window_inference`` does: an axis shorter than ``roi_size`` zero-padded to it,
``(roi - size) // 2`` before and the rest after (not first rounded up to the alignment); for a
tile-dependent network, windows ``int(roi * (1 - overlap))`` apart with the last one shifted back
to the image edge, each window's whole output averaged (``mode: constant``) or weighted by a
gaussian of sigma ``roi / 8`` (``mode: gaussian``; MONAI floors its N-D weights at 1e-3, tilewise
its per-axis weights at 1e-6, so the two differ wherever MONAI's N-D product falls below 1e-3, at
the edges and corners of each window: up to 0.67 measured on a random instance-norm UNet, roi 32;
``constant`` agrees within 1e-4). A local network keeps exact tiles (``halo: auto``) along axes
longer than ``roi_size``.
Transformers (UNETR, SwinUNETR: self-attention over patch tokens) take exactly one input size:
``fixed_tile: true``, the tile and alignment are the window (UNETR's ``img_size``, which must be
the ``roi_size``), tile-dependent, with MONAI's blended windows (``overlap``, ``mode``); the traced
graph runs at that size only (smaller inputs are padded to it, as MONAI pads them).
Multi-label outputs (``Activationsd(sigmoid=True)`` over several channels) are probabilities:
``output=labels`` is refused for them by name (one label per voxel cannot hold two); an
``AsDiscreted(threshold=0.5)`` after a sigmoid is that threshold (labels for one channel).

Any other transform, or an option of these that tilewise cannot reproduce, is refused by name.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import pydoc
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.errors import ImportRefusedError
from models.importers.convert import (
    FORMATS,
    PadToShape,
    WrittenModel,
    export_network,
    model_name,
    refusing,
    write_model,
)
from models.importers.probe import probe_network

__all__ = ["import_bundle"]

logger = logging.getLogger(__name__)

#: Transforms that tilewise does anyway (decode, channel-first, float32, inverse geometry, writing).
_PASS = {
    "LoadImaged", "LoadImage", "EnsureChannelFirstd", "EnsureChannelFirst", "AddChanneld", "EnsureTyped",
    "EnsureType", "ToTensord", "ToTensor", "ToNumpyd", "ToDeviced", "Identityd", "Identity", "Invertd",
    "SaveImaged", "SaveImage", "CopyItemsd", "DeleteItemsd", "CastToTyped",
}  # fmt: skip


@contextlib.contextmanager
def _bundle_root(source: Path) -> Iterator[Path]:
    """The folder holding ``configs/metadata.json``: ``source`` itself, or a zip extracted to a temp dir."""
    if source.is_dir():
        yield source
        return
    with tempfile.TemporaryDirectory(prefix="tilewise-bundle-") as tmp, zipfile.ZipFile(source) as archive:
        for member in archive.namelist():
            if member.startswith(("/", "\\")) or ".." in Path(member).parts:
                raise ImportRefusedError(f"{source}: zip member {member!r} points outside the archive")
        archive.extractall(tmp)
        found = sorted(Path(tmp).rglob("configs/metadata.json"), key=lambda p: len(p.parts))
        yield found[0].parent.parent


def _monai() -> Any:
    try:
        import monai.bundle
    except ImportError as exc:
        from models.extras import install_hint

        raise ImportRefusedError(
            f"reading a MONAI bundle needs MONAI: {install_hint('import')} (serving does not)"
        ) from exc
    return getattr(monai.bundle, "ConfigParser")  # noqa: B009 (not re-exported for mypy)


def _parsed(parser: Any, key: str, where: str) -> Any:
    """``parser.get_parsed_content(key, instantiate=False)``, a failing expression refused by name."""
    try:
        return parser.get_parsed_content(key, instantiate=False)
    except Exception as exc:  # MONAI raises what the config's expressions raise
        cause = exc.__cause__ or exc
        detail = " ".join(f"{type(cause).__name__}: {cause}".split())
        raise ImportRefusedError(f"{where}: field {key!r} cannot be read: {detail}") from exc


def _args(component: Any, what: str = "component") -> tuple[str, dict[str, Any]]:
    """A config component's class name and its arguments, the class's defaults filled in.

    Raises:
        ImportRefusedError: ``component`` is not a component (``"$None"``, a number, a string).
    """
    if not hasattr(component, "resolve_module_name") or not hasattr(component, "resolve_args"):
        raise ImportRefusedError(
            f"{what} is {_shown(component)}, not a component (a mapping with '_target_')"
        )
    module_name = component.resolve_module_name()
    args = dict(component.resolve_args())
    target = pydoc.locate(module_name) if isinstance(module_name, str) else None
    if callable(target):
        with contextlib.suppress(TypeError, ValueError):
            for key, param in inspect.signature(target).parameters.items():
                if param.default is not inspect.Parameter.empty:
                    args.setdefault(key, param.default)
    name = module_name.rsplit(".", 1)[-1] if isinstance(module_name, str) else str(module_name)
    return name, args


def _transforms(parser: Any, key: str, where: str) -> list[tuple[str, dict[str, Any]]]:
    if key not in parser.config:
        raise ImportRefusedError(f"{where}: field {key!r} is missing")
    component = _parsed(parser, key, where)
    config = component.get_config() if hasattr(component, "get_config") else component
    items = config.get("transforms", []) if isinstance(config, dict) else config
    if not isinstance(items, list | tuple):
        raise ImportRefusedError(f"{where}: field {key!r} is {_shown(items)}, not a list of transforms")
    out = []
    for i, item in enumerate(items):
        if hasattr(item, "is_disabled") and item.is_disabled():
            continue
        out.append(_args(item, f"{where}: {key} transform {i}"))
    return out


def _shown(value: Any) -> str:
    """A short description of a config value for a refusal: ``None``, ``5 (int)``, ``'x' (str)``."""
    if value is None:
        return "None"
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


def _as_list(value: Any, dims: int) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value] * dims


def _preprocessing(steps: list[tuple[str, dict[str, Any]]], dims: int, where: str) -> dict[str, Any]:
    """Spec fields from the pre-transforms: ``orientation``, ``spacing`` and ``preprocess``."""
    out: dict[str, Any] = {"preprocess": []}
    for name, a in steps:
        with refusing(f"{where}: transform {name}"):
            if name in _PASS:
                if name == "CastToTyped" and "float32" not in str(a.get("dtype")):
                    dtype = a.get("dtype")
                    raise ImportRefusedError(f"{where}: transform CastToTyped(dtype={dtype}) not mapped")
                continue
            if name == "Orientationd":
                if a.get("as_closest_canonical") or not isinstance(a.get("axcodes"), str):
                    raise ImportRefusedError(f"{where}: transform Orientationd without 'axcodes' not mapped")
                out["orientation"] = a["axcodes"].upper()
            elif name == "Spacingd":
                mode = str(getattr(a.get("mode"), "value", a.get("mode"))).lower()
                pixdim = [float(v) for v in _as_list(a.get("pixdim"), dims)]
                if mode != "bilinear" or len(pixdim) < dims or min(pixdim) <= 0:
                    raise ImportRefusedError(
                        f"{where}: transform Spacingd(pixdim={a.get('pixdim')}, mode={mode}) cannot be "
                        "mapped "
                        "(tilewise resamples images linearly to one positive spacing per axis)"
                    )
                _check_spacing_options(a, where)
                out["spacing"] = pixdim[:dims]
                out["resampling"] = "corners"  # Spacing's compute_shape_offset, scale_extent=False
            elif name == "ScaleIntensityRanged":
                if a.get("b_min") is None or a.get("b_max") is None:
                    raise ImportRefusedError(f"{where}: transform ScaleIntensityRanged needs b_min and b_max")
                out["preprocess"].append(
                    {
                        "type": "scale_range",
                        **{k: float(a[k]) for k in ("a_min", "a_max", "b_min", "b_max")},
                        "clip": bool(a.get("clip")),
                    }  # fmt: skip
                )
            elif name == "NormalizeIntensityd":
                sub, div, nonzero = a.get("subtrahend"), a.get("divisor"), bool(a.get("nonzero"))
                if sub is None and div is None:
                    step = {"type": "zscore", "channel_wise": bool(a.get("channel_wise")), "nonzero": nonzero}
                    out["preprocess"].append(step)
                elif sub is not None and div is not None and not nonzero:
                    step = {"type": "normalize", "mean": _number_or_list(sub), "std": _number_or_list(div)}
                    out["preprocess"].append(step)
                else:
                    raise ImportRefusedError(f"{where}: transform NormalizeIntensityd({a}) cannot be mapped")
            else:
                raise ImportRefusedError(f"{where}: pre-transform {name} cannot be mapped")
    return out


#: Spacingd options tilewise reproduces, with the value it reproduces (MONAI's defaults).
_SPACING_OPTIONS = {
    "scale_extent": False,
    "align_corners": False,
    "padding_mode": "border",
    "diagonal": False,
}


def _check_spacing_options(args: dict[str, Any], where: str) -> None:
    """Refuse a Spacingd option other than MONAI's default, by name (the grid would differ)."""
    for key, default in _SPACING_OPTIONS.items():
        value = args.get(key, default)
        value = str(getattr(value, "value", value)).lower() if isinstance(default, str) else value
        if value is not None and value != default:
            raise ImportRefusedError(
                f"{where}: transform Spacingd({key}={value}) cannot be mapped "
                f"(tilewise places MONAI's grid as Spacingd({key}={default}) does)"
            )


def _number_or_list(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [float(v) for v in value]
    return float(value)


def _postprocessing(steps: list[tuple[str, dict[str, Any]]], where: str) -> dict[str, Any]:
    output = {"activation": "none", "kind": "probabilities"}
    for name, a in steps:
        if name in _PASS:
            continue
        if name == "Activationsd":
            if a.get("other") is not None or (a.get("softmax") and a.get("sigmoid")):
                raise ImportRefusedError(f"{where}: transform Activationsd({a}) cannot be mapped")
            activation = "softmax" if a.get("softmax") else "sigmoid" if a.get("sigmoid") else "none"
            output["activation"] = activation
        elif name == "AsDiscreted":
            if a.get("argmax") and not a.get("to_onehot") and a.get("threshold") is None:
                output["kind"] = "labels"
            elif (not a.get("argmax") and not a.get("to_onehot") and output["activation"] == "sigmoid"
                  and a.get("threshold") is not None and float(a["threshold"]) == 0.5):  # fmt: skip
                output["kind"] = "threshold"  # labels for one channel; multi-label: probabilities
            else:
                raise ImportRefusedError(f"{where}: transform AsDiscreted({a}) cannot be mapped (argmax)")
        else:
            raise ImportRefusedError(f"{where}: post-transform {name} cannot be mapped")
    return output


def _inferer(parser: Any, where: str) -> tuple[str, dict[str, Any]]:
    if "inferer" not in parser.config:
        raise ImportRefusedError(f"{where}: field 'inferer' is missing")
    name, a = _args(_parsed(parser, "inferer", where), f"{where}: field 'inferer'")
    if name == "SlidingWindowInferer":
        pad = str(getattr(a.get("padding_mode"), "value", a.get("padding_mode"))).lower()
        if pad != "constant" or float(a.get("cval") or 0) != 0:
            raise ImportRefusedError(f"{where}: SlidingWindowInferer padding_mode={pad} cval={a.get('cval')}")
        mode = str(getattr(a.get("mode"), "value", a.get("mode"))).lower()
        if isinstance(a.get("overlap"), list | tuple) or mode not in ("constant", "gaussian"):
            raise ImportRefusedError(f"{where}: SlidingWindowInferer overlap={a.get('overlap')} mode={mode}")
    elif name != "SimpleInferer":
        raise ImportRefusedError(f"{where}: inferer {name} cannot be mapped")
    return name, a


def _network(parser: Any, root: Path, where: str) -> nn.Module:
    from models.weights import load_weights

    weights = root / "models" / "model.pt"
    script = root / "models" / "model.ts"
    if "network_def" in parser.config and weights.is_file():
        try:
            network = parser.get_parsed_content("network_def")
        except Exception as exc:  # MONAI raises what the network's constructor raises
            raise ImportRefusedError(f"{where}: field 'network_def' cannot be instantiated: {exc}") from exc
        if not isinstance(network, nn.Module):
            kind = type(network).__name__
            raise ImportRefusedError(f"{where}: field 'network_def' is a {kind}, not a network")
        load_weights(network, weights, str(root.name))
        return network.eval()
    if script.is_file():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript deprecation notices
            module: nn.Module = torch.jit.load(str(script), map_location="cpu")  # type: ignore[no-untyped-call]
        return module.eval()
    raise ImportRefusedError(f"{root}: neither 'network_def' with models/model.pt nor models/model.ts")


def import_bundle(source: Path, *, name: str | None, models_dir: Path, fmt: str) -> WrittenModel:
    """Import a MONAI bundle (folder or zip) into ``models_dir`` as ``NAME.yaml`` plus weights.

    Raises:
        ImportRefusedError: a missing config, or a transform, inferer or option that tilewise cannot
            reproduce (named), or a network that cannot be built or loaded.
        ExportError: the export lost parity with the eager network.
    """
    config_parser = _monai()
    with _bundle_root(source) as root:
        configs = root / "configs"
        inference = next((configs / f"inference{s}" for s in (".json", ".yaml", ".yml")
                          if (configs / f"inference{s}").is_file()), None)  # fmt: skip
        if inference is None:
            raise ImportRefusedError(f"{source}: no configs/inference.json or .yaml")
        with refusing(f"{source} (configs/metadata.json, {inference.name})"):
            meta = json.loads((configs / "metadata.json").read_text(encoding="utf-8"))
            if not isinstance(meta, dict):
                raise ImportRefusedError(f"{source}: configs/metadata.json is {_shown(meta)}, not a mapping")
            parser = config_parser()
            parser.read_meta(str(configs / "metadata.json"))
            parser.read_config(str(inference))
            parser["bundle_root"] = str(root)
        where = f"{source} ({inference.name})"
        with refusing(where):
            inferer, inferer_args = _inferer(parser, where)
            roi = inferer_args.get("roi_size")
            net_def = parser.config.get("network_def")
            hint = len(roi) if isinstance(roi, list | tuple) else None
            if hint is None and isinstance(net_def, dict) and isinstance(net_def.get("spatial_dims"), int):
                hint = net_def["spatial_dims"]
            # the transforms are mapped (or refused) before the network is built and probed
            pre = _preprocessing(_transforms(parser, "preprocessing", where), hint, where) if hint else None
            output = _postprocessing(_transforms(parser, "postprocessing", where), where)
        network = _network(parser, root, where)
        with refusing(f"{source} (configs/metadata.json)"):
            fmt_in = meta.get("network_data_format", {})
            image = fmt_in.get("inputs", {}).get("image", {})
            pred = fmt_in.get("outputs", {}).get("pred", {})
            channels = int(image["num_channels"]) if "num_channels" in image else None
        dims = hint
        name = name or model_name(str(meta.get("name") or source.stem))
        with refusing(f"{where}: inferer roi_size"):
            window = [int(v) for v in _as_list(roi, dims)] if roi is not None and dims else None
        facts = probe_network(network, name=name, spatial_dims=dims, in_channels=channels, tile_shape=window)
        dims = facts.spatial_dims
        if pre is None:
            with refusing(where):
                pre = _preprocessing(_transforms(parser, "preprocessing", where), dims, where)
        if "num_channels" in pred and int(pred["num_channels"]) != facts.out_channels:
            raise ImportRefusedError(
                f"{where}: metadata outputs.pred.num_channels={pred['num_channels']}, the network returns "
                f"{facts.out_channels} channels"
            )
        multi_label = output["activation"] == "sigmoid" and facts.out_channels > 1
        if output["kind"] == "threshold":
            output["kind"] = "probabilities" if multi_label else "labels"
        elif output["kind"] == "labels" and multi_label:
            raise ImportRefusedError(
                f"{where}: AsDiscreted(argmax) after a sigmoid over {facts.out_channels} channels "
                "(multi-label) cannot be mapped: one label per voxel cannot hold two"
            )
        roi_shape = [int(v) for v in _as_list(roi, dims)] if inferer == "SlidingWindowInferer" else None
        if facts.fixed_shape is not None:  # a transformer: its one input size is the window
            roi_shape = list(facts.fixed_shape)
        tile = roi_shape or [96 if dims == 3 else 256] * dims
        align = list(facts.alignment_per_axis)  # per axis: an anisotropic network's own strides
        tile = [-(-t // a) * a for t, a in zip(tile, align, strict=True)]
        defaults: dict[str, Any] = {"tile": tile, "batch_size": int(inferer_args.get("sw_batch_size") or 1)}
        if facts.tile_dependent:
            overlap = float(inferer_args.get("overlap") or 0.0)
            blend = str(inferer_args.get("mode") or "constant").lower()
            # MONAI's windows lie int(roi * (1 - overlap)) apart (at least 1): the overlap keeping them so
            voxels = [t - max(int(t * (1 - overlap)), 1) for t in tile]
            defaults.update(halo=0, overlap=voxels, blend=blend)
        else:
            defaults.update(halo="auto", overlap=0, blend="constant")
        models_dir.mkdir(parents=True, exist_ok=True)
        weights = models_dir / f"{name}{FORMATS[fmt]}"
        small = [max(a, t // 2 // a * a) for t, a in zip(tile, align, strict=True)]
        larger = [t + a for t, a in zip(tile, align, strict=True)]
        if facts.fixed_shape is not None:  # smaller inputs padded to the window; none larger
            small, larger = [t // 2 + 1 for t in tile], tile
        diff = export_network(
            network,
            weights,
            fmt=fmt,
            in_channels=facts.in_channels,
            core_shape=tile,
            check_shapes=[small, larger],
            wrap=(lambda net: PadToShape(net, roi_shape)) if roi_shape else None,
            name=name,
        )
    mapping: dict[str, Any] = {
        "name": name,
        "description": f"MONAI bundle {meta.get('name', source.name)} {meta.get('version', '')}".strip(),
        "backend": fmt,
        "spatial_dims": dims,
        "in_channels": facts.in_channels,
        "out_channels": facts.out_channels,
        "alignment": align if len(set(align)) > 1 else align[0],
        "scale": facts.scale,
        **({"receptive_field": list(facts.receptive_field)} if facts.receptive_field else {}),
        "tile_dependent": facts.tile_dependent,
        **({"padding": "centred-monai"} if roi_shape else {}),
        **({"fixed_tile": True} if facts.fixed_shape is not None else {}),
        **{k: v for k, v in pre.items() if k != "preprocess"},
        "preprocess": pre["preprocess"],
        "output": output,
        "defaults": defaults,
    }
    channel_def = pred.get("channel_def")
    if isinstance(channel_def, dict) and channel_def:
        mapping["labels"] = {int(k): str(v) for k, v in channel_def.items()}
    comment = (
        f"tilewise import-model {source.name} (MONAI bundle, {inferer})\n"
        f"{fmt} parity with the eager network: max abs difference {diff:.2g}\n"
        f"windows placed as MONAI's sliding_window_inference places them (padding: centred-monai): "
        f"inputs smaller than roi_size {roi_shape} are zero-padded, (roi - size) // 2 before"
    )
    return write_model(mapping, weights, models_dir, comment)
