"""Deep Zoom views of jobs (issue 21 item 6): ``/v1/jobs/{id}/dzi/{input|result}.dzi`` and its
tiles, against an oracle of tifffile's own level reads resized by Pillow.

The slide: scikit-image's immunohistochemistry image (512 x 512 RGB, a real micrograph) tiled out
to 2999 x 2503 pixels (odd sizes: every last column and row of tiles is narrower), written by
tifffile as a tiled pyramidal TIFF (levels 1, 1/2, 1/4 as SubIFDs, zlib: lossless, so tiffslide
and the oracle read the same bytes)."""

from __future__ import annotations

import importlib.util
import math
import os
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tifffile
from _inprocess import InProcessClient
from PIL import Image

from service import dzi
from service.dzi import pyramids

WIDTH, HEIGHT = 2999, 2503
ALICE, BOB, ADMIN = "alice-key-0123456789", "bob-key-0123456789ab", "admin-key-0123456789"
NS = "{http://schemas.microsoft.com/deepzoom/2008}"


def _write_pyramid(path: Path, image: np.ndarray, levels: int) -> list[np.ndarray]:
    pyramid = [image]
    for _ in range(levels - 1):
        pyramid.append(pyramid[-1][::2, ::2])
    with tifffile.TiffWriter(path) as tw:
        photometric = "rgb" if image.ndim == 3 else "minisblack"
        tw.write(pyramid[0], tile=(256, 256), photometric=photometric, compression="zlib", subifds=levels - 1)
        for level in pyramid[1:]:
            tw.write(level, tile=(256, 256), photometric=photometric, compression="zlib", subfiletype=1)
    return pyramid


@pytest.fixture(scope="module")
def slide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from skimage import data

    ihc = data.immunohistochemistry()
    image = np.ascontiguousarray(np.tile(ihc, (5, 6, 1))[:HEIGHT, :WIDTH])
    path = tmp_path_factory.mktemp("slide") / "slide.tif"
    _write_pyramid(path, image, 3)
    return path


def _oracle(path: Path, level: int, col: int, row: int, *, resample: Any, overview: int = 0) -> np.ndarray:
    """Deep Zoom tile ``(level, col, row)`` (tile 256, overlap 1) cut from the TIFF level tifffile
    reads, worked out here from the Deep Zoom rules, resized by Pillow."""
    with tifffile.TiffFile(path) as tif:
        arrays = [np.asarray(lv.asarray()) for lv in tif.series[0].levels]
    if overview:
        arrays.append(arrays[-1][::overview, ::overview])
    h0, w0 = arrays[0].shape[:2]
    top = math.ceil(math.log2(max(w0, h0)))
    d = 2 ** (top - level)
    lw, lh = math.ceil(w0 / d), math.ceil(h0 / d)
    x0, y0 = max(0, col * 256 - 1), max(0, row * 256 - 1)
    x1, y1 = min(lw, (col + 1) * 256 + 1), min(lh, (row + 1) * 256 + 1)
    k = max(j for j, a in enumerate(arrays) if w0 / a.shape[1] <= d and h0 / a.shape[0] <= d)
    a = arrays[k]
    sx, sy = w0 / a.shape[1], h0 / a.shape[0]
    kx0, ky0 = math.floor(x0 * d / sx), math.floor(y0 * d / sy)
    kx1 = max(kx0 + 1, min(a.shape[1], math.ceil(min(w0, x1 * d) / sx)))
    ky1 = max(ky0 + 1, min(a.shape[0], math.ceil(min(h0, y1 * d) / sy)))
    region = a[ky0:ky1, kx0:kx1]
    image = Image.fromarray(region)
    if image.size != (x1 - x0, y1 - y0):
        image = image.resize((x1 - x0, y1 - y0), resample)
    return np.asarray(image)


# Level 12 is level 0 (2999 px: 12 columns, the last 2999 - 11*256 + 1 = 184 px wide); level 11
# reads the file's level 1; levels 10 .. 0 read level 2 (1/4) and shrink it.
TILES = [
    (12, 0, 0),
    (12, 11, 9),
    (12, 5, 9),
    (11, 5, 4),
    (11, 3, 2),
    (10, 2, 2),
    (9, 1, 0),
    (8, 0, 0),
    (3, 0, 0),
]


@pytest.mark.parametrize(("level", "col", "row"), TILES)
def test_input_tiles_equal_the_level_read_by_tifffile_and_resized(
    slide: Path, level: int, col: int, row: int
) -> None:
    pyramid = dzi.open_pyramid(slide)
    try:
        # through tiffslide (the `slides` extra) when installed, else tifffile's zarr store
        reader = "_Slide" if importlib.util.find_spec("tiffslide") else "_TiffLevels"
        assert type(pyramid).__name__ == reader
        assert pyramid.levels == [(WIDTH, HEIGHT), (1500, 1252), (750, 626)]
        box = dzi.DeepZoom(WIDTH, HEIGHT).box(level, col, row)
        got = dzi.render_tile(pyramid, box, role="input")
    finally:
        pyramid.close()
    want = _oracle(slide, level, col, row, resample=Image.Resampling.BOX)
    assert got.shape == want.shape
    assert int(np.abs(got.astype(int) - want.astype(int)).max()) == 0


