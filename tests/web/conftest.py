"""Fixtures of the page's browser tests: real ``tilewise serve`` processes on 127.0.0.1, one
chromium for the session, a fresh browser context per test whose requests and console are
recorded and checked, and the data (MNI152 T1 at 2 mm, scikit-image's page as PNG)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _browser import API_KEY, ARGS, ARTIFACTS, Recorder, chromium_or_skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the shared server helper
from _svc_helpers import Server, start_server, stop_server  # noqa: E402


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def viewer_web_dir(tmp_path_factory: pytest.TempPathFactory, session_web_dir: Path) -> Path:
    """A web folder with NiiVue's verified bundle (copied by the root conftest, else set up)."""
    from service.webassets import WebAssetError, setup_niivue

    try:
        setup_niivue(session_web_dir)
    except WebAssetError as exc:
        pytest.fail(f"NiiVue cannot be set up (run `tilewise setup-web`): {exc}", pytrace=False)
    return session_web_dir


@pytest.fixture(scope="session")
def web_models_dir(tmp_path_factory: pytest.TempPathFactory, text_det_dir: Path) -> Path:
    """text-det-2d (tissue-3d and the analytic models are built in)."""
    folder = tmp_path_factory.mktemp("web-models")
    for path in text_det_dir.iterdir():
        shutil.copyfile(path, folder / path.name)
    return folder


@pytest.fixture(scope="session")
def server(
    tmp_path_factory: pytest.TempPathFactory, web_models_dir: Path, viewer_web_dir: Path
) -> Iterator[Server]:
    """The page's server: the test models, the viewer installed, no API key."""
    tmp = tmp_path_factory.mktemp("web-server")
    srv = start_server(
        tmp, models_dir=str(web_models_dir), web_dir=str(viewer_web_dir), jobs_dir=str(tmp / "jobs")
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def key_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with an API key and without the viewer (an empty web folder); built-ins only."""
    tmp = tmp_path_factory.mktemp("web-key-server")
    (tmp / "web").mkdir()
    srv = start_server(
        tmp, api_key=API_KEY, web_dir=str(tmp / "web"), jobs_dir=str(tmp / "jobs"), warmup="false"
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    executable = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture()
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture()
def new_page(browser: Any, recorder: Recorder, tmp_path: Path) -> Iterator[Any]:
    """``new_page(width, height)``: a page in a fresh context (its own storage) at that size,
    recorded by ``recorder``. Playwright gives every context a fresh profile; the browser's
    user-data folder is its own temporary one as well."""
    contexts = []

    def make(width: int = 1280, height: int = 800) -> Any:
        context = browser.new_context(viewport={"width": width, "height": height}, device_scale_factor=1)
        contexts.append(context)
        page = context.new_page()
        recorder.attach(page)
        return page

    yield make
    for context in contexts:
        context.close()


@pytest.fixture(scope="session")
def mni_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """nilearn's MNI152 T1 template at 2 mm (from the package's own files: offline)."""
    import nibabel as nib
    from nilearn.datasets import load_mni152_template

    path = tmp_path_factory.mktemp("mni") / "mni152_t1_2mm.nii.gz"
    nib.save(load_mni152_template(resolution=2), path)
    return path


@pytest.fixture(scope="session")
def page_png(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scikit-image's ``data.page()`` (191 x 384, 8-bit grey) as PNG."""
    from PIL import Image
    from skimage import data

    path = tmp_path_factory.mktemp("page") / "page.png"
    Image.fromarray(data.page()).save(path)
    return path
