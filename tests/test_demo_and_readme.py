"""The README's main job (``tilewise demo`` on MNI152) and its Python example run as written."""

from __future__ import annotations

import re
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage

from service.cli import main
from service.commands.demo import mni152_path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_first_command_runs_the_demo():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)\n```", text, re.S)
    assert first_block is not None
    assert "tilewise demo" in first_block.group(1)


def test_demo_matches_scipy_and_keeps_geometry(tmp_path, capsys):
    # The demo's own check returns non-zero when the output differs from scipy or the geometry.
    assert main(["demo", "--out-dir", str(tmp_path)]) == 0
    # It says on stdout what ran, where the output is, and whether its check passed.
    said = capsys.readouterr().out
    assert "gaussian-3d" in said and "MNI152" in said
    assert str((tmp_path / "mni152_t1_gaussian.nii.gz").resolve()) in said
    assert re.search(r"check against scipy\S* .*passed", said), said
    # The template itself is left beside it, for the README's next steps (tissue-3d, the page).
    template = tmp_path / "mni152_t1.nii.gz"
    assert str(template.resolve()) in said
    assert template.read_bytes() == mni152_path().read_bytes()
    out = nib.load(tmp_path / "mni152_t1_gaussian.nii.gz")
    src = nib.load(mni152_path())
    x = np.asarray(src.dataobj, dtype=np.float32)
    y = np.asarray(out.dataobj, dtype=np.float32)
    assert y.shape == x.shape
    assert np.array_equal(out.affine, src.affine)
    assert out.header.get_sform(coded=True)[1] == src.header.get_sform(coded=True)[1]
    assert out.header.get_qform(coded=True)[1] == src.header.get_qform(coded=True)[1]
    ref = ndimage.gaussian_filter(x, 2.0, truncate=4.0, mode="constant")
    # DESIGN.md: 1e-4 for unit-range data, scaled by max |x| for raw intensities (0..255 here).
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(x).max()


def test_readme_python_example_runs():
    text = README.read_text()
    block = re.search(r"```python\n(.*?)\n```", text, re.S)
    assert block is not None and "tiled_inference" in block.group(1)
    exec(compile(block.group(1), str(README), "exec"), {})  # the block asserts its own result
