"""The README's HTTP API examples work as written (against a real server on another port)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import tifffile
from _svc_helpers import REPO, Server
from PIL import Image


def _http_api_block() -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## HTTP API\n", 1)[1]
    match = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert match, "no bash block in the README's HTTP API section"
    return match.group(1)


def test_readme_curl_examples(server: Server, text_det_onnx: Path, mni152_path: Path, tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    script = _http_api_block()
    assert script.count("curl ") >= 2 and "127.0.0.1:8000" in script
    script = script.replace("http://127.0.0.1:8000", server.url)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    tmp_path = tmp_path / "tilewise-demo"  # the README's commands run in this scratch folder
    out, ref = nib.load(tmp_path / "mni152_gaussian.nii.gz"), nib.load(mni152_path)
    assert out.shape == ref.shape and np.array_equal(out.affine, ref.affine)
    with Image.open(tmp_path / "page.png") as page:
        width, height = page.size
    assert tifffile.imread(tmp_path / "page_text.tiff").shape == (height, width)
    with Image.open(tmp_path / "page_text.png") as labels:
        assert labels.mode == "P" and labels.size == (width, height)  # palette PNG