def test_edge_tiles_have_the_odd_remainder_and_tiles_past_the_edge_are_refused() -> None:
    zoom = dzi.DeepZoom(WIDTH, HEIGHT)
    assert zoom.max_level == 12
    last = zoom.box(12, 11, 9)
    assert (last.x1 - last.x0, last.y1 - last.y0) == (WIDTH - 11 * 256 + 1, HEIGHT - 9 * 256 + 1)
    assert zoom.level_size(11) == (1500, 1252)
    assert zoom.level_size(0) == (1, 1)
    for bad in ((12, 12, 0), (12, 0, 10), (13, 0, 0), (0, 1, 0)):
        with pytest.raises(LookupError):
            zoom.box(*bad)
    from service.errors import BadParameterError

    for bad in (("x", 0, 0), (1, "-1", 0), (1, 0, "1e3"), (1, "", 0)):
        with pytest.raises(BadParameterError):
            zoom.box(*bad)


def test_a_flat_tiff_seen_from_afar_reads_an_overview_never_the_whole_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skimage import data

    monkeypatch.setattr(pyramids, "MAX_READ_PIXELS", 300 * 300)
    monkeypatch.setattr(pyramids, "OVERVIEW_EDGE", 128)
    grey = np.tile(data.camera(), (2, 2))[:1001, :733]  # 733 x 1001, one level, strips
    path = tmp_path / "flat.tif"
    tifffile.imwrite(path, grey)
    pyramid = dzi.open_pyramid(path)
    try:
        f = math.ceil(1001 / 128)
        assert pyramid.levels == [(733, 1001), (math.ceil(733 / f), math.ceil(1001 / f))]
        assert path.with_name("flat.tif.dzi-overview.npy").is_file()
        for level, col, row in ((10, 2, 3), (7, 0, 0), (5, 0, 0)):
            got = dzi.render_tile(pyramid, dzi.DeepZoom(733, 1001).box(level, col, row), role="input")
            oracle = _oracle(path, level, col, row, resample=Image.Resampling.BOX, overview=f)
            want = np.repeat(oracle[..., None], 3, axis=2)
            assert int(np.abs(got.astype(int) - want.astype(int)).max()) == 0, (level, col, row)
    finally:
        pyramid.close()


def test_label_tiles_are_the_legend_colours_label_zero_transparent(tmp_path: Path) -> None:
    from service.codecs.image_encode import LABEL_PALETTE

    rng = np.random.default_rng(3)
    labels = np.repeat(np.repeat(rng.integers(0, 5, (40, 30), dtype=np.uint8), 17, 0), 19, 1)  # 680 x 570
    path = tmp_path / "labels.tif"
    _write_pyramid(path, labels, 2)
    pyramid = dzi.open_pyramid(path)
    try:
        for level, col, row in ((10, 2, 1), (9, 0, 0), (4, 0, 0)):
            got = dzi.render_tile(pyramid, dzi.DeepZoom(570, 680).box(level, col, row), role="result")
            ids = _oracle(path, level, col, row, resample=Image.Resampling.NEAREST)
            palette = np.array(LABEL_PALETTE, np.uint8)
            assert np.array_equal(got[..., :3], palette[ids])
            assert np.array_equal(got[..., 3], np.where(ids > 0, 255, 0))
    finally:
        pyramid.close()


def test_the_descriptor_has_the_deep_zoom_fields() -> None:
    root = ET.fromstring(dzi.dzi_xml(WIDTH, HEIGHT, "jpeg"))
    assert root.tag == f"{NS}Image"
    assert root.attrib == {"TileSize": "256", "Overlap": "1", "Format": "jpeg"}
    size = root.find(f"{NS}Size")
    assert size is not None and size.attrib == {"Width": str(WIDTH), "Height": str(HEIGHT)}


