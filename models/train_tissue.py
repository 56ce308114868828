"""Train the ``tissue-3d`` demonstration model on nilearn's MNI152 template (CPU, deterministic).

Data: the ICBM 2009a symmetric T1 template at 1 mm (197 x 233 x 189, RAS, brain-extracted) and
its grey- and white-matter probability maps, as nilearn ships them in
``nilearn/datasets/data/mni_icbm152_{t1,gm,wm}_tal_nlin_sym_09a_converted.nii.gz`` (read with
nibabel; nothing is downloaded and nilearn itself is not imported). Target labels: the argmax of
``(1 - gm - wm, gm, wm)``, i.e. 0 background (CSF included), 1 grey matter, 2 white matter.

Held-out test: the template is left-right symmetric, so a held-out hemisphere would be seen in
the mirror. Instead an axial band of slices is held out: the middle :data:`BAND_FRACTION` of the
brain's z-extent (slices 62..92 of 189). No training patch reads a voxel of the band, not even
through interpolation; training patches come from the brain above and below it.

Training: random flat patches (56 x 56 x 32 voxels), rotated (up to 10 degrees in the axial
plane, 5 about the other axes), zoomed (0.9-1.1 per axis) and left-right flipped, resampled
trilinearly (the T1 and the class maps; labels are the argmax of the resampled maps). Intensity
augmentation on the normalized T1 (most patches): gamma, gain, a linear bias field and Gaussian
noise, clipped to [0, 1] like the served preprocessing. Loss: cross entropy + soft Dice over
grey and white matter. AdamW with warm-up and a cosine schedule. Batch norm keeps its running
statistics from training.

Normalization: the spec's own ``preprocess`` steps (``percentile`` 0 / 99.5, so that the whole
volume maps to [0, 1]) run through :func:`models.preprocess.preprocess`, exactly as served.

Determinism: ``torch.manual_seed``, a NumPy ``Generator`` for every random draw, deterministic
algorithms and a fixed thread count. The same seed and thread count on the same machine give
bit-identical weights (the sha256 file says which); another CPU may round differently, which is
why the slow test compares Dice, not bytes.

Cost: about 12 k multiply-adds per voxel forward, 2 x 100 k voxels per step; the metrics record
the wall time (``train_seconds``) and the CPU time summed over threads (``train_cpu_seconds``,
which bounds the wall time on as many idle cores as ``threads``).

Run ``python -m models.train_tissue --out DIR`` or ``tilewise train-tissue --out DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)

__all__ = [
    "BAND_FRACTION",
    "LABEL_NAMES",
    "NAME",
    "SPEC_PATH",
    "TrainConfig",
    "add_arguments",
    "band_dice",
    "dice_scores",
    "held_out_band",
    "load_mni152",
    "main",
    "mni152_paths",
    "predict_band",
    "run",
    "train_module",
]

NAME = "tissue-3d"
SPEC_PATH = Path(__file__).parent / "builtin" / f"{NAME}.yaml"
#: Fraction of the brain's z-extent held out, centred on its middle.
BAND_FRACTION = 0.2
LABEL_NAMES = ("background", "grey matter", "white matter")
_FILES = {
    "t1": "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz",
    "gm": "mni_icbm152_gm_tal_nlin_sym_09a_converted.nii.gz",
    "wm": "mni_icbm152_wm_tal_nlin_sym_09a_converted.nii.gz",
}


@dataclass(frozen=True)
class TrainConfig:
    """Training hyper-parameters; every field is recorded in the metrics JSON.

    Patches are ``(patch, patch, patch_z)`` voxels (flat, so that their centres can come close to
    the held-out band), rotated by up to ``max_rotation`` degrees in the axial plane and
    ``max_tilt`` about the two other axes, zoomed by up to ``max_scale`` per axis. Intensity
    augmentation, on a patch with probability ``intensity_p``: ``x ** exp(U(-max_gamma,
    max_gamma))`` times a gain ``exp(U(-max_gain, max_gain))`` times a linear bias field
    ``exp(slope . r)`` (``|slope| <= max_bias`` per axis, ``r`` in [-0.5, 0.5) across the patch),
    plus Gaussian noise of sigma ``U(0, max_noise)``. ``threads`` is the torch CPU thread count
    (part of the result: reductions split differently with another count).
    """

    seed: int = 0
    steps: int = 400
    batch_size: int = 2
    patch: int = 48
    patch_z: int = 48
    lr: float = 5e-3
    weight_decay: float = 1e-4
    warmup_steps: int = 10
    max_rotation: float = 10.0
    max_tilt: float = 0.0
    max_scale: float = 0.1
    flip: bool = True
    intensity_p: float = 0.6
    max_gamma: float = 0.2
    max_gain: float = 0.1
    max_bias: float = 0.2
    max_noise: float = 0.03
    threads: int = 2
    channels_last: bool = True


# ----------------------------------------------------------------------------------------- data


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


def load_mni152() -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.uint8]]:
    """The template as arrays ``(X, Y, Z) = (197, 233, 189)``, RAS, 1 mm.

    Returns:
        ``(t1, maps, labels)``: the raw T1 (float32, 0..255), the ``(3, X, Y, Z)`` float32 class
        probabilities ``(1 - gm - wm, gm, wm)`` and their argmax as uint8 labels.
    """
    import nibabel as nib

    paths = mni152_paths()
    t1 = np.asarray(nib.load(paths["t1"]).get_fdata(dtype=np.float32))
    gm = np.asarray(nib.load(paths["gm"]).get_fdata(dtype=np.float32)) / np.float32(255)
    wm = np.asarray(nib.load(paths["wm"]).get_fdata(dtype=np.float32)) / np.float32(255)
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


def dice_scores(pred: npt.NDArray[Any], ref: npt.NDArray[Any]) -> dict[str, float]:
    """Dice per label name of :data:`LABEL_NAMES` (``2|P and R| / (|P| + |R|)``; 1.0 when both are empty)."""
    scores = {}
    for label, name in enumerate(LABEL_NAMES):
        p, r = pred == label, ref == label
        total = int(p.sum()) + int(r.sum())
        scores[name] = 1.0 if total == 0 else 2.0 * int((p & r).sum()) / total
    return scores


# ------------------------------------------------------------------------------------ inference


def predict_band(
    module: Any, x: npt.NDArray[np.float32], band: tuple[int, int], *, alignment: int, radius: int
) -> npt.NDArray[np.float32]:
    """Logits ``(3, X, Y, stop - start)`` of the whole-volume pass, for the band's slices only.

    The network runs once on the slab from the aligned slice at least ``radius`` below the band
    to ``radius`` above it (zero-padded at the far ends to a multiple of ``alignment``, as a
    whole-volume pass pads the volume). Every band voxel is at least the receptive-field radius
    away from the slab's cut faces and the slab starts on the stride grid, so the band's logits
    are those of the whole-volume pass. Memory: about 40 float32 values per slab voxel at the
    peak (MNI152: 197 x 233 x 84 slab, about 0.6 GB).

    Args:
        module: the network in eval mode.
        x: ``(1, X, Y, Z)`` preprocessed volume.
        band: ``(start, stop)`` slices of the last axis.
        alignment: the network's total stride.
        radius: its receptive-field radius in voxels.
    """
    import torch

    start, stop = band
    depth = x.shape[-1]
    lo = max(0, (start - radius) // alignment * alignment)
    hi = min(depth, stop + radius)
    slab = x[..., lo:hi]
    pad = [(0, 0)] + [(0, -s % alignment) for s in slab.shape[1:]]
    slab = np.pad(slab, pad)
    with torch.inference_mode():
        logits = module(torch.from_numpy(slab)[None])[0].numpy()
    return np.ascontiguousarray(logits[:, : x.shape[1], : x.shape[2], start - lo : stop - lo])


def band_dice(
    module: Any, x: npt.NDArray[np.float32], labels: npt.NDArray[np.uint8], band: tuple[int, int]
) -> dict[str, float]:
    """Dice per class on the held-out band (whole-volume prediction, argmax of the logits)."""
    from models.tissue_net import ALIGNMENT, RECEPTIVE_FIELD

    logits = predict_band(module, x, band, alignment=ALIGNMENT, radius=RECEPTIVE_FIELD)
    return dice_scores(np.argmax(logits, axis=0), labels[..., band[0] : band[1]])


# -------------------------------------------------------------------------------------- training


@contextlib.contextmanager
def _torch_settings(threads: int) -> Iterator[None]:
    """Fixed thread count and deterministic algorithms, restored on exit."""
    import torch

    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1])


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


def _loss(logits: Any, target: Any) -> Any:
    """Cross entropy + (1 - mean soft Dice of grey and white matter)."""
    import torch
    from torch.nn import functional as F

    ce = F.cross_entropy(logits, target)
    prob = torch.softmax(logits, dim=1)[:, 1:]
    onehot = F.one_hot(target, 3).permute(0, 4, 1, 2, 3)[:, 1:].float()
    dims = (0, 2, 3, 4)
    soft_dice = (2 * (prob * onehot).sum(dims) + 1.0) / (prob.sum(dims) + onehot.sum(dims) + 1.0)
    return ce + (1.0 - soft_dice.mean())


def train_module(
    config: TrainConfig,
    x: npt.NDArray[np.float32],
    maps: npt.NDArray[np.float32],
    labels: npt.NDArray[np.uint8],
    band: tuple[int, int],
    *,
    params: dict[str, Any] | None = None,
    log_every: int = 25,
) -> tuple[Any, dict[str, Any]]:
    """Train a fresh :class:`~models.tissue_net.TissueUNet` on patches outside ``band``.

    Args:
        config: hyper-parameters (seed, steps, ...).
        x: ``(1, X, Y, Z)`` preprocessed T1.
        maps: ``(3, X, Y, Z)`` class probabilities.
        labels: ``(X, Y, Z)`` uint8 labels (brain voxels are patch centres).
        band: held-out slices ``[start, stop)`` of the last axis.
        params: architecture parameters (the spec's ``params``).
        log_every: steps between progress log lines.

    Returns:
        ``(module in eval mode, info)`` where ``info`` holds ``train_seconds``, ``final_loss``,
        ``rejected_draws`` and ``voxels_seen``.
    """
    with _torch_settings(config.threads):
        return _train(config, x, maps, labels, band, dict(params or {}), log_every)


def _train(
    config: TrainConfig,
    x: npt.NDArray[np.float32],
    maps: npt.NDArray[np.float32],
    labels: npt.NDArray[np.uint8],
    band: tuple[int, int],
    params: dict[str, Any],
    log_every: int,
) -> tuple[Any, dict[str, Any]]:
    import torch

    from models.tissue_net import TissueUNet

    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    module = TissueUNet(1, 3, tuple(params.get("widths", (8, 16, 32))))
    # channels-last (NDHWC) runs oneDNN's fast 3-D kernels on the CPU: about 2x per step here
    memory_format = torch.channels_last_3d if config.channels_last else torch.contiguous_format
    module = module.to(memory_format=memory_format)  # type: ignore[call-overload]
    sampler = _PatchSampler(x, maps, labels, band, config, rng)
    optimizer = torch.optim.AdamW(module.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def lr_factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    module.train()
    start, cpu_start = time.perf_counter(), time.process_time()
    running = 0.0
    loss_value = float("nan")
    for step in range(config.steps):
        inputs, targets = sampler.batch()
        inputs = inputs.contiguous(memory_format=memory_format)
        loss = _loss(module(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        loss_value = float(loss.detach())
        running += loss_value
        if (step + 1) % log_every == 0 or step + 1 == config.steps:
            count = (step % log_every) + 1
            logger.info(
                "step %d/%d loss %.4f (%.0f s)",
                step + 1,
                config.steps,
                running / count,
                time.perf_counter() - start,
            )
            running = 0.0
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    module = module.to(memory_format=torch.contiguous_format).eval()  # type: ignore[call-overload]
    info = {
        "train_seconds": round(seconds, 1),
        "train_cpu_seconds": round(cpu_seconds, 1),
        "final_loss": round(loss_value, 4),
        "rejected_draws": sampler.rejected,
        "voxels_seen": config.steps * config.batch_size * config.patch**2 * config.patch_z,
    }
    return module, info


# ------------------------------------------------------------------------------------------ run


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(
    config: TrainConfig, out_dir: Path, *, spec_path: Path = SPEC_PATH, update_spec: bool = False
) -> dict[str, Any]:
    """Train, evaluate on the held-out band and write the three files of the model.

    Writes ``OUT/tissue-3d.safetensors`` (float32 state dict), ``OUT/tissue-3d.sha256``
    (``<hex>  tissue-3d.safetensors``, as ``sha256sum`` prints it) and
    ``OUT/tissue-3d.metrics.json``. With ``update_spec`` the ``sha256:`` line of ``spec_path``
    is rewritten to the new digest.

    Returns:
        The metrics written.
    """
    import torch
    from safetensors.torch import save_file

    from models.preprocess import preprocess
    from models.spec import load_spec

    spec = load_spec(spec_path)
    t1, maps, labels = load_mni152()
    x = preprocess(t1[None], spec)
    band = held_out_band(labels)
    outside = np.ones(labels.shape[-1], dtype=bool)
    outside[band[0] : band[1]] = False
    train_voxels = int((labels[..., outside] > 0).sum())
    logger.info("training %s: held-out band z %d..%d, %s", NAME, band[0], band[1] - 1, config)
    module, info = train_module(config, x, maps, labels, band, params=dict(spec.params))

    start = time.perf_counter()
    with _torch_settings(config.threads):
        dice = band_dice(module, x, labels, band)
    eval_seconds = time.perf_counter() - start
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = out_dir / f"{NAME}.safetensors"
    state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(weights), metadata={"model": NAME, "seed": str(config.seed)})
    digest = _sha256(weights)
    (out_dir / f"{NAME}.sha256").write_text(f"{digest}  {weights.name}\n", encoding="utf-8")
    metrics = {
        "model": NAME,
        "data": "nilearn MNI152 ICBM 2009a symmetric T1 + GM/WM maps, 1 mm RAS, 197x233x189",
        "target": "argmax(1 - gm - wm, gm, wm): 0 background, 1 grey matter, 2 white matter",
        "held_out_band": {"axis": 2, "start": band[0], "stop": band[1], "slices": band[1] - band[0]},
        "dice": {k: round(v, 4) for k, v in dice.items()},
        "config": asdict(config),
        "epochs": round(info["voxels_seen"] / train_voxels, 2),
        "epochs_note": "voxels seen in patches / brain voxels outside the band",
        **info,
        "eval_seconds": round(eval_seconds, 1),
        "parameters": sum(p.numel() for p in module.parameters()),
        "weights_bytes": weights.stat().st_size,
        "sha256": digest,
        "torch": torch.__version__,
    }
    (out_dir / f"{NAME}.metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    if update_spec:
        _update_spec_sha(spec_path, digest)
    logger.info(
        "%s: dice %s, trained in %.0f s, wrote %s", NAME, metrics["dice"], info["train_seconds"], out_dir
    )
    return metrics


def _update_spec_sha(spec_path: Path, digest: str) -> None:
    lines = spec_path.read_text(encoding="utf-8").splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.startswith("sha256:")]
    if len(hits) != 1:
        raise ValueError(f"{spec_path}: expected one 'sha256:' line, found {len(hits)}")
    lines[hits[0]] = f'sha256: "{digest}"\n'  # quoted: YAML would read some digests as numbers
    spec_path.write_text("".join(lines), encoding="utf-8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training options (shared by ``python -m models.train_tissue`` and ``tilewise train-tissue``)."""
    default = TrainConfig()
    parser.add_argument(
        "--out", type=Path, default=SPEC_PATH.parent, help=f"output folder (default: {SPEC_PATH.parent})"
    )
    parser.add_argument("--seed", type=int, default=default.seed, help="random seed (default: %(default)s)")
    parser.add_argument(
        "--steps", type=int, default=default.steps, help="optimizer steps (default: %(default)s)"
    )
    parser.add_argument(
        "--threads", type=int, default=default.threads, help="torch CPU threads (default: %(default)s)"
    )
    parser.add_argument(
        "--update-spec", action="store_true", help=f"rewrite the sha256 line of {SPEC_PATH.name}"
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed :func:`add_arguments` options; returns the exit status."""
    config = TrainConfig(seed=args.seed, steps=args.steps, threads=args.threads)
    metrics = run(config, args.out, update_spec=args.update_spec)
    sys.stdout.write(json.dumps(metrics["dice"]) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m models.train_tissue [--out DIR] [--seed N] [--steps N] [--threads N]``."""
    parser = argparse.ArgumentParser(prog="python -m models.train_tissue", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return run_from_args(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
