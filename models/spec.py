"""Model specs: one YAML or JSON file per model, validated strictly (pydantic) at load time.

A spec file (``unet3d.yaml``) looks like this; every key but the first five is optional::

    name: unet3d                  # [a-z0-9][a-z0-9._-]*
    backend: eager                # eager | torchscript | onnx | analytic
    spatial_dims: 3               # 1, 2 or 3
    in_channels: 1
    out_channels: 2
    file: unet3d.safetensors      # relative to the spec's folder (eager / torchscript / onnx)
    sha256: 3b4c...               # verified before loading when given
    architecture: unet            # eager: a name of models.zoo.nets, or "package.module:callable"
    params: {features: 8}         # keyword arguments of the architecture (or analytic parameters)
    alignment: 4                  # total stride of the network (tile sizes are multiples of it),
                                  # or one per axis: [2, 8, 8] (nnU-Net's anisotropic pooling)
    scale: 1                      # output voxels per input voxel
    receptive_field: [10, 10, 10] # radius per axis in voxels, when known (else measured)
    tile_dependent: false         # instance norm / attention / global pooling (absent: probed at warm-up)
    fixed_tile: false             # the network takes exactly defaults.tile (a transformer's img_size)
    spacing: [1.0, 1.0, 1.0]      # mm per spatial axis the network was trained at (inputs resampled)
    resampling: extent            # where the resampled grid lies: extent (nnU-Net) | corners (MONAI)
    orientation: RAS              # axis codes the network was trained in (3-D; inputs reoriented)
    mpp: 0.5                      # 2D: microns per pixel the network was trained at (slides read to it)
    labels: {0: background, 1: grey matter}  # label index -> name
    padding: end                  # where the image lies in its window: end | centred-monai | centred-nnunet
    mirror_axes: [0, 1, 2]        # model-grid axes that tta=mirror flips (default: all)
    frame: {shape: [256, 256, 256], margin: 0.1}  # foreground box resized to shape (not with spacing)
    global_pooling: false         # global average pools whose statistics come from the whole image
    precision: fp32               # fp32 | fp16 | bf16 (autocast, CUDA only)
    channels_last: false          # CUDA memory format
    preprocess:                   # applied to the whole image before tiling, in order
      - {type: ct_window, lo: -1000, hi: 400}
      - zscore
    output: {activation: softmax, kind: labels, dtype: float32, tta_average: probabilities}
    defaults: {tile: [96, 96, 96], halo: auto, overlap: 0, blend: constant, batch_size: 2}

``defaults`` is :class:`~models.planning.params.InferenceParams` (the same schema as the HTTP query and the
CLI options); unset ones are filled in (tile 256 per axis in 1-D/2-D, 96 in 3-D; halo ``auto``;
overlap 0; blend constant; batch size 1; output ``output.kind``) and per-axis values broadcast, so
``spec.defaults`` is complete but for ``format`` (``None``: it follows the input).

``padding`` says how the source framework places an image in its windows, and tilewise does the
same (:class:`tiling.Placement`): ``end`` (tilewise's own grid: the image at the origin, rounded up
to the alignment at its end), ``centred-monai`` (MONAI's ``sliding_window_inference``: an axis
shorter than the tile zero-padded to it, ``(tile - size) // 2`` before and the rest after; windows
``tile - overlap`` apart, the last one shifted back to the image edge) or ``centred-nnunet``
(nnU-Net v2's predictor: the same padding, windows spread evenly; ``tta=mirror`` flips inside each
window). ``tilewise import-model`` writes it for MONAI bundles and nnU-Net folders.

``resampling`` says where the grid at ``spacing`` lies on the input's
(:class:`models.geometry.model_grid.Resampling`): ``extent`` (one field of view, ``round(n * zoom /
spacing)`` voxels; nnU-Net's ``compute_new_shape``) or ``corners`` (MONAI's ``Spacingd``: first voxel
centres kept, the voxel size exactly ``spacing``, ``round((n - 1) * zoom / spacing + 1)`` voxels).
``tilewise import-model`` writes ``corners`` for MONAI bundles with a ``Spacingd``.

Unknown fields are refused. Invalid specs raise :class:`~models.errors.SpecError` naming the file
and the field.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from models.errors import SpecError
from models.geometry.model_grid import Resampling
from models.planning.params import REQUEST_ONLY, Blend, InferenceParams, OutputKind, StrEnum, per_axis_field
from models.transforms.steps import STEP_PARAMS, FrameSpec, PreprocessStep, check_params
from tiling import Placement

__all__ = [
    "ANALYTIC_PARAMS",
    "Activation",
    "Backend",
    "ModelSpec",
    "OutputDtype",
    "OutputSpec",
    "Precision",
    "PreprocessStep",
    "STEP_PARAMS",
    "TtaAverage",
    "load_spec",
    "spec_from_mapping",
]

logger = logging.getLogger(__name__)


class Backend(StrEnum):
    """How a model runs."""

    EAGER = "eager"
    TORCHSCRIPT = "torchscript"
    ONNX = "onnx"
    ANALYTIC = "analytic"


class Activation(StrEnum):
    """Output activation, applied after blending (``softmax`` over channels)."""

    NONE = "none"
    SIGMOID = "sigmoid"
    SOFTMAX = "softmax"


class OutputDtype(StrEnum):
    """dtype of probability outputs."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"


