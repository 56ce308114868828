"""Model geometry: reorient and resample a volume to the grid a network was trained on, and back.

Shapes: ``C`` input channels, ``C_out`` output channels, ``S`` the input's spatial shape (array-axis
order, as the codec stores it), ``S_r`` the same voxels reoriented to the model's axis codes, ``S_m``
the model grid after resampling to the model's spacing.

Medical networks expect their training orientation and spacing (nnU-Net and MONAI bundles resample
and reorient before the network and invert after). Three steps, each skipped when it is a no-op:

1. **Reorient** (3-D only): flips and axis permutations given by nibabel's orientation transform
   from the input affine's closest axis codes to the model's codes (``RAS``, ``LPS``, ``PIR``, ...).
   No interpolation: every voxel keeps its value, so it is exactly invertible.
2. **Resample** (linear) to ``S_m = max(1, round(S_r * zooms / spacing))`` per axis (round half to
   even, as :func:`round`).
3. **Back**: outputs are resampled (linear) from ``S_m`` to ``S_r``, then inverse-reoriented to ``S``.
   Labels are made only after that, by argmax over the resampled probabilities (label ids are never
   interpolated), slab by slab, so no ``C_out``-channel float volume at the input resolution exists.

Interpolation convention (both directions, every axis): the grids share the same field of view, and
voxel ``i`` of an axis of ``n`` voxels is centred at ``(i + 0.5) / n`` of that extent. Output index
``j`` of ``n_out`` samples the input at continuous index ``(j + 0.5) * n_in / n_out - 0.5``, clamped
to ``[0, n_in - 1]`` (edge values extend): exactly ``torch.nn.functional.interpolate(...,
mode="linear"|"bilinear"|"trilinear", align_corners=False)`` without antialiasing, and
``scipy.ndimage.map_coordinates(..., order=1, mode="nearest")`` at those coordinates. The model
grid's voxel size is therefore ``zooms * S_r / S_m`` (within half a voxel of the requested spacing
over the extent), and :attr:`GeometryPlan.model_affine` maps its voxels to the same world points.

Raises :class:`GeometryError` (a :class:`~models.errors.InputError`, HTTP 422) for geometry that
cannot be planned or arrays that do not fit their plan.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import nibabel as nib
import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from nibabel.orientations import apply_orientation, axcodes2ornt, inv_ornt_aff, io_orientation, ornt_transform

from models.errors import InputError

__all__ = [
    "DEFAULT_SLAB_BYTES",
    "GeometryError",
    "GeometryPlan",
    "from_model_labels",
    "from_model_probabilities",
    "plan_geometry",
    "to_model",
]

logger = logging.getLogger(__name__)

#: Default bound on the scratch memory of one slab when resampling outputs back (bytes).
DEFAULT_SLAB_BYTES = 64 * 2**20

_ACTIVATIONS = ("none", "sigmoid", "softmax")
_MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}
_AXIS_OF = {"L": 0, "R": 0, "P": 1, "A": 1, "I": 2, "S": 2}

Ornt = tuple[tuple[int, int], ...]


class GeometryError(InputError):
    """Geometry that cannot be planned (affine, axis codes, spacing) or an array that misfits its plan."""


@dataclass(frozen=True, slots=True)
class GeometryPlan:
    """How one input maps to a model's grid and back: pure arithmetic, no data.

    Attributes:
        spatial_shape: ``S``, the input's spatial shape (voxels, array-axis order).
        zooms_mm: input voxel size per array axis (mm), ``None`` when unknown.
        input_codes: the input's closest axis codes (e.g. ``("L", "A", "S")``), 3-D with an affine only.
        orientation: the model's axis codes (e.g. ``"RAS"``), ``None`` to keep the input's.
        ornt: nibabel orientation (``(axis, flip)`` per input axis) taking the input array to the
            model orientation: ``apply_orientation(x, ornt)`` has shape ``S_r``.
        inverse_ornt: the orientation taking an ``S_r`` array back to the input's: ``S``.
        reoriented_shape: ``S_r`` (a permutation of ``S``).
        reoriented_zooms_mm: input voxel size per axis of ``S_r`` (mm), ``None`` when unknown.
        spacing_mm: the model's spacing (mm per axis of ``S_r``), ``None`` for native (no resampling).
        model_shape: ``S_m = max(1, round(S_r * reoriented_zooms_mm / spacing_mm))``, or ``S_r``.
        model_zooms_mm: the model grid's actual voxel size, ``reoriented_zooms_mm * S_r / S_m`` (mm).
        reorients: ``False`` when ``ornt`` is the identity (the reorientation step is a no-op).
        resamples: ``False`` when ``S_m == S_r`` (the resampling step is a no-op).
        affine: the input's voxel-to-world affine, ``(n + 1, n + 1)`` or ``(4, 4)`` float64, or ``None``.
        model_affine: voxel-to-world affine of the model grid (same world points), or ``None``.
    """

    spatial_shape: tuple[int, ...]
    zooms_mm: tuple[float, ...] | None
    input_codes: tuple[str, ...] | None
    orientation: str | None
    ornt: Ornt
    inverse_ornt: Ornt
    reoriented_shape: tuple[int, ...]
    reoriented_zooms_mm: tuple[float, ...] | None
    spacing_mm: tuple[float, ...] | None
    model_shape: tuple[int, ...]
    model_zooms_mm: tuple[float, ...] | None
    reorients: bool
    resamples: bool
    affine: npt.NDArray[np.float64] | None = field(default=None, compare=False, repr=False)
    model_affine: npt.NDArray[np.float64] | None = field(default=None, compare=False, repr=False)

    @property
    def spatial_dims(self) -> int:
        """Number of spatial axes (1, 2 or 3)."""
        return len(self.spatial_shape)

    @property
    def is_identity(self) -> bool:
        """``True`` when neither reorientation nor resampling does anything."""
        return not (self.reorients or self.resamples)

    def slab_bytes(self, rows: int, out_channels: int) -> int:
        """Upper bound of the scratch bytes that resampling ``rows`` output rows back needs.

        Args:
            rows: rows of ``S_r`` along its first axis done at once (>= 1).
            out_channels: ``C_out``.

        Returns:
            ``4 * C_out * P_m * (2 * n_src + 2 * rows) + rows * P_r * (4 * C_out + 9)`` bytes,
            where ``P_m = prod(S_m[1:])``, ``P_r = prod(S_r[1:])`` and ``n_src = min(S_m[0],
            ceil(rows * S_m[0] / S_r[0]) + 2)`` source rows: the source rows twice (a float32
            copy and the activation's output), the two gathered row sets along axis 0, the
            in-plane result, the int64 argmax and its uint8 copy.
        """
        m0, r0 = self.model_shape[0], self.reoriented_shape[0]
        p_m = math.prod(self.model_shape[1:])
        p_r = math.prod(self.reoriented_shape[1:])
        n_src = min(m0, -(-rows * m0 // r0) + 2)
        return 4 * out_channels * p_m * (2 * n_src + 2 * rows) + rows * p_r * (4 * out_channels + 9)

    def slab_rows(self, out_channels: int, *, max_slab_bytes: int = DEFAULT_SLAB_BYTES) -> int:
        """The most rows of ``S_r[0]`` whose :meth:`slab_bytes` fit ``max_slab_bytes`` (at least 1)."""
        lo, hi = 1, self.reoriented_shape[0]
        while lo < hi:  # largest rows with slab_bytes(rows) <= budget; slab_bytes grows with rows
            mid = (lo + hi + 1) // 2
            if self.slab_bytes(mid, out_channels) <= max_slab_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _fail(message: str) -> GeometryError:
    return GeometryError(message)


def _check_codes(orientation: str) -> tuple[str, ...]:
    codes = tuple(orientation.upper())
    if len(codes) != 3 or any(c not in _AXIS_OF for c in codes):
        raise _fail(f"orientation={orientation!r}: expected three axis codes from L/R, P/A, I/S, e.g. 'RAS'")
    if len({_AXIS_OF[c] for c in codes}) != 3:
        raise _fail(f"orientation={orientation!r} names a world axis twice; e.g. 'RAS', 'LPS', 'PIR'")
    return codes


def _zooms_from_affine(affine: npt.NDArray[np.float64], ndim: int) -> tuple[float, ...]:
    world = affine.shape[0] - 1
    zooms = np.sqrt((affine[:world, :ndim] ** 2).sum(axis=0))
    if not np.all(np.isfinite(zooms)) or np.any(zooms <= 0):
        raise _fail(f"affine has a zero or non-finite voxel size {tuple(zooms.tolist())}:\n{affine}")
    return tuple(float(z) for z in zooms)


def plan_geometry(
    spatial_shape: Sequence[int],
    affine: npt.ArrayLike | None = None,
    *,
    orientation: str | None = None,
    spacing_mm: Sequence[float] | None = None,
    zooms_mm: Sequence[float] | None = None,
) -> GeometryPlan:
    """Plan the reorientation and resampling of one input to a model's grid.

    Args:
        spatial_shape: ``S``, the input's spatial shape (voxels, array-axis order), 1 to 3 axes.
        affine: the input's voxel-to-world affine (mm; NIfTI convention, RAS+ world):
            ``(n + 1, n + 1)`` for ``n`` spatial axes, or ``(4, 4)`` for a 2-D image stored as an
            ``(X, Y, 1)`` NIfTI. ``None`` when the input has none (a PNG): then only ``zooms_mm``
            can say its voxel size.
        orientation: the model's axis codes (three of L/R, P/A, I/S, e.g. ``"RAS"``); ``None``
            keeps the input's orientation. 3-D inputs with an affine only.
        spacing_mm: the model's voxel size (mm) per axis, in the model orientation; ``None`` (the
            request's ``spacing=native``) skips resampling.
        zooms_mm: the input's voxel size (mm) per array axis when there is no affine; ignored
            (and not needed) when ``affine`` is given.

    Returns:
        The :class:`GeometryPlan`.

    Raises:
        GeometryError: ``spatial_shape`` has not 1 to 3 positive axes; ``affine`` has the wrong
            shape, a zero or non-finite column, or no closest axis codes; ``orientation`` is not
            three distinct axis codes, or is given for a 2-D input or without an affine;
            ``spacing_mm`` or ``zooms_mm`` has the wrong length or a non-positive value;
            ``spacing_mm`` is given but the input's voxel size is unknown.

    Notes:
        Pure arithmetic on the shape and the affine: allocates no arrays. Oblique affines are
        reoriented to their closest axis codes (as ``nibabel.as_closest_canonical``) and stay
        oblique.

    Source:
        nibabel.orientations (``io_orientation``, ``ornt_transform``, ``inv_ornt_aff``; MIT);
        output shape rule of MIC-DKFZ/nnUNet nnunetv2/preprocessing/resampling/default_resampling.py
        (``compute_new_shape``; Apache-2.0).

    Example:
        >>> import numpy as np
        >>> lps = np.diag([-0.7, -0.7, 1.5, 1.0])  # an LPS CT
        >>> plan = plan_geometry((512, 512, 300), lps, orientation="RAS", spacing_mm=(1.0, 1.0, 1.0))
        >>> plan.input_codes, plan.reoriented_shape, plan.model_shape
        (('L', 'P', 'S'), (512, 512, 300), (358, 358, 450))
    """
    shape = tuple(int(s) for s in spatial_shape)
    ndim = len(shape)
    if ndim not in _MODES or any(s < 1 for s in shape):
        raise _fail(f"spatial_shape={shape}: expected 1 to 3 axes of at least one voxel")
    aff: npt.NDArray[np.float64] | None = None
    zooms: tuple[float, ...] | None = None
    if affine is not None:
        aff = np.array(affine, dtype=np.float64)
        if aff.shape not in ((ndim + 1, ndim + 1), (4, 4)):
            raise _fail(
                f"affine has shape {aff.shape}; a {ndim}-D input needs ({ndim + 1}, {ndim + 1}) or (4, 4)"
            )
        aff.setflags(write=False)
        zooms = _zooms_from_affine(aff, ndim)
    elif zooms_mm is not None:
        zooms = tuple(float(z) for z in zooms_mm)
        if len(zooms) != ndim or not all(math.isfinite(z) and z > 0 for z in zooms):
            raise _fail(f"zooms_mm={zooms}: expected {ndim} positive voxel sizes (mm)")

    ornt = np.column_stack([np.arange(ndim), np.ones(ndim)])
    codes: tuple[str, ...] | None = None
    if ndim == 3 and aff is not None:
        found = nib.aff2axcodes(aff)  # type: ignore[no-untyped-call]
        codes = tuple(str(c) for c in found) if None not in found else None
    if orientation is not None:
        target = _check_codes(orientation)
        if ndim != 3:
            raise _fail(
                f"orientation={orientation!r} needs a 3-D volume; a {ndim}-D input is never reoriented "
                "(give orientation=None for 2-D models)"
            )
        if aff is None:
            raise _fail(f"orientation={orientation!r} needs the input's affine, and there is none")
        start = io_orientation(aff)  # type: ignore[no-untyped-call]
        if np.isnan(start).any():
            raise _fail(f"affine has no closest axis codes (degenerate columns):\n{aff}")
        ornt = ornt_transform(start, axcodes2ornt(target))  # type: ignore[no-untyped-call]
    ornt_t: Ornt = tuple((int(a), int(f)) for a, f in ornt)
    inverse = np.empty_like(ornt)  # inverse permutation, flips carried along
    for axis, (new_axis, flip) in enumerate(ornt_t):
        inverse[new_axis] = (axis, flip)
    inverse_t: Ornt = tuple((int(a), int(f)) for a, f in inverse)
    reorients = ornt_t != tuple((a, 1) for a in range(ndim))

    r_shape = [0] * ndim
    r_zooms = [0.0] * ndim
    for axis, (new_axis, _) in enumerate(ornt_t):
        r_shape[new_axis] = shape[axis]
        r_zooms[new_axis] = zooms[axis] if zooms is not None else 0.0
    reoriented_shape = tuple(r_shape)
    reoriented_zooms = tuple(r_zooms) if zooms is not None else None

    spacing: tuple[float, ...] | None = None
    model_shape = reoriented_shape
    if spacing_mm is not None:
        spacing = tuple(float(s) for s in spacing_mm)
        if len(spacing) != ndim or not all(math.isfinite(s) and s > 0 for s in spacing):
            raise _fail(f"spacing_mm={spacing}: expected {ndim} positive voxel sizes (mm)")
        if reoriented_zooms is None:
            raise _fail(
                f"spacing_mm={spacing} needs the input's voxel size, and the input has neither an affine "
                "nor zooms_mm (use spacing=native)"
            )
        model_shape = tuple(
            max(1, round(n * z / s))
            for n, z, s in zip(reoriented_shape, reoriented_zooms, spacing, strict=True)
        )
    model_zooms = (
        tuple(z * n / m for z, n, m in zip(reoriented_zooms, reoriented_shape, model_shape, strict=True))
        if reoriented_zooms is not None
        else None
    )

    model_affine: npt.NDArray[np.float64] | None = None
    if aff is not None:
        reoriented_aff = aff @ inv_ornt_aff(ornt, shape) if reorients else aff.copy()  # type: ignore[no-untyped-call]
        # model voxel j sits at reoriented index (j + 0.5) * f - 0.5, f = S_r / S_m
        scaling = np.eye(aff.shape[0])
        for axis in range(ndim):
            f = reoriented_shape[axis] / model_shape[axis]
            scaling[axis, axis] = f
            scaling[axis, -1] = 0.5 * f - 0.5
        model_affine = reoriented_aff @ scaling
        model_affine.setflags(write=False)

    plan = GeometryPlan(
        spatial_shape=shape,
        zooms_mm=zooms,
        input_codes=codes,
        orientation="".join(_check_codes(orientation)) if orientation is not None else None,
        ornt=ornt_t,
        inverse_ornt=inverse_t,
        reoriented_shape=reoriented_shape,
        reoriented_zooms_mm=reoriented_zooms,
        spacing_mm=spacing,
        model_shape=model_shape,
        model_zooms_mm=model_zooms,
        reorients=reorients,
        resamples=model_shape != reoriented_shape,
        affine=aff,
        model_affine=model_affine,
    )
    logger.debug(
        "geometry: %s %s -> %s %s (reorient %s, resample %s)",
        shape,
        codes,
        model_shape,
        plan.orientation,
        reorients,
        plan.resamples,
    )
    return plan


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
    if not plan.resamples:
        return x
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
    n_in: int, n_out: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Source rows ``i0``, ``i1`` and weights ``w0``, ``w1`` of 1-D linear resampling (align_corners=False).

    Output ``j`` is ``w0[j] * x[i0[j]] + w1[j] * x[i1[j]]``. The float32 source index
    ``scale * (j + 0.5) - 0.5`` (``scale = float32(n_in / n_out)``) is rounded once, as ATen's
    ``area_pixel_compute_source_index`` compiled with a fused multiply-add, so the weights are the
    ones ``F.interpolate`` uses on CPU (results agree within one float32 rounding).
    """
    scale = np.float64(np.float32(n_in) / np.float32(n_out))
    src = (scale * (np.arange(n_out, dtype=np.float64) + 0.5) - 0.5).astype(np.float32)
    src = np.maximum(src, np.float32(0.0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    lam = np.clip(src - i0.astype(np.float32), np.float32(0.0), np.float32(1.0)).astype(np.float32)
    i1 = np.minimum(i0 + 1, n_in - 1)
    return i0, i1, (np.float32(1.0) - lam).astype(np.float32), lam


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
    write: Any,
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
    i0, i1, w0, w1 = _linear_weights(m0, r0)
    weight_shape = (-1,) + (1,) * plan.spatial_dims  # broadcast over (rows, C_out, *rest)
    with torch.inference_mode():
        for start in range(0, r0, rows):
            stop = min(start + rows, r0)
            lo, hi = int(i0[start]), int(i1[stop - 1]) + 1
            part = pred[:, lo:hi]
            if part.dtype != np.float32 or not part.flags.writeable or min(part.strides) < 0:
                part = np.array(part, dtype=np.float32)  # torch views only writable, forward-strided memory
            src = torch.from_numpy(part).transpose(0, 1)  # (n_src, C_out, *rest_m), a view
            src = _activate(src, activation, dim=1)
            if m0 != r0:
                a = src.index_select(0, torch.from_numpy(i0[start:stop] - lo))
                b = src.index_select(0, torch.from_numpy(i1[start:stop] - lo))
                a.mul_(torch.from_numpy(w0[start:stop]).view(weight_shape))
                a.add_(b.mul_(torch.from_numpy(w1[start:stop]).view(weight_shape)))
                del b
            else:
                a = src
            if rest_m != rest_r:
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
        ``(*S)`` uint8 labels: argmax over channels, or ``p > threshold`` for one channel.

    Raises:
        GeometryError: ``pred``'s spatial shape is not ``plan.model_shape``; unknown ``activation``;
            more than 256 channels (labels would not fit uint8).

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
    if n_out > 256:
        raise _fail(f"pred has {n_out} channels; uint8 labels hold at most 256 classes")
    out = np.empty(plan.spatial_shape, dtype=np.uint8)
    view = _oriented(out[None], plan.ornt)[0]

    def write(start: int, stop: int, slab: torch.Tensor) -> None:
        if n_out == 1:
            labels = (slab[:, 0] > threshold).to(torch.uint8)
        else:
            labels = torch.argmax(slab, dim=1).to(torch.uint8)
        view[start:stop] = labels.numpy()

    rows = _resample_back(p, plan, activation, write, max_slab_bytes)
    logger.debug("labels back to %s in slabs of %d rows", plan.spatial_shape, rows)
    return out