# -- through the jobs API ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import hashlib

    from models import ModelRepository
    from service.app import create_app
    from service.settings import Settings

    root = tmp_path_factory.mktemp("dzi-server")
    keys = root / "keys.txt"
    keys.write_text(f"alice:{ALICE}\nbob:{BOB}\nadmin:sha256:{hashlib.sha256(ADMIN.encode()).hexdigest()}\n")
    settings = Settings(
        _env_file=None, tmp_dir=root / "tmp", jobs_dir=root / "jobs", api_keys=keys, warmup=False
    )
    app = create_app(settings, repository=ModelRepository(None, device="cpu"))
    with InProcessClient(app) as c:
        c.jobs_dir = root / "jobs" / "jobs"
        yield c


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _run(client: Any, body: bytes, model: str, key: str = ALICE) -> str:
    answer = client.post("/v1/jobs", params={"model": model}, content=body, headers=_auth(key))
    assert answer.status_code == 202, answer.text
    job_id: str = answer.json()["id"]
    for _ in range(600):
        status = client.get(f"/v1/jobs/{job_id}", headers=_auth(key)).json()
        if status["state"] in ("done", "failed", "cancelled"):
            assert status["state"] == "done", status
            return job_id
        time.sleep(0.2)
    raise AssertionError("the job did not end")


@pytest.fixture(scope="module")
def slide_job(client: Any, slide: Path) -> str:
    return _run(client, slide.read_bytes(), "gaussian-2d")


def test_the_job_routes_serve_the_input_and_result_views(client: Any, slide: Path, slide_job: str) -> None:
    base = f"/v1/jobs/{slide_job}/dzi"
    assert (client.jobs_dir / slide_job / "input").is_file()  # a done 2D job keeps its input
    for role, fmt in (("input", "jpeg"), ("result", "png")):
        answer = client.get(f"{base}/{role}.dzi", headers=_auth(ALICE))
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"].startswith("application/xml")
        root = ET.fromstring(answer.text)
        assert root.attrib["Format"] == fmt
        assert root.find(f"{NS}Size").attrib == {"Width": str(WIDTH), "Height": str(HEIGHT)}  # type: ignore[union-attr]
    tile = client.get(f"{base}/input_files/12/11_9.jpeg", headers=_auth(ALICE))
    assert tile.status_code == 200 and tile.headers["content-type"] == "image/jpeg"
    import io

    with Image.open(io.BytesIO(tile.content)) as image:
        got = np.asarray(image.convert("RGB")).astype(int)
    want = _oracle(slide, 12, 11, 9, resample=Image.Resampling.BOX).astype(int)
    assert got.shape == want.shape == (HEIGHT - 9 * 256 + 1, WIDTH - 11 * 256 + 1, 3)
    assert np.abs(got - want).mean() < 4  # JPEG quality 90 of the same pixels
    tile = client.get(f"{base}/result_files/11/5_4.png", headers=_auth(ALICE))
    assert tile.status_code == 200 and tile.headers["content-type"] == "image/png"
    with Image.open(io.BytesIO(tile.content)) as image:
        assert image.mode == "RGBA" and image.size == (1500 - 5 * 256 + 1, 1252 - 4 * 256 + 1)


def test_bad_tiles_are_400_or_404_json(client: Any, slide_job: str) -> None:
    base = f"/v1/jobs/{slide_job}/dzi"
    cases = {
        f"{base}/input_files/12/12_0.jpeg": 404,  # past the last column
        f"{base}/input_files/13/0_0.jpeg": 404,  # past the last level
        f"{base}/input_files/x/0_0.jpeg": 400,
        f"{base}/input_files/3/0-0.jpeg": 400,
        f"{base}/input_files/3/0_0.png": 400,  # the input is JPEG
        f"{base}/result_files/3/a_0.png": 400,
        f"{base}/result_files/3/0_0.png?channel=1": 404,  # one channel
        f"{base}/output_files/3/0_0.png": 404,
        f"{base}/output.dzi": 404,
    }
    for url, status in cases.items():
        answer = client.get(url, headers=_auth(ALICE))
        assert answer.status_code == status, (url, answer.text)
        assert answer.headers["content-type"].startswith("application/"), url
        assert answer.json()["error"], url


def test_only_the_owner_and_the_admin_see_a_jobs_tiles(client: Any, slide_job: str) -> None:
    for url in (f"/v1/jobs/{slide_job}/dzi/input.dzi", f"/v1/jobs/{slide_job}/dzi/result_files/3/0_0.png"):
        assert client.get(url).status_code == 401
        assert client.get(url, headers=_auth("wrong-key-0123456789")).status_code == 401
        other = client.get(url, headers=_auth(BOB))
        assert other.status_code == 404 and other.json()["error"] == "unknown_job"
        assert client.get(url, headers=_auth(ADMIN)).status_code == 200
        assert client.get(url, headers=_auth(ALICE)).status_code == 200


def test_a_volume_job_keeps_no_input_and_has_no_view(client: Any) -> None:
    import nibabel as nib

    volume = nib.Nifti1Image(np.random.default_rng(0).random((12, 11, 7), dtype=np.float32), np.eye(4))
    job_id = _run(client, volume.to_bytes(), "gaussian-3d")
    assert not (client.jobs_dir / job_id / "input").exists()
    assert client.get(f"/v1/jobs/{job_id}/dzi/input.dzi", headers=_auth(ALICE)).status_code == 404
    assert client.get(f"/v1/jobs/{job_id}/dzi/result.dzi", headers=_auth(ALICE)).status_code == 415


