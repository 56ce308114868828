"""OpenAPI fragments shared by the routers (error bodies; the inference query from its schema)."""

from __future__ import annotations

from typing import Any

from models.params import InferenceParams

__all__ = ["error_doc", "params_doc"]


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


def error_doc(code: str, description: str) -> dict[str, Any]:
    """A ``responses={status: ...}`` entry for the JSON error body with ``code``."""
    example = {"error": code, "detail": "...", "request_id": "..."}
    return {
        "description": description,
        "content": {"application/json": {"schema": ERROR_SCHEMA, "example": example}},
    }


def params_doc() -> list[dict[str, Any]]:
    """One OpenAPI query parameter per :class:`InferenceParams` field (values are text)."""
    out = []
    for name, field in InferenceParams.model_fields.items():
        schema: dict[str, Any] = {"type": "string"}
        choices = InferenceParams.choices(name)
        if choices:
            schema["enum"] = choices
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
