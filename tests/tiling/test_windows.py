"""``tiling.windows``: three window routes agree, window counts via gradients, pad-to-fit, sampling.

Oracles: explicit Python loops over window origins (the definition of a sliding window), a loop
count of how many windows contain each pixel, and ``numpy.pad`` for the sampler's padding. All
comparisons are exact (windows are copies or views of the same values; counts are small integers).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tiling import pad_to_fit, sample_windows, sliding_windows

METHODS = [pytest.param(m, id=m) for m in ("unfold", "im2col", "as_strided")]

GEOMETRIES = [
    # (H, W), kernel, stride, padding, dilation
    pytest.param((7, 9), (3, 3), 1, 0, 1, id="k3-s1"),
    pytest.param((7, 9), (2, 4), 1, 0, 1, id="kh!=kw"),
    pytest.param((10, 11), (3, 2), (3, 4), 0, 1, id="stride-leaves-tail"),
    pytest.param((6, 8), (3, 3), 2, (1, 2), 1, id="padding"),
    pytest.param((11, 12), (3, 2), (2, 1), 0, (2, 3), id="dilation"),
    pytest.param((9, 10), (2, 3), (2, 3), 1, (3, 2), id="all-at-once"),
    pytest.param((4, 4), (4, 4), 1, 0, 1, id="window-equals-input"),
]


def _pair(v):
    return tuple(v) if isinstance(v, tuple) else (v, v)


def reference_windows(x: torch.Tensor, kernel, stride, padding, dilation) -> torch.Tensor:
    """Loops over window origins on the zero-padded input: ``(..., nH, nW, kh, kw)``."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = map(_pair, (kernel, stride, padding, dilation))
    H, W = x.shape[-2:]
    xp = torch.zeros((*x.shape[:-2], H + 2 * ph, W + 2 * pw), dtype=x.dtype)
    xp[..., ph : ph + H, pw : pw + W] = x
    nh = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    nw = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = torch.empty((*x.shape[:-2], nh, nw, kh, kw), dtype=x.dtype)
    for i, j, u, v in itertools.product(range(nh), range(nw), range(kh), range(kw)):
        out[..., i, j, u, v] = xp[..., i * sh + u * dh, j * sw + v * dw]
    return out


