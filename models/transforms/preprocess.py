"""Whole-image preprocessing (before tiling) and output activation (after blending).

Statistics such as z-score or percentiles are computed over the whole image, never per tile, so
that every tile sees the same normalization and the tiled result equals the whole-image one.

Non-finite input voxels (NaN, +-inf): every statistic ignores them (mean, std, percentiles, min and
max over the finite voxels only), and after the steps each voxel that is not finite is set to 0 (as
``np.nan_to_num(nan=0, posinf=0, neginf=0)``, nnU-Net's and MONAI's usual stand-in: the image's mean
after a z-score), so a bad voxel changes the output only within the receptive field around it. The
service counts them in ``X-Tilewise-Warning`` (:func:`count_nonfinite`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from models.errors import InputError
from models.spec import ModelSpec, PreprocessStep

if TYPE_CHECKING:
    import torch

__all__ = ["Reduce", "count_nonfinite", "label_dtype", "make_reduce", "preprocess"]

logger = logging.getLogger(__name__)

#: ITU-R BT.601 luma weights for RGB -> grey.
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def _unit_range(x: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """Scale to [0, 1]: integers by their dtype's range, floats by the whole image's min-max.

    ``uint8``/``uint16``/... divide by the dtype's max (signed ones map the dtype's range), so a
    dark 8-bit image stays dark. Floats carry no such range: float data already within [0, 1] is
    kept as is; any other float image (a float TIFF or NIfTI) is min-max scaled over the whole
    image (``(x - min) / (max - min)``, non-finite values ignored for the statistics; a constant
    image becomes 0).
    """
    if np.issubdtype(x.dtype, np.integer):
        info = np.iinfo(x.dtype)
        if info.min < 0:
            return ((x.astype(np.float32) - info.min) / (info.max - info.min)).astype(np.float32)
        return (x.astype(np.float32) / info.max).astype(np.float32)
    if x.dtype == np.bool_:
        return x.astype(np.float32)
    xf = x.astype(np.float32, copy=False)
    if xf.size == 0:
        return xf
    lo, hi = float(xf.min()), float(xf.max())
    if not (np.isfinite(lo) and np.isfinite(hi)):
        finite = xf[np.isfinite(xf)]
        if finite.size == 0:
            return xf
        lo, hi = float(finite.min()), float(finite.max())
    if lo >= 0.0 and hi <= 1.0:
        return xf
    logger.debug("unit_range: float image in [%g, %g], min-max scaled to [0, 1]", lo, hi)
    span = hi - lo if hi > lo else 1.0
    return ((xf - np.float32(lo)) / np.float32(span)).astype(np.float32)


def _per_channel(value: Any, n_channels: int, what: str) -> npt.NDArray[np.float32]:
    arr: npt.NDArray[np.float32] = np.asarray(value, dtype=np.float32).reshape(-1)
    if arr.size not in (1, n_channels):
        raise InputError(f"normalize.{what} has {arr.size} values for {n_channels} channels")
    return arr


def _zscore(x: npt.NDArray[np.float32], nonzero: bool) -> npt.NDArray[np.float32]:
    """``(x - mean) / std`` over the whole array (or its non-zero voxels only, the rest kept)."""
    finite = np.isfinite(x)
    mask = (x != 0) & finite if nonzero else (None if finite.all() else finite)
    values = x[mask] if mask is not None else x
    if values.size == 0:
        return x
    mean = float(values.mean(dtype=np.float64))
    std = float(values.std(dtype=np.float64))
    scaled = ((values - mean) / (std if std > 0 else 1.0)).astype(np.float32)
    if mask is None:
        return scaled
    out = x.copy()
    out[mask] = scaled
    if not nonzero:
        out[~mask] = 0.0  # non-finite: the mean
    return out


def _apply(step: PreprocessStep, x: npt.NDArray[Any], spec: ModelSpec) -> npt.NDArray[Any]:
    p = step.params
    kind = step.kind
    if kind == "grey_to_rgb":
        if x.shape[0] == 1:
            return np.repeat(x, 3, axis=0)
        if x.shape[0] == 4:  # RGBA: drop alpha
            return x[:3]
        return x
    if kind == "rgb_to_grey":
        if x.shape[0] in (3, 4):
            rgb = x[:3].astype(np.float32)
            return np.tensordot(_LUMA, rgb, axes=1)[None].astype(np.float32)
        return x
    if kind == "rgb_to_bgr":
        return np.ascontiguousarray(x[::-1]) if x.shape[0] == 3 else x
    if kind == "unit_range":
        return _unit_range(x)
    xf = x.astype(np.float32, copy=False)
    if kind == "ct_window":
        lo, hi = float(p["lo"]), float(p["hi"])
        return ((np.clip(xf, lo, hi) - lo) / (hi - lo)).astype(np.float32)
    if kind == "zscore":
        if p.get("channel_wise"):
            return np.stack([_zscore(c, bool(p.get("nonzero"))) for c in xf]).astype(np.float32)
        return _zscore(xf, bool(p.get("nonzero")))
    if kind == "clip":
        shape = (-1,) + (1,) * spec.spatial_dims
        lows = _per_channel(p["lo"], x.shape[0], "lo").reshape(shape)
        highs = _per_channel(p["hi"], x.shape[0], "hi").reshape(shape)
        return np.clip(xf, lows, highs).astype(np.float32)
    if kind == "scale_range":  # MONAI ScaleIntensityRange, float32 arithmetic in its order
        a_min, a_max, b_min, b_max = (float(p[k]) for k in ("a_min", "a_max", "b_min", "b_max"))
        if a_max == a_min:
            return (xf - a_min + b_min).astype(np.float32)
        y = (xf - a_min) / (a_max - a_min) * (b_max - b_min) + b_min
        return (np.clip(y, b_min, b_max) if p["clip"] else y).astype(np.float32)
    if kind == "percentile":
        finite = xf[np.isfinite(xf)]
        lo, hi = (
            float(v)
            for v in np.percentile(finite if finite.size else [0.0], [float(p["lo"]), float(p["hi"])])
        )
        span = hi - lo if hi > lo else 1.0
        scaled: npt.NDArray[np.float32] = np.clip((xf - lo) / span, 0.0, 1.0).astype(np.float32)
        return scaled
    if kind == "normalize":
        shape = (-1,) + (1,) * spec.spatial_dims
        centre = _per_channel(p["mean"], x.shape[0], "mean").reshape(shape)
        spread = _per_channel(p["std"], x.shape[0], "std").reshape(shape)
        return ((xf - centre) / spread).astype(np.float32)
    raise AssertionError(f"unknown step {kind!r}")  # spec validation rules this out


def preprocess(data: npt.NDArray[Any], spec: ModelSpec) -> npt.NDArray[np.float32]:
    """Apply ``spec.preprocess`` to a whole image and check it fits the model.

    Args:
        data: ``(C, *spatial)`` array of any numeric dtype, ``len(spatial) == spec.spatial_dims``.
        spec: the model's spec.

    Returns:
        ``(spec.in_channels, *spatial)`` float32 array (a new array unless ``data`` was already
        float32 and no step changed it).

    Raises:
        InputError: wrong number of dimensions, or channels that the steps cannot turn into
            ``spec.in_channels``; the message names the model.
    """
    x = np.asarray(data)
    if x.ndim != spec.spatial_dims + 1:
        raise InputError(
            f"model {spec.name!r} takes (C, *spatial) with {spec.spatial_dims} spatial axes, "
            f"got an array of shape {x.shape}"
        )
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise InputError(f"model {spec.name!r} takes numeric data, got dtype {x.dtype}")
    if np.issubdtype(x.dtype, np.floating) and np.isinf(x).any():
        x = np.where(np.isinf(x), np.nan, x)  # NaN passes every step unchanged (a clip turns inf finite)
    for step in spec.preprocess:
        x = _apply(step, x, spec)
    if x.shape[0] != spec.in_channels:
        raise InputError(
            f"model {spec.name!r} takes {spec.in_channels} channel(s), got {x.shape[0]} "
            f"(input shape {tuple(np.shape(data))})"
        )
    out = np.ascontiguousarray(x, dtype=np.float32)
    bad = ~np.isfinite(out)
    if bad.any():  # the module docstring: non-finite voxels become 0 after the steps
        out = out.copy() if np.shares_memory(out, data) else out
        out[bad] = 0.0
    return out


def count_nonfinite(data: npt.NDArray[Any]) -> int:
    """Voxels (times channels) of ``data`` that are NaN or infinite (0 for integer data)."""
    x = np.asarray(data)
    if not np.issubdtype(x.dtype, np.floating):
        return 0
    return int(x.size - np.count_nonzero(np.isfinite(x)))


def make_reduce(
    activation: str, kind: str, *, threshold: float = 0.5
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The ``reduce`` callback of :func:`tiling.tiled_inference` for an output activation and kind.

    Args:
        activation: ``none``, ``sigmoid`` or ``softmax`` (over channels).
        kind: ``probabilities`` (``(C_out, *r)`` float32) or ``labels`` (``(1, *r)`` uint8: argmax
            over channels, or ``p > threshold`` when there is one channel).
        threshold: probability above which a one-channel output is labelled 1.

    Returns:
        ``None`` when nothing needs doing (no activation, probabilities), else a picklable callable
        (a :class:`Reduce`, so Dask workers can run it) mapping a finalized region ``(C_out, *r)``
        float32 tensor to its reduced form.
    """
    if activation == "none" and kind == "probabilities":
        return None
    return Reduce(activation, kind, threshold)


