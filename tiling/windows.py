"""Dense sliding windows over the last two axes, padding to fit, and 1-D sequence window sampling.

Three routes give the same ``(..., nH, nW, kh, kw)`` windows and are tested equal:

- ``"unfold"``: chained ``Tensor.unfold`` (a view);
- ``"im2col"``: ``torch.nn.functional.unfold`` (a copy, the im2col of convolution);
- ``"as_strided"``: ``Tensor.as_strided`` with strides read from the input, so non-contiguous
  inputs work (a view).

With ``nH = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1`` (PyTorch's ``Conv2d`` output size); a tail
that does not fill a window is dropped, which is why :func:`pad_to_fit` exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["pad_to_fit", "sample_windows", "sliding_windows"]

_METHODS = ("unfold", "im2col", "as_strided")
_MODES = ("mean", "max", "stride")


def _pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(value, Sequence):
        if len(value) != 2:
            raise ValueError(f"{name}={tuple(value)} must be an int or a pair (h, w)")
        return int(value[0]), int(value[1])
    return int(value), int(value)


def sliding_windows(
    x: torch.Tensor,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    method: str = "unfold",
) -> torch.Tensor:
    """All ``kernel_size`` windows of ``x`` with ``stride``, as ``(..., nH, nW, kh, kw)``.

    Args:
        x: ``(..., H, W)`` tensor (any leading dims, any strides).
        kernel_size: ``k`` or ``(kh, kw)``.
        stride: step between windows, ``s`` or ``(sh, sw)``.
        padding: zeros added on both sides, ``p`` or ``(ph, pw)``.
        dilation: spacing between window elements, ``d`` or ``(dh, dw)``.
        method: ``"unfold"``, ``"im2col"`` or ``"as_strided"``.

    Returns:
        ``(..., nH, nW, kh, kw)``; a read-only-by-convention view for ``unfold``/``as_strided``
        (writing to it writes to ``x``), a copy for ``im2col``.

    Raises:
        ValueError: an unknown method, ``x`` with fewer than 2 dims, a non-positive kernel, stride
            or dilation, negative padding, or a window larger than the padded input.

    >>> sliding_windows(torch.arange(12.).reshape(3, 4), 2, stride=2).shape
    torch.Size([1, 2, 2, 2])
    """
    if method not in _METHODS:
        raise ValueError(f"method={method!r} is not one of {list(_METHODS)}")
    if x.dim() < 2:
        raise ValueError(f"x of shape {tuple(x.shape)} needs at least 2 dims (..., H, W)")
    kh, kw = _pair(kernel_size, "kernel_size")
    sh, sw = _pair(stride, "stride")
    ph, pw = _pair(padding, "padding")
    dh, dw = _pair(dilation, "dilation")
    if min(kh, kw, sh, sw, dh, dw) < 1 or min(ph, pw) < 0:
        raise ValueError(
            f"kernel_size={(kh, kw)}, stride={(sh, sw)}, dilation={(dh, dw)} must be >= 1 and "
            f"padding={(ph, pw)} >= 0"
        )
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    H, W = x.shape[-2:]
    eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    if eh > H or ew > W:
        raise ValueError(
            f"window {(eh, ew)} (kernel_size={(kh, kw)}, dilation={(dh, dw)}) is larger than the "
            f"padded input {(H, W)}"
        )
    nh, nw = (H - eh) // sh + 1, (W - ew) // sw + 1
    lead = x.shape[:-2]
    if method == "unfold":
        win = x.unfold(-2, eh, sh).unfold(-2, ew, sw)  # (..., nH, nW, eh, ew)
        return win[..., ::dh, ::dw]
    if method == "as_strided":
        *lead_strides, s_h, s_w = x.stride()
        return x.as_strided(
            (*lead, nh, nw, kh, kw),
            (*lead_strides, s_h * sh, s_w * sw, s_h * dh, s_w * dw),
            x.storage_offset(),
        )
    flat = x.reshape(-1, 1, H, W)
    cols = F.unfold(flat, (kh, kw), dilation=(dh, dw), stride=(sh, sw))  # (B, kh*kw, nH*nW)
    cols = cols.reshape(-1, kh, kw, nh, nw).permute(0, 3, 4, 1, 2)
    return cols.reshape(*lead, nh, nw, kh, kw)


def pad_to_fit(length: int, kernel_size: int, stride: int) -> tuple[int, int]:
    """Smallest padding so that windows of ``kernel_size`` with ``stride`` end exactly at the end.

    Takes the smallest total ``p >= 0`` with ``(length + p - kernel_size) % stride == 0`` and
    ``length + p >= kernel_size``, split as ``(p // 2, p - p // 2)`` (asymmetric when ``p`` is odd).

    Raises:
        ValueError: a non-positive length, kernel size or stride.

    >>> pad_to_fit(10, 3, 4)
    (0, 1)
    >>> pad_to_fit(8, 4, 3)
    (1, 1)
    """
    if length < 1 or kernel_size < 1 or stride < 1:
        raise ValueError(f"length={length}, kernel_size={kernel_size}, stride={stride} must be >= 1")
    p = max(kernel_size - length, 0)
    p += (-(length + p - kernel_size)) % stride
    return p // 2, p - p // 2


def sample_windows(
    x: torch.Tensor,
    window: int,
    stride: int,
    mode: str = "mean",
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool a sequence ``(B, L, D)`` over windows to ``(B, L_out, D)``.

    The sequence is reflect-padded with :func:`pad_to_fit` so no tail is dropped; padded positions
    are masked out. ``L_out = 1 + (L_padded - window) // stride``.

    Args:
        x: ``(B, L, D)`` values.
        window: window length (> 0).
        stride: step between windows (> 0).
        mode: ``"mean"`` (over valid elements), ``"max"`` (over valid elements) or ``"stride"``
            (each window's first element).
        mask: ``(B, L)`` bool, True for valid elements; default all valid.

    Returns:
        ``(values (B, L_out, D), mask_out (B, L_out))``, ``mask_out`` being ``any`` over each
        window; windows with no valid element give 0 for ``mean`` and ``max``.

    Raises:
        ValueError: an unknown mode, ``x`` not 3-D, or a mask of the wrong shape.
    """
    if mode not in _MODES:
        raise ValueError(f"mode={mode!r} is not one of {list(_MODES)}")
    if x.dim() != 3:
        raise ValueError(f"x of shape {tuple(x.shape)} must be (B, L, D)")
    B, L, D = x.shape
    if mask is None:
        mask = torch.ones((B, L), dtype=torch.bool, device=x.device)
    if tuple(mask.shape) != (B, L):
        raise ValueError(f"mask of shape {tuple(mask.shape)} must be (B, L) = {(B, L)}")
    lo, hi = pad_to_fit(L, window, stride)
    if lo or hi:
        seq = x.transpose(1, 2)  # (B, D, L)
        if L > max(lo, hi):
            seq = F.pad(seq, (lo, hi), mode="reflect")
        else:
            seq = F.pad(seq, (lo, hi), mode="replicate")
        x = seq.transpose(1, 2)
        mask = F.pad(mask, (lo, hi), value=False)
    xw = x.unfold(1, window, stride)  # (B, L_out, D, window)
    mw = mask.unfold(1, window, stride)  # (B, L_out, window)
    mask_out = mw.any(dim=-1)
    if mode == "stride":
        return xw[..., 0], mask_out
    m = mw.unsqueeze(2)  # (B, L_out, 1, window)
    if mode == "mean":
        total = torch.where(m, xw, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1)
        count = m.sum(-1).clamp(min=1).to(x.dtype)
        return total / count, mask_out
    neg = torch.full((), float("-inf"), dtype=x.dtype, device=x.device)
    values = torch.where(m, xw, neg).amax(-1)
    return torch.where(mask_out.unsqueeze(-1), values, torch.zeros_like(values)), mask_out
