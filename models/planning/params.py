"""The inference parameters: one pydantic schema for HTTP queries, CLI options and spec defaults.

Adding a parameter is one field here plus its use: the HTTP query (and its OpenAPI entry), the
``tilewise infer`` / ``tilewise batch`` options, the spec's ``defaults`` and ``GET /v1/models`` are all
generated from :class:`InferenceParams`. Values arrive as strings (query, command line) or as YAML
values (spec): per-axis tuples are comma-separated (``tile=128,128,64``) or lists, ``halo`` may be
``auto``, closed sets are :class:`StrEnum` s. Every error is a :class:`ParamError` naming the
parameter and the value, with a did-you-mean hint for unknown names and values.

This module imports pydantic and the standard library only, so the batch client can use it
without torch.
"""

from __future__ import annotations

import difflib
import enum
import math
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from models.errors import ParamError

__all__ = [
    "Blend",
    "InferenceParams",
    "MaskMode",
    "OutputFormat",
    "OutputKind",
    "PerAxis",
    "ProbabilityDtype",
    "REQUEST_ONLY",
    "SegType",
    "Spacing",
    "StrEnum",
    "Tilt",
    "Tta",
    "parse_params",
    "parse_query",
    "per_axis_field",
]

PerAxis = int | tuple[int, ...]

#: Fields that belong to one request only: not a spec default, not an option of ``tilewise infer``
#: or ``tilewise batch`` (``tilewise plan`` is the command line's dry run).
REQUEST_ONLY = frozenset({"dry_run"})

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        """``StrEnum`` of Python 3.11: members are their lower-case string values."""

        def __str__(self) -> str:
            return str(self.value)


class Blend(StrEnum):
    """Blend window of overlapping cores (the values of :class:`tiling.BlendMode`)."""

    CONSTANT = "constant"
    GAUSSIAN = "gaussian"
    HANN = "hann"
    TRIANGULAR = "triangular"


class OutputKind(StrEnum):
    """``probabilities``: float32 ``(C_out, *spatial)``; ``labels``: uint8 argmax ``(*spatial)``."""

    PROBABILITIES = "probabilities"
    LABELS = "labels"


class OutputFormat(StrEnum):
    """Output file formats; :attr:`suffix` is the file name suffix of each."""

    NII_GZ = "nii.gz"
    NII = "nii"
    PNG = "png"
    TIFF = "tiff"
    NPY = "npy"
    DICOM_SEG = "dicom-seg"
    #: tiled pyramidal OME-TIFF (2D), :mod:`service.pyramid`
    OME_TIFF = "ome.tiff"
    #: one Feature per connected object of a 2D label output, :mod:`service.objects`
    GEOJSON = "geojson"
    #: zip of a multiscale OME-Zarr group (2D), :mod:`service.omezarr`
    OME_ZARR = "ome.zarr"

    @property
    def suffix(self) -> str:
        """``".nii.gz"`` for ``nii.gz`` and so on; ``".dcm"`` for ``dicom-seg``, ``".ome.zarr.zip"``
        for ``ome.zarr``."""
        if self is OutputFormat.OME_ZARR:
            return ".ome.zarr.zip"
        return ".dcm" if self is OutputFormat.DICOM_SEG else "." + self.value


class ProbabilityDtype(StrEnum):
    """dtype of a probability output file: ``float32``; ``float16``; ``uint8`` = round(255 * p),
    the values clipped to [0, 1] first (for outputs that must fit: a quarter of float32's bytes)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    UINT8 = "uint8"


class Tta(StrEnum):
    """Test-time augmentation: ``none``, or ``mirror``: the mean over flips of the spatial axes."""

    NONE = "none"
    MIRROR = "mirror"


class Tilt(StrEnum):
    """A gantry-tilted DICOM series: ``refuse`` it (422), or ``resample`` it onto an orthogonal grid."""

    REFUSE = "refuse"
    RESAMPLE = "resample"


class SegType(StrEnum):
    """DICOM SEG kind: ``binary`` (one bit per segment), ``labelmap``, or ``fractional``
    (probabilities, 8 bits)."""

    BINARY = "binary"
    LABELMAP = "labelmap"
    FRACTIONAL = "fractional"


class MaskMode(StrEnum):
    """Slides: ``auto`` (a tissue mask from a low level; tiles outside it are not run), ``none``."""

    AUTO = "auto"
    NONE = "none"


class Spacing(StrEnum):
    """``model``: resample to the spec's ``spacing`` (when it has one); ``native``: never resample."""

    MODEL = "model"
    NATIVE = "native"


