"""Slide outputs (issue 21 items 4, 5): pyramidal OME-TIFF and GeoJSON objects.

Oracles: tifffile and tiffslide reading the file back; ``skimage.measure.block_reduce`` for the
levels (block sums of one-hot labels and of values; the mode is the first class of the largest
count, as ``scipy.stats.mode`` breaks ties); ``skimage.measure.label`` + ``regionprops`` on the
whole label image for the objects; shapely's ``is_valid``; ``skimage.draw.polygon`` rasterizing each
polygon back; ``scipy.ndimage.gaussian_filter`` (gaussian-2d's oracle) for the end-to-end runs.
Sizes are odd (primes) and several tiles and slabs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.ndimage as ndi
import scipy.stats
import shapely
import tifffile
from PIL import Image
from shapely.geometry import shape
from skimage.draw import polygon as draw_polygon
from skimage.measure import block_reduce, label, regionprops

from service.objects import write_geojson
from service.pyramid import pyramid_shapes, write_ome_tiff

tiffslide = pytest.importorskip("tiffslide")


def _mode_oracle(labels: np.ndarray, f: int) -> np.ndarray:
    classes = np.unique(labels)
    counts = np.stack([block_reduce(labels == c, (f, f), np.sum, cval=0) for c in classes])
    return classes[np.argmax(counts, axis=0)]


def _mean_oracle(values: np.ndarray, f: int) -> np.ndarray:
    sums = block_reduce(values.astype(np.float64), (f, f), np.sum, cval=0)
    return sums / block_reduce(np.ones(values.shape), (f, f), np.sum, cval=0)


def _levels(path: Path) -> list[np.ndarray]:
    with tifffile.TiffFile(path) as tif:
        assert tif.is_ome
        return [level.asarray() for level in tif.series[0].levels]


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        pytest.param("labels", np.uint8, id="labels-uint8"),
        pytest.param("values", np.uint8, id="probabilities-uint8"),
        pytest.param("values", np.float32, id="probabilities-float32"),
    ],
)
def test_pyramid_levels_are_block_modes_and_means(tmp_path: Path, kind: str, dtype: Any) -> None:
    rng = np.random.default_rng(0)
    shape_ = (1031, 1297)  # primes: ragged blocks at the right and bottom border of every level
    if kind == "labels":
        # blobs (smoothed noise, 4 classes) rather than noise, so modes are mostly clear
        smooth = ndi.gaussian_filter(rng.random(shape_), 6)
        array = np.digitize(smooth, np.quantile(smooth, [0.3, 0.6, 0.85])).astype(dtype)
    else:
        p = ndi.gaussian_filter(rng.random((2, *shape_)), (0, 3, 3))
        p = (p - p.min()) / (p.max() - p.min())
        array = np.rint(p * 255).astype(np.uint8) if dtype == np.uint8 else p.astype(dtype)
    path = tmp_path / "out.ome.tiff"
    shapes = write_ome_tiff(array, path, labels=kind == "labels", mpp=(0.25, 0.26))
    assert shapes == pyramid_shapes(*shape_) and len(shapes) == 4  # 1297 -> 649 -> 325 -> 163
    levels = _levels(path)
    assert np.array_equal(levels[0], array)
    for k in range(1, len(levels)):
        f = 2**k
        if kind == "labels":
            want = _mode_oracle(array, f)
            assert np.array_equal(levels[k], want), k
            i, j = 37, 41  # one block against scipy.stats.mode itself
            block = array[i * f : (i + 1) * f, j * f : (j + 1) * f].ravel()
            assert levels[k][i, j] == scipy.stats.mode(block, keepdims=False).mode
        else:
            want = np.stack([_mean_oracle(c, f) for c in array])
            tolerance = 0.5 if dtype == np.uint8 else 1e-6  # rounded to the nearest uint8
            assert float(np.abs(levels[k] - want).max()) <= tolerance, k
            if dtype == np.uint8:  # probabilities: the mean within 1/255
                assert float(np.abs(levels[k][0] / 255 - _mean_oracle(p[0], f)).max()) <= 1 / 255 + 1e-9
    with tiffslide.TiffSlide(path) as slide:
        assert slide.level_count == 4
        assert slide.level_dimensions[0] == (1297, 1031) and slide.level_dimensions[3] == (163, 129)
        assert float(slide.properties["tiffslide.mpp-x"]) == pytest.approx(0.26)
        assert float(slide.properties["tiffslide.mpp-y"]) == pytest.approx(0.25)
        region = np.asarray(slide.read_region((64, 128), 2, (50, 40), as_array=True))
    want2 = levels[2] if kind == "labels" else np.moveaxis(levels[2], 0, -1)
    assert np.array_equal(region.reshape(want2[32:72, 16:66].shape), want2[32:72, 16:66])
    with tifffile.TiffFile(path) as tif:
        page = tif.pages.first
        assert (
            page.is_tiled and page.tilewidth == 256 and page.compression == tifffile.COMPRESSION.ADOBE_DEFLATE
        )
        assert 'PhysicalSizeX="0.26"' in tif.ome_metadata and 'PhysicalSizeXUnit="µm"' in tif.ome_metadata


@pytest.mark.slow  # about 10 s: 36 million pixels written and reduced
def test_pyramid_memory_follows_the_tile(tmp_path: Path) -> None:
    """A 6007 x 6011 float32 level 0 (138 MiB) on disk, written with its pyramid by a fresh process:
    its peak RSS grows by far less than the image (a band of blocks, never a level)."""
    shape_ = (1, 6007, 6011)
    raw = np.memmap(tmp_path / "raw.bin", np.float32, "w+", shape=shape_)
    for r in range(0, shape_[1], 500):
        raw[0, r : r + 500] = np.random.default_rng(r).random((min(500, shape_[1] - r), shape_[2]))
    raw.flush()
    del raw
    script = textwrap.dedent(
        f"""
        import resource, numpy as np, tifffile
        from service.paged import open_paged
        from service.pyramid import write_ome_tiff
        a = open_paged({str(tmp_path / "raw.bin")!r}, np.float32, {shape_!r}, mode="r")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        write_ome_tiff(a, {str(tmp_path / "big.ome.tiff")!r}, labels=False, mpp=(0.5, 0.5))
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) * 1024, a.nbytes)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    grown, nbytes = (int(v) for v in out.stdout.split())
    assert grown < min(nbytes / 3, 48 * 2**20), (grown, nbytes)  # measured: 24 MiB of 138 MiB
    levels = _levels(tmp_path / "big.ome.tiff")
    assert len(levels) == 6 and levels[5].shape == (188, 188)


