"""Import an nnU-Net v2 trained-model folder: the folds as one network, nnU-Net's preprocessing as steps.

Read with nnU-Net's own classes (``PlansManager``, the trainer's ``build_network_architecture``):

- ``dataset.json``: input channels (``channel_names``), label names (``labels``; region-based
  training is refused);
- ``plans.json``: the configuration of the checkpoints (``init_args.configuration``), its
  ``patch_size`` -> ``tile``, ``spacing`` -> ``spacing``, ``normalization_schemes`` per channel
  (``ZScoreNormalization`` -> ``zscore`` per channel; ``CTNormalization`` -> ``clip`` to the
  foreground 0.5 / 99.5 percentiles, then ``normalize`` by the foreground mean and std;
  ``NoNormalization``; ``RGBTo01Normalization`` -> ``normalize`` by 255), ``transpose_forward`` and
  the reader's axis order (SimpleITK's ``(z, y, x)`` is the reverse of the NIfTI array order that
  tilewise decodes);
- ``fold_*/checkpoint_final.pth``: the weights of each fold (read with ``weights_only=True``),
  ``inference_allowed_mirroring_axes`` -> ``mirror_axes`` and ``tta: mirror`` by default.

The folds become one :class:`~models.importers.convert.MeanOfNets` (the mean of their logits, before
the softmax, as ``nnUNetPredictor`` averages them), wrapped in
:class:`~models.importers.convert.PadToShape` (nnU-Net zero-pads inputs smaller than the patch,
centred) and :class:`~models.importers.convert.PermuteAxes` (the reader's axis order); ``tta=mirror``
averages logits too (``output.tta_average: logits``).

Windows are nnU-Net's (``padding: centred-nnunet``, :class:`tiling.Placement`): an axis shorter than
the patch is zero-padded to it, ``(patch - size) // 2`` before (``pad_nd_image``); a longer one gets
windows of the patch spread evenly at half a patch apart at most (``tile_step_size=0.5``,
``compute_steps_for_sliding_window``), blended with nnU-Net's gaussian (sigma patch / 8, peak at
``patch // 2``); ``tta=mirror`` flips inside each window, as ``_internal_maybe_mirror_and_predict``.
The alignment is per axis, the product of the pooling strides along it (``pool_op_kernel_sizes``:
strides ``(1, 2, 2)`` twice and ``(2, 2, 2)`` make alignment ``(2, 8, 8)`` in nnU-Net's axis order),
so the patch itself is a valid tile.

Resampling keeps nnU-Net's own grid (the spec's default ``resampling: extent``): ``round(n * zoom /
spacing)`` voxels over the same field of view, as ``compute_new_shape`` in
nnunetv2/preprocessing/resampling/default_resampling.py (MONAI bundles get ``corners`` instead).

Not reproduced (noted in the spec's header): nnU-Net crops the image to its non-zero bounding box
before normalizing and predicting (identical where the image has no all-zero border), resamples
with third-order splines where tilewise's geometry is linear, and accumulates in float16.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from models.errors import ImportRefusedError, IncompatibleWeightsError
from models.importers.convert import (
    FORMATS,
    MeanOfNets,
    PadToShape,
    PermuteAxes,
    WrittenModel,
    export_network,
    model_name,
    refusing,
    write_model,
)
from models.importers.probe import probe_network

__all__ = ["import_nnunet", "mirror_axes"]

logger = logging.getLogger(__name__)

_READERS = ("SimpleITKIO", "NibabelIO", "NibabelIOWithReorient", "NaturalImage2DIO")


def _json(path: Path) -> Any:
    if not path.is_file():
        raise ImportRefusedError(f"{path.parent}: no {path.name} (nnU-Net v2 trained-model folders have one)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ImportRefusedError(f"{path}: not readable JSON: {exc}") from exc


def _checkpoint(path: Path) -> dict[str, Any]:
    """A ``checkpoint_final.pth`` with the safe unpickler (numpy scalars in its logs allowed)."""
    safe: list[Any] = [np.dtype, np.ndarray, np.float64, np.float32, np.int64]
    with_scalar = getattr(np, "_core", None) or getattr(np, "core", None)
    if with_scalar is not None:
        safe.append(with_scalar.multiarray.scalar)
        safe.append(with_scalar.multiarray._reconstruct)
    safe.extend(type(np.dtype(t)) for t in ("float64", "float32", "int64"))
    try:
        with torch.serialization.safe_globals(safe):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler's many error types
        raise ImportRefusedError(f"{path}: not loadable with weights_only=True: {exc}") from exc
    if not isinstance(data, dict) or "network_weights" not in data:
        raise ImportRefusedError(f"{path}: field 'network_weights' is missing (not an nnU-Net v2 checkpoint)")
    return data


def _normalization(plans: dict[str, Any], config: dict[str, Any], channels: int) -> list[dict[str, Any]]:
    schemes = list(config.get("normalization_schemes") or [])
    masked = list(config.get("use_mask_for_norm") or [])
    if len(schemes) != channels:
        raise ImportRefusedError(f"plans.json: normalization_schemes {schemes} for {channels} channel(s)")
    if any(masked):
        raise ImportRefusedError(
            "plans.json: use_mask_for_norm true (z-score inside the non-zero mask of the cropped image) "
            "cannot be mapped"
        )
    if len(set(schemes)) != 1:
        raise ImportRefusedError(f"plans.json: normalization_schemes {schemes} mixes schemes across channels")
    scheme = schemes[0]
    if scheme == "ZScoreNormalization":
        return [{"type": "zscore", "channel_wise": True}]
    if scheme == "NoNormalization":
        return []
    if scheme == "RGBTo01Normalization":
        return [{"type": "normalize", "mean": 0.0, "std": 255.0}]
    if scheme == "CTNormalization":
        props = plans.get("foreground_intensity_properties_per_channel") or {}
        try:
            stats = [props[str(c)] for c in range(channels)]
            lo = [float(s["percentile_00_5"]) for s in stats]
            hi = [float(s["percentile_99_5"]) for s in stats]
            mean = [float(s["mean"]) for s in stats]
            std = [max(float(s["std"]), 1e-8) for s in stats]
        except (KeyError, TypeError, ValueError) as exc:
            raise ImportRefusedError(
                f"plans.json: 'foreground_intensity_properties_per_channel' lacks {exc} (CTNormalization)"
            ) from exc
        return [{"type": "clip", "lo": lo, "hi": hi}, {"type": "normalize", "mean": mean, "std": std}]
    raise ImportRefusedError(f"plans.json: normalization scheme {scheme} cannot be mapped")


def _networks(source: Path, plans: dict[str, Any], dataset: dict[str, Any], checkpoints: list[Any]) -> Any:
    """The folds' networks (eval mode), built as nnUNetPredictor builds them from a model folder."""
    try:
        from nnunetv2.utilities.find_objects import recursive_find_trainer_class_by_name
        from nnunetv2.utilities.label_handling.label_handling import determine_num_input_channels
        from nnunetv2.utilities.plans_handling.plans_handler import PlansManager
    except ImportError as exc:
        from models.extras import install_hint

        raise ImportRefusedError(
            f"reading an nnU-Net folder needs nnU-Net v2: {install_hint('import')} (serving does not)"
        ) from exc
    first = checkpoints[0]
    trainer_name = str(first.get("trainer_name"))
    configuration = (first.get("init_args") or {}).get("configuration") or source.name.rsplit("__", 1)[-1]
    manager = PlansManager(plans)
    try:
        config = manager.get_configuration(configuration)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise ImportRefusedError(f"plans.json: configuration {configuration!r} is missing: {exc}") from exc
    if config.previous_stage_name is not None:
        raise ImportRefusedError(
            f"plans.json: configuration {configuration!r} is a cascade stage (previous_stage)"
        )
    labels = manager.get_label_manager(dataset)
    if labels.has_regions:
        raise ImportRefusedError("dataset.json: region-based labels (sigmoid per region) cannot be mapped")
    channels = determine_num_input_channels(manager, config, dataset)
    trainer = recursive_find_trainer_class_by_name(trainer_name)
    if trainer is None:
        raise ImportRefusedError(f"checkpoint field 'trainer_name' {trainer_name!r}: no such nnU-Net trainer")
    build = trainer.build_network_architecture
    nets = []
    for fold, checkpoint in zip(sorted(source.glob("fold_*")), checkpoints, strict=False):
        if "plans_manager" in inspect.signature(build).parameters:
            heads = labels.num_segmentation_heads
            net = build(manager, config, channels, heads, enable_deep_supervision=False)
        else:  # trainers written for nnU-Net before 2.6
            net = build(
                config.network_arch_class_name,
                config.network_arch_init_kwargs,
                config.network_arch_init_kwargs_req_import,
                channels,
                labels.num_segmentation_heads,
                enable_deep_supervision=False,
            )
        try:
            net.load_state_dict(checkpoint["network_weights"])
        except RuntimeError as exc:
            raise IncompatibleWeightsError(
                f"{fold}/checkpoint_final.pth does not fit plans.json: {exc}"
            ) from exc
        nets.append(net.eval())
    return nets, config, configuration, channels, labels.num_segmentation_heads


