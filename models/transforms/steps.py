"""Preprocessing steps of a model spec: their types, their parameters, their validation.

In a spec file a step is a name (``zscore``) or a mapping with ``type`` and the parameters
(``{type: ct_window, lo: -1000, hi: 400}``); :mod:`models.transforms.preprocess` applies them. The spec's
``frame`` (:class:`FrameSpec`), a geometric step, is applied by :mod:`models.geometry.mapping`.

Steps written by ``tilewise import-model`` follow their source exactly: ``scale_range`` is MONAI's
``ScaleIntensityRange(a_min, a_max, b_min, b_max, clip)``; ``zscore`` with ``channel_wise`` /
``nonzero`` is MONAI's ``NormalizeIntensity`` and, per channel, nnU-Net's ``ZScoreNormalization``;
``clip`` then ``normalize`` is nnU-Net's ``CTNormalization`` (foreground percentiles, mean, std).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

__all__ = ["FrameSpec", "PreprocessStep", "STEP_OPTIONS", "STEP_PARAMS", "check_params"]

_Number = (int, float)
#: Preprocessing step types and their parameters (name -> accepted types); all are required.
STEP_PARAMS: dict[str, dict[str, tuple[type, ...]]] = {
    "grey_to_rgb": {},
    "rgb_to_grey": {},
    "rgb_to_bgr": {},
    "unit_range": {},
    "ct_window": {"lo": _Number, "hi": _Number},
    "zscore": {},
    "percentile": {"lo": _Number, "hi": _Number},
    "normalize": {"mean": (*_Number, list), "std": (*_Number, list)},
    "clip": {"lo": (*_Number, list), "hi": (*_Number, list)},
    "scale_range": {"a_min": _Number, "a_max": _Number, "b_min": _Number, "b_max": _Number, "clip": (bool,)},
}
#: Optional parameters per step type (default ``False`` for the flags).
STEP_OPTIONS: dict[str, dict[str, tuple[type, ...]]] = {
    "zscore": {"channel_wise": (bool,), "nonzero": (bool,)},
}


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types)


def check_params(where: str, values: Mapping[str, Any], allowed: Mapping[str, tuple[type, ...]]) -> None:
    """Unknown names and wrong types of a parameter mapping (``where``: its field path)."""
    for key in values:
        if key not in allowed:
            hint = difflib.get_close_matches(str(key), list(allowed), n=1)
            also = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ValueError(f"field '{where}.{key}' is unknown{also} (allowed: {', '.join(allowed)})")
    for key, types in allowed.items():
        value = values.get(key)
        if value is not None and (
            (isinstance(value, bool) and bool not in types) or not isinstance(value, types)
        ):
            raise ValueError(
                f"field '{where}.{key}' must be {_type_names(types)}, got {type(value).__name__} {value!r}"
            )


class PreprocessStep(BaseModel):
    """One preprocessing step: ``kind`` from :data:`STEP_PARAMS` and its parameters.

    In a spec: a step name (``zscore``) or a mapping with ``type`` and the parameters.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_spec(cls, raw: Any) -> Any:
        if isinstance(raw, str):
            raw = {"type": raw}
        if isinstance(raw, Mapping) and "type" in raw:
            kind = raw["type"]
            params = {k: v for k, v in raw.items() if k != "type"}
        elif isinstance(raw, Mapping) and "kind" in raw:
            kind, params = raw["kind"], dict(raw.get("params") or {})
        else:
            raise ValueError(f"must be a step name or a mapping with 'type', got {raw!r}")
        if kind not in STEP_PARAMS:
            raise ValueError(f"has unknown type {kind!r} (known: {', '.join(STEP_PARAMS)})")
        required = STEP_PARAMS[kind]
        for key in required:
            if key not in params:
                raise ValueError(f"needs '{key}': field '{key}' is required for {kind}")
        check_params(str(kind), params, {**required, **STEP_OPTIONS.get(kind, {})})
        return {"kind": kind, "params": params}

    def to_spec(self) -> str | dict[str, Any]:
        """The spec-file form of the step."""
        return {"type": self.kind, **self.params} if self.params else self.kind


class FrameSpec(BaseModel):
    """``frame``: the network sees the foreground's box, widened by ``margin`` of its size on each
    side, resized to ``shape`` (deepbet's brain frame; MONAI's ``CropForeground`` + ``Resize``).

    The foreground is the voxels above 10 % of the 0.5-99.5 % intensity range; an axis keeps the
    planes of which more than 2 % is foreground. Exclusive with ``spacing``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    shape: tuple[Annotated[StrictInt, Field(ge=1)], ...]
    margin: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.1
