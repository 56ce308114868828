"""Deep Zoom tiles of a job's input or result, read by region (issue 21 item 6).

One module per concept, their public names re-exported here:

- :mod:`~service.dzi.layout`: the Deep Zoom layout OpenSeadragon reads: levels, the box of each
  tile (:class:`DeepZoom`, :class:`TileBox`) and the ``.dzi`` descriptor (:func:`dzi_xml`);
  integers only.
- :mod:`~service.dzi.pyramids`: an image file (TIFF family, PNG, JPEG) as levels read by box
  (:class:`Pyramid`, :func:`open_pyramid`, :func:`opened`), with an overview where the file's
  coarsest level is too fine; at most :data:`MAX_READ_PIXELS` decoded per tile.
- :mod:`~service.dzi.render`: a tile as a picture (:func:`render_tile`, :func:`encode_tile`): the
  input as JPEG, the result in the page's legend colours (:func:`display_window`).

The constants re-exported here are read where they are defined: to change ``MAX_READ_PIXELS`` or
``OVERVIEW_EDGE`` (tests do), set them on :mod:`service.dzi.pyramids`.
"""

from service.dzi.layout import OVERLAP, TILE_SIZE, DeepZoom, TileBox, dzi_xml
from service.dzi.pyramids import (
    MAX_READ_PIXELS,
    OPEN_PYRAMIDS,
    OVERVIEW_EDGE,
    Pyramid,
    open_pyramid,
    opened,
    source_box,
)
from service.dzi.render import RAMP_THRESHOLD, display_window, encode_tile, render_tile

__all__ = [
    "MAX_READ_PIXELS",
    "OPEN_PYRAMIDS",
    "OVERLAP",
    "OVERVIEW_EDGE",
    "RAMP_THRESHOLD",
    "TILE_SIZE",
    "DeepZoom",
    "Pyramid",
    "TileBox",
    "display_window",
    "dzi_xml",
    "encode_tile",
    "open_pyramid",
    "opened",
    "render_tile",
    "source_box",
]
