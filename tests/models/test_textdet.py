"""text-det-2d: setup from the wheel, and tiled inference with halo="auto" against the whole image.

Acceptance (issue 3): with ``halo="auto"`` and tolerance 1e-3, the tiled probability map of real
document images is within 1e-3 (max abs) of the whole-image run. The network pools globally
(squeeze-excitation), so the tiled run reads whole-image pool means computed tile by tile first
(models.transforms.global_pool); the halo then only has to cover the local receptive field.
"""

from __future__ import annotations

import logging
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from models import ChecksumMismatchError, InferenceParams, ModelRepository, WeightsError
from models.transforms.preprocess import preprocess
from models.weights import sha256_file
from models.zoo.textdet import TEXT_DET_FILE, TEXT_DET_SHA256, WHEEL_MEMBER, setup_text_det

logger = logging.getLogger(__name__)

#: Tiles per image: few of them, since each pass costs ~1.5-2 s per megapixel on two busy CPU
#: cores and the pool-mean passes use a halo of the full radius (435). The page (1024x2048) gets
#: two tiles side by side (a seam across columns), the radiograph (1952x1824) two stacked (a seam
#: across rows).
TILES = {"page": (1024, 1536), "radiograph": (1472, 1824)}


def test_setup_extracts_verified_file_and_spec(text_det_dir: Path) -> None:
    assert sha256_file(text_det_dir / TEXT_DET_FILE) == TEXT_DET_SHA256
    assert sorted(p.name for p in text_det_dir.iterdir()) == [TEXT_DET_FILE, "text-det-2d.yaml"]
    spec = ModelRepository(text_det_dir).spec("text-det-2d")
    assert spec.backend == "onnx" and spec.alignment == 32 and spec.global_pooling
    assert spec.file == (text_det_dir / TEXT_DET_FILE).resolve()


def test_onnx_file_alone_registers_text_det(text_det_dir: Path, tmp_path: Path) -> None:
    (tmp_path / TEXT_DET_FILE).symlink_to(text_det_dir / TEXT_DET_FILE)
    assert "text-det-2d" in ModelRepository(tmp_path).names()


def test_setup_rejects_bad_wheels(tmp_path: Path) -> None:
    not_zip = tmp_path / "a.whl"
    not_zip.write_bytes(b"not a zip")
    with pytest.raises(WeightsError, match="cannot extract"):
        setup_text_det(tmp_path / "m1", wheel=not_zip)
    empty = tmp_path / "b.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("other.txt", "x")
    with pytest.raises(WeightsError, match=WHEEL_MEMBER):
        setup_text_det(tmp_path / "m2", wheel=empty)
    tampered = tmp_path / "c.whl"
    with zipfile.ZipFile(tampered, "w") as zf:
        zf.writestr(WHEEL_MEMBER, b"tampered")
    with pytest.raises(ChecksumMismatchError, match=TEXT_DET_SHA256):
        setup_text_det(tmp_path / "m3", wheel=tampered)
    assert not (tmp_path / "m3" / TEXT_DET_FILE).exists()


def page_image() -> np.ndarray:
    """scikit-image's page (191x384) upscaled bilinearly to 1024x2048, uint8 ``(1, H, W)``."""
    from skimage import data, transform

    page = transform.resize(data.page(), (1024, 2048), order=1, anti_aliasing=False)  # type: ignore[no-untyped-call]
    return np.asarray((page * 255).round().astype(np.uint8)[None])


def radiograph_image(radiograph: np.ndarray) -> np.ndarray:
    """RG1_UNCR whole (1955x1841) trimmed to 1952x1824 (multiples of 32; MONOCHROME1 raw values),
    1-99 percentile window, uint8."""
    crop = radiograph[:1952, :1824]
    lo, hi = np.percentile(crop, [1, 99])
    return np.asarray((np.clip((crop - lo) / (hi - lo), 0, 1) * 255).round().astype(np.uint8)[None])


