"""A synchronous HTTP client for the app in process: httpx's ASGI transport on one event loop of
its own, with the app's lifespan entered (Starlette's TestClient warns with httpx installed)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx


class InProcessClient:
    """``client.get(...)``, ``client.post(...)`` ... against ``app``, its lifespan running.

    Use it as a context manager: entering starts the lifespan (models load), leaving stops it.
    """

    def __init__(self, app: Any, base_url: str = "http://tilewise") -> None:
        self.app = app
        self._loop = asyncio.new_event_loop()
        self._lifespan = app.router.lifespan_context(app)
        transport = httpx.ASGITransport(app=app)
        self._client = httpx.AsyncClient(transport=transport, base_url=base_url, timeout=600)

    def __enter__(self) -> InProcessClient:
        self._loop.run_until_complete(self._lifespan.__aenter__())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._loop.run_until_complete(self._client.aclose())
            self._loop.run_until_complete(self._lifespan.__aexit__(None, None, None))
        finally:
            self._loop.close()

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return self._loop.run_until_complete(self._client.request(method, url, **kwargs))

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def head(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("HEAD", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)
