"""Option values shared by the server, the ``tilewise`` commands and the batch client.

Standard library only: the batch client and the command parsers import it without torch, FastAPI
or numpy. Each list is written here once; :data:`BLENDS` mirrors :class:`tiling.BlendMode` (a test
keeps them equal, as the client may not import torch).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

__all__ = [
    "BLENDS",
    "FORMATS",
    "FORMAT_SUFFIXES",
    "OUTPUTS",
    "argparse_number",
    "blank_to_none",
]

#: Blend windows (the values of :class:`tiling.BlendMode`).
BLENDS = ("constant", "gaussian", "hann", "triangular")
#: Output kinds: float32 probabilities, or uint8 argmax labels.
OUTPUTS = ("probabilities", "labels")
#: Output formats the server and ``tilewise infer`` write, with the file suffix of each.
FORMAT_SUFFIXES: dict[str, str] = {
    "nii.gz": ".nii.gz",
    "nii": ".nii",
    "png": ".png",
    "tiff": ".tiff",
    "npy": ".npy",
}
#: The output format names (``format=`` / ``--format``).
FORMATS = tuple(FORMAT_SUFFIXES)

N = TypeVar("N", int, float)


def argparse_number(kind: type[N], minimum: N, *, strict: bool = False) -> Callable[[str], N]:
    """An argparse ``type=`` that parses ``kind`` and requires ``>= minimum`` (``> minimum`` if
    ``strict``), with a message naming the value: ``argparse_number(int, 1)`` for a count.
    """
    noun = "an integer" if kind is int else "a number"
    relation = ">" if strict else ">="

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not (value > minimum if strict else value >= minimum):  # also refuses NaN
            raise argparse.ArgumentTypeError(f"{value} must be {relation} {minimum}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
    return parse


def blank_to_none(value: object) -> object:
    """A pydantic "before" validator: an empty string (``TILEWISE_API_KEY=``) means unset."""
    return None if isinstance(value, str) and not value else value
