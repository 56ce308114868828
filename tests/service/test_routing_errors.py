"""A request to no route, or with the wrong method, says what to do (newuser walk-through: a first
``curl URL/infer`` without a body is a GET, answered a bare "Method Not Allowed")."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI

from service.http_errors import install_error_handlers


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/models/{name}/infer")
    async def infer(name: str) -> dict[str, str]:
        return {"name": name}

    @app.get("/v1/missing")
    async def missing() -> None:
        from starlette.exceptions import HTTPException

        raise HTTPException(404, "job 'x' not found")  # a route's own 404 keeps its detail

    return app


def _get(path: str) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://tilewise") as client:
            return await client.get(path)

    return asyncio.run(go())


def test_wrong_method_names_the_allowed_one() -> None:
    response = _get("/v1/models/tissue-3d/infer")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    body = response.json()
    assert body["error"] == "method_not_allowed"
    assert body["detail"] == "Method Not Allowed: this path answers POST (see /docs)"


def test_unknown_path_points_at_the_docs() -> None:
    body = _get("/v1/model").json()
    assert body["error"] == "not_found" and "/docs" in body["detail"]
    assert _get("/v1/missing").json()["detail"] == "job 'x' not found"
