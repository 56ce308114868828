"""The page's job controls against real servers: cancel during a run, an API key (asked for, a
wrong one refused with the server's own message), and a server without the volume viewer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import nibabel as nib
import numpy as np
import pytest
from _browser import API_KEY, wait_for_end

pytestmark = pytest.mark.slow

#: gaussian-3d with small tiles: over a thousand tiles on the MNI T1, a run of a minute or more.
SLOW_PARAMS = {"tile": "24", "halo": "8"}


def _open(page: Any, url: str) -> None:
    page.goto(url)
    page.wait_for_function("() => !document.getElementById('model').disabled")


def test_cancel_during_a_run(server, new_page, recorder, mni_path) -> None:
    page = new_page()
    _open(page, f"{server.url}/")
    page.select_option("#model", "gaussian-3d")
    page.set_input_files("#file", str(mni_path))
    page.click("#options summary")
    for name, value in SLOW_PARAMS.items():
        page.fill(f"#opt-{name}", value)
    with page.expect_response(lambda r: "/v1/jobs?" in r.url and r.request.method == "POST") as posted:
        page.click("#run")
    job = posted.value.json()
    assert posted.value.status == 202 and job["model"] == "gaussian-3d"
    assert "tile=24" in posted.value.url and "halo=8" in posted.value.url
    # the bar follows the event stream: tiles counted, an ETA once the first batch is through
    page.wait_for_function(
        "() => /^running · [1-9][0-9]* \\/ [0-9]+ tiles · ETA [0-9]+ s/"
        ".test(document.getElementById('status').textContent)",
        timeout=120_000,
    )
    assert 0 < float(page.get_attribute("#progress", "value")) < 1
    assert page.is_enabled("#cancel") and page.is_disabled("#run")
    page.click("#cancel")
    assert wait_for_end(page).startswith("cancelled")  # "cancelled · 57 / 1430 tiles"
    answer = httpx.get(f"{server.url}/v1/jobs/{job['id']}", timeout=10).json()
    assert answer["state"] == "cancelled"
    assert answer["tiles_done"] < answer["tiles_total"]
    assert page.is_enabled("#run")
    # the input shown when it was chosen stays in view, with no output over it and nothing to download
    assert page.is_visible("#view3d") and page.is_hidden("#download")
    assert page.evaluate("() => window.tilewise.volumes.nv.volumes.length") == 1
    assert page.inner_text("#legend") == "" and page.inner_text("#facts") == ""
    assert float(page.get_attribute("#progress", "value")) < 1
    recorder.check()


def test_api_key_asked_wrong_key_refused(key_server, new_page, recorder, page_png) -> None:
    page = new_page()
    page.goto(f"{key_server.url}/")
    assert page.is_visible("#key-form") and page.evaluate("() => document.activeElement.id") == "api-key"
    assert page.is_disabled("#model") and page.is_disabled("#run")
    assert page.text_content("#status") == "Enter the API key."
    assert not [u for u in recorder.requests if "/v1/" in u]  # it asks before it calls /v1

    page.fill("#api-key", "not-the-key")
    page.keyboard.press("Enter")
    page.wait_for_selector("#error:not([hidden])")
    refused = httpx.get(
        f"{key_server.url}/v1/models", headers={"Authorization": "Bearer not-the-key"}, timeout=10
    )
    assert refused.status_code == 401
    body = refused.json()
    assert page.text_content("#error") == f"The server answered 401: {body['error']}: {body['detail']}"
    assert page.text_content("#status") == "The API key was refused." and page.is_disabled("#model")

    page.fill("#api-key", API_KEY)
    page.keyboard.press("Enter")
    page.wait_for_function("() => !document.getElementById('model').disabled")
    assert page.is_hidden("#error")
    page.select_option("#model", "gaussian-2d")
    page.set_input_files("#file", str(page_png))
    page.click("#run")
    status = wait_for_end(page)  # the job, its events and its result all carry the key
    assert status.startswith("done"), (status, page.text_content("#error"))
    assert page.is_visible("#view2d")
    # the browser itself logs each refused request as a console error: only those are allowed
    recorder.check(allowed_errors=("the server responded with a status of 401",))


def test_volume_without_the_viewer(key_server, new_page, recorder, mni_path, tmp_path: Path) -> None:
    """No NiiVue on the server: the page says so and how to fix it; the result still downloads."""
    small = tmp_path / "small.nii.gz"
    image = nib.load(mni_path)
    nib.save(nib.Nifti1Image(np.asarray(image.dataobj)[30:62, 40:72, 30:62], image.affine), small)
    page = new_page()
    page.goto(f"{key_server.url}/")
    assert "tilewise setup-web" in page.text_content("#viewer-note")
    page.fill("#api-key", API_KEY)
    page.keyboard.press("Enter")
    page.wait_for_function("() => !document.getElementById('model').disabled")
    page.select_option("#model", "gaussian-3d")
    page.set_input_files("#file", str(small))
    page.click("#run")
    assert wait_for_end(page).startswith("done")
    assert "The volume viewer (NiiVue) is not installed on this server" in page.text_content("#error")
    assert page.is_visible("#download") and page.is_hidden("#view3d")
    assert "tiles" in page.inner_text("#facts")
    recorder.check()
