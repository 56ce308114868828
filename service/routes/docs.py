"""OpenAPI fragments shared by the routers (error bodies; the inference query from its schema)."""

from __future__ import annotations

from typing import Any

from models.planning.params import InferenceParams

__all__ = ["error_doc", "params_doc", "result_content"]


#: The JSON error body of every refusal (``service.http_errors``).
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "Error",
    "required": ["error", "detail"],
    "properties": {
        "error": {"type": "string", "description": "A stable code: `bad_parameter`, `queue_full` ..."},
        "detail": {"type": "string", "description": "What was wrong, and what to do."},
        "request_id": {"type": "string", "description": "The id of the request (`X-Request-ID`)."},
    },
}


def result_content() -> dict[str, Any]:
    """The ``content`` of a result response: one entry per content type an output format has
    (:data:`service.pipeline.MEDIA_TYPES`), for the synchronous route and a job's result alike."""
    from service.pipeline import MEDIA_TYPES

    return {media_type: {} for media_type in dict.fromkeys(MEDIA_TYPES.values())}


def error_doc(code: str, description: str) -> dict[str, Any]:
    """A ``responses={status: ...}`` entry for the JSON error body with ``code``."""
    example = {"error": code, "detail": "...", "request_id": "..."}
    return {
        "description": description,
        "content": {"application/json": {"schema": ERROR_SCHEMA, "example": example}},
    }


#: A blank value (``tile=``) means "not given": the model's default.
_BLANK: dict[str, Any] = {"type": "string", "pattern": r"^\s*$"}


def _per_axis(minimum: int, *, auto: bool = False) -> dict[str, Any]:
    """One integer for every axis, or one per axis (``128,128,64``), or ``auto``, or blank."""
    digits = "[1-9][0-9]{0,8}" if minimum else "[0-9]{1,9}"
    options: list[dict[str, Any]] = [
        {"type": "integer", "minimum": minimum},
        {"type": "string", "pattern": f"^{digits}(,{digits}){{1,2}}$"},
    ]
    if auto:
        options.append({"type": "string", "enum": ["auto"]})
    return {"anyOf": [*options, _BLANK]}


#: Typed schemas of the numeric and flag parameters (the rest are text, or a closed set).
_SCHEMAS: dict[str, dict[str, Any]] = {
    "tile": _per_axis(1),
    "overlap": _per_axis(0),
    "halo": _per_axis(0, auto=True),
    "halo_tolerance": {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, _BLANK]},
    "batch_size": {"anyOf": [{"type": "integer", "minimum": 1}, _BLANK]},
    "dry_run": {"anyOf": [{"type": "boolean"}, _BLANK]},
}


def params_doc(exclude: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One OpenAPI query parameter per :class:`InferenceParams` field but ``exclude``: numbers
    typed as numbers, flags as booleans, closed sets as enums (with ``""``), the rest as text; a
    blank value means the model's default."""
    out = []
    for name, field in InferenceParams.model_fields.items():
        if name in exclude:
            continue
        schema: dict[str, Any] = dict(_SCHEMAS.get(name, {"type": "string"}))
        choices = InferenceParams.choices(name)
        if choices:
            schema = {"type": "string", "enum": ["", *choices]}
        out.append(
            {
                "name": name,
                "in": "query",
                "required": False,
                "description": field.description,
                "schema": schema,
            }
        )
    return out
