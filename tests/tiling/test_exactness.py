"""Tiled inference equals the whole-image forward pass of a translation-equivariant network.

Oracle: one forward pass of the same random fp32 conv stack over the whole image (PyTorch's own zero
padding at the image edge), or over ``numpy.pad(image, halo, mode)`` for ``border="pad"``. The conv
stacks are stride 1 with a known receptive-field radius ``r`` (three 3x3(x3) convs: r = 3; dilations
1, 2, 1: r = 4); any ``halo >= r`` must reproduce the reference.

Tolerance: 1e-5 max abs difference (the acceptance bound). Outputs are O(1); the only source of
difference is fp32 rounding in convolutions evaluated on differently sized inputs (different
blocking / summation order), measured at about 1e-7, plus the blend normalization (a few ulp).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _tiling_nets import ConvStack, whole

from tiling import BlendMode, tiled_inference

ATOL = 1e-5  # acceptance bound; see the module docstring

PLAIN = (1, 1, 1)  # r = 3
DILATED = (1, 2, 1)  # r = 4

CASES_2D = [
    # shape, tile, halo, overlap, blend, dilations
    pytest.param((37, 41), (16, 12), 3, 0, "constant", PLAIN, id="primes-tile16x12-h3"),
    pytest.param((37, 41), (11, 20), 5, 0, "constant", PLAIN, id="primes-tile11x20-h5"),
    pytest.param((31, 29), (9, 13), 3, (2, 1), "hann", PLAIN, id="primes-tile9x13-h3-ov2x1"),
    pytest.param((5, 7), (16, 16), 3, 0, "constant", PLAIN, id="smaller-than-tile"),
    pytest.param((6, 43), (16, 14), 4, 2, "gaussian", PLAIN, id="smaller-on-one-axis"),
    pytest.param((64, 17), (20, 9), (3, 3), (5, 0), "triangular", PLAIN, id="anisotropic"),
    pytest.param((1, 53), (8, 14), 3, 3, "constant", PLAIN, id="single-row"),
    pytest.param((29, 33), (14, 12), 4, 0, "constant", DILATED, id="dilated-h4"),
    pytest.param((29, 33), (17, 18), (6, 5), (1, 3), "gaussian", DILATED, id="dilated-h6x5-ov"),
]

CASES_3D = [
    pytest.param((13, 17, 11), (9, 10, 12), 3, 0, "constant", PLAIN, id="primes-h3"),
    pytest.param((13, 17, 11), (10, 8, 9), (3, 3, 4), (2, 1, 0), "hann", PLAIN, id="primes-h3-ov"),
    pytest.param((4, 5, 6), (12, 12, 12), 3, 0, "constant", PLAIN, id="smaller-than-tile"),
    pytest.param((23, 7, 12), (10, 16, 9), 3, (1, 0, 2), "gaussian", PLAIN, id="anisotropic"),
    pytest.param((15, 14, 13), (12, 11, 10), 4, 1, "triangular", DILATED, id="dilated-h4"),
]


FIXED = pytest.mark.parametrize(
    "fixed", [pytest.param(False, id="sized"), pytest.param(True, id="fixed-tile-shape")]
)


def _check(record_diff, family, got, want):
    diff = record_diff(family, got, want)
    assert diff <= ATOL, f"{family}: max abs diff {diff:.3e} > {ATOL}"


@FIXED
@pytest.mark.parametrize(("shape", "tile", "halo", "overlap", "blend", "dilations"), CASES_2D)
def test_exact_2d(rng, record_diff, shape, tile, halo, overlap, blend, dilations, fixed):
    net = ConvStack(2, 2, 3, dilations)
    assert isinstance(halo, tuple) or halo >= net.radius
    x = rng.standard_normal((2, *shape), dtype=np.float32)
    y = tiled_inference(x, net, tile, halo=halo, overlap=overlap, blend=blend, batch_size=3,
                        fixed_tile_shape=fixed)  # fmt: skip
    assert isinstance(y, np.ndarray) and y.dtype == np.float32
    _check(record_diff, "exact-2d-clip", y, whole(net, x))


@FIXED
@pytest.mark.parametrize(("shape", "tile", "halo", "overlap", "blend", "dilations"), CASES_3D)
def test_exact_3d(rng, record_diff, shape, tile, halo, overlap, blend, dilations, fixed):
    net = ConvStack(3, 1, 2, dilations)
    x = rng.standard_normal((1, *shape), dtype=np.float32)
    y = tiled_inference(x, net, tile, halo=halo, overlap=overlap, blend=blend, batch_size=2,
                        fixed_tile_shape=fixed)  # fmt: skip
    _check(record_diff, "exact-3d-clip", y, whole(net, x))


@pytest.mark.parametrize("length", [pytest.param(97, id="prime"), pytest.param(6, id="smaller-than-tile")])
def test_exact_1d(rng, record_diff, length):
    net = ConvStack(1, 1, 1, DILATED)
    x = rng.standard_normal((1, length), dtype=np.float32)
    y = tiled_inference(x, net, 19, halo=5, overlap=2, blend="hann")
    _check(record_diff, "exact-1d-clip", y, whole(net, x))


@pytest.mark.parametrize("blend", [pytest.param(m.value, id=m.value) for m in BlendMode])
@pytest.mark.parametrize(
    "overlap", [pytest.param(0, id="ov0"), pytest.param(1, id="ov1"), pytest.param(6, id="ov6")]
)
@pytest.mark.parametrize("extra_halo", [pytest.param(0, id="h=r"), pytest.param(2, id="h=r+2")])
def test_exact_every_blend_and_overlap(rng, record_diff, blend, overlap, extra_halo):
    net = ConvStack(2, 1, 2)
    x = rng.standard_normal((1, 41, 38), dtype=np.float32)
    y = tiled_inference(x, net, (17, 19), halo=net.radius + extra_halo, overlap=overlap, blend=blend)
    _check(record_diff, "exact-2d-blends", y, whole(net, x))


def test_halo_below_radius_is_detected(rng):
    # Negative control: the oracle has teeth. With halo = r - 1 interior seams differ visibly.
    net = ConvStack(2, 1, 1)
    x = rng.standard_normal((1, 40, 40), dtype=np.float32)
    y = tiled_inference(x, net, 16, halo=net.radius - 1)
    assert np.abs(y - whole(net, x)).max() > 1e-3


def test_batch_size_invariance(rng, record_diff):
    net = ConvStack(3, 1, 2)
    x = rng.standard_normal((1, 14, 15, 16), dtype=np.float32)
    results = [
        tiled_inference(x, net, (8, 9, 10), halo=3, overlap=1, blend="gaussian", batch_size=b)
        for b in (1, 2, 5, 64)
    ]
    for y in results[1:]:
        # Same tiles, same weights, same order of accumulation: only the batched conv may round
        # differently with the batch size (measured up to 2.4e-7 on CPU for O(1) outputs); 1e-6.
        diff = record_diff("batch-size-invariance", y, results[0])
        assert diff <= 1e-6, f"batch size changed the result by {diff:.3e}"
    _check(record_diff, "exact-3d-clip", results[0], whole(net, x))


def test_memmap_input_and_out(tmp_path, rng, record_diff):
    net = ConvStack(3, 1, 2)
    x = rng.standard_normal((1, 19, 12, 10), dtype=np.float32)
    src = np.memmap(tmp_path / "in.dat", dtype=np.float32, mode="w+", shape=x.shape)
    src[:] = x
    src.flush()
    src = np.memmap(tmp_path / "in.dat", dtype=np.float32, mode="r", shape=x.shape)
    out = np.memmap(tmp_path / "out.dat", dtype=np.float32, mode="w+", shape=(2, 19, 12, 10))
    y = tiled_inference(src, net, (12, 12, 10), halo=3, overlap=2, blend="hann", out=out)
    assert y is out
    del out, y
    back = np.memmap(tmp_path / "out.dat", dtype=np.float32, mode="r", shape=(2, 19, 12, 10))
    _check(record_diff, "exact-inputs", back, whole(net, x))


def test_numpy_non_float32_input(record_diff):
    net = ConvStack(2, 1, 1)
    x = np.arange(23 * 19, dtype=np.int16).reshape(1, 23, 19) % 7
    y = tiled_inference(x, net, 10, halo=3)
    assert y.dtype == np.float32
    _check(record_diff, "exact-inputs", y, whole(net, x.astype(np.float32)))


@pytest.mark.parametrize("with_out", [pytest.param(False, id="allocated"), pytest.param(True, id="out")])
def test_torch_batch_input(rng, record_diff, with_out):
    net = ConvStack(2, 2, 3)
    x = torch.from_numpy(rng.standard_normal((3, 2, 21, 26), dtype=np.float32))
    out = torch.full((3, 3, 21, 26), float("nan")) if with_out else None
    y = tiled_inference(x, net, (10, 12), halo=3, overlap=2, blend="triangular", batch_size=4, out=out)
    assert isinstance(y, torch.Tensor) and y.shape == (3, 3, 21, 26)
    if with_out:
        assert y is out
    with torch.inference_mode():
        want = net(x)
    _check(record_diff, "exact-inputs", y.numpy(), want.numpy())


def test_torch_input_on_explicit_device_with_progress(rng, record_diff):
    net = ConvStack(2, 1, 1)
    x = torch.from_numpy(rng.standard_normal((2, 1, 20, 20), dtype=np.float32))
    y = tiled_inference(x, net, 12, halo=3, device="cpu", progress=True)
    with torch.inference_mode():
        _check(record_diff, "exact-inputs", y.numpy(), net(x).numpy())


def test_nibabel_array_proxy_input(tmp_path, rng, record_diff):
    nib = pytest.importorskip("nibabel")
    net = ConvStack(3, 2, 1)
    x = rng.standard_normal((2, 13, 11, 9), dtype=np.float32)
    nib.save(nib.Nifti1Image(x, np.eye(4)), tmp_path / "x.nii")
    proxy = nib.load(tmp_path / "x.nii").dataobj
    assert isinstance(proxy, nib.arrayproxy.ArrayProxy) and proxy.shape == x.shape
    y = tiled_inference(proxy, net, (10, 9, 9), halo=3, overlap=1, blend="gaussian")
    assert type(y) is np.ndarray
    _check(record_diff, "exact-inputs", y, whole(net, x))


# --- border="pad": whole-image forward on np.pad(image, halo, mode), cropped ---------------------

NP_MODE = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}


@pytest.mark.parametrize("mode", [pytest.param(m, id=m) for m in NP_MODE])
@pytest.mark.parametrize(
    ("shape", "tile", "halo", "overlap", "blend"),
    [
        pytest.param((2, 29, 31), (12, 14), 3, 0, "constant", id="2d-h3"),
        pytest.param((1, 23, 30), (15, 11), (5, 4), (2, 1), "hann", id="2d-h5x4-ov"),
        pytest.param((1, 2, 37), (9, 9), 3, 0, "constant", id="2d-halo-wider-than-axis"),
        pytest.param((1, 11, 9, 13), (8, 9, 10), 3, (1, 0, 2), "gaussian", id="3d-h3-ov"),
    ],
)
def test_pad_border_matches_numpy_pad(rng, record_diff, mode, shape, tile, halo, overlap, blend):
    ndim = len(shape) - 1
    net = ConvStack(ndim, shape[0], 2)
    x = rng.standard_normal(shape, dtype=np.float32)
    halos = halo if isinstance(halo, tuple) else (halo,) * ndim
    padded = np.pad(x, [(0, 0)] + [(h, h) for h in halos], mode=NP_MODE[mode])
    crop = (slice(None), *(slice(h, h + s) for h, s in zip(halos, shape[1:], strict=True)))
    want = whole(net, padded)[crop]
    y = tiled_inference(
        x, net, tile, halo=halo, overlap=overlap, blend=blend, border="pad", padding_mode=mode
    )
    _check(record_diff, f"exact-pad-{mode}", y, want)
