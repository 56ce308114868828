"""A slide's probe reports ``level_used`` as the dry run does, and region reads of a tiled slide
decode each stored tile once (issue 21 follow-ups: DESIGN "third wave", probe and dry run keys;
:mod:`service.slides.tilecache`).

Oracles nobody here wrote: tifffile reading a level whole (the decoded stored tiles, for the cached
region reads: the same decoder, so the difference must be 0); tifffile's own zarr store, whose
``get`` of a chunk key is one decode of that stored tile (counted by wrapping it, the real method
still doing the work); openslide-python's test fixtures (``boxes.tiff``: 4 levels, no plausible mpp;
``boxes_0.dcm``: a DICOM-WSI read through OpenSlide).
"""

from __future__ import annotations

import collections
import io
import json
import threading
from contextlib import closing, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
from _inprocess import InProcessClient
from _slide_fixtures import fixtures
from _slides import write_svs

from models import ModelRepository
from models.planning.params import parse_params
from service.slides import open_slide, open_slide_regions, probe_slide
from service.slides.tilecache import TileCache, read_tiles

pytest.importorskip("tiffslide")

SHAPE = (997, 1301)  # odd sizes: the last stored tiles of each axis are partial
STORED = 256  # the stored tile side; the engine's regions below are 222 x 236, never aligned to it


@pytest.fixture(scope="module")
def svs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("probe-slides")
    return write_svs(root / "s.svs", SHAPE, n_levels=3, mpp=0.25, tissue=(0.2, 0.2, 0.8, 0.8), tile=STORED)


@pytest.fixture(scope="module")
def model():
    return ModelRepository(None, device="cpu").get("gaussian-2d")


def _spec_with_mpp(mpp: float):
    import yaml

    from models.spec import ModelSpec

    raw = yaml.safe_load((Path(__file__).parents[2] / "models" / "builtin" / "gaussian-2d.yaml").read_text())
    return ModelSpec.model_validate({**raw, "mpp": mpp})


# ---------------------------------------------------------------- level_used in the probe
@pytest.mark.parametrize(
    ("query", "level"),
    [({}, 0), ({"mpp": "0.5"}, 1), ({"mpp": "1.0"}, 2), ({"mpp": "0.7"}, 1), ({"level": "2"}, 2),
     ({"level": "1"}, 1), ({"mpp": "model"}, 0)],
)  # fmt: skip
def test_probe_reports_the_level_the_dry_run_uses(svs, model, query, level):
    from service.codecs import probe
    from service.dryrun import dry_run
    from service.pipeline import Limits
    from service.precheck import check_input

    assert probe(svs).info["level_used"] == 0  # no request, no model: level 0 as it is
    params = parse_params(query)
    header = check_input(model.spec, svs, Limits(), params)
    plan = dry_run(model, svs, params, Limits())
    assert header.info["level_used"] == plan["level_used"] == level


def test_probe_level_of_a_model_with_an_mpp_is_the_dry_runs(svs):
    from service.pipeline import Limits
    from service.precheck import check_input
    from service.slides import slide_fields

    spec = _spec_with_mpp(0.5)  # trained at 0.5 um/px: level 1 of this 0.25 um/px slide
    for query, level in (({}, 1), ({"mpp": "1.0"}, 2), ({"level": "0"}, 0)):
        params = parse_params({**query, "mask": "none"})
        header = check_input(spec, svs, Limits(), params)
        fields = slide_fields(svs, header, spec, params, plan=None)
        assert header.info["level_used"] == fields["level_used"] == level, query
    assert check_input(spec, svs, Limits()).info["level_used"] == 1  # no parameters: the spec's mpp


