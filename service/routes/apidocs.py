"""``GET /docs``: Swagger UI 5 served from an installed package, not a CDN.

The files (``swagger-ui-bundle.js``, ``swagger-ui.css``, the icon) are those of Swagger UI 5.34.0
(Apache-2.0, SmartBear) as the ``fastapi-swagger`` wheel (0.4.64, MIT) ships them; only the files
are used, not its plugin. Swagger UI 5 reads the OpenAPI 3.1 document FastAPI writes (the 4.x of
``swagger-ui-bundle`` answered "Unable to render this definition"). On an air-gapped hospital
network a CDN page stays blank. The page, its script, style sheet and
icon all come from this server (``/static/swagger-ui/...``); the validator badge, which would call
swagger.io, is switched off. ReDoc (CDN only) is not served.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["STATIC_PREFIX", "install_docs", "swagger_ui_dir"]

#: Where Swagger UI's files are served.
STATIC_PREFIX = "/static/swagger-ui"


def swagger_ui_dir() -> Path:
    """The folder of Swagger UI 5's files (``swagger-ui-bundle.js``, ``swagger-ui.css``)."""
    import fastapi_swagger.resources

    return Path(fastapi_swagger.resources.__file__).parent


def install_docs(app: FastAPI, *, docs_url: str = "/docs") -> None:
    """Serve Swagger UI at ``docs_url`` for ``app`` (created with ``docs_url=None``)."""
    app.mount(STATIC_PREFIX, StaticFiles(directory=swagger_ui_dir()), name="swagger-ui")
    redirect_url = f"{docs_url}/oauth2-redirect"

    @app.get(docs_url, include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{STATIC_PREFIX}/swagger-ui-bundle.js",
            swagger_css_url=f"{STATIC_PREFIX}/swagger-ui.css",
            swagger_favicon_url=f"{STATIC_PREFIX}/favicon-32x32.png",
            oauth2_redirect_url=redirect_url,
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get(redirect_url, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