def _count_reads(pyramid: Any) -> list[int]:
    """The pixels of every ``pyramid.read`` from now on (the real read, counted)."""
    areas: list[int] = []
    read = pyramid.read

    def counted(level: int, x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
        areas.append((x1 - x0) * (y1 - y0))
        return read(level, x0, y0, x1, y1)

    pyramid.read = counted
    return areas


def test_a_big_gap_between_levels_never_reads_more_than_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review item 2: levels 2048^2 and 16^2 (a gap of 128): a tile at downsample 8 once read all
    of level 0; it now reads the coarser level, every request within MAX_READ_PIXELS."""
    from skimage import data

    monkeypatch.setattr(pyramids, "MAX_READ_PIXELS", 512 * 512)
    image = np.ascontiguousarray(np.tile(data.camera(), (4, 4)))  # 2048 x 2048 grey
    path = tmp_path / "gap.tif"
    with tifffile.TiffWriter(path, ome=True) as tw:  # OME: tifffile keeps a SubIFD level of any size
        tw.write(image, tile=(256, 256), photometric="minisblack", compression="zlib", subifds=1)
        tw.write(image[::128, ::128], tile=(16, 16), photometric="minisblack", subfiletype=1)
    pyramid = dzi.open_pyramid(path)
    try:
        assert pyramid.levels == [(2048, 2048), (16, 16)]
        areas = _count_reads(pyramid)
        zoom = dzi.DeepZoom(2048, 2048)
        for level in range(zoom.max_level + 1):
            box = zoom.box(level, 0, 0)
            tile = dzi.render_tile(pyramid, box, role="input")
            assert tile.shape == (box.y1 - box.y0, box.x1 - box.x0, 3)
        assert max(areas) <= 512 * 512
        assert len(areas) == zoom.max_level + 1
    finally:
        pyramid.close()


def test_an_overview_is_built_in_bounded_memory_and_locks_only_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review item 4: the overview's bands are copies (the coarsest level is not kept whole: peak
    Python memory under 60 % of it), and its build lock is per file (another file opens meanwhile)."""
    import threading
    import tracemalloc

    from skimage import data

    monkeypatch.setattr(pyramids, "MAX_READ_PIXELS", 1000 * 1000)
    monkeypatch.setattr(pyramids, "OVERVIEW_EDGE", 128)
    grey = np.ascontiguousarray(np.tile(data.camera(), (8, 8))[:4001, :3999])  # 16 Mpx, one level
    big, other = tmp_path / "big.tif", tmp_path / "other.tif"
    tifffile.imwrite(big, grey, tile=(256, 256))  # tiled: a band decodes only its own tiles
    tifffile.imwrite(other, grey[:1500, :1400])
    del grey
    tracemalloc.start()
    try:
        dzi.open_pyramid(big).close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 0.6 * 4001 * 3999, peak
    opened: list[Any] = []
    with pyramids._overview_lock(tmp_path / "big.tif.dzi-overview.npy"):
        worker = threading.Thread(target=lambda: opened.append(dzi.open_pyramid(other)), daemon=True)
        worker.start()
        worker.join(60)
    assert opened and opened[0].levels[-1] == (117, 125)
    opened[0].close()


def test_tile_requests_reuse_the_open_image_until_it_changes(tmp_path: Path) -> None:
    """Review item 16: a PNG is decoded once for all its tiles (the same open image serves every
    request), opened anew once rewritten; a deleted file's entry is closed."""
    from skimage import data

    path = tmp_path / "camera.png"
    Image.fromarray(data.camera()).save(path)
    zoom = dzi.DeepZoom(512, 512)
    with dzi.opened(path) as first:
        tile = dzi.render_tile(first, zoom.box(9, 1, 1), role="input")
    with dzi.opened(path) as second:
        again = dzi.render_tile(second, zoom.box(9, 1, 1), role="input")
    assert second is first
    assert np.array_equal(tile, again)
    assert np.array_equal(tile[..., 0], data.camera()[255:512, 255:512])
    Image.fromarray(data.camera()[::-1]).save(path)
    os.utime(path, ns=(1, 1))
    with dzi.opened(path) as third:
        assert third is not first
        assert np.array_equal(dzi.render_tile(third, zoom.box(9, 0, 0), role="input")[..., 0],
                              data.camera()[::-1][:257, :257])  # fmt: skip
    other = tmp_path / "other.png"
    Image.fromarray(data.camera()[:100]).save(other)
    path.unlink()
    with dzi.opened(other) as fourth:
        assert fourth.levels == [(512, 100)]
    assert all(Path(key[0]).is_file() for key in pyramids._OPEN)