def _objects_image() -> np.ndarray:
    """Labels with discs on a grid offset from tiles and slabs, rings (holes), bars spanning 3+
    slabs, objects on the image border, diagonal touches and noise."""
    height, width = 367, 419
    yy, xx = np.mgrid[:height, :width]
    labels = np.zeros((height, width), np.uint8)
    rng = np.random.default_rng(2)
    for cy in range(13, height, 47):
        for cx in range(-5, width + 10, 53):  # the first and last columns cut by the border
            r = int(rng.integers(6, 22))
            labels[(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = int(rng.integers(1, 4))
    ring = ((yy - 180) ** 2 + (xx - 200) ** 2 <= 60**2) & ((yy - 180) ** 2 + (xx - 200) ** 2 > 30**2)
    labels[ring] = 2
    labels[(yy - 180) ** 2 + (xx - 200) ** 2 <= 8**2] = 3  # an island in the hole
    labels[20:350, 100:104] = 1  # a bar over many slabs
    labels[:, 410:] = 3  # a column along the right border, top to bottom
    labels[300, 300], labels[301, 301], labels[302, 300] = 2, 2, 2  # corner touches only
    labels[rng.random(labels.shape) < 0.01] = 1
    return labels


def _noise_image() -> np.ndarray:
    """Dense noise of two labels (45 % filled): corner touches, holes and islands everywhere."""
    rng = np.random.default_rng(5)
    filled = rng.random((157, 211)) < 0.45
    return (filled * rng.integers(1, 3, filled.shape)).astype(np.uint8)


@pytest.mark.parametrize(
    ("image", "slab_rows"),
    [
        pytest.param(_objects_image, 16, id="shapes-slab16"),
        pytest.param(_objects_image, 31, id="shapes-slab31"),
        pytest.param(_objects_image, 128, id="shapes-slab128"),
        pytest.param(_noise_image, 23, id="noise-slab23"),
    ],
)
def test_geojson_objects_equal_connected_components(
    tmp_path: Path, image: Any, slab_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import service.outlines

    def no_fallback(*args: Any) -> None:
        raise AssertionError(f"the edge tracer gave an invalid outline: {args[1:]}")

    monkeypatch.setattr(service.outlines, "_runs_union", no_fallback)  # the tracer alone is exact
    labels = image()
    path = tmp_path / "objects.geojson"
    n = write_geojson(labels, path, names={1: "tumour", 2: "stroma"}, slab_rows=slab_rows)
    features = json.loads(path.read_text())["features"]
    components = label(labels, background=0)  # 8-connected, same value: skimage's default
    regions = regionprops(components, intensity_image=labels)
    assert n == len(features) == len(regions)
    want = sorted((int(r.intensity_max), int(r.area)) for r in regions)
    got = sorted((f["properties"]["label"], f["properties"]["area"]) for f in features)
    assert got == want
    for feature in features:
        geometry = shape(feature["geometry"])
        assert geometry.is_valid, shapely.is_valid_reason(geometry)
        props = feature["properties"]
        assert geometry.area == props["area"]
        # rasterize back (in the bounding box, one pixel of margin): the pixel centres
        # (row + 0.5, col + 0.5) inside the polygon are the object's pixels
        x0, y0, x1, y1 = (int(v) for v in geometry.bounds)
        x0, y0 = max(x0 - 1, 0), max(y0 - 1, 0)
        x1, y1 = min(x1 + 1, labels.shape[1]), min(y1 + 1, labels.shape[0])
        mask = np.zeros((y1 - y0, x1 - x0), bool)
        parts = geometry.geoms if geometry.geom_type == "MultiPolygon" else [geometry]
        for part in parts:
            for ring in (part.exterior, *part.interiors):
                x, y = np.asarray(ring.coords).T
                mask[draw_polygon(y - y0 - 0.5, x - x0 - 0.5, mask.shape)] ^= True
        crop = components[y0:y1, x0:x1]
        ids = np.unique(crop[mask])
        assert ids.size == 1 and np.array_equal(mask, crop == ids[0])
        assert int(mask.sum()) == props["area"] and labels[y0:y1, x0:x1][mask][0] == props["label"]
        name = {1: "tumour", 2: "stroma"}.get(props["label"], f"label {props['label']}")
        assert props["classification"]["name"] == name and len(props["classification"]["color"]) == 3
    holes = [f for f in features if any(len(p) > 1 for p in _polygons(f["geometry"]))]
    assert holes, "holes are kept"


def _polygons(geometry: dict[str, Any]) -> list[Any]:
    return [geometry["coordinates"]] if geometry["type"] == "Polygon" else geometry["coordinates"]


def _discs_tiff(path: Path) -> np.ndarray:
    """A 431 x 523 grey TIFF (tiled, so it is read by region) with discs on a grid that tiles of 64
    cut; its resolution 0.5 um per pixel."""
    height, width = 431, 523
    yy, xx = np.mgrid[:height, :width]
    image = np.zeros((height, width), np.uint8)
    for cy in range(30, height + 20, 61):
        for cx in range(25, width + 20, 59):
            image[(yy - cy) ** 2 + (xx - cx) ** 2 <= 21**2] = 200
    image[(yy - 200) ** 2 + (xx - 260) ** 2 <= 9**2] = 0  # and a hole
    tifffile.imwrite(path, image, tile=(64, 64), resolution=(2e4, 2e4), resolutionunit="CENTIMETER")
    return image


def test_cli_writes_geojson_and_ome_tiff_of_a_label_model(tmp_path: Path) -> None:
    """``tilewise infer -o x.geojson / x.ome.tiff`` (gaussian-2d with output=labels: p > 0.5),
    streamed: the objects are those of the label PNG of the same run, the pyramid's level 0 is it."""
    from service.cli import main

    source = tmp_path / "discs.tif"
    image = _discs_tiff(source)
    common = ["--model", "gaussian-2d", "--output", "labels", "--tile", "64", "--device", "cpu"]
    for name in ("out.png", "out.geojson", "out.ome.tiff"):
        assert main(["infer", str(source), str(tmp_path / name), *common]) == 0, name
    labels = np.asarray(Image.open(tmp_path / "out.png"))
    oracle = ndi.gaussian_filter(image.astype(np.float64), 2.0, truncate=4.0, mode="constant") > 0.5
    assert int((labels.astype(bool) != oracle).sum()) == 0
    features = json.loads((tmp_path / "out.geojson").read_text())["features"]
    regions = regionprops(label(labels))
    assert sorted(f["properties"]["area"] for f in features) == sorted(int(r.area) for r in regions)
    assert len(features) > 40 and all(shape(f["geometry"]).is_valid for f in features)
    levels = _levels(tmp_path / "out.ome.tiff")
    assert len(levels) == 3 and np.array_equal(levels[0], labels)
    assert np.array_equal(levels[1], _mode_oracle(labels, 2))
    png = tmp_path / "discs.png"  # decoded whole: encode writes the same objects
    Image.fromarray(image).save(png)
    assert main(["infer", str(png), str(tmp_path / "whole.geojson"), *common]) == 0
    assert json.loads((tmp_path / "whole.geojson").read_text())["features"] == features


def test_http_and_jobs_answer_ome_tiff_and_geojson(tmp_path: Path, make_settings: Any) -> None:
    """The sync route and a job answer the same files as ``run_file``; refusals are 400 with a
    sentence: geojson of probabilities, ome.tiff of a 3D model, float16 in OME-TIFF."""
    from fastapi.testclient import TestClient

    from service.app import create_app

    source = tmp_path / "discs.tif"
    _discs_tiff(source)
    body = source.read_bytes()
    settings = make_settings(tmp_dir=tmp_path / "tmp", jobs_dir=tmp_path / "jobs", device="cpu", warmup=False)
    with TestClient(create_app(settings)) as client:
        geo = client.post("/v1/models/gaussian-2d/infer?output=labels&format=geojson&tile=64", content=body)
        assert geo.status_code == 200, geo.text
        assert geo.headers["content-type"].startswith("application/geo+json")
        assert len(geo.json()["features"]) > 40 and geo.json()["tilewise"]["model"] == "gaussian-2d"
        ome = client.post("/v1/models/gaussian-2d/infer?format=ome.tiff&output_dtype=uint8", content=body)
        assert ome.status_code == 200, ome.text
        (tmp_path / "sync.ome.tiff").write_bytes(ome.content)
        levels = _levels(tmp_path / "sync.ome.tiff")
        assert len(levels) == 3 and levels[0].dtype == np.uint8
        with tiffslide.TiffSlide(tmp_path / "sync.ome.tiff") as slide:
            assert slide.properties["tiffslide.mpp-x"] is None  # the TIFF's probe gives no mpp
        png = tmp_path / "discs.png"  # decoded whole; Pillow reads its pixel size (0.5 um)
        Image.open(source).save(png, dpi=(50800, 50800))
        whole = client.post("/v1/models/gaussian-2d/infer?format=ome.tiff&tile=64", content=png.read_bytes())
        assert whole.status_code == 200, whole.text
        (tmp_path / "png.ome.tiff").write_bytes(whole.content)
        with tiffslide.TiffSlide(tmp_path / "png.ome.tiff") as slide:
            assert float(slide.properties["tiffslide.mpp-x"]) == pytest.approx(0.5, rel=1e-3)
            assert slide.level_count == 3
        job = client.post(
            "/v1/jobs",
            params={"model": "gaussian-2d", "format": "ome.tiff", "output": "labels"},
            content=body,
        ).json()
        deadline = time.monotonic() + 60
        while (status := client.get(f"/v1/jobs/{job['id']}").json())["state"] not in ("done", "failed"):
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        assert status["state"] == "done", status
        result = client.get(f"/v1/jobs/{job['id']}/result")
        (tmp_path / "job.ome.tiff").write_bytes(result.content)
        assert len(_levels(tmp_path / "job.ome.tiff")) == 3
        refusals = {
            "geojson of probabilities": "/v1/models/gaussian-2d/infer?format=geojson",
            "ome.tiff of a 3D model": "/v1/models/gaussian-3d/infer?format=ome.tiff",
            "float16 in OME-TIFF": "/v1/models/gaussian-2d/infer?format=ome.tiff&output_dtype=float16",
        }
        for why, url in refusals.items():
            answer = client.post(url, content=body)
            assert answer.status_code == 400, why
            assert answer.json()["detail"].startswith(("format=", "output_dtype=")), answer.json()
        assert client.post("/v1/jobs?model=gaussian-2d&format=geojson", content=body).status_code == 400


@pytest.mark.parametrize("dtype", [np.uint8, np.float16], ids=["labels-uint8", "probabilities-float16"])
def test_ome_zarr_holds_the_same_levels_in_a_zip(tmp_path: Path, dtype: Any) -> None:
    """``format=ome.zarr``: zarr reads the zip back; level k is the OME-TIFF's level k (float16
    too, which OME-TIFF cannot hold, against block_reduce); each level's scale is mpp * 2**k."""
    import zarr
    from zarr.storage import ZipStore

    from service.omezarr import write_ome_zarr

    rng = np.random.default_rng(4)
    labels = dtype == np.uint8
    array = (
        rng.integers(0, 3, (389, 601)).astype(dtype) if labels else rng.random((2, 389, 601)).astype(dtype)
    )
    path = tmp_path / "out.ome.zarr.zip"
    shapes = write_ome_zarr(array, path, labels=labels, mpp=(0.5, 0.25))
    group = zarr.open_group(ZipStore(path, mode="r"), mode="r")
    attrs = dict(group.attrs)
    datasets = attrs["multiscales"][0]["datasets"]
    assert [d["coordinateTransformations"][0]["scale"] for d in datasets] == [
        [1.0, 0.5 * 2**k, 0.25 * 2**k] for k in range(len(shapes))
    ]
    assert len(shapes) == 3 and ("image-label" in attrs) == labels
    got = [np.asarray(group[str(k)][:]) for k in range(len(shapes))]
    planes = array[None] if labels else array
    assert np.array_equal(got[0], planes)
    if labels:
        write_ome_tiff(array, tmp_path / "same.ome.tiff", labels=True)
        assert all(
            np.array_equal(g[0], t) for g, t in zip(got, _levels(tmp_path / "same.ome.tiff"), strict=True)
        )
        assert np.array_equal(got[1][0], _mode_oracle(array, 2))
    else:
        for k in (1, 2):  # float16 rounding of the mean: half a unit in the last place (values < 1)
            want = np.stack([_mean_oracle(c, 2**k) for c in array])
            assert float(np.abs(got[k] - want).max()) <= 2**-11


def test_cli_writes_ome_zarr(tmp_path: Path) -> None:
    from service.cli import main

    source = tmp_path / "discs.tif"
    _discs_tiff(source)
    target = tmp_path / "out.ome.zarr.zip"
    assert main(["infer", str(source), str(target), "--model", "gaussian-2d", "--device", "cpu"]) == 0
    import zarr
    from zarr.storage import ZipStore

    group = zarr.open_group(ZipStore(target, mode="r"), mode="r")
    assert group["0"].shape == (1, 431, 523) and group["2"].shape == (1, 108, 131)
    assert dict(group.attrs)["tilewise"]["model"] == "gaussian-2d"


def test_geojson_coordinates_are_level0_pixels_for_a_coarser_output(tmp_path: Path) -> None:
    """A label image read at level 1 (half size): ``scale=(2, 2)`` gives the objects of the same
    labels at level 0 (each pixel a 2 x 2 block, ``np.kron``): same shapes, areas in level-0 pixels."""
    labels = _objects_image()[:101, :157]
    write_geojson(labels, tmp_path / "coarse.geojson", scale=(2.0, 2.0), slab_rows=19)
    write_geojson(np.kron(labels, np.ones((2, 2), np.uint8)), tmp_path / "fine.geojson", slab_rows=64)
    coarse, fine = (
        json.loads((tmp_path / f"{n}.geojson").read_text())["features"] for n in ("coarse", "fine")
    )
    key = lambda f: (f["properties"]["label"], f["properties"]["area"], shape(f["geometry"]).bounds)  # noqa: E731
    coarse, fine = sorted(coarse, key=key), sorted(fine, key=key)
    assert [key(f) for f in coarse] == [key(f) for f in fine]
    assert all(shape(a["geometry"]).equals(shape(b["geometry"])) for a, b in zip(coarse, fine, strict=True))


def _peak_bytes(labels: np.ndarray, path: Path) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        write_ome_tiff(labels, path, labels=True)
        return int(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


def test_mode_pyramid_of_many_classes_is_memory_bounded(tmp_path: Path) -> None:
    """Review item 7: the mode of a 300-class label image (uint16, 389 x 521) peaks (tracemalloc)
    at under twice the peak of a 3-class one and under 32 bytes per level-0 pixel (the per-class
    counts at once were 300 x 5 bytes a pixel), and its levels are the block modes."""
    rng = np.random.default_rng(7)
    shape_ = (389, 521)
    many = rng.integers(0, 300, shape_, dtype=np.uint16)
    many[:40, :40] = 299  # a large block of one class: modes are not all ties
    few = rng.integers(0, 3, shape_, dtype=np.uint16)
    peak_many = _peak_bytes(many, tmp_path / "many.ome.tiff")
    peak_few = _peak_bytes(few, tmp_path / "few.ome.tiff")
    assert len(np.unique(many)) == 300
    assert peak_many < 2 * peak_few + 2**20, (peak_many, peak_few)
    assert peak_many < 32 * many.size, (peak_many, many.size)
    levels = _levels(tmp_path / "many.ome.tiff")
    assert len(levels) == 3
    for k, level in enumerate(levels):
        assert np.array_equal(level, _mode_oracle(many, 2**k) if k else many), k
