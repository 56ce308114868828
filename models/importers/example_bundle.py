"""A small MONAI bundle to follow the README with: ``tilewise import-model --example-bundle DIR``.

The bundle is laid out as MONAI lays one out (``configs/metadata.json``, ``configs/inference.json``,
``models/model.pt``) around one of MONAI's own networks (``monai.networks.nets``) with small feature
sizes and random weights (a seed; batch-norm statistics randomized so they matter): it imports in
seconds on a CPU and its outputs mean nothing. The inference config holds the transforms tilewise
maps (Orientationd, Spacingd, ScaleIntensityRanged), a ``SlidingWindowInferer`` and a softmax +
argmax post-processing (README, "Supported MONAI networks, transforms and nnU-Net configurations").

Writing it needs MONAI (the ``import`` extra) and evaluates nothing: the configs are plain JSON
without ``$`` expressions, so the bundle imports without ``--trust``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.errors import ImportRefusedError

__all__ = ["EXAMPLE_NETWORKS", "example_network_args", "write_example_bundle"]

#: The networks of ``monai.networks.nets`` an example bundle can hold, and the window each needs.
EXAMPLE_NETWORKS = ("UNet", "BasicUNet", "SegResNet", "UNETR", "SwinUNETR")

_LABELS = {"0": "background", "1": "grey matter", "2": "white matter"}


def example_network_args(network: str, roi: tuple[int, ...], norm: str = "batch") -> dict[str, Any]:
    """Small-feature constructor arguments of ``monai.networks.nets.NETWORK`` (3-D, 1 -> 3 channels).

    ``norm`` (``batch`` or ``instance``) applies to UNet and BasicUNet; UNETR's ``img_size`` is ``roi``.

    Raises:
        ImportRefusedError: ``network`` is not one of :data:`EXAMPLE_NETWORKS`.
    """
    base = {"spatial_dims": 3, "in_channels": 1, "out_channels": len(_LABELS)}
    if network == "UNet":
        return {**base, "channels": [8, 16, 32], "strides": [2, 2], "num_res_units": 1, "norm": norm}
    if network == "BasicUNet":
        return {**base, "features": [4, 4, 8, 8, 16, 4], "norm": norm}
    if network == "SegResNet":
        return {**base, "init_filters": 4, "blocks_down": [1, 1, 1], "blocks_up": [1, 1], "norm": "batch"}
    if network == "UNETR":
        return {**base, "img_size": list(roi), "feature_size": 4, "hidden_size": 48, "mlp_dim": 96,
                "num_heads": 4, "norm_name": norm}  # fmt: skip
    if network == "SwinUNETR":
        return {**base, "feature_size": 12, "depths": [1, 1, 1, 1], "num_heads": [1, 1, 1, 1],
                "window_size": 4, "norm_name": norm}  # fmt: skip
    raise ImportRefusedError(f"example bundle: network {network!r} is not one of {list(EXAMPLE_NETWORKS)}")


def write_example_bundle(
    root: Path,
    *,
    network: str = "UNet",
    roi: tuple[int, ...] = (48, 48, 48),
    norm: str = "batch",
    seed: int = 0,
) -> Any:
    """Write a MONAI bundle holding ``monai.networks.nets.NETWORK`` (random weights) into ``root``.

    Args:
        root: the bundle folder (created; existing bundle files are overwritten).
        network: one of :data:`EXAMPLE_NETWORKS`.
        roi: the ``SlidingWindowInferer``'s ``roi_size`` (voxels per axis; a multiple of the network's
            total stride: 4 for UNet, 16 for BasicUNet, 4 for SegResNet, 16 for UNETR, 32 for SwinUNETR).
        norm: ``batch`` or ``instance`` for the networks that take one.
        seed: the weights' seed.

    Returns:
        The network (``torch.nn.Module`` in eval mode) whose state dict is ``models/model.pt``.

    Raises:
        ImportRefusedError: MONAI is not installed, or ``network`` is unknown.
    """
    try:
        import torch
        from monai.networks import nets
    except ImportError as exc:
        raise ImportRefusedError(
            "writing an example bundle needs MONAI: pip install -e '.[import]' (a checkout) or "
            "pip install 'tilewise[import]'"
        ) from exc
    args = example_network_args(network, tuple(roi), norm)
    torch.manual_seed(seed)
    net = getattr(nets, network)(**args)
    for module in net.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            assert module.running_mean is not None and module.running_var is not None  # tracked stats
            module.running_mean.uniform_(-0.2, 0.2)
            module.running_var.uniform_(0.5, 1.5)
    root = Path(root)
    (root / "configs").mkdir(parents=True, exist_ok=True)
    (root / "models").mkdir(exist_ok=True)
    torch.save(net.state_dict(), root / "models" / "model.pt")
    image = {"type": "image", "format": "magnitude", "modality": "MR", "num_channels": 1, "dtype": "float32",
             "spatial_shape": list(roi), "value_range": [0, 1], "is_patch_data": True,
             "channel_def": {"0": "T1"}}  # fmt: skip
    pred = {"type": "image", "format": "segmentation", "num_channels": len(_LABELS), "dtype": "float32",
            "spatial_shape": list(roi), "value_range": [0, 1], "is_patch_data": True,
            "channel_def": _LABELS}  # fmt: skip
    meta = {"version": "0.1.0", "name": f"Example {network}", "monai_version": "1.6.1",
            "pytorch_version": str(torch.__version__).split("+")[0],
            "description": "tilewise example bundle: random weights, for following the README only",
            "network_data_format": {"inputs": {"image": image}, "outputs": {"pred": pred}}}  # fmt: skip
    key = "image"
    config = {
        "network_def": {"_target_": network, **args},
        "preprocessing": {"_target_": "Compose", "transforms": [
            {"_target_": "LoadImaged", "keys": key},
            {"_target_": "EnsureChannelFirstd", "keys": key},
            {"_target_": "Orientationd", "keys": key, "axcodes": "RAS"},
            {"_target_": "Spacingd", "keys": key, "pixdim": [1.0, 1.0, 1.0], "mode": "bilinear"},
            {"_target_": "ScaleIntensityRanged", "keys": key, "a_min": 0, "a_max": 100, "b_min": 0.0,
             "b_max": 1.0, "clip": True},
            {"_target_": "EnsureTyped", "keys": key},
        ]},
        "inferer": {"_target_": "SlidingWindowInferer", "roi_size": list(roi), "sw_batch_size": 2,
                    "overlap": 0.25, "mode": "gaussian"},
        "postprocessing": {"_target_": "Compose", "transforms": [
            {"_target_": "Activationsd", "keys": "pred", "softmax": True},
            {"_target_": "AsDiscreted", "keys": "pred", "argmax": True},
        ]},
    }  # fmt: skip
    (root / "configs" / "metadata.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    (root / "configs" / "inference.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return net.eval()