def reference_counts(shape, kernel, stride, padding, dilation) -> np.ndarray:
    """How many windows contain each pixel of an ``(H, W)`` input (padding pixels not counted)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = map(_pair, (kernel, stride, padding, dilation))
    H, W = shape
    nh = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    nw = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    count = np.zeros((H, W), dtype=np.int64)
    for i, j, u, v in itertools.product(range(nh), range(nw), range(kh), range(kw)):
        r, c = i * sh + u * dh - ph, j * sw + v * dw - pw
        if 0 <= r < H and 0 <= c < W:
            count[r, c] += 1
    return count


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("hw", "kernel", "stride", "padding", "dilation"), GEOMETRIES)
def test_routes_match_loops(method, hw, kernel, stride, padding, dilation):
    x = torch.randn(2, 3, *hw)
    got = sliding_windows(x, kernel, stride, padding, dilation, method=method)
    torch.testing.assert_close(got, reference_windows(x, kernel, stride, padding, dilation), rtol=0, atol=0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("hw", "kernel", "stride", "padding", "dilation"), GEOMETRIES)
def test_routes_agree_on_non_contiguous_input(method, hw, kernel, stride, padding, dilation):
    base = torch.randn(3, hw[1], hw[0] + 3)
    x = base.transpose(-1, -2)[..., 1 : 1 + hw[0], :]  # non-contiguous, with a storage offset
    assert not x.is_contiguous() and x.storage_offset() > 0
    got = sliding_windows(x, kernel, stride, padding, dilation, method=method)
    want = reference_windows(x.contiguous(), kernel, stride, padding, dilation)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_views_share_memory():
    x = torch.randn(5, 6)
    for method in ("unfold", "as_strided"):
        w = sliding_windows(x, 2, method=method)
        assert w.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert (
        sliding_windows(x, 2, method="im2col").untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("hw", "kernel", "stride", "padding", "dilation"), GEOMETRIES)
def test_gradient_of_window_sum_is_window_count(method, hw, kernel, stride, padding, dilation):
    x = torch.randn(*hw, dtype=torch.float64, requires_grad=True)
    sliding_windows(x, kernel, stride, padding, dilation, method=method).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), reference_counts(hw, kernel, stride, padding, dilation))


def test_gradient_count_matches_conv_of_ones():
    # A second, independent count: conv_transpose of an all-ones window grid by an all-ones kernel.
    x = torch.randn(1, 1, 12, 10, requires_grad=True)
    sliding_windows(x, (3, 2), (2, 3), method="as_strided").sum().backward()
    n = sliding_windows(torch.zeros(12, 10), (3, 2), (2, 3)).shape[:2]
    counts = torch.nn.functional.conv_transpose2d(torch.ones(1, 1, *n), torch.ones(1, 1, 3, 2), stride=(2, 3))
    want = torch.zeros(1, 1, 12, 10)
    want[..., : counts.shape[-2], : counts.shape[-1]] = counts
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"method": "loop"}, "method='loop'", id="method"),
        pytest.param({"kernel_size": 0}, "must be >= 1", id="kernel"),
        pytest.param({"stride": (1, 0)}, "must be >= 1", id="stride"),
        pytest.param({"padding": -1}, ">= 0", id="padding"),
        pytest.param({"kernel_size": (1, 2, 3)}, "pair", id="kernel-3-values"),
        pytest.param({"kernel_size": 6}, "larger than the padded input", id="too-large"),
    ],
)
def test_sliding_windows_errors(kwargs, match):
    kwargs = {"kernel_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        sliding_windows(torch.zeros(5, 5), **kwargs)


def test_sliding_windows_needs_two_dims():
    with pytest.raises(ValueError, match="at least 2 dims"):
        sliding_windows(torch.zeros(5), 2)


# --- pad_to_fit ---------------------------------------------------------------------------------


def test_pad_to_fit_invariants():
    for length, k, s in itertools.product(range(1, 31), range(1, 11), range(1, 7)):
        lo, hi = pad_to_fit(length, k, s)
        total = lo + hi
        assert lo >= 0 and 0 <= hi - lo <= 1, "split as evenly as possible, the extra voxel at the end"
        assert length + total >= k and (length + total - k) % s == 0, "windows end exactly at the end"
        smaller = [p for p in range(total) if length + p >= k and (length + p - k) % s == 0]
        assert not smaller, f"L={length} k={k} s={s}: total padding {total} is not minimal"


def test_pad_to_fit_examples():
    assert pad_to_fit(10, 3, 4) == (0, 1)
    assert pad_to_fit(8, 4, 3) == (1, 1)
    assert pad_to_fit(9, 3, 3) == (0, 0)
    assert pad_to_fit(2, 5, 1) == (1, 2)  # shorter than the window


@pytest.mark.parametrize(
    "args",
    [
        pytest.param((0, 3, 1), id="length0"),
        pytest.param((5, 0, 1), id="kernel0"),
        pytest.param((5, 3, 0), id="stride0"),
    ],
)
def test_pad_to_fit_rejects_non_positive(args):
    with pytest.raises(ValueError, match="must be >= 1"):
        pad_to_fit(*args)


# --- sample_windows ------------------------------------------------------------------------------


def reference_sample(x: np.ndarray, mask: np.ndarray, window: int, stride: int, mode: str):
    lo, hi = pad_to_fit(x.shape[1], window, stride)
    np_mode = "reflect" if x.shape[1] > max(lo, hi) else "edge"
    xp = np.pad(x, [(0, 0), (lo, hi), (0, 0)], mode=np_mode)
    mp = np.pad(mask, [(0, 0), (lo, hi)], constant_values=False)
    n = 1 + (xp.shape[1] - window) // stride
    values = np.zeros((x.shape[0], n, x.shape[2]), dtype=np.float64)
    keep = np.zeros((x.shape[0], n), dtype=bool)
    for b, j in itertools.product(range(x.shape[0]), range(n)):
        seg, m = xp[b, j * stride : j * stride + window], mp[b, j * stride : j * stride + window]
        keep[b, j] = m.any()
        if mode == "stride":
            values[b, j] = seg[0]
        elif m.any():
            values[b, j] = seg[m].mean(axis=0) if mode == "mean" else seg[m].max(axis=0)
    return values, keep, xp.shape[1]


@pytest.mark.parametrize("mode", [pytest.param(m, id=m) for m in ("mean", "max", "stride")])
@pytest.mark.parametrize(
    ("length", "window", "stride"),
    [
        pytest.param(20, 4, 4, id="fits"),
        pytest.param(21, 4, 3, id="tail"),
        pytest.param(17, 5, 2, id="odd-padding"),
        pytest.param(3, 8, 2, id="shorter-than-window"),
        pytest.param(1, 1, 1, id="single"),
    ],
)
@pytest.mark.parametrize("masked", [pytest.param(False, id="nomask"), pytest.param(True, id="mask")])
def test_sample_windows_matches_loops(rng, mode, length, window, stride, masked):
    x = rng.standard_normal((3, length, 2))
    mask = rng.random((3, length)) > 0.4 if masked else np.ones((3, length), dtype=bool)
    if masked:
        mask[1] = False  # a sequence with nothing valid: every window is masked out
    values, keep = sample_windows(
        torch.from_numpy(x), window, stride, mode=mode, mask=torch.from_numpy(mask) if masked else None
    )
    want_values, want_keep, padded = reference_sample(x, mask, window, stride, mode)
    assert values.shape == (3, 1 + (padded - window) // stride, 2) and keep.shape == values.shape[:2]
    np.testing.assert_array_equal(keep.numpy(), want_keep)
    # float64 sums of at most `window` elements: summation order differs from the loop's
    np.testing.assert_allclose(values.numpy(), want_values, rtol=1e-12, atol=1e-12)


def test_masked_mean_ignores_padding():
    # One window over [1, 2, 3] padded to length 4: the reflected value must not enter the mean.
    x = torch.tensor([[[1.0], [2.0], [3.0]]])
    values, keep = sample_windows(x, 4, 4, mode="mean")
    assert pad_to_fit(3, 4, 4) == (0, 1)
    assert values.item() == pytest.approx(2.0) and keep.item()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"mode": "median"}, "mode='median'", id="mode"),
        pytest.param({"mask": torch.ones(2, 5, dtype=torch.bool)}, "mask of shape", id="mask-shape"),
    ],
)
def test_sample_windows_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_windows(torch.zeros(1, 6, 2), 2, 2, **kwargs)


def test_sample_windows_needs_3d():
    with pytest.raises(ValueError, match=r"must be \(B, L, D\)"):
        sample_windows(torch.zeros(6, 2), 2, 2)