def _axis_order(plans: dict[str, Any], dims: int) -> tuple[list[int], bool]:
    """Per network axis, the tilewise array axis it reads; and whether the reader reorients to RAS."""
    reader = str(plans.get("image_reader_writer", "SimpleITKIO"))
    if reader not in _READERS:
        raise ImportRefusedError(f"plans.json: image_reader_writer {reader} cannot be mapped ({_READERS})")
    shape = plans.get("original_median_shape_after_transp") or []
    if dims == 2 and len(shape) == 3:
        raise ImportRefusedError("plans.json: a 2d configuration of 3-D images (slice-wise) cannot be mapped")
    forward = [int(a) for a in plans.get("transpose_forward") or range(dims)]
    if sorted(forward) != list(range(dims)):
        raise ImportRefusedError(f"plans.json: transpose_forward {forward} for {dims} axes")
    reverse = reader == "SimpleITKIO" and dims == 3  # SimpleITK arrays are (z, y, x): NIfTI's reversed
    return [dims - 1 - a if reverse else a for a in forward], reader == "NibabelIOWithReorient"


def mirror_axes(axes: Any, order: list[int]) -> list[int] | None:
    """The checkpoint's ``inference_allowed_mirroring_axes`` (network axes) as tilewise axes, sorted.

    >>> mirror_axes((1, 2), [2, 1, 0])  # SimpleITK's (z, y, x): y and x are tilewise axes 1 and 0
    [0, 1]
    >>> mirror_axes(None, [0, 1, 2]) is None
    True
    """
    if axes is None:
        return None
    return sorted(order[int(a)] for a in axes)


