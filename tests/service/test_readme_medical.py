"""The README's "Medical models" commands work as written, against a real server (``slow``: two
passes over the MNI152 T1, brain-mask-3d's 256^3 frame and tissue-3d at 1 mm, about a minute).

The server's model folder holds brain-mask-3d, set up from the verified network file that
``tilewise setup-models`` extracted (skipped locally without it, failed in CI); tissue-3d is a
built-in. The bash block runs with the server's address in place of ``127.0.0.1:8000``, then the
Python block, whose ``volumes_ml`` must name the three tissue labels.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from _svc_helpers import REPO, start_server, stop_server


def _section_blocks() -> tuple[str, str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Medical models\n", 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    python = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert bash and python, "the Medical models section needs its bash and python blocks"
    return bash.group(1), python.group(1)


def test_medical_section_names_both_models_and_their_labels() -> None:
    bash, python = _section_blocks()
    assert "/v1/models/brain-mask-3d/infer" in bash and "/v1/models/tissue-3d/infer" in bash
    assert "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz" in bash and '["labels"]' in python


@pytest.mark.slow
def test_readme_medical_commands(tmp_path: Path, mni152_path: Path) -> None:
    from models import DEFAULT_MODELS_DIR
    from models.weights import sha256_file
    from models.zoo.brainmask import BRAIN_MASK_FILE, BRAIN_MASK_SHA256, WHEEL_MEMBER, setup_brain_mask

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    network = DEFAULT_MODELS_DIR / BRAIN_MASK_FILE
    if not network.is_file() or sha256_file(network) != BRAIN_MASK_SHA256:
        if os.environ.get("CI"):
            pytest.fail("brain-mask-3d is not prepared (CI is set: run `tilewise setup-models`)")
        pytest.skip("brain-mask-3d is not prepared: run `tilewise setup-models`")
    wheel = tmp_path / "deepbet-1.0.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(network, WHEEL_MEMBER)
    setup_brain_mask(tmp_path / "models", wheel=wheel)
    bash, python = _section_blocks()
    server = start_server(tmp_path, models_dir=str(tmp_path / "models"), timeout_s=600.0)
    try:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        run = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", bash.replace("http://127.0.0.1:8000", server.url)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr + server.log_tail()
        demo = tmp_path / "tilewise-demo"
        scope: dict[str, object] = {}
        cwd = Path.cwd()
        os.chdir(demo)
        try:
            exec(python.replace("http://127.0.0.1:8000", server.url), scope)  # noqa: S102 - the README's own code
        finally:
            os.chdir(cwd)
    finally:
        stop_server(server)
    src = nib.load(mni152_path)
    for name, labels in (("mni152_brain.nii.gz", {0, 1}), ("mni152_tissue.nii.gz", {0, 1, 2})):
        out = nib.load(demo / name)
        assert out.shape == src.shape and np.array_equal(out.affine, src.affine)
        assert out.get_data_dtype() == np.uint8 and set(np.unique(np.asarray(out.dataobj))) == labels
    headers = (demo / "brain_headers.txt").read_text().lower()
    assert "x-tilewise-seam: max=0; mean=0; voxels=0" in headers
    volumes = scope["volumes_ml"]
    assert isinstance(volumes, dict) and set(volumes) == {"background", "grey matter", "white matter"}
    assert 300 < volumes["grey matter"] < 1200 and 200 < volumes["white matter"] < 900  # an adult brain