def test_http_and_cli_dry_runs_match_the_probe(svs, tmp_path, empty_models_dir):
    from service.app import create_app
    from service.cli import main
    from service.codecs import probe
    from service.settings import Settings
    from service.slides import set_level_used

    spec = ModelRepository(None, device="cpu").get("gaussian-2d").spec
    (tmp_path / "models").mkdir()
    settings = Settings(_env_file=None, models_dir=tmp_path / "models", tmp_dir=tmp_path, device="cpu",
                        warmup=False)  # fmt: skip
    body = svs.read_bytes()
    with InProcessClient(create_app(settings)) as client:
        for query in ("mpp=0.5", "level=2", "mpp=1.0"):
            dry = client.post(f"/v1/models/gaussian-2d/infer?dry_run=true&{query}", content=body)
            assert dry.status_code == 200, dry.text
            key, value = query.split("=")
            header = set_level_used(probe(svs), spec, parse_params({key: value}))
            assert dry.json()["level_used"] == header.info["level_used"] == {"mpp=0.5": 1}.get(query, 2)
    out = io.StringIO()
    with redirect_stdout(out):
        status = main(["plan", str(svs), "--model", "gaussian-2d", "--device", "cpu", "--mpp", "0.5",
                       "--models", str(empty_models_dir)])  # fmt: skip
    assert status == 0 and json.loads(out.getvalue())["level_used"] == 1


REAL = fixtures()


@pytest.mark.skipif(REAL is None, reason="openslide-python's fixtures not fetched (_slide_fixtures.py fetch)")
def test_real_slides_probe_level_used_as_the_dry_run(model):
    from service.codecs import probe
    from service.dryrun import dry_run
    from service.pipeline import Limits
    from service.precheck import check_input

    pytest.importorskip("openslide")
    boxes = REAL / "boxes.tiff"  # 4 levels, 72 dpi tags (no plausible mpp): only level=N picks a level
    for level in range(4):
        params = parse_params({"level": str(level)})
        plan = dry_run(model, boxes, params, Limits())
        assert (
            check_input(model.spec, boxes, Limits(), params).info["level_used"] == plan["level_used"] == level
        )
    dicom = REAL / "boxes_0.dcm"  # a DICOM-WSI, probed through OpenSlide
    header = probe(dicom)
    assert header.kind == "slide" and header.info["reader"] == "openslide" and header.info["level_used"] == 0
    plan = dry_run(model, dicom, parse_params({}), Limits())
    assert (
        check_input(model.spec, dicom, Limits(), parse_params({})).info["level_used"]
        == plan["level_used"]
        == 0
    )


# ---------------------------------------------------------------- decoded tiles kept
class _Decodes:
    """Counts tifffile's zarr-store chunk reads (one decode of a stored tile each) per store and key."""

    def __init__(self, monkeypatch) -> None:
        import tifffile.zarr as tz

        self.counts: collections.Counter = collections.Counter()
        real = tz.ZarrTiffStore.get

        async def get(store, key, prototype, byte_range=None):
            if not key.rsplit("/", 1)[-1].startswith((".z", "zarr.json")):
                self.counts[(id(store), key)] += 1
            return await real(store, key, prototype, byte_range)

        monkeypatch.setattr(tz.ZarrTiffStore, "get", get)


def _raster_boxes(shape, tile=(206, 220), halo=8):
    """The engine's read boxes of a 2D grid in C order: ``tile`` plus ``halo`` each side, clipped."""
    H, W = shape
    for y in range(0, H, tile[0]):
        for x in range(0, W, tile[1]):
            yield max(y - halo, 0), min(y + tile[0] + halo, H), max(x - halo, 0), min(x + tile[1] + halo, W)


