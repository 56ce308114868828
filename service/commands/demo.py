"""``tilewise demo``: the main job once, on real data shipped by a PyPI package.

Runs nilearn's MNI152 T1 template (1 mm, 197x233x189) through the tiled ``gaussian-3d`` model with
``tilewise infer``, then checks the output against ``scipy.ndimage.gaussian_filter`` (sigma 2 voxels,
truncate 4, mode ``constant``) and the input's shape and affine. The template itself is copied
beside the output (``mni152_t1.nii.gz``): the README's next steps send it to ``tissue-3d``, the
model trained on it (the smoothed output is no input for a segmentation).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: nilearn ships the template inside its wheel (no download).
MNI152_FILE = "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz"


def register(sub: Any) -> None:
    """Add the ``demo`` sub-command."""
    parser = sub.add_parser(
        "demo",
        help="run gaussian-3d over the MNI152 T1 template and check it against scipy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out-dir", type=Path, default=Path("tilewise-demo"), help="output folder")
    parser.add_argument("--tile", default="64", help="tile shape (default: 64)")
    parser.set_defaults(run=_run)


def mni152_path() -> Path:
    """Path of nilearn's MNI152 T1 template file.

    Raises:
        FileNotFoundError: nilearn is not installed (``pip install nilearn``).
    """
    try:
        import nilearn
    except ImportError as exc:
        raise FileNotFoundError("the demo needs nilearn (pip install 'tilewise[dev]')") from exc
    path = Path(nilearn.__file__).parent / "datasets" / "data" / MNI152_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from this nilearn installation")
    return path


def _run(args: argparse.Namespace) -> int:
    import nibabel as nib
    import numpy as np

    from service.cli import main

    try:
        from scipy import ndimage

        src = mni152_path()
    except (ImportError, FileNotFoundError) as exc:
        logger.error("demo: %s; install the dev extra: pip install 'tilewise[dev]'", exc)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dst = args.out_dir / "mni152_t1_gaussian.nii.gz"
    template = args.out_dir / "mni152_t1.nii.gz"
    shutil.copyfile(src, template)
    out = sys.stdout
    out.write(f"tilewise demo: gaussian-3d (tile {args.tile}) over nilearn's MNI152 T1 template {src.name}\n")
    out.write(f"input: {template.resolve()} (a copy of the template, to try the other models on)\n")
    status = main(["infer", str(src), str(dst), "--model", "gaussian-3d", "--tile", args.tile])
    if status:
        out.write(f"tilewise demo: the inference failed (exit status {status}); see the log above\n")
        return status
    img_in: Any = nib.load(src)
    img_out: Any = nib.load(dst)
    x = np.asarray(img_in.dataobj, dtype=np.float32)
    y = np.asarray(img_out.dataobj, dtype=np.float32)
    y = y[..., 0] if y.ndim == 4 else y
    ref = ndimage.gaussian_filter(x, 2.0, truncate=4.0, mode="constant")
    err = float(np.abs(y - ref).max())
    tol = 1e-4 * max(float(np.abs(x).max()), 1.0)  # DESIGN.md: tolerances scale with max |x|
    same_geometry = (
        y.shape == x.shape
        and np.array_equal(img_in.affine, img_out.affine)
        and img_in.header.get_qform(coded=True)[1] == img_out.header.get_qform(coded=True)[1]
        and img_in.header.get_sform(coded=True)[1] == img_out.header.get_sform(coded=True)[1]
    )
    logger.info(
        "demo: %s -> %s shape=%s geometry_equal=%s max_abs_diff_vs_scipy=%.3g (tolerance %.3g)",
        src.name, dst, y.shape, same_geometry, err, tol,
    )  # fmt: skip
    passed = same_geometry and err <= tol
    out.write(f"output: {dst.resolve()} (shape {'x'.join(map(str, y.shape))}, same affine and codes: "
              f"{'yes' if same_geometry else 'NO'})\n")  # fmt: skip
    out.write(
        f"check against scipy.ndimage.gaussian_filter: {'passed' if passed else 'FAILED'} "
        f"(max abs difference {err:.3g}, tolerance {tol:.3g})\n"
    )
    return 0 if passed else 1
