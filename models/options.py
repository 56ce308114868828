"""Per-request inference options and their resolution against a model's defaults."""

from __future__ import annotations

from dataclasses import dataclass

from models.errors import InputError
from models.spec import BLENDS, OUTPUT_KINDS, ModelSpec
from tiling.errors import GridError

__all__ = ["InferenceOptions", "ResolvedOptions"]

PerAxis = int | tuple[int, ...]


def _per_axis(value: PerAxis, ndim: int, name: str, minimum: int) -> tuple[int, ...]:
    values = (value,) * ndim if isinstance(value, int) else tuple(value)
    if len(values) != ndim:
        raise GridError(f"{name}={value!r} needs 1 or {ndim} values (one per spatial axis)")
    for axis, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise GridError(f"{name}[{axis}]={v!r} must be an int >= {minimum}")
    return values


@dataclass(frozen=True, slots=True)
class ResolvedOptions:
    """Options with every default filled in: per-axis tuples (voxels), or ``halo="auto"``."""

    tile: tuple[int, ...]
    halo: tuple[int, ...] | str
    halo_tolerance: float
    overlap: tuple[int, ...]
    blend: str
    batch_size: int
    output: str


@dataclass(frozen=True, slots=True)
class InferenceOptions:
    """Inference options; ``None`` means the model spec's default.

    Attributes:
        tile: network input size per axis (voxels), int or one per axis.
        halo: discarded margin per side (voxels), or ``"auto"`` for the calibrated halo.
        halo_tolerance: max abs truncation error accepted by ``halo="auto"``.
        overlap: voxels shared by neighbouring cores (blended).
        blend: ``constant``, ``gaussian``, ``hann`` or ``triangular``.
        batch_size: tiles per forward pass.
        output: ``probabilities`` (float32 ``(C_out, *spatial)``) or ``labels`` (uint8 ``(*spatial)``).
    """

    tile: int | tuple[int, ...] | None = None
    halo: int | tuple[int, ...] | str | None = None
    halo_tolerance: float = 1e-4
    overlap: int | tuple[int, ...] | None = None
    blend: str | None = None
    batch_size: int | None = None
    output: str | None = None

    def resolve(self, spec: ModelSpec) -> ResolvedOptions:
        """Fill ``None`` fields from ``spec.defaults`` and validate.

        Raises:
            GridError: a tile/halo/overlap/blend/batch value of the wrong type, count or range.
            InputError: an unknown output kind.
        """
        d = spec.defaults
        ndim = spec.spatial_dims
        halo_raw = d.halo if self.halo is None else self.halo
        if isinstance(halo_raw, str):
            if halo_raw != "auto":
                raise GridError(f"halo={halo_raw!r} must be an int, a tuple of ints or 'auto'")
            halo: tuple[int, ...] | str = "auto"
        else:
            halo = _per_axis(halo_raw, ndim, "halo", 0)
        blend = d.blend if self.blend is None else self.blend
        if blend not in BLENDS:
            raise GridError(f"blend={blend!r} must be one of {list(BLENDS)}")
        output = d.output if self.output is None else self.output
        if output not in OUTPUT_KINDS:
            raise InputError(f"output={output!r} must be one of {list(OUTPUT_KINDS)}")
        batch = d.batch_size if self.batch_size is None else self.batch_size
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise GridError(f"batch_size={batch!r} must be an int >= 1")
        if not self.halo_tolerance > 0:
            raise GridError(f"halo_tolerance={self.halo_tolerance!r} must be > 0")
        return ResolvedOptions(
            tile=_per_axis(d.tile if self.tile is None else self.tile, ndim, "tile", 1),
            halo=halo,
            halo_tolerance=float(self.halo_tolerance),
            overlap=_per_axis(d.overlap if self.overlap is None else self.overlap, ndim, "overlap", 0),
            blend=blend,
            batch_size=batch,
            output=output,
        )