# ASCII digits only: Python's int() and float() also take other scripts' digits ("٦٤" is 64) and
# underscores ("1_000"), which no client means to send.
_INT_RE = re.compile(r"[+-]?[0-9]+")
_FLOAT_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _int(text: str) -> int:
    """``int(text)`` for ASCII decimal digits with an optional sign; ``ValueError`` otherwise."""
    text = text.strip()
    if not _INT_RE.fullmatch(text):
        raise ValueError(text)
    return int(text)


def _did_you_mean(value: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def per_axis_field(minimum: int, *, auto: bool = False) -> BeforeValidator:
    """Parse ``"8"``, ``"8,8,4"``, ``8``, ``[8, 8, 4]`` (and ``"auto"``) into an int or a tuple."""

    def parse(value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        if value is None:
            return None
        if auto and isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, str):
            parts: list[Any] = [p.strip() for p in value.split(",")]
        elif isinstance(value, list | tuple):
            parts = list(value)
        else:
            parts = [value]
        numbers: list[int] = []
        for index, part in enumerate(parts):
            where = name if len(parts) == 1 else f"{name}[{index}]"
            if isinstance(part, bool) or not isinstance(part, int | str):
                raise ValueError(f"{where}={part!r} is not an integer")
            try:
                number = _int(part) if isinstance(part, str) else int(part)
            except ValueError:
                raise ValueError(f"{where}={part!r} is not an integer (in {name}={value!r})") from None
            if number < minimum:
                raise ValueError(f"{where}={number} must be >= {minimum}")
            numbers.append(number)
        if not numbers:
            raise ValueError(f"{name}={value!r} is empty")
        if len(numbers) == 1 and not isinstance(value, list | tuple):
            return numbers[0]
        return tuple(numbers)

    return BeforeValidator(parse)


def _count(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name
    if value is None:
        return None
    if isinstance(value, str) and "," in value:
        raise ValueError(f"{name}={value!r} must be one integer")
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{name}={value!r} is not an integer")
    try:
        number = _int(value) if isinstance(value, str) else int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None
    if number < 1:
        raise ValueError(f"{name}={number} must be >= 1")
    return number


def _positive_number(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name
    if value is None:
        return None
    if isinstance(value, bool) or (isinstance(value, str) and not _FLOAT_RE.fullmatch(value.strip())):
        raise ValueError(f"{name}={value!r} is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a number") from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name}={number} must be a finite number > 0")
    return number


_UID_RE = re.compile(r"[0-9]+(?:\.[0-9]+)*")


def _mpp(value: Any, info: ValidationInfo) -> Any:
    """``model`` (any case) or a positive number of microns per pixel."""
    if isinstance(value, str) and value.strip().lower() == "model":
        return "model"
    return _positive_number(value, info)


def _level(value: Any, info: ValidationInfo) -> Any:
    """A pyramid level: an integer >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{info.field_name}={value!r} is not an integer")
    try:
        number = _int(value) if isinstance(value, str) else int(value)
    except ValueError:
        raise ValueError(f"{info.field_name}={value!r} is not an integer") from None
    if number < 0:
        raise ValueError(f"{info.field_name}={number} must be >= 0 (0 is full resolution)")
    return number


def _uid(value: Any, info: ValidationInfo) -> Any:
    """A DICOM UID: digits and dots, at most 64 characters."""
    if value is None:
        return None
    text = str(value).strip()
    if len(text) > 64 or not _UID_RE.fullmatch(text):
        raise ValueError(f"{info.field_name}={value!r} is not a DICOM UID (digits and dots, up to 64)")
    return text


def _flag(value: Any, info: ValidationInfo) -> Any:
    """``true``/``false`` (also ``1``/``0``, ``yes``/``no``, any case) or a bool."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"true", "1", "yes", "on"}:
        return True
    if text in {"false", "0", "no", "off"}:
        return False
    raise ValueError(f"{info.field_name}={value!r} is not true or false")


def _choice(kind: type[StrEnum]) -> BeforeValidator:
    """Case-insensitive choice of ``kind``'s values (``format`` also drops a leading dot)."""

    def parse(value: Any, info: ValidationInfo) -> Any:
        if value is None or isinstance(value, kind):
            return value
        text = str(value).strip().lower().lstrip(".") if isinstance(value, str) else value
        allowed = [m.value for m in kind]
        if text not in allowed:
            hint = _did_you_mean(str(text), allowed)
            raise ValueError(f"{info.field_name}={value!r} is not one of {allowed}{hint}")
        return kind(text)

    return BeforeValidator(parse)


class InferenceParams(BaseModel):
    """Inference parameters; ``None`` means the model's default (its spec's ``defaults``).

    The same fields are the HTTP query parameters, the ``--name`` options of ``tilewise infer`` and
    ``tilewise batch``, the spec's ``defaults`` and the ``defaults`` of ``GET /v1/models``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tile: Annotated[PerAxis | None, per_axis_field(1)] = Field(
        default=None, description="Tile (network input) per axis, voxels: `128` or `128,128,64`."
    )
    halo: Annotated[PerAxis | Literal["auto"] | None, per_axis_field(0, auto=True)] = Field(
        default=None, description="Discarded margin per side, voxels, per axis; or `auto` (calibrated)."
    )
    halo_tolerance: Annotated[float | None, BeforeValidator(_positive_number)] = Field(
        default=None, description="Max truncation error accepted by `halo=auto` (after the activation)."
    )
    overlap: Annotated[PerAxis | None, per_axis_field(0)] = Field(
        default=None, description="Voxels shared by neighbouring tile cores (blended)."
    )
    blend: Annotated[Blend | None, _choice(Blend)] = Field(
        default=None, description="Blend window of overlapping cores."
    )
    batch_size: Annotated[int | None, BeforeValidator(_count)] = Field(
        default=None, description="Tiles per forward pass."
    )
    output: Annotated[OutputKind | None, _choice(OutputKind)] = Field(
        default=None, description="Output kind: float32 probabilities or uint8 argmax labels."
    )
    format: Annotated[OutputFormat | None, _choice(OutputFormat)] = Field(
        default=None,
        description="Output format. Default: nii.gz for NIfTI input; png for labels and tiff "
        "(float32) for probabilities otherwise.",
    )
    output_dtype: Annotated[ProbabilityDtype | None, _choice(ProbabilityDtype)] = Field(
        default=None,
        description="dtype of probability outputs: `float32` (default), `float16`, or `uint8` "
        "(probabilities scaled to 0-255); labels are unaffected.",
    )
    tta: Annotated[Tta, _choice(Tta)] = Field(
        default=Tta.NONE,
        description="Test-time augmentation: `mirror` averages the predictions over flips of the "
        "model's `mirror_axes` (default every spatial axis: 2**dims tiled passes).",
    )
    spacing: Annotated[Spacing, _choice(Spacing)] = Field(
        default=Spacing.MODEL,
        description="`model`: resample NIfTI inputs to the model's spacing (and the output back); "
        "`native`: no resampling (reorientation still applies). Images without an affine (PNG, "
        "TIFF, JPEG) are always native.",
    )
    series: Annotated[str | None, BeforeValidator(_uid)] = Field(
        default=None,
        description="DICOM input: the SeriesInstanceUID to read when the upload holds several series "
        "(default: none; an upload of several series is refused with their list).",
    )
    tilt: Annotated[Tilt | None, _choice(Tilt)] = Field(
        default=None,
        description="DICOM input with a gantry tilt: `refuse` (default, 422) or `resample` onto an "
        "orthogonal grid (each slice shifted in plane, linear).",
    )
    mpp: Annotated[float | Literal["model"] | None, BeforeValidator(_mpp)] = Field(
        default=None,
        description="Slides: microns per pixel to read at (the nearest level at or finer, resampled), "
        "or `model` (default: the model's `mpp`; level 0 when it has none). Excludes `level`.",
    )
    level: Annotated[int | None, BeforeValidator(_level)] = Field(
        default=None,
        description="Slides: the pyramid level to read (0 = full resolution). Excludes `mpp` "
        "(default: the level that `mpp` picks).",
    )
    mask: Annotated[MaskMode | None, _choice(MaskMode)] = Field(
        default=None,
        description="Slides: `auto` (default: a tissue mask from a low level; tiles outside it are "
        "not run but given the network's output on blank glass) or `none`.",
    )
    seg_type: Annotated[SegType | None, _choice(SegType)] = Field(
        default=None,
        description="format=dicom-seg: `binary` (default for labels), `labelmap`, or `fractional` "
        "(the default for probabilities).",
    )

    dry_run: Annotated[bool, BeforeValidator(_flag)] = Field(
        default=False,
        description="`true`: answer the plan as JSON (tile, halo, batch_size, tiles, work, peak_bytes, "
        "eta_s ...) without running the network.",
    )

    @model_validator(mode="after")
    def _mpp_or_level(self) -> InferenceParams:
        if self.level is not None and self.mpp is not None and self.mpp != "model":
            raise ValueError(f"mpp={self.mpp} and level={self.level} exclude each other: give one")
        return self

    def merged(self, defaults: InferenceParams) -> InferenceParams:
        """These parameters, with every one not given here taken from ``defaults``.

        "Given" means set explicitly (pydantic's ``model_fields_set``), so a field may have a
        default of its own (used when neither side gives it) without overriding ``defaults``.
        """
        mine = {k: v for k, v in self.model_dump(exclude_unset=True).items() if v is not None}
        return defaults.model_copy(update=mine)

    def to_query(self) -> dict[str, str]:
        """The given parameters as strings (HTTP query, command line): tuples comma-separated."""
        out = {}
        for name, value in self.model_dump(mode="json", exclude_unset=True, exclude_none=True).items():
            out[name] = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
        return out

    @classmethod
    def choices(cls, name: str) -> list[str] | None:
        """The allowed values of a closed-set parameter (``None`` for open ones)."""
        kind = _enum_of(cls.model_fields[name].annotation)
        return None if kind is None else [m.value for m in kind]


def _enum_of(annotation: Any) -> type[StrEnum] | None:
    for arg in getattr(annotation, "__args__", (annotation,)):
        if isinstance(arg, type) and issubclass(arg, StrEnum):
            return arg
    return None


def _message(exc: ValidationError) -> str:
    """One line per problem, each naming the parameter and the value."""
    problems = []
    for err in exc.errors():
        ctx_error = (err.get("ctx") or {}).get("error")
        if ctx_error is not None:
            problems.append(str(ctx_error))
        else:
            where = ".".join(str(p) for p in err["loc"])
            problems.append(f"{where}={err.get('input')!r}: {err['msg']}")
    return "; ".join(problems)


def parse_params(raw: Mapping[str, Any]) -> InferenceParams:
    """Validate parameters (strings from a query or command line, or YAML values) into the schema.

    Unknown names are refused, so a typo (``tiles=64``) never silently falls back to a default;
    ``None`` and blank strings mean "not given".

    Raises:
        ParamError: an unknown name or an invalid value (the message names both, with a hint).
    """
    allowed = list(InferenceParams.model_fields)
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        hints = "".join(_did_you_mean(name, allowed) for name in unknown[:1])
        raise ParamError(f"unknown parameter(s) {unknown}{hints} (allowed: {', '.join(allowed)})")
    given = {k: v for k, v in raw.items() if v is not None and not (isinstance(v, str) and not v.strip())}
    try:
        return InferenceParams.model_validate(given)
    except ValidationError as exc:
        raise ParamError(_message(exc)) from None


def parse_query(pairs: Iterable[tuple[str, str]]) -> InferenceParams:
    """:func:`parse_params` of a query's ``(name, value)`` pairs, refusing a repeated name.

    ``?tile=64&tile=128`` has no single meaning (frameworks keep the first, or the last, or both):
    it is an error naming the parameter, never a silent choice.

    Raises:
        ParamError: a repeated, unknown or invalid parameter.
    """
    raw: dict[str, str] = {}
    for name, value in pairs:
        if name in raw:
            raise ParamError(
                f"parameter {name!r} is given more than once ({raw[name]!r}, {value!r}); give it once"
            )
        raw[name] = value
    return parse_params(raw)
