"""``GET /`` and its files, in process (the browser tests are in ``tests/web``).

The page's HTML says whether ``/v1`` needs a key and whether the viewer is installed; its files
are package data; the viewer is served from the web folder only when it is there; the policy
keeps every request on the page's own server.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.routes.page import CONTENT_SECURITY_POLICY
from service.settings import Settings
from service.webassets import NIIVUE_FILE

WEB = Path(__file__).resolve().parents[2] / "service" / "web"


def _get(settings: Settings, *paths: str, headers: dict[str, str] | None = None) -> list[httpx.Response]:
    """GET each path from a fresh app (no lifespan: the page needs no models)."""
    app = create_app(settings)

    async def fetch() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tilewise") as client:
            return [await client.get(path, headers=headers) for path in paths]

    return asyncio.run(fetch())


def _meta(html: str, name: str) -> str:
    found = re.search(rf'<meta name="{name}" content="([^"]*)">', html)
    assert found is not None, name
    return found.group(1)


@pytest.fixture
def web_with_viewer(tmp_path: Path) -> Path:
    folder = tmp_path / "web"
    folder.mkdir()
    (folder / NIIVUE_FILE).write_text("window.niivue = {};\n")
    return folder


def test_page_without_key_and_viewer(tmp_path: Path) -> None:
    (page,) = _get(Settings(web_dir=tmp_path / "empty"), "/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "default-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe" not in CONTENT_SECURITY_POLICY
    assert _meta(page.text, "tilewise-api-key") == "none"
    assert _meta(page.text, "tilewise-viewer") == "missing"
    assert NIIVUE_FILE not in page.text.split("</head>")[0]  # no script tag that would 404
    assert "__" not in page.text  # every placeholder filled


def test_page_with_viewer_and_key(web_with_viewer: Path) -> None:
    settings = Settings(web_dir=web_with_viewer, api_key="s3cret")
    page, models, script = _get(settings, "/", "/v1/models", f"/static/vendor/{NIIVUE_FILE}")
    assert page.status_code == 200  # the page itself is public: it asks for the key
    assert _meta(page.text, "tilewise-api-key") == "required"
    assert _meta(page.text, "tilewise-viewer") == "niivue"
    assert f'<script src="/static/vendor/{NIIVUE_FILE}" defer></script>' in page.text
    assert "s3cret" not in page.text
    assert models.status_code == 401
    assert script.status_code == 200 and script.text == "window.niivue = {};\n"
    assert script.headers["content-type"].startswith("text/javascript")


def test_viewer_missing_is_404_with_the_remedy(tmp_path: Path) -> None:
    (script,) = _get(Settings(web_dir=tmp_path), f"/static/vendor/{NIIVUE_FILE}")
    assert script.status_code == 404
    assert "tilewise setup-web" in script.text


def test_every_page_file_is_served_and_local(tmp_path: Path) -> None:
    """Each file the page loads is package data, served with its type; none names another host."""
    files = sorted(p.relative_to(WEB).as_posix() for p in WEB.rglob("*") if p.is_file())
    assert "index.html" in files and "js/main.js" in files and "style.css" in files
    answers = _get(Settings(web_dir=tmp_path), *(f"/static/web/{name}" for name in files))
    types = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml", ".html": "text/html"}
    for name, answer in zip(files, answers, strict=True):
        assert answer.status_code == 200, name
        assert answer.headers["content-type"].startswith(types[Path(name).suffix]), name
        text = answer.text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # a name, not a request
        assert not re.search(r"https?://", text), f"{name} names a URL"
        if name.endswith(".js"):
            assert len(answer.text.splitlines()) <= 400, f"{name} is over 400 lines"
            for target in re.findall(r'from "(\./[^"]+)"', answer.text):
                assert (WEB / Path(name).parent / target).resolve().is_file(), f"{name} imports {target}"


def test_page_files_are_package_data() -> None:
    """pyproject's package-data patterns take every file of service/web (a wheel has the page)."""
    import ast
    import fnmatch

    text = (WEB.parents[1] / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.package-data]", 1)[1]
    found = re.search(r"^service = (\[.*\])$", section, re.M)  # tomllib is Python 3.11+
    assert found is not None
    patterns = ast.literal_eval(found.group(1))
    for path in WEB.rglob("*"):
        if path.is_file():
            name = path.relative_to(WEB.parent).as_posix()
            assert any(fnmatch.fnmatch(name, p) for p in patterns), name
