"""Review item 8: the whole-decode encoders (GeoJSON, OME-TIFF, OME-Zarr) record an output coarser
than its input (a model of ``scale != 1``) as the streamed writers do: GeoJSON coordinates in input
pixels, mpp of the output's pixels. Oracles: :func:`service.objects.write_geojson` given the scale,
and the OME-XML PhysicalSize that tifffile reads back."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import tifffile

from service.codecs.image_encode import encode_geojson, encode_ome_tiff
from service.codecs.volume import DecodedVolume
from service.objects import write_geojson


def _labels() -> np.ndarray:
    labels = np.zeros((101, 157), np.uint8)  # odd sizes
    labels[10:40, 20:77] = 1
    labels[50:97, 90:150] = 2
    labels[60:70, 5:11] = 1
    return labels


@pytest.mark.parametrize("single_slice", [False, True])
def test_a_half_size_output_in_input_pixels_and_its_own_mpp(tmp_path: Path, single_slice: bool) -> None:
    labels = _labels()
    if single_slice:  # a one-slice NIfTI (X, Y, 1): its output squeezed to 2D
        volume = DecodedVolume(np.zeros((1, 202, 314, 1), np.float32), "nifti", info={"mpp": 0.5})
        out = labels[..., None]
    else:
        volume = DecodedVolume(np.zeros((3, 202, 314), np.uint8), "png", info={"mpp": 0.5})
        out = labels
    encode_geojson(volume, out, tmp_path / "whole.geojson")
    write_geojson(labels, tmp_path / "streamed.geojson", scale=(2.0, 2.0))
    whole = json.loads((tmp_path / "whole.geojson").read_text())
    streamed = json.loads((tmp_path / "streamed.geojson").read_text())
    assert whole == streamed
    assert max(f["properties"]["area"] for f in whole["features"]) == 47 * 60 * 4
    encode_ome_tiff(volume, out, tmp_path / "whole.ome.tif")
    with tifffile.TiffFile(tmp_path / "whole.ome.tif") as tif:
        pixels = next(e for e in ET.fromstring(tif.ome_metadata).iter() if e.tag.endswith("Pixels"))
        assert float(pixels.get("PhysicalSizeX")) == pytest.approx(1.0)
        assert float(pixels.get("PhysicalSizeY")) == pytest.approx(1.0)
