"""The ``tissue-3d`` training data: the MNI152 template from nilearn, the held-out band, augmented patches.

One job: what :mod:`models.zoo.train_tissue` trains on: :func:`load_mni152` (T1, class maps, labels),
:func:`held_out_band` (the axial band no training patch reads), and ``_PatchSampler`` (rotated,
zoomed, flipped, intensity-augmented patches drawn around the band). See
:mod:`models.zoo.train_tissue` for the data, band and augmentation choices.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from models.zoo.train_tissue import TrainConfig


__all__ = ["BAND_FRACTION", "held_out_band", "load_mni152", "mni152_paths"]

#: Fraction of the brain's z-extent held out, centred on its middle.
BAND_FRACTION = 0.2
_FILES = {
    "t1": "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz",
    "gm": "mni_icbm152_gm_tal_nlin_sym_09a_converted.nii.gz",
    "wm": "mni_icbm152_wm_tal_nlin_sym_09a_converted.nii.gz",
}


def mni152_paths() -> dict[str, Path]:
    """Paths of the MNI152 2009a T1, GM and WM files inside the installed nilearn package.

    Raises:
        FileNotFoundError: nilearn is not installed or lacks the files.
    """
    found = importlib.util.find_spec("nilearn")
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError("nilearn is not installed (pip install 'tilewise[dev]')")
    folder = Path(next(iter(found.submodule_search_locations))) / "datasets" / "data"
    paths = {key: folder / name for key, name in _FILES.items()}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"nilearn ships no {', '.join(missing)}")
    return paths


def _fdata(path: Path) -> npt.NDArray[np.float32]:
    """The float32 voxels of one of the template's NIfTI files."""
    import nibabel as nib
    from nibabel.dataobj_images import DataobjImage

    image = nib.load(path)
    assert isinstance(image, DataobjImage)  # the template's files are NIfTI images
    return np.asarray(image.get_fdata(dtype=np.float32), dtype=np.float32)


def load_mni152() -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.uint8]]:
    """The template as arrays ``(X, Y, Z) = (197, 233, 189)``, RAS, 1 mm.

    Returns:
        ``(t1, maps, labels)``: the raw T1 (float32, 0..255), the ``(3, X, Y, Z)`` float32 class
        probabilities ``(1 - gm - wm, gm, wm)`` and their argmax as uint8 labels.
    """
    paths = mni152_paths()
    t1 = _fdata(paths["t1"])
    gm = _fdata(paths["gm"]) / np.float32(255)
    wm = _fdata(paths["wm"]) / np.float32(255)
    maps = np.stack([np.clip(1 - gm - wm, 0, 1), gm, wm]).astype(np.float32)
    labels = np.argmax(maps, axis=0).astype(np.uint8)
    return t1, maps, labels


def held_out_band(labels: npt.NDArray[Any], fraction: float = BAND_FRACTION) -> tuple[int, int]:
    """The held-out axial band ``[start, stop)`` of slices (last axis, inferior to superior).

    It is the middle ``fraction`` of the brain's z-extent (slices holding grey or white matter),
    ``round(fraction * extent)`` slices long. MNI152: brain in slices 1..153, band 62..92.
    """
    z = np.nonzero(np.asarray(labels).any(axis=(0, 1)))[0]
    lo, hi = int(z.min()), int(z.max()) + 1
    length = round(fraction * (hi - lo))
    start = lo + (hi - lo - length) // 2
    return start, start + length


def _rotation(rng: np.random.Generator, max_rotation: float, max_tilt: float) -> npt.NDArray[np.float64]:
    """A rotation matrix: up to ``max_tilt`` degrees about x and y, ``max_rotation`` about z."""
    a, b = np.deg2rad(rng.uniform(-max_tilt, max_tilt, size=2))
    c = np.deg2rad(rng.uniform(-max_rotation, max_rotation))
    rx = np.array([[1, 0, 0], [0, np.cos(a), -np.sin(a)], [0, np.sin(a), np.cos(a)]])
    ry = np.array([[np.cos(b), 0, np.sin(b)], [0, 1, 0], [-np.sin(b), 0, np.cos(b)]])
    rz = np.array([[np.cos(c), -np.sin(c), 0], [np.sin(c), np.cos(c), 0], [0, 0, 1]])
    out: npt.NDArray[np.float64] = rx @ ry @ rz
    return out


