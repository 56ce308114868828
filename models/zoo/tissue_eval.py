"""Held-out evaluation of ``tissue-3d``: Dice per class, and the whole-volume logits of the band.

One job: score a trained network on the axial band :mod:`models.zoo.tissue_data` holds out
(:func:`predict_band` runs only the slab the band's receptive field needs; :func:`band_dice`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["LABEL_NAMES", "band_dice", "dice_scores", "predict_band"]

LABEL_NAMES = ("background", "grey matter", "white matter")


def dice_scores(pred: npt.NDArray[Any], ref: npt.NDArray[Any]) -> dict[str, float]:
    """Dice per label name of :data:`LABEL_NAMES` (``2|P and R| / (|P| + |R|)``; 1.0 when both are empty)."""
    scores = {}
    for label, name in enumerate(LABEL_NAMES):
        p, r = pred == label, ref == label
        total = int(p.sum()) + int(r.sum())
        scores[name] = 1.0 if total == 0 else 2.0 * int((p & r).sum()) / total
    return scores


def predict_band(
    module: Any, x: npt.NDArray[np.float32], band: tuple[int, int], *, alignment: int, radius: int
) -> npt.NDArray[np.float32]:
    """Logits ``(3, X, Y, stop - start)`` of the whole-volume pass, for the band's slices only.

    The network runs once on the slab from the aligned slice at least ``radius`` below the band
    to ``radius`` above it (zero-padded at the far ends to a multiple of ``alignment``, as a
    whole-volume pass pads the volume). Every band voxel is at least the receptive-field radius
    away from the slab's cut faces and the slab starts on the stride grid, so the band's logits
    are those of the whole-volume pass. Memory: about 40 float32 values per slab voxel at the
    peak (MNI152: 197 x 233 x 84 slab, about 0.6 GB).

    Args:
        module: the network in eval mode.
        x: ``(1, X, Y, Z)`` preprocessed volume.
        band: ``(start, stop)`` slices of the last axis.
        alignment: the network's total stride.
        radius: its receptive-field radius in voxels.
    """
    import torch

    start, stop = band
    depth = x.shape[-1]
    lo = max(0, (start - radius) // alignment * alignment)
    hi = min(depth, stop + radius)
    slab = x[..., lo:hi]
    pad = [(0, 0)] + [(0, -s % alignment) for s in slab.shape[1:]]
    slab = np.pad(slab, pad)
    with torch.inference_mode():
        logits = module(torch.from_numpy(slab)[None])[0].numpy()
    return np.ascontiguousarray(logits[:, : x.shape[1], : x.shape[2], start - lo : stop - lo])


def band_dice(
    module: Any, x: npt.NDArray[np.float32], labels: npt.NDArray[np.uint8], band: tuple[int, int]
) -> dict[str, float]:
    """Dice per class on the held-out band (whole-volume prediction, argmax of the logits)."""
    from models.zoo.tissue_net import ALIGNMENT, RECEPTIVE_FIELD

    logits = predict_band(module, x, band, alignment=ALIGNMENT, radius=RECEPTIVE_FIELD)
    return dice_scores(np.argmax(logits, axis=0), labels[..., band[0] : band[1]])