@pytest.mark.parametrize("reader", ["tiffslide", "tifffile"])
def test_cached_regions_equal_tifffile_and_decode_each_tile_once(svs, reader, monkeypatch):
    import tifffile

    info = probe_slide(svs)
    if reader == "tifffile":
        from dataclasses import replace

        info = replace(info, reader="tifffile")
    decodes = _Decodes(monkeypatch)
    for bound in (None, 1536 << 10, 0):  # the default; one that evicts (8 tiles of 192 KiB, a row is 6); none
        decodes.counts.clear()
        with closing(open_slide(svs, info)) as slide:
            if bound is not None:
                slide.tiles = TileCache(bound)
            for level in range(3):
                whole = tifffile.imread(svs, series=0, level=level)  # the oracle: the level decoded whole
                shape = whole.shape[:2]
                worst = 0
                for y0, y1, x0, x1 in _raster_boxes(shape):
                    got = slide.read(level, y0, y1, x0, x1)
                    worst = max(worst, int(np.abs(got.astype(int) - whole[y0:y1, x0:x1].astype(int)).max()))
                assert worst == 0, (bound, level)
            assert slide.tiles.nbytes <= slide.tiles.max_bytes
        per_tile = collections.Counter(decodes.counts.values())
        assert sum(per_tile.values()) == 4 * 6 + 2 * 3 + 1 * 2  # the stored tiles of the 3 levels
        if bound is None:  # raster order: every stored tile decoded once
            assert set(per_tile) == {1}, per_tile
        elif bound:  # tiles evicted before the next row of regions needs them: decoded again
            assert max(per_tile) == 2, per_tile  # the right-hand neighbours' tiles still kept
        else:  # no cache: the tiles under the corners of 4 regions decoded 4 times
            assert max(per_tile) == 4, per_tile


def test_a_run_decodes_each_stored_tile_once(svs, model, monkeypatch, tmp_path):
    import tifffile
    import tiffslide

    from service.pipeline import Limits, run_file

    decodes = _Decodes(monkeypatch)
    params = parse_params({"mask": "none", "tile": "300,300"})  # read boxes 286 x 286 on 256 tiles
    result = run_file(model, svs, tmp_path / "out", params, limits=Limits())
    per_tile = collections.Counter(decodes.counts.values())
    assert set(per_tile) == {1} and sum(per_tile.values()) == 4 * 6, per_tile  # level 0: 4 x 6 tiles
    from scipy import ndimage

    with tiffslide.TiffSlide(svs) as slide:
        level0 = np.asarray(slide.zarr_group["0"][:]).astype(np.float32)
    grey = level0 @ np.array([0.299, 0.587, 0.114], np.float32)
    want = ndimage.gaussian_filter(grey, sigma=2.0, truncate=4.0, mode="constant")
    assert np.abs(tifffile.imread(result.path) - want).max() <= 1e-3


def test_regions_read_from_threads_equal_the_level(svs):
    import tifffile

    info = probe_slide(svs)
    whole = tifffile.imread(svs, series=0, level=0)
    boxes = list(_raster_boxes(SHAPE, tile=(97, 131), halo=5))
    with closing(open_slide_regions(svs, info, _level0(info), mask=False)) as regions:
        regions.slide.tiles = TileCache(2 << 20)  # 10 tiles: threads evict each other's tiles

        bad = _wrong_in_threads(
            boxes, lambda y0, y1, x0, x1: np.moveaxis(regions[:, y0:y1, x0:x1], 0, -1), whole
        )
    assert not bad


