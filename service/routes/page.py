"""``GET /``: the page that sends a file to the jobs API and shows the result over the input.

Its HTML, scripts and style sheet are package data (``service/web/``), served under
``/static/web/``; the volume viewer, NiiVue's browser bundle, is served from the web folder
(``TILEWISE_WEB_DIR``) under ``/static/vendor/``, where ``tilewise setup-web`` put it. Nothing
comes from a CDN, and the page's Content-Security-Policy lets it talk to its own server only.

Two facts are written into the HTML when it is served, so the page needs no extra request (and
meets no 401) to learn them: whether ``/v1`` needs an API key, and whether the viewer is installed
(without it the page still shows 2D results, and says how to install the viewer for volumes).
"""

from __future__ import annotations

import html
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from service.webassets import (
    DEFAULT_WEB_DIR,
    NIIVUE_FILE,
    NIIVUE_VERSION,
    OPENSEADRAGON_FILE,
    niivue_path,
    openseadragon_path,
)

__all__ = ["CONTENT_SECURITY_POLICY", "STATIC_PREFIX", "VENDOR_PREFIX", "install_page"]

#: Where the page's own files are served.
STATIC_PREFIX = "/static/web"
#: Where the third-party viewer is served.
VENDOR_PREFIX = "/static/vendor"

#: Same origin only. ``blob:`` is the downloaded result (and NiiVue's image decoding, and
#: OpenSeadragon's tiles fetched with the API key), ``data:`` NiiVue's built-in font and colour
#: bars; no inline script, no eval. One inline style is allowed by its hash: the only rule
#: OpenSeadragon 6.1.1 injects (``@media (hover: none)``: no focus outline on touch screens).
_OPENSEADRAGON_STYLE = "'sha256-9xTiqzfwFaL2SGb1rmr8gysEwVVjIvqWAgmZgqFqpEE='"
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        f"style-src 'self' {_OPENSEADRAGON_STYLE}",
        "img-src 'self' blob: data:",
        "connect-src 'self' blob: data:",
        "worker-src 'self' blob:",
        "font-src 'self' data:",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _web_files() -> Path:
    return Path(str(resources.files("service") / "web"))


def _render(template: str, *, api_key: bool, viewer: bool, slides: bool = False) -> str:
    script = f'<script src="{VENDOR_PREFIX}/{NIIVUE_FILE}" defer></script>' if viewer else ""
    if slides:  # OpenSeadragon: slides and large 2D results, from the job's deep-zoom tiles
        script += f'<script src="{VENDOR_PREFIX}/{OPENSEADRAGON_FILE}" defer></script>'
    script += f'<meta name="tilewise-slides" content="{"openseadragon" if slides else "missing"}">'
    values = {
        "__API_KEY__": "required" if api_key else "none",
        "__VIEWER__": "niivue" if viewer else "missing",
        "__VIEWER_SCRIPT__": script,
        "__NIIVUE_VERSION__": html.escape(NIIVUE_VERSION),
        "__STATIC__": STATIC_PREFIX,
    }
    for key, value in values.items():
        template = template.replace(key, value)
    return template


def install_page(app: FastAPI) -> None:
    """Serve the page at ``/`` and its files under :data:`STATIC_PREFIX` and :data:`VENDOR_PREFIX`."""
    web = _web_files()
    template = (web / "index.html").read_text(encoding="utf-8")
    app.mount(STATIC_PREFIX, StaticFiles(directory=web), name="web")

    def web_dir(request: Request) -> Path:
        folder: Path | None = request.app.state.settings.web_dir
        return (folder or DEFAULT_WEB_DIR).expanduser()

    @app.get("/", include_in_schema=False)
    async def page(request: Request) -> HTMLResponse:
        keyring = getattr(request.app.state, "keyring", None)
        keyed = keyring.enabled if keyring is not None else request.app.state.settings.api_key is not None
        viewer = niivue_path(web_dir(request)) is not None
        slides = openseadragon_path(web_dir(request)) is not None
        body = _render(template, api_key=keyed, viewer=viewer, slides=slides)
        return HTMLResponse(body, headers=_HEADERS)

    @app.get(f"{VENDOR_PREFIX}/{NIIVUE_FILE}", include_in_schema=False)
    async def niivue(request: Request) -> Response:
        path = niivue_path(web_dir(request))
        if path is None:
            return Response(
                "NiiVue is not installed: run `tilewise setup-web`\n", 404, media_type="text/plain"
            )
        return FileResponse(path, media_type="text/javascript", headers={"Cache-Control": "no-cache"})

    @app.get(f"{VENDOR_PREFIX}/{OPENSEADRAGON_FILE}", include_in_schema=False)
    async def openseadragon(request: Request) -> Response:
        path = openseadragon_path(web_dir(request))
        if path is None:
            return Response(
                "OpenSeadragon is not installed: run `tilewise setup-web`\n", 404, media_type="text/plain"
            )
        return FileResponse(path, media_type="text/javascript", headers={"Cache-Control": "no-cache"})
