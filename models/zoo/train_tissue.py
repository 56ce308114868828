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

Training: random patches (48 x 48 x 48 voxels by default; ``patch_z`` can make them flat),
rotated (up to 10 degrees in the axial plane; ``max_tilt`` about the other axes, 0 by default),
zoomed (0.9-1.1 per axis) and left-right flipped, resampled
trilinearly (the T1 and the class maps; labels are the argmax of the resampled maps). Intensity
augmentation on the normalized T1 (most patches): gamma, gain, a linear bias field and Gaussian
noise, clipped to [0, 1] like the served preprocessing. Loss: cross entropy + soft Dice over
grey and white matter. AdamW with warm-up and a cosine schedule. Batch norm keeps its running
statistics from training.

Normalization: the spec's own ``preprocess`` steps (``percentile`` 0 / 99.5, so that the whole
volume maps to [0, 1]) run through :func:`models.transforms.preprocess.preprocess`, exactly as served.

Determinism: ``torch.manual_seed``, a NumPy ``Generator`` for every random draw, deterministic
algorithms and a fixed thread count. The same seed and thread count on the same machine give
bit-identical weights (the sha256 file says which); another CPU may round differently, which is
why the slow test compares Dice, not bytes.

Cost: about 12 k multiply-adds per voxel forward, 2 x 110 k voxels per step, 800 steps: about
980 CPU-seconds here (8 minutes on 2 idle cores; held-out Dice grey 0.93, white 0.92). The metrics
record the wall time (``train_seconds``) and the CPU time summed over threads
(``train_cpu_seconds``, which bounds the wall time on as many idle cores as ``threads``).

Run ``python -m models.zoo.train_tissue --out DIR`` or ``tilewise train-tissue --out DIR``.

Modules: this one holds the config, the training loop, the run (weights, sha256, metrics) and the
CLI; :mod:`models.zoo.tissue_data` the template, the band and the patch sampler;
:mod:`models.zoo.tissue_eval` the held-out Dice.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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

from models.zoo.tissue_data import BAND_FRACTION, _PatchSampler, held_out_band, load_mni152, mni152_paths
from models.zoo.tissue_eval import LABEL_NAMES, band_dice, dice_scores, predict_band

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
    "run_from_args",
    "train_module",
]

NAME = "tissue-3d"
SPEC_PATH = Path(__file__).parents[1] / "builtin" / f"{NAME}.yaml"


@dataclass(frozen=True)
class TrainConfig:
    """Training hyper-parameters; every field is recorded in the metrics JSON.

    Patches are ``(patch, patch, patch_z)`` voxels (``patch_z < patch`` makes them flat, so that
    their centres can come closer to the held-out band), rotated by up to ``max_rotation``
    degrees in the axial plane and ``max_tilt`` about the two other axes, zoomed by up to
    ``max_scale`` per axis. Intensity augmentation, on a patch with probability
    ``intensity_p``: ``x ** exp(U(-max_gamma, max_gamma))`` times a gain ``exp(U(-max_gain,
    max_gain))`` times a linear bias field ``exp(slope . r)`` (``|slope| <= max_bias`` per axis,
    ``r`` in [-0.5, 0.5) across the patch), plus Gaussian noise of sigma ``U(0, max_noise)``.
    ``threads`` is the torch CPU thread count
    (part of the result: reductions split differently with another count).
    """

    seed: int = 0
    steps: int = 800
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
    """Train a fresh :class:`~models.zoo.tissue_net.TissueUNet` on patches outside ``band``.

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

    from models.zoo.tissue_net import TissueUNet

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
    module = module.to(memory_format=torch.contiguous_format).eval()
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

    from models.spec import load_spec
    from models.transforms.preprocess import preprocess

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
    """The training options (shared by ``python -m models.zoo.train_tissue`` and
    ``tilewise train-tissue``)."""
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
    """``python -m models.zoo.train_tissue [--out DIR] [--seed N] [--steps N] [--threads N]``."""
    parser = argparse.ArgumentParser(
        prog="python -m models.zoo.train_tissue", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return run_from_args(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
