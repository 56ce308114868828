"""Model geometry: plan how a volume maps to the grid a network was trained on, and back.

Shapes: ``C`` input channels, ``C_out`` output channels, ``S`` the input's spatial shape (array-axis
order, as the codec stores it), ``S_r`` the same voxels reoriented to the model's axis codes, ``S_m``
the model grid after resampling to the model's spacing.

Medical networks expect their training orientation and spacing (nnU-Net and MONAI bundles resample
and reorient before the network and invert after). Three steps, each skipped when it is a no-op:

1. **Reorient** (3-D only): flips and axis permutations given by nibabel's orientation transform
   from the input affine's closest axis codes to the model's codes (``RAS``, ``LPS``, ``PIR``, ...).
   No interpolation: every voxel keeps its value, so it is exactly invertible.
2. **Resample** (linear) to the model's spacing, by one of two rules (:class:`Resampling`, the
   spec's ``resampling``; round half to even, as :func:`round`):

   - ``extent`` (the default; nnU-Net's ``compute_new_shape``): ``S_m = max(1, round(S_r * zooms /
     spacing))``; both grids share one field of view, voxel ``i`` of ``n`` centred at ``(i + 0.5) / n``
     of it (the model grid's voxel size is ``zooms * S_r / S_m``, close to the spacing).
   - ``corners`` (MONAI's ``Spacing`` / ``Spacingd``, ``scale_extent=False``, the default of every
     bundle): ``S_m = round((S_r - 1) * zooms / spacing + 1)``; the first voxel centres coincide and
     the model grid's voxel size is exactly the spacing, so model voxel ``j`` lies at input index
     ``j * spacing / zooms`` (beyond the last input voxel, the edge value: MONAI's ``border``).
3. **Back**: outputs are resampled (linear) from ``S_m`` to ``S_r``, then inverse-reoriented to ``S``.
   Labels are made only after that, by argmax over the resampled probabilities (label ids are never
   interpolated), slab by slab, so no ``C_out``-channel float volume at the input resolution exists.

This module only plans: pure arithmetic, :func:`plan_geometry` returns a :class:`GeometryPlan`.
:mod:`models.geometry.resample` moves the arrays (``to_model``, ``from_model_probabilities``,
``from_model_labels``) and states each rule's interpolation convention.
:attr:`GeometryPlan.model_affine` maps the model grid's voxels to the world points that were sampled.

Raises :class:`GeometryError` (a :class:`~models.errors.InputError`, HTTP 422) for geometry that
cannot be planned or arrays that do not fit their plan.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import nibabel as nib
import numpy as np
import numpy.typing as npt
from nibabel.orientations import axcodes2ornt, inv_ornt_aff, io_orientation, ornt_transform

from models.errors import InputError
from models.planning.params import StrEnum

__all__ = ["DEFAULT_SLAB_BYTES", "GeometryError", "GeometryPlan", "Ornt", "Resampling", "plan_geometry"]

logger = logging.getLogger(__name__)

#: Default bound on the scratch memory of one slab when resampling outputs back (bytes).
DEFAULT_SLAB_BYTES = 64 * 2**20

_AXIS_OF = {"L": 0, "R": 0, "P": 1, "A": 1, "I": 2, "S": 2}

#: A nibabel orientation as a tuple: ``(new axis, flip)`` per input axis.
Ornt = tuple[tuple[int, int], ...]


class Resampling(StrEnum):
    """Where the model grid's voxels lie on the input's (see the module docstring).

    ``extent``: one field of view, ``S_m = round(S_r * zooms / spacing)`` (nnU-Net v2,
    ``compute_new_shape``). ``corners``: the first voxel centres coincide and the voxel size is the
    spacing, ``S_m = round((S_r - 1) * zooms / spacing + 1)`` (MONAI ``Spacing``,
    ``compute_shape_offset`` with ``scale_extent=False``).
    """

    EXTENT = "extent"
    CORNERS = "corners"


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
        model_shape: ``S_m`` by the ``resampling`` rule (:class:`Resampling`), or ``S_r``.
        model_zooms_mm: the model grid's actual voxel size (mm): ``reoriented_zooms_mm * S_r / S_m``
            (``extent``) or ``spacing_mm`` (``corners``).
        reorients: ``False`` when ``ornt`` is the identity (the reorientation step is a no-op).
        resamples: ``False`` when ``S_m == S_r`` (the resampling step is a no-op).
        affine: the input's voxel-to-world affine, ``(n + 1, n + 1)`` or ``(4, 4)`` float64, or ``None``.
        model_affine: voxel-to-world affine of the model grid (same world points), or ``None``.
        resampling: the rule that placed the model grid (:class:`Resampling`).
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
    resampling: Resampling = Resampling.EXTENT

    def source_index(self, axis: int, *, back: bool = False) -> tuple[float, float]:
        """``(a, b)``: output index ``j`` of ``axis`` samples the other grid at ``a * j + b``.

        To the model grid (``back=False``) the source is ``S_r``; back, it is ``S_m``. ``extent``:
        ``a = n_src / n_out``, ``b = a / 2 - 0.5`` (``F.interpolate``, ``align_corners=False``);
        ``corners``: ``a = spacing / zoom`` (or its inverse back), ``b = 0``.
        """
        m, r = self.model_shape[axis], self.reoriented_shape[axis]
        if self.resampling == Resampling.CORNERS and self.spacing_mm and self.reoriented_zooms_mm:
            step = self.spacing_mm[axis] / self.reoriented_zooms_mm[axis]
            return (1.0 / step if back else step), 0.0
        a = m / r if back else r / m
        return a, 0.5 * a - 0.5

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


def _steps_off_one(
    rule: Resampling, spacing: tuple[float, ...] | None, zooms: tuple[float, ...] | None
) -> bool:
    """Whether a ``corners`` grid moves voxels although its shape is the input's (spacing != zoom)."""
    if rule != Resampling.CORNERS or spacing is None or zooms is None:
        return False
    return any(not math.isclose(s, z, rel_tol=1e-9) for s, z in zip(spacing, zooms, strict=True))


