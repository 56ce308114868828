"""Broadcasting of per-axis parameters and validation: one test per error branch.

Every invalid input raises a ``ValueError`` subclass (``GridError`` or ``ShapeMismatchError``) whose
message names the parameter, the received value and what was expected.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from tiling import (
    BlendMode,
    BorderMode,
    GridError,
    PaddingMode,
    ShapeMismatchError,
    TileGrid,
    TileReuse,
    tiled_inference,
)
from tiling.geometry import as_fractions, as_ints


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


@pytest.fixture
def image() -> np.ndarray:
    return np.zeros((1, 40, 30), dtype=np.float32)


# --- broadcasting ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "ndim", "expected"),
    [
        pytest.param(5, 3, (5, 5, 5), id="int-broadcasts"),
        pytest.param((4, 5), 2, (4, 5), id="tuple-per-axis"),
        pytest.param([7], 1, (7,), id="list-1d"),
        pytest.param(np.int64(3), 2, (3, 3), id="numpy-int"),
        pytest.param((np.int32(2), 6), 2, (2, 6), id="tuple-of-numpy-ints"),
    ],
)
def test_as_ints_broadcasts(value, ndim, expected):
    assert as_ints(value, ndim, "tile_shape", minimum=1) == expected


def test_as_fractions_is_exact():
    assert as_fractions(0.25, 2, "scale") == (Fraction(1, 4), Fraction(1, 4))
    assert as_fractions((2, 0.5), 2, "scale") == (Fraction(2), Fraction(1, 2))


def test_int_and_tuple_plans_agree():
    a = TileGrid.plan((40, 30), 16, 2, overlap=3)
    b = TileGrid.plan((40, 30), (16, 16), (2, 2), overlap=(3, 3))
    assert [t.starts for t in a.tiles()] == [t.starts for t in b.tiles()]
    # 40 voxels need 4 tiles at stride 9 (core 16 - 2 * 2 = 12, minus overlap 3); spread evenly
    # over the 40 - 16 = 24 voxels left, their origins are 8 apart.
    assert a.stride == b.stride == (8, 8)
    c = TileGrid.plan((40, 30), (16, 16), (2, 2), overlap=(3, 3), fixed_tile_shape=True)
    assert c.stride == (9, 9) and c.grid_shape == a.grid_shape


def test_enums_accept_strings_and_members():
    a = TileGrid.plan((20,), 8, blend="hann", border="pad")
    b = TileGrid.plan((20,), 8, blend=BlendMode.HANN, border=BorderMode.PAD)
    assert (a.blend, a.border) == (b.blend, b.border) == (BlendMode.HANN, BorderMode.PAD)
    assert PaddingMode("replicate") is PaddingMode.REPLICATE


# --- one test per error branch -------------------------------------------------------------------


def _raises(exc: type[Exception], *fragments: str):
    """Context manager: ``exc`` (a ValueError subclass) whose message contains every fragment."""
    assert issubclass(exc, ValueError)

    class _Ctx:
        def __enter__(self):
            self._cm = pytest.raises(exc)
            self.info = self._cm.__enter__()
            return self.info

        def __exit__(self, *args):
            suppressed = self._cm.__exit__(*args)
            message = str(self.info.value)
            for fragment in fragments:
                assert fragment in message, f"{fragment!r} not in {message!r}"
            return suppressed

    return _Ctx()


@pytest.mark.parametrize("tile", [pytest.param(0, id="zero"), pytest.param((16, -4), id="negative-axis1")])
def test_non_positive_tile(image, tile):
    received = "tile_shape[0]=0" if tile == 0 else "tile_shape[1]=-4"
    with _raises(GridError, received, ">= 1"):
        tiled_inference(image, identity, tile)


def test_non_integer_tile(image):
    with _raises(GridError, "tile_shape[1]=12.5", "integer"):
        tiled_inference(image, identity, (16, 12.5))


def test_bool_tile_rejected(image):
    with _raises(GridError, "tile_shape[0]=True", "integer"):
        tiled_inference(image, identity, (True, 8))


def test_string_tile_rejected(image):
    with _raises(GridError, "tile_shape='16'", "tuple of 2"):
        tiled_inference(image, identity, "16")


def test_negative_halo(image):
    with _raises(GridError, "halo[1]=-1", ">= 0"):
        tiled_inference(image, identity, 16, halo=(2, -1))


def test_negative_overlap(image):
    with _raises(GridError, "overlap[0]=-2", ">= 0"):
        tiled_inference(image, identity, 16, overlap=-2)


def test_zero_alignment(image):
    with _raises(GridError, "alignment[0]=0", ">= 1"):
        tiled_inference(image, identity, 16, alignment=0)


def test_tile_with_wrong_number_of_axes(image):
    with _raises(GridError, "tile_shape=(8, 8, 8)", "3 axes", "2 spatial axes"):
        tiled_inference(image, identity, (8, 8, 8))


def test_halo_with_wrong_number_of_axes(image):
    with _raises(GridError, "halo=(2,)", "1 axes", "2 spatial axes"):
        tiled_inference(image, identity, 16, halo=(2,))


def test_scale_with_wrong_number_of_axes(image):
    with _raises(GridError, "scale=(2, 2, 2)", "3 axes", "2 spatial axes"):
        tiled_inference(image, identity, 16, scale=(2, 2, 2))


def test_non_positive_scale(image):
    with _raises(GridError, "scale[0]=0", "> 0"):
        tiled_inference(image, identity, 16, scale=0)


def test_scale_off_the_output_grid():
    # tile 9 times scale 1/2 is 4.5 output voxels: not a whole number.
    with _raises(GridError, "tile_shape[0]=9", "scale[0]=1/2", "4.5"):
        TileGrid.plan((30,), 9, scale=0.5)


def test_empty_spatial_axis():
    with _raises(GridError, "spatial_shape[1]=0", ">= 1"):
        TileGrid.plan((10, 0), 4)


def test_no_spatial_axes():
    with _raises(GridError, "no spatial axes"):
        TileGrid.plan((), 4)


def test_halo_leaves_empty_core(image):
    with _raises(GridError, "halo[0]=8", "tile_shape[0]=16", "empty core", "core = tile - 2 * halo = 0"):
        tiled_inference(image, identity, 16, halo=(8, 2))


def test_overlap_leaves_no_stride(image):
    with _raises(GridError, "overlap[1]=12", "core 12", "tile_shape[1]=16", "halo[1]=2"):
        tiled_inference(image, identity, 16, halo=2, overlap=(0, 12))


def test_overlap_leaves_no_stride_after_alignment(image):
    # core 8 - overlap 5 = 3 rounds down to 0 on the alignment-4 grid.
    with _raises(GridError, "overlap[0]=5", "alignment[0]=4"):
        tiled_inference(image, identity, 12, halo=2, overlap=5, alignment=4)


def test_refused_tile_names_the_smallest_that_runs(image):
    # "leaves an empty core" said what is wrong, not what to ask for (a first `?tile=8` with a
    # model whose halo is 24). 2 * 8 + 1 = 17; 2 * 2 + 12 + 1 = 17; 2 * 2 + 5 + 4 = 13 -> 16 on 4.
    with _raises(GridError, "empty core", "smallest tile_shape[0] for this halo and overlap is 17"):
        tiled_inference(image, identity, 16, halo=(8, 2))
    with _raises(GridError, "no positive stride", "smallest tile_shape[1] for this halo and overlap is 17"):
        tiled_inference(image, identity, 16, halo=2, overlap=(0, 12))
    with _raises(GridError, "smallest tile_shape[0] for this halo and overlap is 16"):
        tiled_inference(image, identity, 12, halo=2, overlap=5, alignment=4)
    tiled_inference(image, identity, 16, halo=2, overlap=5, alignment=4)  # and 16 runs


def test_tile_not_multiple_of_alignment(image):
    with _raises(GridError, "tile_shape[0]=18", "alignment[0]=4"):
        tiled_inference(image, identity, (18, 16), alignment=4)


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        pytest.param({"blend": "cosine"}, ("blend='cosine'", "'constant'", "'triangular'"), id="blend"),
        pytest.param({"border": "wrap"}, ("border='wrap'", "'clip'", "'pad'"), id="border"),
        pytest.param(
            {"padding_mode": "edge"}, ("padding_mode='edge'", "'reflect'", "'replicate'"), id="padding_mode"
        ),
    ],
)
def test_bad_mode_names(image, kwargs, fragments):
    with _raises(GridError, *fragments):
        tiled_inference(image, identity, 16, **kwargs)


def test_predictor_returns_wrong_spatial_shape(image):
    # (40, 30) with tile 16 and halo 2: 3 x 3 tiles sized to the grid, (16, 13) voxels each.
    with _raises(ShapeMismatchError, "(1, 1, 15, 12)", "expected", "(1, 'C_out', 16, 13)"):
        tiled_inference(image, lambda t: t[..., 1:, 1:], 16, halo=2)


def test_predictor_returns_wrong_batch(image):
    with _raises(ShapeMismatchError, "(1, 1, 16, 13)", "(2, 'C_out', 16, 13)"):
        tiled_inference(image, lambda t: t[:1], 16, halo=2, batch_size=2)


def test_predictor_changes_channels_between_batches(image):
    calls = []

    def predictor(t):
        calls.append(1)
        return t.repeat(1, len(calls), 1, 1)

    with _raises(ShapeMismatchError, "(1, 2, 16, 13)", "(1, 1, 16, 13)"):  # a zero image: no copies
        tiled_inference(image, predictor, 16, halo=2, reuse=TileReuse(constant=False))


def test_predictor_returns_wrong_ndim(image):
    with _raises(ShapeMismatchError, "(1, 16, 13)", "expected"):
        tiled_inference(image, lambda t: t[:, 0], 16, halo=2)


def test_predictor_returns_non_tensor(image):
    with _raises(ShapeMismatchError, "list", "torch.Tensor"):
        tiled_inference(image, lambda t: t.tolist(), 16, halo=2)


def test_predictor_may_return_numpy(image):
    out = tiled_inference(image + 1, lambda t: t.numpy() * 2, 16, halo=2)
    np.testing.assert_array_equal(out, 2 * (image + 1))


@pytest.mark.parametrize(
    ("inputs", "fragments"),
    [
        pytest.param(np.zeros(5, np.float32), ("(5,)", "1 dimensions", "(C, *spatial)"), id="numpy-1d"),
        pytest.param(torch.zeros(2, 5), ("(2, 5)", "2 dimensions", "(N, C, *spatial)"), id="torch-2d"),
    ],
)
def test_input_with_wrong_ndim(inputs, fragments):
    with _raises(ShapeMismatchError, *fragments):
        tiled_inference(inputs, identity, 4)


def test_input_with_more_axes_than_tile(image):
    # A (C, H, W) image with a 3-D tile: the mismatch names both axis counts and the input's shape.
    with _raises(GridError, "3 axes", "2 spatial axes", "(1, 40, 30)", "(C, *spatial)"):
        tiled_inference(image, identity, (4, 4, 4))


@pytest.mark.parametrize(
    ("inputs", "name", "value", "fragments"),
    [
        pytest.param(
            np.zeros((1, 1, 40, 30), np.float32), "tile_shape", (16, 16),
            ("(1, 1, 40, 30)", "(C, *spatial)", "3 spatial axes", "spatial shape (1, 40, 30)"),
            id="numpy-with-batch-axis",
        ),
        pytest.param(
            torch.zeros(1, 40, 30), "halo", (2, 2),
            ("(1, 40, 30)", "(N, C, *spatial)", "1 spatial axes", "spatial shape (30,)"),
            id="torch-without-batch-axis",
        ),
        pytest.param(
            np.zeros((2, 9, 8, 7), np.float32), "overlap", (1, 1),
            ("overlap=(1, 1)", "(2, 9, 8, 7)", "3 spatial axes"), id="overlap-axes",
        ),
        pytest.param(
            np.zeros((2, 9, 8, 7), np.float32), "alignment", [2, 2],
            ("alignment=(2, 2)", "(2, 9, 8, 7)"), id="alignment-axes",
        ),
        pytest.param(
            np.zeros((2, 9, 8), np.float32), "scale", (1, 1, 1),
            ("scale=(1, 1, 1)", "(2, 9, 8)"), id="scale-axes",
        ),
    ],
)  # fmt: skip
def test_layout_errors_name_the_received_shape(inputs, name, value, fragments):
    kwargs = {"tile_shape": 4, name: value}
    with _raises(GridError, *fragments):
        tiled_inference(inputs, identity, **kwargs)


def test_out_with_wrong_spatial_shape(image):
    out = np.zeros((1, 40, 31), np.float32)
    with _raises(ShapeMismatchError, "(1, 40, 31)", "(40, 30)"):
        tiled_inference(image, identity, 16, out=out)


def test_out_with_wrong_channels(image):
    out = np.zeros((3, 40, 30), np.float32)
    with _raises(ShapeMismatchError, "3 channels", "has 1"):
        tiled_inference(image, identity, 16, out=out)


@pytest.mark.parametrize("batch_size", [pytest.param(0, id="zero"), pytest.param(-1, id="negative")])
def test_non_positive_batch_size(image, batch_size):
    with _raises(GridError, f"batch_size={batch_size}", ">= 1"):
        tiled_inference(image, identity, 16, batch_size=batch_size)
