"""The app in process (httpx's ASGI transport, lifespan entered by hand) with a stand-in
repository: internal errors stay internal."""

from __future__ import annotations

import asyncio
import gzip
from pathlib import Path
from types import SimpleNamespace

import httpx
import nibabel as nib
import numpy as np

from service.app import create_app


class _BrokenRepository:
    """Knows one model whose loading fails with an unexpected error."""

    spec_ = SimpleNamespace(
        name="broken-3d", backend="eager", spatial_dims=3, info=lambda: {"name": "broken-3d"}
    )

    def names(self) -> list[str]:
        return ["broken-3d"]

    def specs(self) -> list[object]:
        return [self.spec_]

    def spec(self, name: str) -> object:
        from models.errors import UnknownModelError

        if name != "broken-3d":
            raise UnknownModelError(f"unknown model {name!r}")
        return self.spec_

    def get(self, name: str) -> object:
        raise RuntimeError("secret internal path /opt/weights/broken.pt exploded")


def test_internal_errors_are_generic_and_logged(make_settings, tmp_path: Path, caplog) -> None:
    settings = make_settings(tmp_dir=tmp_path, warmup=False)
    body = gzip.compress(nib.Nifti1Image(np.zeros((4, 4, 4), np.float32), np.eye(4)).to_bytes())
    app = create_app(settings, repository=_BrokenRepository())

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://t") as client,
        ):
            assert (await client.get("/readyz")).json()["models"] == ["broken-3d"]
            response = await client.post(
                "/v1/models/broken-3d/infer", content=body, headers={"X-Request-ID": "req-42"}
            )
            assert response.status_code == 500
            assert response.json() == {
                "error": "internal_error",
                "detail": "internal error (see the server log)",
                "request_id": "req-42",
            }
            assert response.headers["x-request-id"] == "req-42"
            assert (await client.get("/healthz")).status_code == 200
            metrics = (await client.get("/metrics")).text
            assert 'tilewise_requests_total{model="broken-3d",status="500"} 1.0' in metrics
        assert not app.state.ready

    asyncio.run(scenario())
    assert "secret internal path" in caplog.text and "req-42" in caplog.text  # in the log only
    assert not list(tmp_path.iterdir())  # the upload's temporary folder was removed
