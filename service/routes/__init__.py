"""HTTP routes: ``health`` (probes, metrics), ``catalog`` (``/v1/models``), ``infer``, ``jobs``.

Handlers only do HTTP (parse, respond, headers); the work is :mod:`service.pipeline`'s.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from service.routes.catalog import router as catalog_router
from service.routes.docs import error_doc
from service.routes.dzi import router as dzi_router
from service.routes.health import router as health_router
from service.routes.infer import router as infer_router
from service.routes.jobs import router as jobs_router
from service.security import require_api_key

__all__ = ["health_router", "v1_router"]

#: Responses every ``/v1`` route may give (its own list adds the rest).
_COMMON: dict[int | str, dict[str, Any]] = {
    400: error_doc(
        "bad_parameter", "An invalid parameter (`bad_parameter`), or a Host not allowed (`bad_host`)."
    ),
    401: error_doc("unauthorized", "Missing or wrong API key (when the server has keys)."),
    403: error_doc(
        "forbidden", "A POST/DELETE from another site's page (`cross_origin`), or not an admin key."
    ),
}

#: Everything under ``/v1`` (API key when one is set).
v1_router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], responses=_COMMON)
v1_router.include_router(catalog_router)
v1_router.include_router(infer_router)
v1_router.include_router(jobs_router)
v1_router.include_router(dzi_router)