def import_nnunet(source: Path, *, name: str | None, models_dir: Path, fmt: str) -> WrittenModel:
    """Import an nnU-Net v2 trained-model folder into ``models_dir`` as ``NAME.yaml`` plus weights.

    Raises:
        ImportRefusedError: a missing file or field, or a feature tilewise cannot reproduce (a
            cascade stage, region-based labels, masked or mixed normalization, an unknown reader).
        IncompatibleWeightsError: a fold's weights do not fit the network built from the plans.
        ExportError: the export lost parity with the eager ensemble.
    """
    dataset = _json(source / "dataset.json")
    plans = _json(source / "plans.json")
    paths = sorted(source.glob("fold_*/checkpoint_final.pth"))
    if not paths:
        raise ImportRefusedError(f"{source}: no fold_*/checkpoint_final.pth")
    checkpoints = [_checkpoint(p) for p in paths]
    with refusing(f"{source} (plans.json, dataset.json)"):
        if not isinstance(plans, dict) or not isinstance(dataset, dict):
            raise ImportRefusedError(f"{source}: plans.json and dataset.json must each hold a mapping")
        nets, config, configuration, channels, out_channels = _networks(source, plans, dataset, checkpoints)
        patch = [int(p) for p in config.patch_size]
        dims = len(patch)
        order, reorient = _axis_order(plans, dims)
        preprocess = _normalization(plans, config.configuration, channels)
        strides = [int(s) for s in np.prod(np.asarray(config.pool_op_kernel_sizes, dtype=np.int64), axis=0)]
        labels = {int(v): str(k) for k, v in dataset["labels"].items() if k != "ignore"}
    core = MeanOfNets(nets).eval()
    name = name or model_name(f"{plans.get('dataset_name', source.parent.name)}-{configuration}")
    identity = order == list(range(dims))

    def wrap(net: nn.Module) -> nn.Module:
        padded = PadToShape(net, patch)
        return padded if identity else PermuteAxes(padded, order)

    tile = [0] * dims
    spacing = [0.0] * dims
    align = [1] * dims  # per axis: the product of the pooling strides along it
    for i, axis in enumerate(order):
        tile[axis] = patch[i]
        spacing[axis] = float(config.spacing[i])
        align[axis] = strides[i]
    net = core if identity else PermuteAxes(core, order)
    facts = probe_network(
        net, name=name, spatial_dims=dims, in_channels=channels, tile_shape=tile, alignment=math.lcm(*align)
    )
    mirror = mirror_axes(checkpoints[0].get("inference_allowed_mirroring_axes"), order)
    models_dir.mkdir(parents=True, exist_ok=True)
    weights = models_dir / f"{name}{FORMATS[fmt]}"
    diff = export_network(
        core,
        weights,
        fmt=fmt,
        in_channels=channels,
        core_shape=patch,
        check_shapes=[[max(a, t // 2 // a * a) for t, a in zip(tile, align, strict=True)], tile],
        wrap=wrap,
        name=name,
    )
    mapping: dict[str, Any] = {
        "name": name,
        "description": f"nnU-Net v2 {plans.get('dataset_name', '')} {configuration}, folds "
        f"{[p.parent.name for p in paths]}",
        "backend": fmt,
        "spatial_dims": dims,
        "in_channels": channels,
        "out_channels": out_channels,
        "alignment": align if len(set(align)) > 1 else align[0],
        "scale": 1,
        "tile_dependent": facts.tile_dependent,
        "spacing": spacing,
        **({"orientation": "RAS"} if reorient else {}),
        "padding": "centred-nnunet",
        "labels": labels,
        "preprocess": preprocess,
        "output": {"activation": "softmax", "kind": "labels", "tta_average": "logits"},
        "defaults": {
            "tile": tile,
            "halo": 0 if facts.tile_dependent else "auto",
            "overlap": [t // 2 for t in tile] if facts.tile_dependent else 0,
            "blend": "gaussian" if facts.tile_dependent else "constant",
            "batch_size": 1,
            "tta": "mirror" if mirror is not None else "none",
        },
    }
    if mirror is not None and mirror != list(range(dims)):
        mapping["mirror_axes"] = mirror
    if facts.receptive_field is not None:
        mapping["receptive_field"] = list(facts.receptive_field)
    trainer = checkpoints[0].get("trainer_name")
    notes = [
        f"tilewise import-model {source} (nnU-Net v2 {configuration}, trainer {trainer})",
        f"{len(nets)} fold(s) averaged as logits; {fmt} parity with the eager folds: max abs diff {diff:.2g}",
        "not reproduced: cropping to the non-zero bounding box, spline resampling, float16 accumulation",
        "windows placed as nnU-Net places them (padding: centred-nnunet); smaller inputs padded, centred",
    ]
    return write_model(mapping, weights, models_dir, "\n".join(notes))