class _PatchSampler:
    """Augmented training patches that never read a voxel of the held-out band.

    Each patch is a ``(P, P, Pz)`` grid of points ``centre + R @ (s * offset)`` (voxel
    coordinates), sampled trilinearly from the normalized T1 and the three class maps at once
    (zero outside the volume). A draw whose box comes within one voxel of the band (trilinear
    reads the two neighbouring slices) is rejected and drawn again from the same generator; the
    box's z-range is that of its 8 corners, since the map is affine. Flat patches (``Pz < P``)
    with small tilts let patch centres come close to the band.
    """

    def __init__(
        self,
        x: npt.NDArray[np.float32],
        maps: npt.NDArray[np.float32],
        labels: npt.NDArray[np.uint8],
        band: tuple[int, int],
        config: TrainConfig,
        rng: np.random.Generator,
    ) -> None:
        import torch

        self.config = config
        self.rng = rng
        self.band = band
        self.size = (config.patch, config.patch, config.patch_z)
        self.shape = np.array(x.shape[1:], dtype=np.float64)
        self.volume = torch.from_numpy(np.concatenate([x, maps]))[None]  # (1, 4, X, Y, Z)
        axes = [np.arange(n, dtype=np.float64) - n // 2 for n in self.size]
        grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1)
        self.offsets = grid.reshape(-1, 3)  # (P * P * Pz, 3)
        self.corners = np.array(np.meshgrid(*[(a[0], a[-1]) for a in axes], indexing="ij")).reshape(3, -1).T
        # Centres: brain voxels whose patch can miss the band at all (smallest zoom, no rotation).
        brain = np.argwhere(labels > 0)
        least = 1.0 - config.max_scale
        below = brain[:, 2] + axes[2][-1] * least < band[0] - 1
        above = brain[:, 2] + axes[2][0] * least >= band[1]
        self.centres = brain[below | above]
        self.rejected = 0

    def _points(self) -> npt.NDArray[np.float64]:
        cfg, rng = self.config, self.rng
        while True:
            centre = self.centres[rng.integers(len(self.centres))].astype(np.float64)
            rot = _rotation(rng, cfg.max_rotation, cfg.max_tilt)
            zoom = rng.uniform(1 - cfg.max_scale, 1 + cfg.max_scale, size=3)
            z = centre[2] + (self.corners * zoom) @ rot[2]
            if z.max() < self.band[0] - 1 or z.min() >= self.band[1]:
                points: npt.NDArray[np.float64] = centre + (self.offsets * zoom) @ rot.T
                return points
            self.rejected += 1

    def batch(self) -> tuple[Any, Any]:
        """``(inputs (B, 1, P, P, Pz) float32, targets (B, P, P, Pz) int64)``."""
        import torch
        from torch.nn import functional as F

        cfg, rng = self.config, self.rng
        inputs, targets = [], []
        for _ in range(cfg.batch_size):
            points = self._points()
            normalized = 2.0 * points / (self.shape - 1.0) - 1.0
            grid = torch.from_numpy(normalized[:, ::-1].astype(np.float32).reshape(1, *self.size, 3))
            sample = F.grid_sample(
                self.volume, grid, mode="bilinear", padding_mode="zeros", align_corners=True
            )
            sample = sample[0]  # (4, P, P, Pz)
            image, maps = sample[:1], sample[1:]
            target = maps.argmax(0)  # outside the volume all maps read 0: argmax 0, background
            if cfg.flip and rng.random() < 0.5:  # left-right (first axis in RAS)
                image, target = image.flip(1), target.flip(0)
            image = self._intensity(image, rng)
            inputs.append(image)
            targets.append(target)
        return torch.stack(inputs), torch.stack(targets)

    def _intensity(self, image: Any, rng: np.random.Generator) -> Any:
        """Gamma, global gain, linear bias field and Gaussian noise, then clip to [0, 1]."""
        import torch

        cfg = self.config
        if rng.random() >= cfg.intensity_p:
            return image
        gamma = math.exp(rng.uniform(-cfg.max_gamma, cfg.max_gamma))
        scale = math.exp(rng.uniform(-cfg.max_gain, cfg.max_gain))
        slope = rng.uniform(-cfg.max_bias, cfg.max_bias, size=3)
        sigma = rng.uniform(0.0, cfg.max_noise)
        ramps = [(np.arange(n, dtype=np.float32) - n / 2) / n for n in self.size]
        field = np.exp(
            slope[0] * ramps[0][:, None, None] + slope[1] * ramps[1][None, :, None] + slope[2] * ramps[2]
        ).astype(np.float32)
        noise = rng.standard_normal((1, *self.size), dtype=np.float32) * np.float32(sigma)
        out = scale * torch.from_numpy(field)[None] * image.clamp_min(0) ** gamma
        return (out + torch.from_numpy(noise)).clamp(0.0, 1.0)
