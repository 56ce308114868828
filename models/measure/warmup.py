"""Warm-up checks: a spec's ``out_channels``, ``alignment`` and ``scale`` against a real forward pass.

A spec that claims 3 output channels for a 2-channel network, or an alignment the network does not
have, would otherwise be found out in the middle of a request (or never: a wrong ``scale`` tiles
silently wrong). :func:`check_forward` runs one batch at a size that is a multiple of the spec's
alignment and an odd multiple of it (so a network that needs twice the alignment fails here), and
raises :class:`~models.errors.SpecError` naming the spec file and the field. :func:`reason` turns
any load or warm-up failure into the one-line ``reason`` of an unavailable model.
"""

from __future__ import annotations

import logging

import torch

from models.backends import BasePredictor
from models.errors import InferenceError, ModelError, SpecError, WeightsError
from models.spec import ModelSpec

__all__ = ["check_forward", "check_size", "reason"]

logger = logging.getLogger(__name__)


def check_size(alignment: int, minimum: int = 8) -> int:
    """``alignment * m`` for the smallest odd ``m`` with a result of at least ``minimum`` voxels.

    >>> check_size(1), check_size(4), check_size(16), check_size(32)
    (9, 12, 16, 32)
    """
    m = max(1, -(-minimum // alignment))
    return alignment * (m if m % 2 else m + 1)


def check_forward(spec: ModelSpec, predictor: BasePredictor) -> None:
    """Run ``(1, in_channels, *size)`` zeros and compare the output with the spec.

    Raises:
        SpecError: the network fails on a multiple of ``alignment`` (field ``alignment``), returns
            another number of channels (``out_channels``) or another spatial size than
            ``size * scale`` (``scale``, or ``alignment`` when the ratio is not an integer).
    """
    size = check_size(spec.alignment_lcm)
    shape = [size] * spec.spatial_dims
    if spec.fixed_tile and spec.defaults.tile is not None:  # a transformer: its one input size
        shape = [int(t) for t in spec.defaults.tile]  # type: ignore[union-attr]
        size = shape[0]
    batch = torch.zeros((1, spec.in_channels, *shape))
    try:
        out = predictor(batch)
    except InferenceError as exc:
        raise SpecError(
            f"{spec.where}: field 'alignment' is {spec.alignment}, but the network fails on a tile of "
            f"{size} voxels per axis (a multiple of it): {exc}"
        ) from exc
    if out.ndim != spec.spatial_dims + 2 or out.shape[0] != 1:
        raise SpecError(
            f"{spec.where}: field 'spatial_dims' is {spec.spatial_dims}, the network returns "
            f"{tuple(out.shape)}"
        )
    if out.shape[1] != spec.out_channels:
        raise SpecError(
            f"{spec.where}: field 'out_channels' is {spec.out_channels}, the network returns {out.shape[1]}"
        )
    got = tuple(int(s) for s in out.shape[2:])
    if got != tuple(s * spec.scale for s in shape):
        ratios = {s / size for s in got}
        ratio = ratios.pop() if len(ratios) == 1 else None
        if ratio is not None and ratio == int(ratio) and ratio >= 1:
            raise SpecError(
                f"{spec.where}: field 'scale' is {spec.scale}, the network's output is {int(ratio)}x"
            )
        raise SpecError(
            f"{spec.where}: field 'alignment' is {spec.alignment}: a tile of {size} voxels per axis gives "
            f"{got}, not {size * spec.scale} (the network needs a larger size divisor)"
        )
    logger.debug("model %s: forward check passed at %d voxels per axis", spec.name, size)


def reason(spec: ModelSpec | None, exc: BaseException) -> str:
    """One line saying why a model is unavailable, naming its spec file and the field when known."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if spec is None or isinstance(exc, SpecError) and str(spec.source or "") in text:
        return text
    if isinstance(exc, WeightsError):
        return f"{spec.where}: field 'file': {text}"
    if isinstance(exc, ModelError):
        return f"{spec.where}: {text}"
    return f"{spec.where}: {type(exc).__name__}: {text}"
