"""README "Serve your own model": every example runs as written, in an empty folder.

The nnU-Net folder (``nnUNet_results/...``) that the examples import is written first by the test
kit, as a user would have it; the MONAI bundle (``tissue_bundle``) is written by the README itself
(``tilewise import-model --example-bundle``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import yaml
from _import_kit import need, write_nnunet_folder

README = Path(__file__).resolve().parents[2] / "README.md"


def _section() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("## Serve your own model")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def test_readme_examples_run_as_written(tmp_path: Path) -> None:
    need("monai")
    need("nnunetv2")
    blocks = re.findall(r"```bash\n(.*?)\n```", _section(), re.S)
    assert len(blocks) == 5  # ANAT, TorchScript/ONNX, eager, MONAI bundle, nnU-Net
    write_nnunet_folder(tmp_path / "nnUNet_results")
    script = "set -euo pipefail\n" + "\n".join(blocks)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    anatomical = Path(nib.__file__).parent / "tests" / "data" / "anatomical.nii"
    shape = nib.load(anatomical).shape
    for name in ("my_net", "my_net_onnx", "eager", "tissue", "toy"):
        assert nib.load(tmp_path / f"anat_{name}.nii.gz").shape[:3] == shape, name
    spec = yaml.safe_load((tmp_path / "my-models" / "my-net-3d.yaml").read_text())
    assert spec["alignment"] == 2 and spec["receptive_field"] == [3, 3, 3]  # as the README says
    assert spec["defaults"]["halo"] == "auto" and spec["backend"] == "torchscript"
    assert yaml.safe_load((tmp_path / "my-models" / "my-net-onnx-3d.yaml").read_text())["backend"] == "onnx"
