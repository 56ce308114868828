"""Command-line glue shared by the ``tilewise`` commands, the server settings and the batch client.

Light (argparse, pydantic, :mod:`models.planning.params`): the batch client and the command parsers import
it without torch or FastAPI. The inference options are generated from
:class:`~models.planning.params.InferenceParams`, so a new parameter appears on every command by itself.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any, TypeVar

from models.planning.params import REQUEST_ONLY, InferenceParams, OutputFormat

__all__ = [
    "FORMAT_SUFFIXES",
    "INPUT_HELP",
    "HelpFormatter",
    "add_param_options",
    "argparse_bytes",
    "argparse_number",
    "blank_to_none",
    "bytes_with_unit",
    "comma_list",
    "param_values",
    "parse_bytes",
    "plain_text",
]

#: Output formats and the file suffix of each (``nii.gz`` -> ``.nii.gz``).
FORMAT_SUFFIXES: dict[str, str] = {f.value: f.suffix for f in OutputFormat}
_DEST = "param_"

N = TypeVar("N", int, float)


#: The help of a command's input file (``tilewise infer``, ``tilewise plan``).
INPUT_HELP = (
    "input file: NIfTI-1/2 (.nii, .nii.gz), PNG, JPEG, TIFF, a whole-slide image (SVS, NDPI, "
    "OME-TIFF ...: the slides extra), or DICOM: a file, the folder or .zip of one series "
    "(the dicom extra)"
)


def add_param_options(parser: Any, *, choices: bool = True) -> None:
    """Add one ``--name`` option per :class:`InferenceParams` field (``batch_size`` -> ``--batch-size``).

    Values stay text; :func:`models.planning.params.parse_params` validates them (``param_values(args)``).
    With ``choices``, closed sets are argparse choices (a wrong value exits with status 2). A help
    text gets "(default: the model's)" unless its description states a default itself (the group's
    title says that the model's spec comes first).
    """
    for name, field in InferenceParams.model_fields.items():
        if name in REQUEST_ONLY:
            continue
        allowed = InferenceParams.choices(name) if choices else None
        text = (field.description or "").replace("`", "")
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=_DEST + name,
            metavar=None if allowed else name.upper(),
            choices=allowed,
            help=text if "default" in text.lower() else text + " (default: the model's)",
        )


def param_values(args: argparse.Namespace) -> dict[str, str]:
    """The inference options given on the command line, by parameter name (as text)."""
    values = {
        name: getattr(args, _DEST + name, None)
        for name in InferenceParams.model_fields
        if name not in REQUEST_ONLY
    }
    return {name: str(value) for name, value in values.items() if value is not None}


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


def parse_bytes(text: str) -> int:
    """Bytes from ``300000000``, ``300MB``, ``300 MiB`` or ``2GiB`` (pydantic's ``ByteSize``: kB,
    MB, GB are powers of 1000, KiB, MiB, GiB of 1024).

    Raises:
        ValueError: not a size, or below 1 byte.
    """
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        value = int(TypeAdapter(ByteSize).validate_python(text.strip()))
    except ValidationError:
        raise ValueError(f"{text!r} is not a size in bytes (e.g. 300000000, 300MB, 2GiB)") from None
    if value < 1:
        raise ValueError(f"{text!r}: a size must be at least 1 byte")
    return value


def argparse_bytes(text: str) -> int:
    """An argparse ``type=`` for a size in bytes, with or without a unit (:func:`parse_bytes`)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def bytes_with_unit(value: object) -> object:
    """A pydantic "before" validator: ``TILEWISE_MEMORY_BUDGET=300MB`` as bytes (:func:`parse_bytes`);
    an empty string means unset."""
    if isinstance(value, str):
        return parse_bytes(value) if value.strip() else None
    return value


def blank_to_none(value: object) -> object:
    """A pydantic "before" validator: an empty string (``TILEWISE_API_KEY=``) means unset."""
    return None if isinstance(value, str) and not value else value


def comma_list(value: object) -> object:
    """A pydantic "before" validator: ``"a, b"`` -> ``("a", "b")``; an empty string is ``None``."""
    if isinstance(value, str):
        items = tuple(item.strip() for item in value.split(",") if item.strip())
        return items or None
    return value


# :role:`~a.b.C` -> C, :role:`text` -> text, ``code`` -> code, `text` -> text, "Example::" -> "Example:".
_ROLE_TILDE = re.compile(r":[\w:.-]+:`~(?:[\w.]+\.)?([^`]+)`")
_ROLE = re.compile(r":[\w:.-]+:`([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_INTERPRETED = re.compile(r"`([^`]+)`")
_DOUBLE_COLON = re.compile(r"(?<=\S)::(?=\s*$)", re.MULTILINE)


def plain_text(text: str | None) -> str | None:
    """``text`` (a docstring) with its reStructuredText markup removed, for ``--help``."""
    if not text:
        return text
    for pattern in (_ROLE_TILDE, _ROLE, _LITERAL, _INTERPRETED):
        text = pattern.sub(r"\1", text)
    return _DOUBLE_COLON.sub(":", text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (paragraphs kept); every option with a default says it.

    An option whose help does not mention its default gets ``(default: VALUE)`` appended when the
    default is a value (not ``None``, ``False`` or suppressed); ``None`` defaults are explained in
    the help text itself ("default: the model's").
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default not in (None, False, argparse.SUPPRESS)
            and "default" not in text.lower()
        ):
            text += " (default: %(default)s)"
        return text
