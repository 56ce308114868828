"""Measure what a network file does not say: layout, channels, alignment, scale, reach, tile dependence.

Shapes: ``C`` input channels, ``S`` spatial axes; every probe input is ``(1, C, *S)`` float32.

1. **Layout**: the spatial dims and input channels come from the caller (an ONNX graph's input
   shape, the first convolution of a TorchScript module) when it knows them; otherwise every
   combination of 3, 2, 1 spatial axes and 1, 3, 2, 4 channels is tried, on a few base sizes, until
   one runs and returns ``(1, C_out, *S')``. Output channels and ``scale = S' / S`` (an integer)
   come from that run.
2. **Alignment** (the smallest size divisor that works): per axis, the sizes ``base + d`` for
   ``d = 1, 2, ...`` until one runs and returns exactly ``(base + d) * scale`` voxels
   (``alignment_per_axis``, checked together at ``base + 2 * d`` per axis); ``alignment`` is their
   lcm and the network's total stride, checked once more at ``base + 2 * alignment``. The total
   stride (eager modules only) is read from the feature maps of one pass at 64 voxels per axis
   (3-D; 256 in 2-D): input size over the smallest feature map larger than one voxel. It matters
   for networks that pad or crop their skip connections to make any size run eagerly (MONAI's
   ``BasicUNet``): their traced graph keeps the pads of the traced size, so only sizes on the
   stride grid (where the pads are zero) run exported; such a network gets that stride on every axis.
3. **Tile dependence**: :func:`models.measure.dependence.probe_tile_dependence` at the network's window.
4. **Fixed window** (vision transformers): a network built around self-attention over patch tokens
   (MONAI's ``SABlock`` in UNETR/ViT, ``WindowAttention`` in SwinUNETR, ``nn.MultiheadAttention``),
   or one that runs at the caller's window and at no size near it, takes exactly one tile shape:
   UNETR's position embeddings hold ``img_size / patch_size`` tokens, and SwinUNETR's traced graph
   keeps the window partition of the size it was traced at. Such a network's facts are its window:
   ``fixed_shape = alignment_per_axis = tile_shape``, tile-dependent (attention is global in a
   tile), no receptive field; it is served with the source framework's blended windows.
5. **Receptive field** (local networks only): the impulse probe of :mod:`models.measure.receptive` on
   inputs long along one axis and narrow on the others, grown while the response reaches the
   probe's edge (up to 96 voxels in 3-D, 1024 in 2-D); ``None`` (and tile-dependent) when it never
   stops reaching the edge.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from models.errors import ImportRefusedError
from models.measure.dependence import probe_tile_dependence
from models.measure.receptive import probe_input, probe_receptive_field

__all__ = ["NetworkFacts", "probe_network"]

logger = logging.getLogger(__name__)

#: Base sizes tried per spatial dims (a network with a larger total stride needs a larger base).
_BASES = {3: (32, 64, 128), 2: (64, 128, 256), 1: (256, 1024)}
_CHANNELS = (1, 3, 2, 4)
_FIRST_PROBE = {1: 1024, 2: 128, 3: 40}
_MAX_PROBE = {1: 8192, 2: 1024, 3: 96}
_STRIDE_PROBE = {1: 1024, 2: 256, 3: 64}

Run = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class NetworkFacts:
    """What :func:`probe_network` measured.

    Attributes:
        spatial_dims: number of spatial axes.
        in_channels: input channels.
        out_channels: output channels.
        alignment: smallest size divisor that works (lcm over the axes).
        scale: output voxels per input voxel.
        receptive_field: radius per axis (voxels), ``None`` when unbounded within the probes.
        tile_dependent: the tile-dependence probe's verdict.
        seconds: wall time of all probes.
        alignment_per_axis: the smallest size divisor of each axis (their lcm is ``alignment``).
        fixed_shape: the one tile shape (voxels per axis) a fixed-window network takes (module
            docstring, step 4), ``None`` for a network that runs at any aligned size.
    """

    spatial_dims: int
    in_channels: int
    out_channels: int
    alignment: int
    scale: int
    receptive_field: tuple[int, ...] | None
    tile_dependent: bool
    seconds: float
    alignment_per_axis: tuple[int, ...] = ()
    fixed_shape: tuple[int, ...] | None = None


#: Module classes of self-attention over tokens (a transformer's patch grid is fixed).
_ATTENTION = frozenset({"SABlock", "WindowAttention", "MultiheadAttention", "CrossAttentionBlock"})


def attention_modules(run: Run) -> list[str]:
    """Names of the self-attention modules of an eager network (:data:`_ATTENTION` classes), if any."""
    if not isinstance(run, nn.Module):
        return []
    return [name for name, m in run.named_modules() if type(m).__name__ in _ATTENTION]


def _fixed_facts(
    run: Run,
    name: str,
    spatial_dims: int | None,
    in_channels: int | None,
    window: Sequence[int],
    start: float,
) -> NetworkFacts | None:
    """The facts of a network that takes exactly ``window`` (see the module docstring), or ``None``
    when it does not run at ``window`` with an output of that spatial shape."""
    shape = [int(w) for w in window]
    if spatial_dims not in (None, len(shape)):
        return None
    for channels in (in_channels,) if in_channels else _CHANNELS:
        y = _output(run, channels, shape)
        if y is None:
            continue
        if tuple(y.shape[2:]) != tuple(shape):
            return None
        facts = NetworkFacts(
            len(shape), channels, int(y.shape[1]), math.lcm(*shape), 1, None, True,
            time.perf_counter() - start, tuple(shape), tuple(shape),
        )  # fmt: skip
        logger.info("%s: takes exactly %s (fixed window): %s", name, tuple(shape), facts)
        return facts
    return None


class _Net:
    """A forward function with the metadata :func:`probe_receptive_field` reads."""

    def __init__(self, run: Run, spatial_dims: int, in_channels: int, alignment: int, scale: int) -> None:
        self.run = run
        self.spatial_dims = spatial_dims
        self.in_channels = in_channels
        self.alignment = alignment
        self.scale = scale

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return self.run(batch)


def _output(run: Run, channels: int, shape: Sequence[int]) -> torch.Tensor | None:
    """The output for a zero-free random input of ``shape``, or ``None`` when the network refuses it."""
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((1, channels, *shape)).astype(np.float32))
    try:
        with torch.inference_mode():
            y = run(x)
    except Exception as exc:  # any runtime refuses a wrong shape in its own way
        logger.debug("probe %s: refused (%s)", tuple(shape), str(exc).splitlines()[0] if str(exc) else exc)
        return None
    if not isinstance(y, torch.Tensor) or y.ndim != len(shape) + 2 or y.shape[0] != 1:
        return None
    return y


def _fits(run: Run, channels: int, shape: Sequence[int], scale: int) -> bool:
    y = _output(run, channels, shape)
    return y is not None and tuple(y.shape[2:]) == tuple(s * scale for s in shape)


def _layout(
    run: Run, name: str, spatial_dims: int | None, in_channels: int | None
) -> tuple[int, int, int, int, int]:
    """``(spatial_dims, in_channels, out_channels, scale, base)`` of the first layout that runs."""
    for dims in (spatial_dims,) if spatial_dims else (3, 2, 1):
        for channels in (in_channels,) if in_channels else _CHANNELS:
            for base in _BASES[dims]:
                y = _output(run, channels, (base,) * dims)
                if y is None:
                    continue
                ratios = {s / base for s in y.shape[2:]}
                scale = ratios.pop() if len(ratios) == 1 else None
                if scale is None or scale < 1 or scale != int(scale):
                    raise ImportRefusedError(
                        f"{name}: output spatial shape {tuple(y.shape[2:])} for input {(base,) * dims} is "
                        "not an integer multiple of the input (field 'scale' must be a positive integer)"
                    )
                return dims, channels, int(y.shape[1]), int(scale), base
    tried = f"{spatial_dims or '1-3'} spatial dims, {in_channels or list(_CHANNELS)} channels"
    raise ImportRefusedError(f"{name}: no input layout runs ({tried}): cannot tell spatial_dims, in_channels")


def _alignment(run: Run, name: str, dims: int, channels: int, scale: int, base: int) -> tuple[int, ...]:
    per_axis = []
    for axis in range(dims):
        for d in range(1, base + 1):
            shape = [base + d if a == axis else base for a in range(dims)]
            if _fits(run, channels, shape, scale):
                per_axis.append(d)
                break
        else:
            raise ImportRefusedError(f"{name}: no size from {base + 1} to {2 * base} works on axis {axis}")
    alignment = math.lcm(*per_axis)
    check = [base + 2 * alignment] * dims
    if not _fits(run, channels, check, scale):
        raise ImportRefusedError(f"{name}: alignment {alignment} measured, but size {check} fails")
    odd = [base + 2 * a for a in per_axis]  # each axis at its own step
    if len(set(per_axis)) > 1 and not _fits(run, channels, odd, scale):
        return (alignment,) * dims
    return tuple(per_axis)


def _stride_alignment(run: Run, dims: int, channels: int, base: int) -> int:
    """The total stride of an eager ``nn.Module`` from its feature maps (1 when it cannot be read)."""
    if not isinstance(run, nn.Module) or isinstance(run, torch.jit.ScriptModule):
        return 1
    for size in dict.fromkeys((max(_STRIDE_PROBE[dims], base), base)):
        sizes: list[int] = []

        def record(_module: nn.Module, inputs: object, output: object, sizes: list[int] = sizes) -> None:
            for t in (*(inputs if isinstance(inputs, tuple) else (inputs,)), output):
                if isinstance(t, torch.Tensor) and t.ndim == dims + 2:
                    sizes.extend(int(v) for v in t.shape[2:])

        handles = [m.register_forward_hook(record) for m in run.modules()]
        try:
            found = _output(run, channels, (size,) * dims) is not None
        finally:
            for handle in handles:
                handle.remove()
        if found:
            ratios = [size // s for s in sizes if 1 < s < size and size % s == 0]
            return max(ratios, default=1)
    return 1


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _receptive_field(net: _Net) -> tuple[tuple[int, ...] | None, int]:
    """Radius per axis (``None`` when unbounded) and the largest probe size used."""
    dims, align = net.spatial_dims, net.alignment
    size = _FIRST_PROBE[dims]
    while True:
        long = _round_up(size, align)
        narrow = _round_up(min(size, max(32, 4 * align)), align)
        radius, bounded = [], True
        for axis in range(dims):
            shape = [long if a == axis else narrow for a in range(dims)]
            result = probe_receptive_field(net, base=probe_input(net, shape), batch_size=3, quiet=True)
            radius.append(result.radius[axis])
            bounded = bounded and result.radius[axis] < long // 2 - 1
        if bounded:
            return tuple(radius), long
        if size >= _MAX_PROBE[dims]:
            return None, long
        size = min(2 * size, _MAX_PROBE[dims])


def probe_network(
    run: Run,
    *,
    name: str,
    spatial_dims: int | None = None,
    in_channels: int | None = None,
    tile_shape: Sequence[int] | None = None,
    alignment: int | None = None,
) -> NetworkFacts:
    """Measure layout, channels, alignment, scale, tile dependence and receptive field of ``run``.

    The tile-dependence probe runs first, at ``tile_shape`` (the network's window, e.g. MONAI's
    ``roi_size`` or nnU-Net's patch; default 96 voxels per axis in 3-D, 256 otherwise): a
    tile-dependent network's receptive field is not probed (no halo makes its tiles exact).

    Args:
        run: the network's forward function, ``(1, C, *S)`` float32 tensor -> tensor.
        name: the model's name for messages.
        spatial_dims: known number of spatial axes (else tried).
        in_channels: known input channels (else tried).
        tile_shape: the window the network is run on (voxels per axis), when known.
        alignment: the size divisor when the source says it (nnU-Net's pooling strides): checked
            at two sizes instead of searched.

    Returns:
        The facts; ``fixed_shape`` is set (to ``tile_shape``) for a network that takes exactly one
        tile shape (module docstring, step 4).

    Raises:
        ImportRefusedError: no layout runs, the output is not an integer multiple of the input, or
            no size divisor works (the message names what was tried).
    """
    start = time.perf_counter()
    if tile_shape is not None and attention_modules(run):
        fixed = _fixed_facts(run, name, spatial_dims, in_channels, tile_shape, start)
        if fixed is None:
            raise ImportRefusedError(
                f"{name}: a transformer (self-attention: {attention_modules(run)[0]}) takes one input "
                f"size, and it fails at the window {tuple(tile_shape)} (its img_size must be the window)"
            )
        return fixed
    try:
        dims, channels, out_channels, scale, base = _layout(run, name, spatial_dims, in_channels)
        per_axis: tuple[int, ...] = ()
        if alignment is None:
            per_axis = _alignment(run, name, dims, channels, scale, base)
    except ImportRefusedError:
        fixed = _fixed_facts(run, name, spatial_dims, in_channels, tile_shape, start) if tile_shape else None
        if fixed is None:
            raise
        return fixed
    if alignment is None:
        measured = math.lcm(*per_axis)
        stride = _stride_alignment(run, dims, channels, base)
        alignment = math.lcm(measured, stride)
        if alignment != measured:
            logger.info("%s: sizes from %d run, stride %d: alignment %d", name, measured, stride, alignment)
            for size in (base + alignment, base + 2 * alignment):
                if not _fits(run, channels, [size] * dims, scale):
                    raise ImportRefusedError(f"{name}: total stride {alignment}, but size {size} fails")
            per_axis = (alignment,) * dims
    else:
        for size in (base + alignment, base + 2 * alignment):
            if not _fits(run, channels, [size] * dims, scale):
                raise ImportRefusedError(f"{name}: alignment {alignment} given, but size {size} fails")
    window = list(tile_shape) if tile_shape is not None else [96 if dims == 3 else 256] * dims
    window = [_round_up(max(int(t), base), alignment) for t in window]
    if scale == 1:
        dependent = probe_tile_dependence(
            run, spatial_dims=dims, in_channels=channels, tile_shape=window, alignment=alignment
        ).tile_dependent
    else:  # the dependence probe compares outputs voxel for voxel with the input
        dependent = False
    radius = None
    if not dependent:
        radius, _ = _receptive_field(_Net(run, dims, channels, alignment, scale))
        dependent = radius is None
    facts = NetworkFacts(
        dims,
        channels,
        out_channels,
        alignment,
        scale,
        radius,
        dependent,
        time.perf_counter() - start,
        per_axis or (alignment,) * dims,
    )
    logger.info("%s: probed %s", name, facts)
    return facts
