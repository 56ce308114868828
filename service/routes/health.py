"""``GET /healthz`` (alive), ``GET /readyz`` (models loaded), ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service.deps import MetricsDep, RepositoryDep, SettingsDep
from service.metrics import CONTENT_TYPE_LATEST
from service.requestid import current_request_id
from service.routes.docs import error_doc

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: error_doc("not_ready", "Models not loaded (yet).")})
async def readyz(request: Request, settings: SettingsDep, repository: RepositoryDep) -> JSONResponse:
    """Readiness: models are loaded and warmed up, and the server is not stopping.

    While models warm up, the 503 body's ``warming`` lists those not warm yet (one by one; a
    model whose measurements an earlier start stored is warm in about a second).

    Fails (503) first when the server drains before it stops (SIGTERM), while it still serves.
    """
    state = request.app.state
    if not getattr(state, "ready", False) or getattr(state, "draining", False):
        draining = getattr(state, "draining", False)
        warming: Any = getattr(state, "warming", None)
        names = warming.warming() if not draining and hasattr(warming, "warming") else None
        if draining:
            detail = "the server is stopping"
        elif names is None:
            detail = "models are not loaded"
        else:
            detail = f"models are warming up: {', '.join(names)}" if names else "starting"
        body: dict[str, Any] = {"error": "not_ready", "detail": detail, "request_id": current_request_id()}
        return JSONResponse(
            body if names is None else {**body, "warming": names},
            status_code=503,
            headers={"Retry-After": str(settings.retry_after_s)},
        )
    unavailable = sorted(repository.unavailable()) if hasattr(repository, "unavailable") else []
    body = {"status": "ready", "models": repository.names(), "unavailable": unavailable}
    return JSONResponse({**body, "device": request.app.state.device})


@router.get("/metrics", response_class=Response)
async def metrics(registry: MetricsDep) -> Response:
    """Prometheus metrics (text exposition format)."""
    return Response(registry.render(), media_type=CONTENT_TYPE_LATEST)
