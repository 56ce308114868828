"""``GET /v1/models`` and ``GET /v1/models/{name}``: registered specs (``ModelSpec.info``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.deps import ReadyRepositoryDep as RepositoryDep
from service.routes.docs import error_doc

__all__ = ["router"]

router = APIRouter(tags=["models"])


@router.get("/models")
async def list_models(repository: RepositoryDep) -> list[dict[str, Any]]:
    """List the models with their specs and defaults."""
    return [spec.info() for spec in repository.specs()]


@router.get("/models/{name}", responses={404: error_doc("unknown_model", "No model of this name.")})
async def get_model(name: str, repository: RepositoryDep) -> dict[str, Any]:
    """Describe one model."""
    info: dict[str, Any] = repository.spec(name).info()
    return info
