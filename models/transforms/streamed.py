"""Preprocessing applied per tile or slab, for inputs read by region (issue 20 item 2).

:class:`RegionPreprocessed` wraps an array-like input ``(C, *spatial)`` (``shape``, ``dtype``,
``source[slices]``) as the preprocessed ``(C_in, *spatial)`` float32 array the engine reads tiles
from: each region read is preprocessed on its own, so no full-size float copy of the input exists.
It equals :func:`models.transforms.preprocess.preprocess` of the whole image, voxel for voxel, because every
step is either local (channel conversions, ``ct_window``, ``clip``, ``scale_range``,
``normalize``, ``unit_range`` of integers) or takes whole-image statistics computed first in one
streaming pass over slabs (``zscore``: mean and standard deviation, per channel or over non-zero
voxels, combined slab by slab in float64 with Chan's formula; ``unit_range`` of floats: the finite
minimum and maximum).

What cannot be applied this way (:func:`why_not_local`): ``percentile`` (a global percentile needs
every voxel at once); such a model's inputs are decoded whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from models.errors import InputError
from models.spec import ModelSpec, PreprocessStep
from models.transforms.preprocess import _apply, _unit_range

__all__ = [
    "RegionPreprocessed",
    "SLAB_BYTES",
    "why_not_local",
]

#: Bytes of the source read per slab in a statistics pass (32 MiB).
SLAB_BYTES = 32 << 20

_GLOBAL = {"percentile": "a global percentile needs every voxel at once"}


def why_not_local(spec: ModelSpec) -> str | None:
    """Why ``spec``'s preprocessing cannot run per region (a sentence), or ``None`` when it can."""
    for step in spec.preprocess:
        if step.kind in _GLOBAL:
            return f"preprocessing step {step.kind!r}: {_GLOBAL[step.kind]}"
    return None


class _Moments:
    """Count, mean and sum of squared deviations, combined chunk by chunk (Chan et al. 1979)."""

    __slots__ = ("m2", "mean", "n")

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, values: npt.NDArray[Any]) -> None:
        n = int(values.size)
        if n == 0:
            return
        mean = float(values.mean(dtype=np.float64))
        m2 = float(np.square(values - np.float64(mean), dtype=np.float64).sum(dtype=np.float64))
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.n) if self.n else 0.0


