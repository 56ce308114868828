"""``GET /healthz`` (alive), ``GET /readyz`` (models loaded), ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

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

    Fails (503) first when the server drains before it stops (SIGTERM), while it still serves.
    """
    state = request.app.state
    if not getattr(state, "ready", False) or getattr(state, "draining", False):
        detail = "the server is stopping" if getattr(state, "draining", False) else "models are not loaded"
        return JSONResponse(
            {"error": "not_ready", "detail": detail, "request_id": current_request_id()},
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