def plan_geometry(
    spatial_shape: Sequence[int],
    affine: npt.ArrayLike | None = None,
    *,
    orientation: str | None = None,
    spacing_mm: Sequence[float] | None = None,
    zooms_mm: Sequence[float] | None = None,
    resampling: Resampling | str = Resampling.EXTENT,
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
        resampling: the rule that places the model grid (:class:`Resampling`): ``extent`` (one
            field of view; nnU-Net) or ``corners`` (first voxel centres kept; MONAI's Spacingd).

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
        (``compute_new_shape``; Apache-2.0); ``corners``: Project-MONAI/MONAI monai/data/utils.py
        (``compute_shape_offset``; Apache-2.0).

    Example:
        >>> import numpy as np
        >>> lps = np.diag([-0.7, -0.7, 1.5, 1.0])  # an LPS CT
        >>> plan = plan_geometry((512, 512, 300), lps, orientation="RAS", spacing_mm=(1.0, 1.0, 1.0))
        >>> plan.input_codes, plan.reoriented_shape, plan.model_shape
        (('L', 'P', 'S'), (512, 512, 300), (358, 358, 450))
    """
    shape = tuple(int(s) for s in spatial_shape)
    ndim = len(shape)
    try:
        rule = Resampling(resampling)
    except ValueError:
        raise _fail(f"resampling={resampling!r}: expected one of {[r.value for r in Resampling]}") from None
    if ndim not in (1, 2, 3) or any(s < 1 for s in shape):
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
        triples = zip(reoriented_shape, reoriented_zooms, spacing, strict=True)
        if rule == Resampling.CORNERS:
            # MONAI rounds ptp + 1 (not ptp): 24.5 + 1 -> 26, half to even
            model_shape = tuple(round((n - 1) * z / s + 1.0) for n, z, s in triples)
        else:
            model_shape = tuple(max(1, round(n * z / s)) for n, z, s in triples)
    model_zooms = (
        tuple(z * n / m for z, n, m in zip(reoriented_zooms, reoriented_shape, model_shape, strict=True))
        if reoriented_zooms is not None
        else None
    )
    if rule == Resampling.CORNERS and spacing is not None:
        model_zooms = spacing

    model_affine: npt.NDArray[np.float64] | None = None
    if aff is not None:
        reoriented_aff = aff @ inv_ornt_aff(ornt, shape) if reorients else aff.copy()  # type: ignore[no-untyped-call]
        # model voxel j sits at reoriented index (j + 0.5) * f - 0.5, f = S_r / S_m (extent),
        # or j * spacing / zoom (corners)
        scaling = np.eye(aff.shape[0])
        for axis in range(ndim):
            f = reoriented_shape[axis] / model_shape[axis]
            offset = 0.5 * f - 0.5
            if rule == Resampling.CORNERS and spacing is not None and reoriented_zooms is not None:
                f, offset = spacing[axis] / reoriented_zooms[axis], 0.0
            scaling[axis, axis] = f
            scaling[axis, -1] = offset
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
        resamples=model_shape != reoriented_shape or _steps_off_one(rule, spacing, reoriented_zooms),
        affine=aff,
        model_affine=model_affine,
        resampling=rule,
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