class Precision(StrEnum):
    """Autocast precision on CUDA."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"


#: Parameters of ``backend: analytic`` models and their types (``sigma``, ``truncate`` in voxels).
ANALYTIC_PARAMS: dict[str, tuple[type, ...]] = {
    "kind": (str,),
    "sigma": (int, float),
    "truncate": (int, float),
}
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


class TtaAverage(StrEnum):
    """What ``tta=mirror`` averages: probabilities after the activation, or logits before it (nnU-Net)."""

    PROBABILITIES = "probabilities"
    LOGITS = "logits"


class OutputSpec(BaseModel):
    """``output``: activation after blending, the default output kind, the probability dtype, and what
    test-time augmentation averages (``tta_average``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    activation: Activation = Activation.NONE
    kind: OutputKind = OutputKind.PROBABILITIES
    dtype: OutputDtype = OutputDtype.FLOAT32
    tta_average: TtaAverage = TtaAverage.PROBABILITIES


def _name(value: str) -> str:
    if not _NAME_RE.match(value):
        raise ValueError(f"must match {_NAME_RE.pattern}, got {value!r}")
    return value


def _sha256(value: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ValueError("must be 64 lowercase hex digits")
    return value


def _dims(value: int) -> int:
    if value not in (1, 2, 3):
        raise ValueError(f"must be 1, 2 or 3, got {value}")
    return value


def _orientation(value: str) -> str:
    codes = value.upper()
    pairs = ("LR", "PA", "IS")
    if not codes.isalpha() or any(c not in "LRPAIS" for c in codes):
        raise ValueError(f"must be axis codes from L/R, P/A, I/S such as 'RAS', got {value!r}")
    if sorted(next(i for i, p in enumerate(pairs) if c in p) for c in codes) != list(range(len(codes))):
        raise ValueError(f"must name each of L/R, P/A, I/S once, got {value!r}")
    return codes


Positive = Annotated[StrictInt, Field(ge=1)]


class ModelSpec(BaseModel):
    """Everything needed to load and run one model (see the module docstring for the file).

    ``receptive_field`` is the radius per spatial axis in voxels (``None``: measure it); ``file`` is
    absolute once loaded (relative names resolve against the spec's folder); ``source`` is the spec
    file (set by the loader, not a spec field).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[StrictStr, AfterValidator(_name)]
    backend: Backend
    spatial_dims: Annotated[StrictInt, AfterValidator(_dims)]
    in_channels: Positive
    out_channels: Positive
    defaults: InferenceParams = InferenceParams()
    file: Path | None = None
    sha256: Annotated[StrictStr, AfterValidator(_sha256)] | None = None
    architecture: StrictStr | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    alignment: Positive | tuple[Positive, ...] = 1
    scale: Positive = 1
    receptive_field: Annotated[tuple[int, ...] | None, per_axis_field(0)] = None
    tile_dependent: StrictBool | None = None
    fixed_tile: StrictBool = False
    spacing: tuple[Annotated[float, Field(gt=0, allow_inf_nan=False)], ...] | None = None
    resampling: Resampling = Resampling.EXTENT
    mpp: tuple[Annotated[float, Field(gt=0, allow_inf_nan=False)], ...] | None = None
    orientation: Annotated[StrictStr, AfterValidator(_orientation)] | None = None
    labels: dict[Annotated[int, Field(ge=0)], StrictStr] | None = None
    mirror_axes: tuple[Annotated[StrictInt, Field(ge=0)], ...] | None = None
    frame: FrameSpec | None = None
    padding: Placement = Placement.END
    global_pooling: StrictBool = False
    precision: Precision = Precision.FP32
    channels_last: StrictBool = False
    preprocess: tuple[PreprocessStep, ...] = ()
    output: OutputSpec = OutputSpec()
    description: StrictStr = ""
    source: Path | None = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _spec_file_form(cls, raw: Any) -> Any:
        if isinstance(raw, Mapping):
            raw = dict(raw)
            if raw.get("preprocess") is None:
                raw.pop("preprocess", None)
            for key in ("defaults", "output", "params"):  # ``key:`` with no value: the defaults
                if key in raw and raw[key] is None:
                    del raw[key]
            mpp = raw.get("mpp")
            if isinstance(mpp, int | float) and not isinstance(mpp, bool):
                raw["mpp"] = [mpp, mpp]  # one value for both axes
            rf, dims = raw.get("receptive_field"), raw.get("spatial_dims")
            if isinstance(rf, int) and not isinstance(rf, bool) and isinstance(dims, int):
                raw["receptive_field"] = [rf] * dims  # one radius for every axis
        return raw

    @model_validator(mode="after")
    def _complete(self) -> ModelSpec:
        ndim = self.spatial_dims
        if self.backend != Backend.ANALYTIC and self.file is None:
            raise ValueError(f"field 'file' is required for backend {self.backend.value!r}")
        if self.backend == Backend.EAGER and self.architecture is None:
            raise ValueError("field 'architecture' is required for backend 'eager'")
        if self.backend == Backend.ANALYTIC:
            check_params("params", self.params, ANALYTIC_PARAMS)
            if self.tile_dependent is None:  # fixed filters: local by construction
                object.__setattr__(self, "tile_dependent", False)
        request_only = sorted(name for name in REQUEST_ONLY if getattr(self.defaults, name))
        if request_only:
            raise ValueError(f"field 'defaults.{request_only[0]}' is a request option, not a model default")
        filled = self.defaults.merged(
            InferenceParams(
                tile=256 if ndim < 3 else 96,
                halo="auto",  # seam-safe: never 0 unless the spec says so
                halo_tolerance=1e-4,
                overlap=0,
                blend=Blend.CONSTANT,
                batch_size=1,
                output=self.output.kind,
            )
        )
        update = {name: _broadcast(f"defaults.{name}", getattr(filled, name), ndim)
                  for name in ("tile", "halo", "overlap")}  # fmt: skip
        object.__setattr__(self, "defaults", filled.model_copy(update=update))
        if self.spacing is not None and len(got := list(self.spacing)) != ndim:
            raise ValueError(f"field 'spacing' must list {ndim} values (mm per axis), got {got}")
        if self.mpp is not None and (ndim != 2 or len(self.mpp) != 2):
            raise ValueError(f"field 'mpp' (microns per pixel of a slide) needs a 2D model and 2 values, got "
                             f"{list(self.mpp)} for spatial_dims={ndim}")  # fmt: skip
        if self.orientation is not None and len(self.orientation) != ndim:
            raise ValueError(f"field 'orientation' must give {ndim} axis codes, got {self.orientation!r}")
        if self.frame is not None and (len(self.frame.shape) != ndim or self.spacing is not None):
            raise ValueError(f"field 'frame' needs {ndim} sizes in 'shape', and no 'spacing' beside it")
        multi_label = self.output.activation == Activation.SIGMOID and self.out_channels > 1
        if multi_label and self.output.kind == OutputKind.LABELS:
            raise ValueError(
                f"field 'output.kind' is labels for a sigmoid over {self.out_channels} channels "
                "(multi-label: one label per voxel cannot hold several); use probabilities"
            )
        if isinstance(self.alignment, tuple):
            if len(self.alignment) != ndim:
                got = list(self.alignment)
                raise ValueError(f"field 'alignment' must be an int or a list of {ndim} ints, got {got}")
            if len(set(self.alignment)) == 1:  # one value: the plain form
                object.__setattr__(self, "alignment", self.alignment[0])
        rf = self.receptive_field
        if rf is not None:
            object.__setattr__(self, "receptive_field", _broadcast("receptive_field", rf, ndim))
        axes = tuple(range(ndim)) if self.mirror_axes is None else self.mirror_axes
        if any(a >= ndim for a in axes) or len(set(axes)) != len(axes):
            raise ValueError(f"field 'mirror_axes' must list distinct axes < {ndim}, got {list(axes)}")
        object.__setattr__(self, "mirror_axes", tuple(sorted(axes)))
        return self

    # Names used throughout the code base for the nested output settings.
    @property
    def activation(self) -> str:
        """``output.activation``."""
        return self.output.activation.value

    @property
    def output_kind(self) -> str:
        """``output.kind``: the default output kind."""
        return self.output.kind.value

    @property
    def output_dtype(self) -> str:
        """``output.dtype``."""
        return self.output.dtype.value

    @property
    def alignment_per_axis(self) -> tuple[int, ...]:
        """``alignment`` per spatial axis: tile sizes (and ``end`` tile origins) are multiples of it."""
        a = self.alignment
        return tuple(int(v) for v in a) if isinstance(a, tuple) else (int(a),) * self.spatial_dims

    @property
    def alignment_lcm(self) -> int:
        """The least common multiple of the per-axis alignments: a size every axis accepts."""
        return math.lcm(*self.alignment_per_axis)

    @property
    def where(self) -> str:
        """How messages name this spec: its file and name."""
        return f"{self.source} (model {self.name!r})" if self.source else f"model {self.name!r}"

    def info(self) -> dict[str, Any]:
        """The ``GET /v1/models`` entry of this model (JSON-serializable): the one serializer."""
        return {
            "name": self.name,
            "description": self.description,
            "spatial_dims": self.spatial_dims,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "backend": self.backend.value,
            "alignment": list(self.alignment) if isinstance(self.alignment, tuple) else self.alignment,
            "scale": self.scale,
            "receptive_field": None if self.receptive_field is None else list(self.receptive_field),
            "params": dict(self.params),
            "defaults": self.defaults.model_dump(mode="json"),
            "spacing": None if self.spacing is None else list(self.spacing),
            "mpp": None if self.mpp is None else list(self.mpp),
            "orientation": self.orientation,
            "labels": None if self.labels is None else {str(k): v for k, v in self.labels.items()},
            "tile_dependent": self.tile_dependent,
            "mirror_axes": list(self.mirror_axes or ()),
            "frame": None if self.frame is None else self.frame.model_dump(mode="json"),
            "output": self.output.model_dump(mode="json"),
        }

    def with_receptive_field(self, radius: tuple[int, ...]) -> ModelSpec:
        """A copy with ``receptive_field`` set to ``radius`` (voxels per axis)."""
        return self.model_copy(update={"receptive_field": tuple(int(r) for r in radius)})


def _broadcast(where: str, value: Any, ndim: int) -> Any:
    if isinstance(value, str) or value is None:
        return value
    values = (value,) * ndim if isinstance(value, int) else tuple(value)
    if len(values) != ndim:
        raise ValueError(f"field '{where}' must be an int or a list of {ndim} ints, got {list(values)}")
    return values


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or "[" in str(part):
            continue  # pydantic's validator frames, not fields
        else:
            out += f".{part}" if out else str(part)
    return out


def _problem(err: Any) -> str:
    """One pydantic error as ``field 'x' <problem>``."""
    where = _location(err["loc"])
    kind = err["type"]
    ctx_error = (err.get("ctx") or {}).get("error")
    if kind == "missing":
        return f"field '{where}' is required"
    if kind == "extra_forbidden":
        return f"field '{where}' is unknown" + (f" (in {where.rsplit('.', 1)[0]})" if "." in where else "")
    if ctx_error is not None:
        text = str(ctx_error)
        if text.startswith("field "):
            return text
        if where.startswith("defaults") or not where:
            return f"field '{where}': {text}" if where else text
        return f"field '{where}' {text}"
    value = err.get("input")
    msg = str(err["msg"])
    if msg.startswith("Input should be "):
        msg = "must be " + msg[len("Input should be ") :]
    return f"field '{where}' {msg}, got {type(value).__name__} {value!r}"


def spec_from_mapping(data: Any, *, source: Path | None = None, where: str | None = None) -> ModelSpec:
    """Validate a parsed spec mapping and build a :class:`ModelSpec`.

    Args:
        data: the parsed YAML/JSON document.
        source: the spec file; relative ``file`` names resolve against its folder.
        where: how errors name the spec (default: the file path, or ``"<spec>"``).

    Raises:
        SpecError: unknown field, wrong type, missing required field or impossible value (the
            message names the spec and the field).
    """
    where = where or (str(source) if source else "<spec>")
    if not isinstance(data, Mapping):
        raise SpecError(f"{where}: a spec must be a mapping, got {type(data).__name__}")
    if isinstance(data.get("name"), str):
        where = f"{where} (model {data['name']!r})"
    if "source" in data:
        raise SpecError(f"{where}: field 'source' is unknown")
    try:
        spec = ModelSpec.model_validate({**data, "source": source})
    except ValidationError as exc:
        problems = "; ".join(_problem(err) for err in exc.errors())
        raise SpecError(f"{where}: {problems}") from None
    if spec.file is not None:
        path = spec.file.expanduser()
        if not path.is_absolute() and source is not None:
            path = source.parent / path
        spec = spec.model_copy(update={"file": path})
    return spec


def load_spec(path: Path) -> ModelSpec:
    """Read and validate one spec file (``.yaml``, ``.yml`` or ``.json``).

    Raises:
        SpecError: unreadable or unparsable file, or any invalid field (the message names both).
    """
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        raise SpecError(f"{path}: cannot read spec: {exc}") from exc
    spec = spec_from_mapping(data, source=path.resolve())
    logger.debug("loaded spec %s from %s", spec.name, path)
    return spec
