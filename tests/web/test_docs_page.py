"""``/docs`` renders the OpenAPI 3.1 document in Debian's chromium (issue 25 item 13).

Swagger UI 4.x (swagger-ui-bundle 1.1.0) answered "Unable to render this definition" for FastAPI's
3.1 document; the page must list the API's operations, load nothing from outside the server and
log no console error.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

_OPERATIONS = (
    "() => [...document.querySelectorAll('.opblock-summary-path')].map(e => e.getAttribute('data-path'))"
)


def test_docs_lists_the_operations(key_server, new_page, recorder, artifacts) -> None:
    page = new_page(1280, 800)
    page.goto(f"{key_server.url}/docs")
    page.wait_for_selector(".opblock-summary-path", timeout=60_000)
    assert "Unable to render" not in page.content()
    paths = set(page.evaluate(_OPERATIONS))
    assert {"/v1/models", "/v1/models/{name}/infer", "/v1/jobs", "/v1/jobs/{job_id}", "/readyz"} <= paths, (
        paths
    )
    assert "OAS 3.1" in page.content()  # Swagger UI's stamp of the document's version
    page.screenshot(path=str(artifacts / "docs-1280x800.png"))
    recorder.check()