@dataclass(frozen=True, slots=True)
class Reduce:
    """Activation then, for labels, argmax (or threshold); see :func:`make_reduce`."""

    activation: str
    kind: str
    threshold: float = 0.5

    def __call__(self, region: torch.Tensor) -> torch.Tensor:
        """``(C_out, *r)`` -> ``(C_out, *r)`` float32 probabilities or ``(1, *r)`` uint8 labels."""
        import torch

        y = region.float()
        if self.activation == "sigmoid":
            y = torch.sigmoid(y)
        elif self.activation == "softmax":
            y = torch.softmax(y, dim=0)
        if self.kind == "probabilities":
            return y
        if y.shape[0] == 1:
            return (y > self.threshold).to(torch.uint8)
        labels = torch.argmax(y, dim=0, keepdim=True)  # int64
        return labels.to(torch.uint8) if y.shape[0] <= 256 else labels.to(torch.int32)  # >255 classes kept


def label_dtype(n_classes: int) -> np.dtype[Any]:
    """The smallest unsigned dtype holding labels ``0 .. n_classes - 1``: uint8 up to 256 classes,
    uint16 up to 65,536, else uint32 (encoders refuse by name what their format cannot hold)."""
    if n_classes <= 256:
        return np.dtype(np.uint8)
    return np.dtype(np.uint16) if n_classes <= 65_536 else np.dtype(np.uint32)
