"""``GET /v1/models``, ``GET /v1/models/{name}`` (every model, ready or unavailable) and
``POST /v1/models/reload`` (rescan the model folder without a restart)."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Depends, Request

from service.deps import ReadyRepositoryDep as RepositoryDep
from service.routes.docs import error_doc
from service.security import require_admin

__all__ = ["router"]

router = APIRouter(tags=["models"])


def _infos(repository: Any) -> list[dict[str, Any]]:
    if hasattr(repository, "infos"):
        infos: list[dict[str, Any]] = repository.infos()
        return infos
    return [{**spec.info(), "status": "ready"} for spec in repository.specs()]  # stand-in repositories


@router.get("/models")
async def list_models(repository: RepositoryDep) -> list[dict[str, Any]]:
    """List the models: specs and defaults, ``status`` ``ready`` or ``unavailable`` with ``reason``."""
    return _infos(repository)


@router.post(
    "/models/reload",
    dependencies=[Depends(require_admin)],
    responses={
        403: error_doc("forbidden", "The key is not an admin key (the models folder is code)."),
        503: error_doc("not_ready", "Models are not loaded (yet)."),
    },
)
async def reload_models(request: Request, repository: RepositoryDep) -> list[dict[str, Any]]:
    """Rescan the model folder and warm the models up again; answers the new list."""
    del repository  # only for the readiness check: the new one replaces it
    state = request.app.state
    async with state.reload_lock:  # one rescan at a time; requests keep the repository they began with
        state.repository = await anyio.to_thread.run_sync(state.load_repository)
    return _infos(state.repository)


@router.get("/models/{name}", responses={404: error_doc("unknown_model", "No model of this name.")})
async def get_model(name: str, repository: RepositoryDep) -> dict[str, Any]:
    """Describe one model (its status too)."""
    if hasattr(repository, "info"):
        info: dict[str, Any] = repository.info(name)
        return info
    return {**repository.spec(name).info(), "status": "ready"}
