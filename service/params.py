"""Parsing of the inference parameters shared by HTTP queries and ``tilewise infer`` options.

Standard library only (the batch client may validate its flags with it). Values arrive as strings:
tuples are comma-separated (``tile=128,128,64``), ``halo`` may be ``auto``. Every error is a
:class:`~service.errors.BadParameterError` naming the parameter and the value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from service._options import BLENDS, FORMATS, OUTPUTS
from service.errors import BadParameterError

__all__ = ["BLENDS", "FORMATS", "OUTPUTS", "InferenceParams", "parse_params"]

_NAMES = ("tile", "halo", "halo_tolerance", "overlap", "blend", "batch_size", "output", "format")


@dataclass(frozen=True, slots=True)
class InferenceParams:
    """Validated inference parameters; ``None`` means the model's default."""

    tile: int | tuple[int, ...] | None = None
    halo: int | tuple[int, ...] | str | None = None
    halo_tolerance: float | None = None
    overlap: int | tuple[int, ...] | None = None
    blend: str | None = None
    batch_size: int | None = None
    output: str | None = None
    format: str | None = None

    def option_kwargs(self) -> dict[str, object]:
        """Keyword arguments for ``models.InferenceOptions`` (the parameters that are set)."""
        names = ("tile", "halo", "halo_tolerance", "overlap", "blend", "batch_size", "output")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def _ints(name: str, value: str, minimum: int) -> int | tuple[int, ...]:
    parts = [p.strip() for p in value.split(",")]
    numbers: list[int] = []
    for index, part in enumerate(parts):
        where = name if len(parts) == 1 else f"{name}[{index}]"
        try:
            number = int(part)
        except ValueError:
            raise BadParameterError(f"{where}={part!r} is not an integer (in {name}={value!r})") from None
        if number < minimum:
            raise BadParameterError(f"{where}={number} must be >= {minimum}")
        numbers.append(number)
    return numbers[0] if len(numbers) == 1 else tuple(numbers)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise BadParameterError(f"{name}={value!r} is not one of {list(choices)}")
    return value


def parse_params(raw: Mapping[str, str | None]) -> InferenceParams:
    """Validate string parameters (query or command line) into :class:`InferenceParams`.

    Unknown names are refused too, so a typo (``tiles=64``) never silently falls back to a default.

    Raises:
        BadParameterError: an unknown name or an invalid value (the message names both).
    """
    unknown = sorted(set(raw) - set(_NAMES))
    if unknown:
        raise BadParameterError(f"unknown parameter(s) {unknown}; allowed: {list(_NAMES)}")
    values = {k: v.strip() for k, v in raw.items() if v is not None and v.strip() != ""}
    kwargs: dict[str, object] = {}
    if "tile" in values:
        kwargs["tile"] = _ints("tile", values["tile"], 1)
    if "halo" in values:
        halo = values["halo"]
        kwargs["halo"] = "auto" if halo.lower() == "auto" else _ints("halo", halo, 0)
    if "overlap" in values:
        kwargs["overlap"] = _ints("overlap", values["overlap"], 0)
    if "batch_size" in values:
        batch = _ints("batch_size", values["batch_size"], 1)
        if isinstance(batch, tuple):
            raise BadParameterError(f"batch_size={values['batch_size']!r} must be one integer")
        kwargs["batch_size"] = batch
    if "halo_tolerance" in values:
        try:
            tolerance = float(values["halo_tolerance"])
        except ValueError:
            raise BadParameterError(f"halo_tolerance={values['halo_tolerance']!r} is not a number") from None
        if not math.isfinite(tolerance) or tolerance <= 0:
            raise BadParameterError(f"halo_tolerance={tolerance} must be a finite number > 0")
        kwargs["halo_tolerance"] = tolerance
    if "blend" in values:
        kwargs["blend"] = _choice("blend", values["blend"], BLENDS)
    if "output" in values:
        kwargs["output"] = _choice("output", values["output"], OUTPUTS)
    if "format" in values:
        kwargs["format"] = _choice("format", values["format"].lower().lstrip("."), FORMATS)
    return InferenceParams(**kwargs)  # type: ignore[arg-type]