class RegionPreprocessed:
    """The spec's preprocessing of a region-readable ``source``, applied region by region.

    Args:
        source: ``(C, *spatial)`` array-like of any numeric dtype (``shape``, ``dtype``, indexing
            by a tuple of slices; ``slab_axis``, if it has one, is the spatial axis along which
            slabs are cheapest to read).
        spec: the model's spec (``preprocess``, ``in_channels``, ``spatial_dims``).
        as_float: cast the source to float32 first (what :meth:`models.geometry.mapping.GridMapping.to_model`
            does for a spec with geometry).
        check_finite: refuse a float input without a single finite value (one streaming pass).

    Raises:
        InputError: the steps do not give ``spec.in_channels`` channels, a spec step cannot run per
            region (:func:`why_not_local`), or (``check_finite``) no finite value.
    """

    def __init__(
        self, source: Any, spec: ModelSpec, *, as_float: bool = False, check_finite: bool = True
    ) -> None:
        why = why_not_local(spec)
        if why is not None:
            raise InputError(why)
        self.source = source
        self.spec = spec
        self.as_float = as_float
        spatial = tuple(int(n) for n in source.shape[1:])
        if len(spatial) != spec.spatial_dims:
            raise InputError(f"model {spec.name!r} takes {spec.spatial_dims} spatial axes, got {spatial}")
        self.slab_axis = int(getattr(source, "slab_axis", 0))
        self._steps: list[Callable[[npt.NDArray[Any]], npt.NDArray[Any]]] = []
        #: Non-finite (NaN, inf) input voxels, counted when ``check_finite`` and the input is float.
        self.nonfinite = 0
        if check_finite and np.dtype(source.dtype).kind == "f":
            self._check_finite()
        for step in spec.preprocess:
            self._steps.append(self._prepare(step))
        probe = self._region(tuple(slice(0, 1) for _ in spatial))
        if probe.shape[0] != spec.in_channels:
            raise InputError(
                f"model {spec.name!r} takes {spec.in_channels} channel(s), got {probe.shape[0]} "
                f"(input shape {tuple(source.shape)})"
            )
        self.shape = (int(spec.in_channels), *spatial)
        self.dtype = np.dtype(np.float32)

    @property
    def ndim(self) -> int:
        """``1 + spatial dims``."""
        return len(self.shape)

    def __getitem__(self, key: Any) -> npt.NDArray[np.float32]:
        key = key if isinstance(key, tuple) else (key,)
        channels, spatial = key[0], tuple(key[1:]) + (slice(None),) * (self.ndim - len(key))
        region = self._region(spatial)
        return region if channels == slice(None) else np.ascontiguousarray(region[channels])

    def _raw(self, spatial: tuple[slice, ...]) -> npt.NDArray[Any]:
        x = np.asarray(self.source[(slice(None), *spatial)])
        return x.astype(np.float32) if self.as_float else x

    def _region(self, spatial: tuple[slice, ...], upto: int | None = None) -> npt.NDArray[Any]:
        x = self._raw(spatial)
        for fn in self._steps[:upto]:
            x = fn(x)
        if upto is not None:
            return x
        out = np.ascontiguousarray(x, dtype=np.float32)
        # non-finite voxels become 0 after the steps, as in models.transforms.preprocess (MONAI / nnU-Net)
        if np.isfinite(out).all():
            return out
        return np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0)

    def _slabs(self) -> list[tuple[slice, ...]]:
        """Slabs of about :data:`SLAB_BYTES` along :attr:`slab_axis` covering the image."""
        spatial = [int(n) for n in self.source.shape[1:]]
        axis = self.slab_axis
        plane = (
            int(self.source.shape[0])
            * np.dtype(self.source.dtype).itemsize
            * math.prod(spatial)
            // spatial[axis]
        )
        step = max(1, SLAB_BYTES // max(1, plane))
        slabs = []
        for lo in range(0, spatial[axis], step):
            key = [slice(None)] * len(spatial)
            key[axis] = slice(lo, min(lo + step, spatial[axis]))
            slabs.append(tuple(key))
        return slabs

    def _check_finite(self) -> None:
        """Count the non-finite input voxels (:attr:`nonfinite`, replaced by 0 after the steps);
        refuse an input without a finite one."""
        finite = False
        for slab in self._slabs():
            good = np.isfinite(self._raw(slab))
            finite = finite or bool(good.any())
            self.nonfinite += int(good.size - np.count_nonzero(good))
        if not finite:
            raise InputError("the input holds no finite value (all NaN or infinite)")

    def _prepare(self, step: PreprocessStep) -> Callable[[npt.NDArray[Any]], npt.NDArray[Any]]:
        """The step as a function of one region, with its whole-image statistics computed now."""
        kind, p, spec = step.kind, step.params, self.spec
        if kind == "zscore":
            return self._zscore(bool(p.get("channel_wise")), bool(p.get("nonzero")))
        if kind == "unit_range":
            return self._unit_range()
        return lambda x: _apply(step, x, spec)

    def _stat_pass(self, gather: Callable[[npt.NDArray[Any]], None]) -> None:
        upto = len(self._steps)
        for slab in self._slabs():
            gather(self._region(slab, upto))

    def _zscore(self, channel_wise: bool, nonzero: bool) -> Callable[[npt.NDArray[Any]], npt.NDArray[Any]]:
        moments: list[_Moments] = []

        def gather(x: npt.NDArray[Any]) -> None:
            xf = x.astype(np.float32, copy=False)
            groups = list(xf) if channel_wise else [xf]
            while len(moments) < len(groups):
                moments.append(_Moments())
            for m, values in zip(moments, groups, strict=False):
                picked = values[values != 0] if nonzero else values.reshape(-1)
                m.add(picked[np.isfinite(picked)])  # statistics ignore NaN and inf

        self._stat_pass(gather)
        stats = [(m.mean, m.std, m.n) for m in moments]

        def scale(
            values: npt.NDArray[np.float32], mean: float, std: float, n: int
        ) -> npt.NDArray[np.float32]:
            if n == 0:
                return values
            mask = values != 0 if nonzero else None
            picked = values[mask] if mask is not None else values
            scaled = ((picked - mean) / (std if std > 0 else 1.0)).astype(np.float32)
            if mask is None:
                return scaled
            out = values.copy()
            out[mask] = scaled
            return out

        def apply(x: npt.NDArray[Any]) -> npt.NDArray[Any]:
            xf = x.astype(np.float32, copy=False)
            if channel_wise:
                return np.stack([scale(c, *stats[i]) for i, c in enumerate(xf)]).astype(np.float32)
            return scale(xf, *stats[0])

        return apply

    def _unit_range(self) -> Callable[[npt.NDArray[Any]], npt.NDArray[Any]]:
        kind = np.dtype(
            self._region(tuple(slice(0, 1) for _ in self.source.shape[1:]), len(self._steps)).dtype
        )
        if kind.kind in "iub":  # by the dtype's range: local
            return _unit_range
        bounds = [math.inf, -math.inf]

        def gather(x: npt.NDArray[Any]) -> None:
            finite = x[np.isfinite(x)]
            if finite.size:
                bounds[0] = min(bounds[0], float(finite.min()))
                bounds[1] = max(bounds[1], float(finite.max()))

        self._stat_pass(gather)
        lo, hi = bounds

        def apply(x: npt.NDArray[Any]) -> npt.NDArray[Any]:
            xf = x.astype(np.float32, copy=False)
            if not math.isfinite(lo) or (lo >= 0.0 and hi <= 1.0):
                return xf
            span = hi - lo if hi > lo else 1.0
            return ((xf - np.float32(lo)) / np.float32(span)).astype(np.float32)

        return apply
