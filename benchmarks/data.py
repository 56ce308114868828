"""Benchmark inputs prepared once into the cache folder (MNI152, a radiograph, a text page)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.config import TEXT_DET


def mni_volume(cache: Path, *, spacing_mm: float | None = None, cube: int | None = None) -> Path:
    """nilearn's MNI152 T1 (1 mm), resampled (linear), z-scored, as ``(1, D, H, W)`` float32 .npy."""
    name = f"mni_{spacing_mm}mm.npy" if cube is None else f"mni_cube{cube}.npy"
    path = cache / name
    if path.exists():
        return path
    import numpy as np
    from nilearn import datasets
    from scipy import ndimage

    img = datasets.load_mni152_template(resolution=1)
    x = np.asarray(img.dataobj, dtype=np.float32)
    if cube is not None:
        zoom = [cube / s for s in x.shape]
    else:
        zoom = [1.0 / float(spacing_mm)] * 3
    y = ndimage.zoom(x, zoom, order=1)
    if cube is not None:
        y = y[:cube, :cube, :cube]
    y = ((y - y.mean()) / y.std()).astype(np.float32)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, y[None])
    tmp.replace(path)
    return path


def nifti_copy(npy: Path, *, compressed: bool) -> Path:
    """The ``(1, *spatial)`` volume of ``npy`` as a NIfTI file (``.nii.gz`` when ``compressed``)."""
    path = npy.with_suffix(".nii.gz" if compressed else ".nii")
    if path.exists():
        return path
    import nibabel as nib
    import numpy as np

    tmp = path.with_name("tmp-" + path.name)
    nib.save(nib.Nifti1Image(np.load(npy)[0], np.eye(4)), tmp)
    tmp.replace(path)
    return path


def radiograph_raw(cache: Path) -> Path:
    """RG1_UNCR.dcm (pydicom-data) as ``(1, H, W)`` float32, inverted (MONOCHROME1) to dark background."""
    path = cache / "rg1_raw.npy"
    if path.exists():
        return path
    import numpy as np
    from pydicom import dcmread
    from pydicom.data import get_testdata_file

    ds = dcmread(get_testdata_file("RG1_UNCR.dcm"))
    x = ds.pixel_array.astype(np.float32)
    if getattr(ds, "PhotometricInterpretation", "") == "MONOCHROME1":
        x = x.max() - x
    np.save(path, x[None])
    return path


def page_raw(cache: Path) -> Path:
    """scikit-image's ``page`` (a scanned text page) upscaled 6x (1146x2304), ``(1, H, W)`` float32."""
    path = cache / "page_x6_raw.npy"
    if path.exists():
        return path
    import numpy as np
    from scipy import ndimage
    from skimage import data as skdata

    x = ndimage.zoom(skdata.page().astype(np.float32), 6, order=1)
    np.save(path, x[None])
    return path


def preprocessed(raw: Path, models_dir: Path, dest: Path) -> Path:
    """``raw`` through text-det-2d's preprocessing (computed each run: the spec decides)."""
    import numpy as np

    from models.repository import ModelRepository
    from models.transforms.preprocess import preprocess

    spec = ModelRepository(models_dir, device="cpu").spec(TEXT_DET)
    np.save(dest, np.ascontiguousarray(preprocess(np.load(raw), spec), dtype=np.float32))
    return dest
