"""Model specs: one YAML or JSON file per model, validated strictly at load time.

A spec file (``unet3d.yaml``) looks like this; every key but the first five is optional::

    name: unet3d                  # [a-z0-9][a-z0-9._-]*
    backend: eager                # eager | torchscript | onnx | analytic
    spatial_dims: 3               # 1, 2 or 3
    in_channels: 1
    out_channels: 2
    file: unet3d.safetensors      # relative to the spec's folder (eager / torchscript / onnx)
    sha256: 3b4c...               # verified before loading when given
    architecture: unet            # eager: a name of models.nets, or "package.module:callable"
    params: {features: 8}         # keyword arguments of the architecture (or analytic parameters)
    alignment: 4                  # total stride of the network (tile sizes are multiples of it)
    scale: 1                      # output voxels per input voxel
    receptive_field: [10, 10, 10] # radius per axis in voxels, when known (else measured)
    tile_dependent: false         # instance norm / attention / global pooling over the tile
    global_pooling: false         # global average pools whose statistics come from the whole image
    precision: fp32               # fp32 | fp16 | bf16 (autocast, CUDA only)
    channels_last: false          # CUDA memory format
    preprocess:                   # applied to the whole image before tiling, in order
      - {type: ct_window, lo: -1000, hi: 400}
      - zscore
    output: {activation: softmax, kind: labels, dtype: float32}
    defaults: {tile: [96, 96, 96], halo: auto, overlap: 0, blend: constant, batch_size: 2}

Invalid specs raise :class:`~models.errors.SpecError` naming the file and the field.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from models.errors import SpecError

__all__ = [
    "ANALYTIC_PARAMS",
    "ModelDefaults",
    "ModelSpec",
    "PreprocessStep",
    "load_spec",
    "spec_from_mapping",
]

logger = logging.getLogger(__name__)

BACKENDS = ("eager", "torchscript", "onnx", "analytic")
ACTIVATIONS = ("none", "sigmoid", "softmax")
OUTPUT_KINDS = ("probabilities", "labels")
OUTPUT_DTYPES = ("float32", "float16")
PRECISIONS = ("fp32", "fp16", "bf16")
BLENDS = ("constant", "gaussian", "hann", "triangular")
FORMATS = ("png", "tiff", "nii.gz", "nii", "npy")
#: Preprocessing step types and their allowed parameters (name -> type).
STEP_PARAMS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "grey_to_rgb": {},
    "rgb_to_grey": {},
    "rgb_to_bgr": {},
    "unit_range": {},
    "ct_window": {"lo": (int, float), "hi": (int, float)},
    "zscore": {},
    "percentile": {"lo": (int, float), "hi": (int, float)},
    "normalize": {"mean": (int, float, list), "std": (int, float, list)},
}
#: Parameters of ``backend: analytic`` models and their types (``sigma``, ``truncate`` in voxels).
ANALYTIC_PARAMS: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "sigma": (int, float),
    "truncate": (int, float),
}
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


@dataclass(frozen=True, slots=True)
class PreprocessStep:
    """One preprocessing step: ``kind`` from :data:`STEP_PARAMS` and its parameters."""

    kind: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelDefaults:
    """Inference defaults of a model; ``tile`` and ``halo`` are voxels (``halo`` may be ``"auto"``)."""

    tile: tuple[int, ...]
    halo: int | tuple[int, ...] | str = 0
    overlap: int | tuple[int, ...] = 0
    blend: str = "constant"
    batch_size: int = 1
    output: str = "probabilities"
    format: str | None = None


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything needed to load and run one model.

    ``receptive_field`` is the radius per spatial axis in voxels (``None``: measure it);
    ``file`` is absolute once loaded (relative names resolve against the spec's folder).
    """

    name: str
    backend: str
    spatial_dims: int
    in_channels: int
    out_channels: int
    defaults: ModelDefaults
    file: Path | None = None
    sha256: str | None = None
    architecture: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    alignment: int = 1
    scale: int = 1
    receptive_field: tuple[int, ...] | None = None
    tile_dependent: bool = False
    global_pooling: bool = False
    precision: str = "fp32"
    channels_last: bool = False
    preprocess: tuple[PreprocessStep, ...] = ()
    activation: str = "none"
    output_kind: str = "probabilities"
    output_dtype: str = "float32"
    description: str = ""
    source: Path | None = None

    def info(self) -> dict[str, Any]:
        """The ``GET /v1/models`` entry of this model (JSON-serializable)."""
        d = self.defaults
        halo: Any = list(d.halo) if isinstance(d.halo, tuple) else d.halo
        overlap: Any = list(d.overlap) if isinstance(d.overlap, tuple) else d.overlap
        return {
            "name": self.name,
            "description": self.description,
            "spatial_dims": self.spatial_dims,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "backend": self.backend,
            "alignment": self.alignment,
            "scale": self.scale,
            "receptive_field": None if self.receptive_field is None else list(self.receptive_field),
            "params": dict(self.params),
            "defaults": {
                "tile": list(d.tile),
                "halo": halo,
                "overlap": overlap,
                "blend": d.blend,
                "batch_size": d.batch_size,
                "output": d.output,
                "format": d.format,
            },
        }

    def with_receptive_field(self, radius: tuple[int, ...]) -> ModelSpec:
        """A copy with ``receptive_field`` set to ``radius`` (voxels per axis)."""
        return replace(self, receptive_field=tuple(int(r) for r in radius))