@pytest.mark.parametrize("which", ["page", "radiograph"])
def test_tiled_auto_halo_matches_whole_image(text_det, radiograph: np.ndarray, which: str) -> None:
    image = page_image() if which == "page" else radiograph_image(radiograph)
    tile = TILES[which]
    x = preprocess(image, text_det.spec)
    start = time.perf_counter()
    with torch.inference_mode():
        whole = text_det.predictor(torch.from_numpy(x)[None])[0].numpy()
    whole_s = time.perf_counter() - start
    start = time.perf_counter()
    params = InferenceParams(tile=tile, halo="auto", halo_tolerance=1e-3)
    tiled = text_det.run(image, params)
    tiled_s = time.perf_counter() - start
    halo = text_det.plan(x.shape[1:], params, sample=x).halo  # cached for this image: no new calibration
    err = float(np.abs(tiled - whole).max())
    logger.info(
        "text-det-2d %s %s tile %s: halo %s, max abs diff %.3g, tiled %.1f s vs whole %.1f s (max p %.3f)",
        which,
        image.shape[1:],
        tile,
        halo,
        err,
        tiled_s,
        whole_s,
        float(whole.max()),
    )
    assert tiled.shape == (1, *image.shape[1:]) and image.shape[1] % 32 == 0 == image.shape[2] % 32
    assert 0 < halo[0] <= text_det.receptive_field()[0]
    assert err <= 1e-3


def test_global_pools_are_found(text_det) -> None:
    """The 10 squeeze-excitation pools form 4 dependent stages.

    Stage 0: the backbone's first pool and 3 neck pools whose inputs precede it; then one backbone
    pool each; then the 4 pools after the neck's top-down path.
    """
    predictor = text_det.predictor
    assert len(predictor.pool_names) == 10
    assert [len(stage[1]) for stage in predictor._stage_sessions] == [4, 1, 1, 4]


def test_setup_downloads_the_wheel_without_dependencies(
    tmp_path: Path, wheel_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --wheel, setup runs `pip download --no-deps rapidocr-onnxruntime==1.4.4` (faked here)."""
    import shutil
    import subprocess

    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        shutil.copy(wheel_path, Path(cmd[cmd.index("--dest") + 1]) / wheel_path.name)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    setup_text_det(tmp_path)
    assert len(calls) == 1 and calls[0][1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in calls[0] and calls[0][-1] == "rapidocr-onnxruntime==1.4.4"
    assert sha256_file(tmp_path / TEXT_DET_FILE) == TEXT_DET_SHA256


def test_tiled_pool_means_with_radius_halo_are_exact(text_det) -> None:
    """Images larger than models.execution.execute.CONTEXT_WHOLE_FACTOR tiles get their pool means
    tile by tile with the receptive-field radius as halo: the means equal the whole-image ones."""
    image = page_image()[:, :256, :1600]
    x = preprocess(image, text_det.spec)
    predictor = text_det.predictor
    radius = text_det.receptive_field()
    whole = {k: v.copy() for k, v in predictor.prepare_context(x, tile=None, halo=None).items()}
    try:
        tiled = predictor.prepare_context(x, tile=(256, 1024), halo=(0, min(radius[1], 511)))
    finally:
        predictor.clear_context()
    # relative to each pool's scale (|mean| up to ~50): float32 rounding differs between tile
    # shapes (~1e-5); a halo that truncates is far off (halo 188 on the radiograph: ~2e-2)
    worst = max(float(np.abs(whole[k] - tiled[k]).max() / np.abs(whole[k]).max()) for k in whole)
    logger.info(
        "text-det-2d pool means, 256x1600 in tiles of 256x1024, halo %d: max relative diff %.3g",
        radius[1],
        worst,
    )
    assert worst <= 1e-4


@pytest.mark.parametrize(
    "tile", [pytest.param(None, id="whole-image-means"), pytest.param((64, 64), id="stage-passes")]
)
def test_pool_context_translates_onnxruntime_errors(text_det, tile) -> None:
    """Every onnxruntime call of the global-pooling context goes through the backend's error
    boundary: a wrong input is an InferenceError naming the model, never onnxruntime's own class."""
    from models import InferenceError

    grey = np.zeros((1, 128, 128), dtype=np.float32)  # the network takes 3 channels
    with pytest.raises(InferenceError, match="text-det-2d.*onnxruntime failed to compute") as info:
        text_det.context.prepare_context(grey, tile=tile, halo=None if tile is None else (8, 8))
    assert type(info.value.__cause__).__module__.startswith("onnxruntime")
    text_det.context.clear_context()