def _wrong_in_threads(boxes, read, whole, n=4):
    """The boxes ``(y0, y1, x0, x1)`` that ``read`` gets wrong against ``whole``, read by ``n`` threads."""
    bad: list[tuple] = []

    def work(part):
        for y0, y1, x0, x1 in part:
            if not np.array_equal(read(y0, y1, x0, x1), whole[y0:y1, x0:x1]):
                bad.append((y0, x0))

    threads = [threading.Thread(target=work, args=(boxes[k::n],)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return bad


def _level0(info):
    from service.slides import choose_resolution

    return choose_resolution(info, None, None, 0)


def test_tile_cache_is_least_recently_used_and_bounded_in_bytes():
    cache = TileCache(3 * 1000)
    tiles = {k: np.full(1000, k, np.uint8) for k in range(5)}
    for k in range(3):
        cache.put(k, tiles[k])
    assert cache.get(0) is tiles[0]  # 0 used: 1 is now the least recently used
    cache.put(3, tiles[3])
    assert cache.get(1) is None and cache.get(2) is not None and len(cache) == 3 and cache.nbytes == 3000
    cache.put(4, np.zeros(3001, np.uint8))  # larger than the bound: not kept, nothing dropped
    assert len(cache) == 3 and cache.get(4) is None
    assert not tiles[0].flags.writeable  # kept tiles are read-only: a caller cannot change them
    assert (cache.hits, cache.misses) == (2, 2)
    cache.put(5, tiles[4], done=lambda k: k == 3)  # 3 is done with: dropped before 2, the oldest
    assert cache.get(3) is None and cache.get(2) is not None and len(cache) == 3


def test_read_tiles_of_a_plain_array_matches_slicing():
    zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng(0)
    data = rng.integers(0, 255, (101, 67, 3), dtype=np.uint8)
    array = zarr.create_array(store={}, shape=data.shape, chunks=(16, 10, 3), dtype=np.uint8)
    array[:] = data
    cache = TileCache(1 << 20)
    for y0, y1, x0, x1 in [(0, 101, 0, 67), (3, 4, 5, 6), (15, 17, 9, 11), (90, 101, 60, 67), (5, 5, 0, 3)]:
        assert np.array_equal(read_tiles(array, y0, y1, x0, x1, cache), data[y0:y1, x0:x1])


def test_read_tiles_shared_by_threads_equals_slicing():
    """Four threads on one small cache (no reader lock around it): every region equals the array."""
    zarr = pytest.importorskip("zarr")
    data = np.random.default_rng(1).integers(0, 255, (211, 173, 3), dtype=np.uint8)
    array = zarr.create_array(store={}, shape=data.shape, chunks=(16, 16, 3), dtype=np.uint8)
    array[:] = data
    cache = TileCache(16 * 16 * 3 * 6)  # 6 tiles: the threads evict each other's
    boxes = list(_raster_boxes(data.shape[:2], tile=(23, 29), halo=4))
    bad = _wrong_in_threads(boxes, lambda y0, y1, x0, x1: read_tiles(array, y0, y1, x0, x1, cache), data)
    assert not bad and cache.nbytes <= cache.max_bytes


def test_a_short_region_across_a_wide_level_is_read_directly():
    """A 60-row strip of an 8192-wide level is 1.4 MiB but touches 6 MiB of stored tiles: over
    half the cache's 8 MiB, it is read without keeping them (traced peak under 4 MiB; through the
    cache, 2 x 6 MiB)."""
    import tracemalloc

    zarr = pytest.importorskip("zarr")
    array = zarr.create_array(store={}, shape=(512, 8192, 3), chunks=(256, 256, 3), dtype=np.uint8)
    array[:] = 7
    cache = TileCache(8 << 20)
    tracemalloc.start()
    try:
        got = read_tiles(array, 100, 160, 0, 8192, cache)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.shape == (60, 8192, 3) and int(got.min()) == int(got.max()) == 7
    assert len(cache) == 0 and peak < 4 << 20, (len(cache), peak)


# ---------------------------------------------------------------- the cache in the memory plan
def test_the_memory_plan_counts_the_tile_cache_of_a_streamed_slide(svs, model, tmp_path):
    """The planner's peak holds the slide's tile cache (bounded by the level's bytes); a plain
    tiled TIFF of the same pixels, read without a cache, holds nothing beside its plan."""
    import tifffile

    from service.codecs import probe
    from service.dryrun import dry_run
    from service.pipeline import Limits
    from service.precheck import held_beside
    from service.slides.tilecache import TILE_CACHE_BYTES

    header = probe(svs)
    held = held_beside(model.spec, header, streamed=True)
    assert held["input_bytes"] == min(TILE_CACHE_BYTES, SHAPE[0] * SHAPE[1] * 3) > 0
    plain = tmp_path / "plain.tif"
    pixels = tifffile.imread(svs, level=0)[..., 0]
    tifffile.imwrite(plain, pixels, tile=(STORED, STORED), compression="zlib")
    assert held_beside(model.spec, probe(plain), streamed=True)["input_bytes"] == 0
    params = parse_params({"tile": "256", "mask": "none"})
    slide_peak = dry_run(model, svs, params, Limits())["peak_bytes"]
    assert slide_peak >= held["input_bytes"]
