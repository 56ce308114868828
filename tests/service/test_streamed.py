"""Streamed requests (issue 20 items 2-4): region reads, per-region preprocessing, streamed writes.

Oracles: the whole-image path of the same request (:func:`service.pipeline.run_volume` on the
decoded file, then :func:`service.codecs.encode`: what every request did before), nibabel's own
writer (the streamed ``.nii`` is byte-identical to ``nib.save``'s), tifffile reading the streamed
TIFF back, ``scipy.ndimage.gaussian_filter`` (the gaussian models' oracle) and
:func:`models.transforms.preprocess.preprocess` on the whole image. Sizes are odd (primes) and several tiles.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
import scipy.ndimage as ndi
import tifffile
import yaml
from PIL import Image

from models import ModelRepository
from models.planning.params import parse_params
from models.transforms.preprocess import preprocess
from models.transforms.streamed import RegionPreprocessed
from service.codecs import decode, encode
from service.dryrun import dry_run
from service.errors import BadParameterError, InsufficientStorageError, PayloadTooLargeError
from service.http_errors import classify
from service.pipeline import Limits, plan_format, run_file, run_volume
from service.precheck import precheck
from service.stages import check_disk
from service.writers import output_dtype, to_output_dtype

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> ModelRepository:
    """Built-ins plus ``zgauss-3d``: gaussian-3d after a z-score over non-zero voxels, then
    unit_range (statistics the streamed path computes in a pass)."""
    folder = tmp_path_factory.mktemp("models")
    spec = {"name": "zgauss-3d", "backend": "analytic", "architecture": "gaussian", "spatial_dims": 3,
            "in_channels": 1, "out_channels": 1, "params": {"sigma": 1.0, "truncate": 4.0},
            "receptive_field": 4, "preprocess": [{"type": "zscore", "nonzero": True}, "unit_range"],
            "defaults": {"tile": 16, "halo": 4}}  # fmt: skip
    (folder / "zgauss-3d.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    return ModelRepository(folder, device="cpu")


def _whole(model: Any, source: Path, stem: Path, params: Any) -> Path:
    """The whole-image path of one request: decode, run, encode."""
    volume = decode(source)
    run = run_volume(model, volume, params)
    fmt = plan_format(volume, model.spec, params, str(params.output or model.spec.defaults.output))
    path = stem.with_name(
        stem.name + {"nii": ".nii", "nii.gz": ".nii.gz", "tiff": ".tiff", "npy": ".npy"}[fmt]
    )
    result = (
        run.result
        if run.plan.output == "labels"
        else to_output_dtype(run.result, output_dtype(params, False))
    )
    from service.provenance import provenance_of

    provenance = provenance_of(model.spec, run.plan.header(), str(run.plan.output))
    encode(volume, result, fmt, path, provenance=provenance)
    return path


def _ct(path: Path, shape: tuple[int, ...], *, slope: float | None = None) -> np.ndarray:
    data = np.random.default_rng(1).integers(-1000, 1000, shape).astype(np.int16)
    data[:3] = 0
    image = nib.Nifti1Image(data, np.diag([0.7, 0.9, 2.5, 1.0]))
    if slope is not None:
        image.header.set_slope_inter(slope, -3.0)
    nib.save(image, path)
    return data


@pytest.mark.parametrize("suffix", [".nii", ".nii.gz"])
@pytest.mark.parametrize("fmt", ["nii", "nii.gz", "npy"])
def test_streamed_nifti_equals_the_whole_path_and_scipy(
    repo: Any, tmp_path: Path, suffix: str, fmt: str
) -> None:
    source = tmp_path / f"ct{suffix}"
    data = _ct(source, (37, 41, 29))
    model = repo.get("gaussian-3d")
    params = parse_params({"format": fmt, "tile": "32"})
    streamed = run_file(model, source, tmp_path / "streamed", params)
    assert dry_run(model, source, params, Limits())["streamed"] is True
    whole = _whole(model, source, tmp_path / "whole", params)
    assert streamed.plan.n_tiles > 1 and streamed.output_shape == (1, 37, 41, 29)
    if fmt in ("nii", "nii.gz"):
        assert streamed.path.read_bytes() == whole.read_bytes()  # header and voxels (and gzip stream)
    got = np.load(streamed.path)[0] if fmt == "npy" else np.asarray(nib.load(streamed.path).dataobj)
    want = np.load(whole)[0] if fmt == "npy" else np.asarray(nib.load(whole).dataobj)
    assert np.array_equal(got, want)
    oracle = ndi.gaussian_filter(data.astype(np.float64), 2.0, truncate=4.0, mode="constant")
    assert float(np.abs(got - oracle).max()) <= 1e-6 * float(np.abs(oracle).max())
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporaries


def test_scaled_nifti_and_labels_stream_like_the_whole_path(repo: Any, tmp_path: Path) -> None:
    source = tmp_path / "scaled.nii"
    _ct(source, (23, 19, 31), slope=0.5)
    model = repo.get("gaussian-3d")
    for query in ({"format": "nii"}, {"format": "nii", "output": "labels", "tile": "20"}):
        params = parse_params(query)
        streamed = run_file(model, source, tmp_path / "s", params)
        whole = _whole(model, source, tmp_path / "w", params)
        assert streamed.path.read_bytes() == whole.read_bytes(), query


def test_zscore_statistics_pass_equals_whole_image_preprocessing(repo: Any, tmp_path: Path) -> None:
    source = tmp_path / "mr.nii.gz"
    data = np.random.default_rng(2).gamma(2.0, 100.0, (31, 37, 23)).astype(np.float32)
    data[:5] = 0  # non-zero z-score: the zeros are kept
    nib.save(nib.Nifti1Image(data, np.eye(4)), source)
    model = repo.get("zgauss-3d")
    from service.regions import open_regions

    regions = open_regions(source, __import__("service.codecs", fromlist=["probe"]).probe(source), tmp_path)
    lazy = RegionPreprocessed(regions, model.spec)
    whole = preprocess(data[None], model.spec)
    assert float(np.abs(lazy[:, 3:20, :, 5:9] - whole[:, 3:20, :, 5:9]).max()) < 1e-6
    params = parse_params({"format": "nii"})
    streamed = run_file(model, source, tmp_path / "s", params)
    reference = _whole(model, source, tmp_path / "w", params)
    got, want = (np.asarray(nib.load(p).dataobj) for p in (streamed.path, reference))
    assert streamed.plan.n_tiles > 1 and float(np.abs(got - want).max()) < 1e-5


@pytest.mark.parametrize("layout", ["tiled", "striped"])
def test_streamed_tiff_is_tiled_compressed_and_equals_the_whole_path(
    repo: Any, tmp_path: Path, layout: str
) -> None:
    source = tmp_path / "page.tif"
    page = np.random.default_rng(3).integers(0, 256, (613, 577)).astype(np.uint8)
    kwargs = {"tile": (128, 128)} if layout == "tiled" else {"rowsperstrip": 17}
    tifffile.imwrite(source, page, photometric="minisblack", compression="zlib", **kwargs)
    model = repo.get("gaussian-2d")
    params = parse_params({})
    streamed = run_file(model, source, tmp_path / "s", params, limits=Limits(max_image_pixels=10_000))
    whole = _whole(model, source, tmp_path / "w", params)
    with tifffile.TiffFile(streamed.path) as tif:
        assert tif.pages.first.is_tiled and tif.pages.first.compression == tifffile.COMPRESSION.ADOBE_DEFLATE
        got = tif.asarray()
    assert streamed.format == "tiff" and got.shape == (613, 577) and got.dtype == np.float32
    assert np.array_equal(got, tifffile.imread(whole))
    assert streamed.path.read_bytes() == whole.read_bytes()  # encode_tiff writes tiled zlib too
    oracle = ndi.gaussian_filter(page.astype(np.float64), 2.0, truncate=4.0, mode="constant")
    assert float(np.abs(got - oracle).max()) < 1e-4  # values up to 255: float32 rounding


def test_png_keeps_the_bomb_limit_and_a_tiff_over_it_is_streamed(repo: Any, tmp_path: Path) -> None:
    model = repo.get("gaussian-2d")
    png, tif = tmp_path / "big.png", tmp_path / "big.tif"
    page = np.full((120, 110), 200, np.uint8)
    Image.fromarray(page).save(png)
    tifffile.imwrite(tif, page, tile=(64, 64))
    limits = Limits(max_image_pixels=10_000, max_voxels=10_000, max_bytes=10_000)
    with pytest.raises(PayloadTooLargeError, match="max_image_pixels"):
        precheck(model, png, parse_params({}), limits)
    with pytest.raises(PayloadTooLargeError):
        run_file(model, png, tmp_path / "o", parse_params({}), limits=limits)
    precheck(model, tif, parse_params({}), limits)  # read by region: memory and disk decide
    assert run_file(model, tif, tmp_path / "o", parse_params({}), limits=limits).output_shape == (1, 120, 110)


def test_a_full_disk_is_refused_with_507_and_a_sentence(tmp_path: Path) -> None:
    with pytest.raises(InsufficientStorageError, match=r"need \d+ MiB of disk; \d+ MiB are free") as info:
        check_disk(tmp_path, 1 << 62)
    assert classify(info.value).status == 507 and classify(info.value).code == "insufficient_storage"


def test_what_cannot_stream_says_why(repo: Any, tmp_path: Path) -> None:
    source = tmp_path / "ct.nii"
    _ct(source, (20, 18, 16))
    from service.codecs import probe
    from service.stages import why_not_streamed

    header = probe(source)
    model = repo.get("gaussian-3d")
    assert why_not_streamed(model, header, parse_params({}), "nii.gz", source) is None
    assert "test-time" in str(why_not_streamed(model, header, parse_params({"tta": "mirror"}), "nii", source))
    assert "TIFF" in str(why_not_streamed(model, header, parse_params({}), "tiff", source))
    png = tmp_path / "p.png"
    Image.fromarray(np.zeros((20, 20), np.uint8)).save(png)
    assert "PNG" in str(why_not_streamed(repo.get("gaussian-2d"), probe(png), parse_params({}), "tiff", png))


def test_paged_memmap_keeps_resident_memory_bounded(tmp_path: Path) -> None:
    """256 MiB written through a PagedMemmap (strided, as a NIfTI output is) raise the peak
    resident memory far less than a plain memmap does (measured in a fresh process)."""
    script = textwrap.dedent(
        f"""
        import numpy as np, sys
        from models.measure.rss import peak_rss_bytes, reset_peak_rss, rss_bytes
        from service.paged import open_paged
        kind = sys.argv[1]
        shape = (256, 256, 1024)
        path = {str(tmp_path)!r} + "/" + kind
        if kind == "paged":
            out = open_paged(path, np.float32, shape, mode="w+", order="F")
        else:
            out = np.memmap(path, np.float32, "w+", shape=shape, order="F")
        base = rss_bytes(); reset_peak_rss()
        tile = np.ones((64, 256, 64), np.float32)
        for x in range(0, 256, 64):
            for z in range(0, 1024, 64):
                out[x:x + 64, :, z:z + 64] = tile
        out.flush()
        print((peak_rss_bytes() - base) / 2**20)
        """
    )
    rise = {}
    for kind in ("paged", "plain"):
        proc = subprocess.run([sys.executable, "-c", script, kind], capture_output=True, text=True, cwd=ROOT,
                              check=True)  # fmt: skip
        rise[kind] = float(proc.stdout.split()[-1])
    assert rise["plain"] > 200 and rise["paged"] < 140, rise


@pytest.mark.parametrize("dtype", ["float16", "uint8"])
def test_output_dtype_is_the_same_streamed_and_whole(repo: Any, tmp_path: Path, dtype: str) -> None:
    source = tmp_path / "unit.nii"
    data = np.random.default_rng(4).random((29, 23, 19), dtype=np.float32)
    nib.save(nib.Nifti1Image(data, np.eye(4)), source)
    model = repo.get("gaussian-3d")
    if dtype == "float16":  # NIfTI has no half-precision type: refused by name
        with pytest.raises(BadParameterError, match="output_dtype=float16 cannot be stored in NIfTI"):
            run_file(model, source, tmp_path / "s", parse_params({"format": "nii", "output_dtype": dtype}))
        return
    params = parse_params({"format": "nii", "output_dtype": dtype, "tile": "20"})
    streamed = run_file(model, source, tmp_path / "s", params)
    whole = _whole(model, source, tmp_path / "w", params)
    got = np.asarray(nib.load(streamed.path).dataobj)
    assert got.dtype == np.dtype(dtype) and streamed.output_dtype == dtype
    assert np.array_equal(got, np.asarray(nib.load(whole).dataobj))
    oracle = ndi.gaussian_filter(data.astype(np.float64), 2.0, truncate=4.0, mode="constant")
    scale = 255.0 if dtype == "uint8" else 1.0
    assert float(np.abs(got / scale - oracle).max()) <= (0.5 / 255 + 1e-6 if dtype == "uint8" else 1e-3)


def test_http_streamed_request_runs_in_three_stages(repo: Any, tmp_path: Path, make_settings: Any) -> None:
    """The sync route prepares and finishes off the device thread; the file is run_file's."""
    from fastapi.testclient import TestClient

    from service.app import create_app

    source = tmp_path / "ct.nii.gz"
    _ct(source, (41, 37, 23))
    params = parse_params({"tile": "32"})
    reference = run_file(repo.get("gaussian-3d"), source, tmp_path / "ref", params)
    settings = make_settings(tmp_dir=tmp_path, device="cpu", warmup=False)
    with TestClient(create_app(settings)) as client:
        answer = client.post("/v1/models/gaussian-3d/infer?tile=32", content=source.read_bytes())
        text = client.get("/metrics").text
    assert answer.status_code == 200, answer.text
    assert answer.content == reference.path.read_bytes()
    assert answer.headers["x-tilewise-plan"] == reference.plan.header()
    for stage in ("prepare", "queue", "execute", "finish"):
        assert f'tilewise_stage_seconds_count{{stage="{stage}"}} 1.0' in text, stage


def test_a_big_endian_nifti_streams_like_the_whole_path(repo: Any, tmp_path: Path) -> None:
    source = tmp_path / "be.nii"
    data = np.random.default_rng(5).random((21, 19, 17)).astype(">f4")
    header = nib.Nifti1Header().as_byteswapped(">")
    nib.save(nib.Nifti1Image(data, np.eye(4), header), source)
    model = repo.get("gaussian-3d")
    params = parse_params({"format": "nii", "tile": "20"})
    streamed = run_file(model, source, tmp_path / "s", params)
    assert streamed.path.read_bytes() == _whole(model, source, tmp_path / "w", params).read_bytes()
    assert streamed.output_dtype == "float32"