class _Checker:
    """Field validation that names the spec file and the field in every error."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, key: str, problem: str) -> SpecError:
        return SpecError(f"{self.where}: field {key!r} {problem}")

    def get(self, data: Mapping[str, Any], key: str, types: type | tuple[type, ...], default: Any) -> Any:
        if key not in data or (data[key] is None and default is None):
            if default is _REQUIRED:
                raise self.fail(key, "is required")
            return default
        value = data[key]
        if isinstance(value, bool) and bool not in _as_tuple(types):
            raise self.fail(key, f"must be {_type_names(types)}, got bool {value!r}")
        if not isinstance(value, types):
            raise self.fail(key, f"must be {_type_names(types)}, got {type(value).__name__} {value!r}")
        return value

    def choice(self, data: Mapping[str, Any], key: str, choices: tuple[str, ...], default: Any) -> Any:
        value = self.get(data, key, str, default)
        if value is not None and value not in choices:
            raise self.fail(key, f"must be one of {list(choices)}, got {value!r}")
        return value

    def positive(self, key: str, value: int, minimum: int = 1) -> int:
        if value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        return value

    def per_axis(self, data: Mapping[str, Any], key: str, ndim: int, default: Any, minimum: int) -> Any:
        value = self.get(data, key, (int, list), default)
        if value is None or isinstance(value, tuple):
            return value
        values = [value] * ndim if isinstance(value, int) else value
        if len(values) != ndim or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise self.fail(key, f"must be an int or a list of {ndim} ints, got {value!r}")
        for v in values:
            self.positive(key, v, minimum)
        return tuple(values)

    def unknown(self, data: Mapping[str, Any], allowed: tuple[str, ...], prefix: str = "") -> None:
        for key in data:
            if key not in allowed:
                raise self.fail(prefix + str(key), f"is unknown (allowed: {', '.join(allowed)})")


_REQUIRED = object()
_TOP_KEYS = (
    "name",
    "backend",
    "spatial_dims",
    "in_channels",
    "out_channels",
    "file",
    "sha256",
    "architecture",
    "params",
    "alignment",
    "scale",
    "receptive_field",
    "tile_dependent",
    "global_pooling",
    "precision",
    "channels_last",
    "preprocess",
    "output",
    "defaults",
    "description",
)
_OUTPUT_KEYS = ("activation", "kind", "dtype")
_DEFAULT_KEYS = ("tile", "halo", "overlap", "blend", "batch_size", "format")


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _type_names(types: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in _as_tuple(types))


def _steps(check: _Checker, raw: Any) -> tuple[PreprocessStep, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise check.fail("preprocess", f"must be a list of steps, got {type(raw).__name__}")
    steps = []
    for i, item in enumerate(raw):
        key = f"preprocess[{i}]"
        if isinstance(item, str):
            kind, params = item, {}
        elif isinstance(item, Mapping) and isinstance(item.get("type"), str):
            kind, params = item["type"], {k: v for k, v in item.items() if k != "type"}
        else:
            raise check.fail(key, f"must be a step name or a mapping with 'type', got {item!r}")
        if kind not in STEP_PARAMS:
            raise check.fail(key, f"has unknown type {kind!r} (known: {', '.join(STEP_PARAMS)})")
        allowed = STEP_PARAMS[kind]
        check.unknown(params, tuple(allowed), prefix=f"{key}.")
        for name, types in allowed.items():
            check.get(params, name, types, _REQUIRED)
        steps.append(PreprocessStep(kind, dict(params)))
    return tuple(steps)


def spec_from_mapping(data: Any, *, source: Path | None = None, where: str | None = None) -> ModelSpec:
    """Validate a parsed spec mapping and build a :class:`ModelSpec`.

    Args:
        data: the parsed YAML/JSON document.
        source: the spec file; relative ``file`` names resolve against its folder.
        where: how errors name the spec (default: the file path, or ``"<spec>"``).

    Raises:
        SpecError: unknown field, wrong type, missing required field or impossible value.
    """
    check = _Checker(where or (str(source) if source else "<spec>"))
    if not isinstance(data, Mapping):
        raise SpecError(f"{check.where}: a spec must be a mapping, got {type(data).__name__}")
    name = check.get(data, "name", str, _REQUIRED)
    if not _NAME_RE.match(name):
        raise check.fail("name", f"must match {_NAME_RE.pattern}, got {name!r}")
    check.where = f"{check.where} (model {name!r})"
    check.unknown(data, _TOP_KEYS)
    backend = check.choice(data, "backend", BACKENDS, _REQUIRED)
    ndim = check.get(data, "spatial_dims", int, _REQUIRED)
    if ndim not in (1, 2, 3):
        raise check.fail("spatial_dims", f"must be 1, 2 or 3, got {ndim}")
    in_ch = check.positive("in_channels", check.get(data, "in_channels", int, _REQUIRED))
    out_ch = check.positive("out_channels", check.get(data, "out_channels", int, _REQUIRED))
    file = check.get(data, "file", str, None)
    if backend != "analytic" and file is None:
        raise check.fail("file", f"is required for backend {backend!r}")
    path = None
    if file is not None:
        path = Path(file).expanduser()
        if not path.is_absolute() and source is not None:
            path = source.parent / path
    architecture = check.get(data, "architecture", str, None)
    if backend == "eager" and architecture is None:
        raise check.fail("architecture", "is required for backend 'eager'")
    sha = check.get(data, "sha256", str, None)
    if sha is not None and not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise check.fail("sha256", "must be 64 lowercase hex digits")
    params = check.get(data, "params", Mapping, {})
    if backend == "analytic":
        check.unknown(params, tuple(ANALYTIC_PARAMS), prefix="params.")
        for key, types in ANALYTIC_PARAMS.items():
            check.get(params, key, types, None)
    output = check.get(data, "output", Mapping, {})
    check.unknown(output, _OUTPUT_KEYS, prefix="output.")
    out_kind = check.choice(output, "kind", OUTPUT_KINDS, "probabilities")
    defaults_raw = check.get(data, "defaults", Mapping, {})
    check.unknown(defaults_raw, _DEFAULT_KEYS, prefix="defaults.")
    halo = defaults_raw.get("halo", 0)
    if halo != "auto":
        halo = check.per_axis(defaults_raw, "halo", ndim, 0, 0)
    defaults = ModelDefaults(
        tile=check.per_axis(defaults_raw, "tile", ndim, 256 if ndim < 3 else 96, 1),
        halo=halo,
        overlap=check.per_axis(defaults_raw, "overlap", ndim, 0, 0),
        blend=check.choice(defaults_raw, "blend", BLENDS, "constant"),
        batch_size=check.positive("defaults.batch_size", check.get(defaults_raw, "batch_size", int, 1)),
        output=out_kind,
        format=check.choice(defaults_raw, "format", FORMATS, None),
    )
    rf = check.per_axis(data, "receptive_field", ndim, None, 0)
    return ModelSpec(
        name=name,
        backend=backend,
        spatial_dims=ndim,
        in_channels=in_ch,
        out_channels=out_ch,
        defaults=defaults,
        file=path,
        sha256=sha,
        architecture=architecture,
        params=dict(params),
        alignment=check.positive("alignment", check.get(data, "alignment", int, 1)),
        scale=check.positive("scale", check.get(data, "scale", int, 1)),
        receptive_field=rf,
        tile_dependent=check.get(data, "tile_dependent", bool, False),
        global_pooling=check.get(data, "global_pooling", bool, False),
        precision=check.choice(data, "precision", PRECISIONS, "fp32"),
        channels_last=check.get(data, "channels_last", bool, False),
        preprocess=_steps(check, data.get("preprocess")),
        activation=check.choice(output, "activation", ACTIVATIONS, "none"),
        output_kind=out_kind,
        output_dtype=check.choice(output, "dtype", OUTPUT_DTYPES, "float32"),
        description=check.get(data, "description", str, ""),
        source=source,
    )


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
