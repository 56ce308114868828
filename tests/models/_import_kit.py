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


def write_monai_bundle(root, *, roi=(48, 48, 48), norm="batch", seed=0, code=False):
    """The shipped example bundle (:func:`models.importers.example_bundle.write_example_bundle`, a
    random-weight ``monai.networks.nets.UNet``) with what model-zoo bundles add around it: an
    ``image_key`` that the transforms reference (``@image_key``), ``Invertd`` and ``SaveImaged``
    post-transforms, an ``output_dir``; named ``Tissue UNet`` (imported as ``tissue-unet``).

    ``code=True`` adds the ``$`` expressions model-zoo bundles carry (``imports``, ``device``,
    ``network``, ``output_dir``): importing that bundle then needs ``--trust`` (issue 24 item 7).
    Returns the network (eval mode).
    """
    import json

    need("monai.networks.nets")
    from models.importers.example_bundle import write_example_bundle

    net = write_example_bundle(root, network="UNet", roi=tuple(roi), norm=norm, seed=seed)
    meta_path = root / "configs" / "metadata.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    meta_path.write_text(json.dumps({**meta, "name": "Tissue UNet"}, indent=1), encoding="utf-8")
    path = root / "configs" / "inference.json"
    shipped = json.loads(path.read_text(encoding="utf-8"))
    key = "@image_key"
    for transform in shipped["preprocessing"]["transforms"]:
        transform["keys"] = key
    post = shipped["postprocessing"]["transforms"]  # Activationsd, AsDiscreted
    post.insert(1, {"_target_": "Invertd", "keys": "pred", "transform": "@preprocessing", "orig_keys": key,
                    "nearest_interp": False, "to_tensor": True})  # fmt: skip
    post.append({"_target_": "SaveImaged", "keys": "pred", "output_dir": "@output_dir", "resample": False})
    config = {"bundle_root": ".", "image_key": "image", "output_dir": "eval", **shipped}
    if code:
        config.update({"imports": ["$import glob", "$import os"], "output_dir": "$@bundle_root + '/eval'",
                       "device": "$torch.device('cpu')", "network": "$@network_def.to(@device)"})  # fmt: skip
    path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    return net


def nnunet_plans(
    *, normalization: str = "CTNormalization", patch=(32, 48, 48), reader: str = "SimpleITKIO"
) -> dict:
    """A 3d_fullres ``plans.json`` in nnU-Net v2's own format (anisotropic strides: alignment 4, 8, 8)."""
    strides = [[1, 1, 1], [1, 2, 2], [2, 2, 2], [2, 2, 2]]
    arch = {
        "network_class_name": "dynamic_network_architectures.architectures.unet.PlainConvUNet",
        "arch_kwargs": {
            "n_stages": 4, "features_per_stage": [8, 16, 32, 32], "conv_op": "torch.nn.modules.conv.Conv3d",
            "kernel_sizes": [[1, 3, 3], [3, 3, 3], [3, 3, 3], [3, 3, 3]], "strides": strides,
            "n_conv_per_stage": [2, 2, 2, 2], "n_conv_per_stage_decoder": [2, 2, 2], "conv_bias": True,
            "norm_op": "torch.nn.modules.instancenorm.InstanceNorm3d",
            "norm_op_kwargs": {"eps": 1e-05, "affine": True}, "dropout_op": None, "dropout_op_kwargs": None,
            "nonlin": "torch.nn.LeakyReLU", "nonlin_kwargs": {"inplace": True},
        },
        "_kw_requires_import": ["conv_op", "norm_op", "dropout_op", "nonlin"],
    }  # fmt: skip
    resampling = {"is_seg": False, "order": 3, "order_z": 0, "force_separate_z": None}
    config = {
        "data_identifier": "nnUNetPlans_3d_fullres", "preprocessor_name": "DefaultPreprocessor",
        "batch_size": 2,
        "patch_size": list(patch), "median_image_size_in_voxels": [64, 96, 96], "spacing": [2.0, 1.0, 1.0],
        "normalization_schemes": [normalization], "use_mask_for_norm": [False],
        "resampling_fn_data": "resample_data_or_seg_to_shape", "resampling_fn_data_kwargs": resampling,
        "resampling_fn_seg": "resample_data_or_seg_to_shape",
        "resampling_fn_seg_kwargs": {**resampling, "is_seg": True, "order": 1},
        "resampling_fn_probabilities": "resample_data_or_seg_to_shape",
        "resampling_fn_probabilities_kwargs": {**resampling, "order": 1},
        "architecture": arch, "batch_dice": True,
    }  # fmt: skip
    return {
        "dataset_name": "Dataset042_Toy", "plans_name": "nnUNetPlans",
        "original_median_spacing_after_transp": [2.0, 1.0, 1.0],
        "original_median_shape_after_transp": [64, 96, 96], "image_reader_writer": reader,
        "transpose_forward": [0, 1, 2], "transpose_backward": [0, 1, 2],
        "configurations": {"3d_fullres": config}, "experiment_planner_used": "ExperimentPlanner",
        "label_manager": "LabelManager",
        "foreground_intensity_properties_per_channel": {"0": {
            "max": 3000.0, "mean": 100.0, "median": 90.0, "min": -1000.0, "percentile_00_5": -900.0,
            "percentile_99_5": 1200.0, "std": 250.0}},
    }  # fmt: skip


