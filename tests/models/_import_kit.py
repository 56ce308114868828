"""Helpers of the import-model tests: optional packages (MONAI, nnU-Net) that CI must have."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def need(module: str) -> ModuleType:
    """Import ``module`` (of the ``import`` extra); skip locally without it, fail in CI (``CI`` set)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        reason = f"{module} is not installed (pip install -e '.[import]'): {exc}"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: acceptance tests must not skip)", pytrace=False)
        pytest.skip(reason)


def write_monai_bundle(root, *, roi=(48, 48, 48), norm="batch", seed=0):
    """A MONAI bundle as MONAI lays one out, with a random-weight ``monai.networks.nets.UNet``.

    ``configs/metadata.json`` (channels, label names), ``configs/inference.json`` (Orientationd +
    Spacingd + ScaleIntensityRanged, SlidingWindowInferer, softmax + argmax post-transforms) and
    ``models/model.pt`` (the state dict; batch-norm statistics randomized so they matter).
    Returns the network (eval mode).
    """
    import json

    import torch

    nets = need("monai.networks.nets")
    torch.manual_seed(seed)
    arch = {
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 3,
        "channels": [8, 16, 32],
        "strides": [2, 2],
    }
    net = nets.UNet(**arch, num_res_units=1, norm=norm)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm3d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    (root / "configs").mkdir(parents=True, exist_ok=True)
    (root / "models").mkdir(exist_ok=True)
    torch.save(net.state_dict(), root / "models" / "model.pt")
    labels = {"0": "background", "1": "grey matter", "2": "white matter"}
    image = {
        "type": "image",
        "format": "magnitude",
        "modality": "MR",
        "num_channels": 1,
        "dtype": "float32",
        "spatial_shape": list(roi),
        "value_range": [0, 1],
        "is_patch_data": True,
        "channel_def": {"0": "T1"},
    }
    pred = {
        "type": "image",
        "format": "segmentation",
        "num_channels": 3,
        "dtype": "float32",
        "spatial_shape": list(roi),
        "value_range": [0, 1],
        "is_patch_data": True,
        "channel_def": labels,
    }
    meta = {"version": "0.1.0", "name": "Tissue UNet", "monai_version": "1.6.1", "pytorch_version": "2.13.0",
            "network_data_format": {"inputs": {"image": image}, "outputs": {"pred": pred}}}  # fmt: skip
    key = "@image_key"
    config = {
        "imports": ["$import glob", "$import os"],
        "bundle_root": ".",
        "image_key": "image",
        "output_dir": "$@bundle_root + '/eval'",
        "device": "$torch.device('cpu')",
        "network_def": {"_target_": "UNet", **arch, "num_res_units": 1, "norm": norm},
        "network": "$@network_def.to(@device)",
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
            {"_target_": "Invertd", "keys": "pred", "transform": "@preprocessing", "orig_keys": key,
             "nearest_interp": False, "to_tensor": True},
            {"_target_": "AsDiscreted", "keys": "pred", "argmax": True},
            {"_target_": "SaveImaged", "keys": "pred", "output_dir": "@output_dir", "resample": False},
        ]},
    }  # fmt: skip
    (root / "configs" / "metadata.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    (root / "configs" / "inference.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return net.eval()
