"""Move arrays between the input grid and a model's grid, as a ``GeometryPlan`` says.

Shapes: ``C`` input channels, ``C_out`` output channels, ``S`` the input's spatial shape, ``S_r`` the
same voxels reoriented to the model's axis codes, ``S_m`` the model grid (see
:mod:`models.geometry.model_grid`).

- :func:`to_model`: reorient (flips and transposes, exact) then resample (linear), ``S -> S_m``.
- :func:`from_model_probabilities`: resample back (linear) then inverse-reorient, ``S_m -> S``.
- :func:`from_model_labels`: the same, then argmax: probabilities are interpolated, label ids never;
  slab by slab, so no ``C_out``-channel float volume at the input resolution exists.

Interpolation convention (both directions, every axis), by the plan's
:class:`~models.geometry.model_grid.Resampling` rule:

- ``extent``: the two grids share one field of view, and voxel ``i`` of an axis of ``n`` voxels is
  centred at ``(i + 0.5) / n`` of that extent (physically at ``(i + 0.5) * zoom`` from its edge).
  Output index ``j`` of ``n_out`` samples the input at continuous index
  ``(j + 0.5) * n_in / n_out - 0.5``: exactly ``torch.nn.functional.interpolate(...,
  mode="linear"|"bilinear"|"trilinear", align_corners=False)`` without antialiasing. Up by an odd
  integer factor and back is therefore the identity (each coarse voxel is sampled at its own centre).
- ``corners`` (MONAI's ``Spacingd`` and its inverse in ``Invertd``): the first voxel centres
  coincide; model voxel ``j`` samples the input at index ``j * spacing / zoom`` and input voxel
  ``i`` samples the model grid at ``i * zoom / spacing``.

Either way the continuous index is clamped to ``[0, n_in - 1]`` (edge values extend, MONAI's
``border``), and the result is ``scipy.ndimage.map_coordinates(..., order=1, mode="nearest")`` at
those coordinates, one axis after another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from nibabel.orientations import apply_orientation

from models.geometry.model_grid import DEFAULT_SLAB_BYTES, GeometryError, GeometryPlan, Ornt, Resampling

__all__ = ["from_model_labels", "from_model_probabilities", "to_model"]

logger = logging.getLogger(__name__)

_ACTIVATIONS = ("none", "sigmoid", "softmax")
_MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}


def _fail(message: str) -> GeometryError:
    return GeometryError(message)


def _oriented(x: npt.NDArray[Any], ornt: Ornt) -> npt.NDArray[Any]:
    """``(C, *S)`` viewed through ``ornt`` (flips and a transpose of the spatial axes; a view)."""
    spatial_last = np.moveaxis(x, 0, -1)
    oriented = apply_orientation(spatial_last, np.array(ornt, dtype=np.float64))  # type: ignore[no-untyped-call]
    return np.moveaxis(oriented, -1, 0)


def _check_array(x: npt.NDArray[Any], shape: tuple[int, ...], name: str, what: str) -> None:
    if x.ndim != len(shape) + 1 or tuple(x.shape[1:]) != shape:
        raise _fail(f"{name} has shape {tuple(x.shape)}; the plan expects (C, *{what}) = (C, *{shape})")


def to_model(volume: npt.ArrayLike, plan: GeometryPlan) -> npt.NDArray[np.float32]:
    """Reorient, then resample (linear) a volume from the input grid to the model grid.

    Args:
        volume: ``(C, *S)`` array (float32 preferred; other numeric dtypes are converted), e.g. the
            preprocessed network input.

    Returns:
        ``(C, *S_m)`` float32, C-contiguous. When the plan is the identity this is ``volume``
        itself (or its float32 copy): it may share memory with the input.

    Raises:
        GeometryError: ``volume``'s spatial shape is not ``plan.spatial_shape``.

    Notes:
        Memory: the reoriented copy ``4 * C * prod(S)`` bytes (only when flips or permutations
        are needed) plus the result ``4 * C * prod(S_m)``. Convention: see the module docstring.

    Source:
        none (original); ``torch.nn.functional.interpolate`` does the arithmetic.
    """
    x = np.asarray(volume)
    _check_array(x, plan.spatial_shape, "volume", "S")
    if plan.reorients:
        x = _oriented(x, plan.ornt)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.strides and min(x.strides) < 0:  # a flipped axis of one voxel keeps its negative stride
        x = x.copy()
    if not plan.resamples:
        return x
    if plan.resampling == Resampling.CORNERS:
        with torch.inference_mode():
            t = torch.from_numpy(x)
            for axis in range(plan.spatial_dims):
                t = _along(
                    t,
                    axis + 1,
                    *_linear_weights(x.shape[axis + 1], plan.model_shape[axis], plan.source_index(axis)),
                )
        return np.ascontiguousarray(t.numpy())
    with torch.inference_mode():
        y = F.interpolate(
            torch.from_numpy(x)[None],
            size=plan.model_shape,
            mode=_MODES[plan.spatial_dims],
            align_corners=False,
        )[0]
    out: npt.NDArray[np.float32] = y.numpy()
    return out


def _linear_weights(
    n_in: int, n_out: int, step: tuple[float, float] | None = None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Source rows ``i0``, ``i1`` and weights ``w0``, ``w1`` of 1-D linear resampling.

    Output ``j`` is ``w0[j] * x[i0[j]] + w1[j] * x[i1[j]]``. With ``step = None`` (``extent``,
    align_corners=False) the float32 source index ``scale * (j + 0.5) - 0.5`` (``scale =
    float32(n_in / n_out)``) is rounded once, as ATen's ``area_pixel_compute_source_index`` compiled
    with a fused multiply-add, so the weights are the ones ``F.interpolate`` uses on CPU (results
    agree within one float32 rounding). With ``step = (a, b)`` the source index is ``a * j + b``
    (:meth:`GeometryPlan.source_index`), clamped to ``[0, n_in - 1]``.
    """
    if step is not None and step[1] == 0.0:  # corners
        src = np.clip(step[0] * np.arange(n_out, dtype=np.float64), 0.0, n_in - 1).astype(np.float32)
    else:
        scale = np.float64(np.float32(n_in) / np.float32(n_out))
        src = (scale * (np.arange(n_out, dtype=np.float64) + 0.5) - 0.5).astype(np.float32)
    src = np.maximum(src, np.float32(0.0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    lam = np.clip(src - i0.astype(np.float32), np.float32(0.0), np.float32(1.0)).astype(np.float32)
    i1 = np.minimum(i0 + 1, n_in - 1)
    return i0, i1, (np.float32(1.0) - lam).astype(np.float32), lam


def _along(
    t: torch.Tensor,
    dim: int,
    i0: npt.NDArray[np.int64],
    i1: npt.NDArray[np.int64],
    w0: npt.NDArray[np.float32],
    w1: npt.NDArray[np.float32],
) -> torch.Tensor:
    """Linear resampling of ``t`` along ``dim`` with :func:`_linear_weights`' rows and weights."""
    shape = [1] * t.ndim
    shape[dim] = -1
    a = t.index_select(dim, torch.from_numpy(i0)).mul_(torch.from_numpy(w0).view(shape))
    return a.add_(t.index_select(dim, torch.from_numpy(i1)).mul_(torch.from_numpy(w1).view(shape)))


def _activate(x: torch.Tensor, activation: str, dim: int) -> torch.Tensor:
    if activation == "sigmoid":
        return torch.sigmoid(x)
    if activation == "softmax":
        return torch.softmax(x, dim=dim)
    return x


def _resample_back(
    pred: npt.NDArray[Any],
    plan: GeometryPlan,
    activation: str,
    write: Callable[[int, int, torch.Tensor], None],
    max_slab_bytes: int,
) -> int:
    """Resample ``pred`` ``(C_out, *S_m)`` to ``S_r`` slab by slab; ``write(start, stop, slab)``.

    ``slab`` is the ``(rows, C_out, *S_r[1:])`` float32 tensor of rows ``start:stop`` of ``S_r``, after
    ``activation`` (applied on the model grid, before interpolation). Returns the rows per slab.
    """
    n_out = int(pred.shape[0])
    m0, r0 = plan.model_shape[0], plan.reoriented_shape[0]
    rest_m, rest_r = plan.model_shape[1:], plan.reoriented_shape[1:]
    rows = plan.slab_rows(n_out, max_slab_bytes=max_slab_bytes)
    corners = plan.resampling == Resampling.CORNERS
    i0, i1, w0, w1 = _linear_weights(m0, r0, plan.source_index(0, back=True) if corners else None)
    weight_shape = (-1,) + (1,) * plan.spatial_dims  # broadcast over (rows, C_out, *rest)
    with torch.inference_mode():
        for start in range(0, r0, rows):
            stop = min(start + rows, r0)
            if m0 != r0 or corners:  # the source rows that bracket rows start:stop
                lo, hi = int(i0[start]), int(i1[stop - 1]) + 1
            else:  # the same rows (i1 = i0 + 1 would add one row, and the slab one row too many)
                lo, hi = start, stop
            part = pred[:, lo:hi]
            if part.dtype != np.float32 or not part.flags.writeable or min(part.strides) < 0:
                part = np.array(part, dtype=np.float32)  # torch views only writable, forward-strided memory
            src = torch.from_numpy(part).transpose(0, 1)  # (n_src, C_out, *rest_m), a view
            src = _activate(src, activation, dim=1)
            if m0 != r0 or corners:
                a = src.index_select(0, torch.from_numpy(i0[start:stop] - lo))
                b = src.index_select(0, torch.from_numpy(i1[start:stop] - lo))
                a.mul_(torch.from_numpy(w0[start:stop]).view(weight_shape))
                a.add_(b.mul_(torch.from_numpy(w1[start:stop]).view(weight_shape)))
                del b
            else:
                a = src
            if corners:
                for axis in range(1, plan.spatial_dims):
                    weights = _linear_weights(
                        rest_m[axis - 1], rest_r[axis - 1], plan.source_index(axis, back=True)
                    )
                    a = _along(a, axis + 1, *weights)
            elif rest_m != rest_r:
                a = F.interpolate(a, size=rest_r, mode=_MODES[len(rest_r)], align_corners=False)
            write(start, stop, a)
            del a, src
    return rows


def _check_pred(pred: npt.NDArray[Any], plan: GeometryPlan, activation: str, max_slab_bytes: int) -> None:
    _check_array(pred, plan.model_shape, "pred", "S_m")
    if activation not in _ACTIVATIONS:
        raise _fail(f"activation={activation!r}: expected one of {list(_ACTIVATIONS)}")
    if max_slab_bytes < 1:
        raise _fail(f"max_slab_bytes={max_slab_bytes}: expected a positive number of bytes")


def from_model_probabilities(
    pred: npt.ArrayLike,
    plan: GeometryPlan,
    *,
    activation: str = "none",
    max_slab_bytes: int = DEFAULT_SLAB_BYTES,
) -> npt.NDArray[np.float32]:
    """Resample (linear) model-grid outputs back to the input grid, then inverse-reorient them.

    Args:
        pred: ``(C_out, *S_m)`` network output on the model grid (float32; numpy or memmap).
        plan: the plan that made the network input.
        activation: ``none``, ``sigmoid`` or ``softmax`` (over channels), applied on the model grid
            before resampling (one slab of source rows at a time; ``pred`` is not modified).
        max_slab_bytes: bound on the scratch memory of one slab (see :meth:`GeometryPlan.slab_bytes`).

    Returns:
        ``(C_out, *S)`` float32, in the input's orientation and grid.

    Raises:
        GeometryError: ``pred``'s spatial shape is not ``plan.model_shape``; unknown ``activation``.

    Notes:
        Peak memory: ``pred`` + the result (``4 * C_out * prod(S)`` bytes) + one slab; the result is
        written through an orientation view of itself, so no second full-size copy exists.
    """
    p = np.asarray(pred)
    _check_pred(p, plan, activation, max_slab_bytes)
    out = np.empty((p.shape[0], *plan.spatial_shape), dtype=np.float32)
    view = _oriented(out, plan.ornt)

    def write(start: int, stop: int, slab: torch.Tensor) -> None:
        view[:, start:stop] = slab.transpose(0, 1).numpy()

    _resample_back(p, plan, activation, write, max_slab_bytes)
    return out


def from_model_labels(
    pred: npt.ArrayLike,
    plan: GeometryPlan,
    *,
    activation: str,
    threshold: float = 0.5,
    max_slab_bytes: int = DEFAULT_SLAB_BYTES,
) -> npt.NDArray[np.uint8]:
    """Labels on the input grid: resample probabilities back (linear), then argmax, slab by slab.

    Label ids are never interpolated: each slab of rows of ``S_r`` (the reoriented input grid) is
    resampled from the two model-grid rows that bracket each of its rows (linear along axis 0 with
    :func:`F.interpolate`'s own weights), then along the remaining axes with ``F.interpolate``,
    then turned into labels and written into the uint8 result through its orientation view.

    Args:
        pred: ``(C_out, *S_m)`` network output on the model grid (float32; numpy or memmap).
        plan: the plan that made the network input.
        activation: ``none``, ``sigmoid`` or ``softmax`` (over channels), applied on the model grid
            before resampling, so probabilities are what is interpolated.
        threshold: with one channel, voxels whose probability exceeds it are labelled 1.
        max_slab_bytes: bound on the scratch memory of one slab (see :meth:`GeometryPlan.slab_bytes`).

    Returns:
        ``(*S)`` labels: argmax over channels, or ``p > threshold`` for one channel; uint8 up to 256
        channels, uint16 up to 65,536, else uint32.

    Raises:
        GeometryError: ``pred``'s spatial shape is not ``plan.model_shape``; unknown ``activation``.

    Notes:
        Peak memory is ``pred`` + ``prod(S)`` bytes of labels + one slab of at most
        ``max_slab_bytes`` (:meth:`GeometryPlan.slab_bytes`); no ``C_out``-channel float volume at
        the input resolution exists. (Resident memory can exceed this by what the allocator keeps:
        glibc holds freed slabs on its heap while its mmap threshold adapts; setting
        ``MALLOC_MMAP_THRESHOLD_`` stops that.)

        For instance, a 512 x 512 x 300 CT at 0.7 x 0.7 x 1.5 mm with a 3-class model at 1 mm:
        ``S_m = 358 x 358 x 450`` (57.7 M voxels), so ``pred`` is 692 MB; the
        labels are 78.6 MB; a slab of ``r`` input rows (512 x 300 voxels each) needs
        ``slab_bytes(r, 3)`` = 18.7 MB for one row and 58.7 MB for 5, so the default 64 MiB
        holds 5 rows: peak 692 + 78.6 + 58.7 = 0.83 GB. Resampling the whole volume first would
        instead add the 3-channel float32 volume at input resolution (944 MB) and its int64
        argmax (629 MB): 2.34 GB.

        Where two classes tie within float32 rounding (about 1e-7), the argmax can differ from a
        full-volume ``F.interpolate`` followed by argmax, whose rounding differs.

    Source:
        nnU-Net's order (resample, then argmax): MIC-DKFZ/nnUNet
        nnunetv2/inference/export_prediction.py (Apache-2.0). The slab loop: none (original).
    """
    p = np.asarray(pred)
    _check_pred(p, plan, activation, max_slab_bytes)
    n_out = int(p.shape[0])
    dtype = np.uint8 if n_out <= 256 else np.uint16 if n_out <= 65_536 else np.uint32
    out = np.empty(plan.spatial_shape, dtype=dtype)
    view = _oriented(out[None], plan.ornt)[0]

    def write(start: int, stop: int, slab: torch.Tensor) -> None:
        if n_out == 1:
            labels = (slab[:, 0] > threshold).to(torch.uint8)
        else:
            labels = torch.argmax(slab, dim=1)
        view[start:stop] = labels.numpy()  # cast to out's dtype (uint8, uint16 or uint32)

    rows = _resample_back(p, plan, activation, write, max_slab_bytes)
    logger.debug("labels back to %s in slabs of %d rows", plan.spatial_shape, rows)
    return out