NNUNET_DATASET = {
    "channel_names": {"0": "CT"},
    "labels": {"background": 0, "liver": 1, "tumour": 2},
    "numTraining": 10,
    "file_ending": ".nii.gz",
}


def write_nnunet_folder(root, *, plans=None, dataset=None, folds=(0, 1), mirror_axes=(0, 1, 2)):
    """An nnU-Net v2 trained-model folder: ``dataset.json``, ``plans.json``, ``fold_*/checkpoint_final.pth``.

    Each fold holds random weights (nnU-Net's own initialization, a seed per fold) of the network that
    nnU-Net builds from the plans, saved in the checkpoint layout of ``nnUNetTrainer.save_checkpoint``.
    Returns the folder (``Dataset042_Toy/nnUNetTrainer__nnUNetPlans__3d_fullres``).
    """
    import json

    import numpy as np
    import torch

    need("nnunetv2")
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans

    plans = plans or nnunet_plans()
    dataset = dataset or NNUNET_DATASET
    folder = root / "Dataset042_Toy" / "nnUNetTrainer__nnUNetPlans__3d_fullres"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plans.json").write_text(json.dumps(plans, indent=1), encoding="utf-8")
    (folder / "dataset.json").write_text(json.dumps(dataset, indent=1), encoding="utf-8")
    arch = plans["configurations"]["3d_fullres"]["architecture"]
    for fold in folds:
        torch.manual_seed(fold)
        net = get_network_from_plans(
            arch["network_class_name"], arch["arch_kwargs"], arch["_kw_requires_import"],
            len(dataset["channel_names"]), len(dataset["labels"]), allow_init=True, deep_supervision=False,
        )  # fmt: skip
        checkpoint = {
            "network_weights": net.state_dict(),
            "optimizer_state": {},
            "grad_scaler_state": None,
            "logging": {"mean_fg_dice": [np.float64(0.5)], "ema_fg_dice": [np.float64(0.5)]},
            "_best_ema": np.float64(0.5),
            "current_epoch": 1000,
            "init_args": {"plans": plans, "configuration": "3d_fullres", "fold": fold,
                          "dataset_json": dataset, "device": torch.device("cpu")},
            "trainer_name": "nnUNetTrainer",
            "inference_allowed_mirroring_axes": mirror_axes,
        }  # fmt: skip
        (folder / f"fold_{fold}").mkdir(exist_ok=True)
        torch.save(checkpoint, folder / f"fold_{fold}" / "checkpoint_final.pth")
    return folder
