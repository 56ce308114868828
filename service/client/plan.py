"""Which files a batch run sends, and where each output goes (no network, no image decoding).

A file is sent when its content is a format the server reads (:mod:`service.sniff`) or, when its
content is unknown, its name claims one (``.nii``, ``.nii.gz``, ``.png``, ``.jpg``, ``.jpeg``,
``.tif``, ``.tiff``), so a corrupt scan is reported with the server's error instead of vanishing
silently. DICOM (``DICM`` at byte 128, whatever the name) is never sent: it is listed as skipped
with what to do instead.

Every path the walk meets is in the result, so the report lists every input:

- **Symlinks to files** are followed wherever they point: a folder of links to data stored
  elsewhere (nnU-Net's ``imagesTs`` is often built so) is the user's own data, read as the user.
  **Symlinks to folders** are followed only when their fully resolved target stays inside
  INPUT_DIR. A dangling link, a link loop, a link to a folder outside INPUT_DIR and a link to a
  folder that contains it are listed as ``skipped`` with the reason. Outputs are never written
  outside OUTPUT_DIR (:mod:`service.client.outdir`), wherever an input lies.
- Anything that is not a regular file (FIFO, socket, device) is listed as ``skipped``; a file that
  cannot be read is listed as ``failed`` with the error. ``--pattern``
globs narrow the walk first. Names starting with ``.`` (temporary outputs, ``.git``) are never
walked, nor is OUTPUT_DIR when it lies inside INPUT_DIR.

Output paths mirror the input tree with the suffix of the output format::

    a/b/scan.nii.gz  --nii.gz-->  a/b/scan.nii.gz
    x/page.jpg       --png----->  x/page.png
    x/page.jpg       --tiff---->  x/page.tiff
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from service.options import FORMAT_SUFFIXES
from service.sniff import KINDS, slide_kind, sniff_file

__all__ = [
    "FORMAT_SUFFIXES",
    "Candidate",
    "discover",
    "glob_to_regex",
    "inside",
    "output_format",
    "output_relpath",
    "unwalked_folders",
]

logger = logging.getLogger(__name__)

#: Input suffixes (lower case, longest first) and the kind of file each claims to be.
_INPUT_SUFFIXES = (
    (".nii.gz", "nifti"),
    (".nii", "nifti"),
    (".png", "png"),
    (".jpeg", "jpeg"),
    (".jpg", "jpeg"),
    (".tiff", "tiff"),
    (".tif", "tiff"),
)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One file found under INPUT_DIR.

    Attributes:
        path: the file on disk.
        rel: its path relative to INPUT_DIR (POSIX separators).
        size_bytes: file size.
        kind: what its content is (``nifti``, ``png``, ``jpeg``, ``tiff``, or ``dicom`` which the
            server does not read), else ``None``.
        claimed_kind: what its name says it is, else ``None``.
        skipped: why the walk did not read it (a symlink leaving INPUT_DIR ...), else ``None``.
        unreadable: the error met reading it, else ``None``.
        slide: for a TIFF, its slide layout by content (:func:`service.sniff.slide_kind`: ``svs``,
            ``ndpi``, ``ome-tiff``, ``tiled-tiff``), whatever its name (``.svs``, ``.ndpi``, ...).
    """

    path: Path
    rel: PurePosixPath
    size_bytes: int
    kind: str | None
    claimed_kind: str | None
    skipped: str | None = None
    unreadable: str | None = None
    slide: str | None = None

    @property
    def sendable(self) -> bool:
        """Whether the server should see this file (by content, or by name when content is unknown)."""
        if self.skipped is not None or self.unreadable is not None:
            return False
        if self.kind is not None:
            return self.kind in KINDS
        return self.claimed_kind is not None

    @property
    def effective_kind(self) -> str | None:
        """The content kind, else the kind its name claims."""
        return self.kind or self.claimed_kind


def _claimed_kind(name: str) -> tuple[str, str | None]:
    """Split a file name into (stem, kind its suffix claims)."""
    lower = name.lower()
    for suffix, kind in _INPUT_SUFFIXES:
        if lower.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], kind
    stem, dot, _ = name.rpartition(".")
    return (stem, None) if dot and stem else (name, None)


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Compile a glob over POSIX relative paths: ``*`` and ``?`` stay in one folder, ``**`` crosses.

    ``**/`` also matches no folder at all, so ``**/*.png`` matches ``page.png`` and ``a/b/page.png``.
    ``[...]`` character classes work as in :mod:`fnmatch`. Matching is case-sensitive.
    """
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and (close := pattern.find("]", i + 2)) != -1:
            body = pattern[i + 1 : close]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append(f"[{body.replace(chr(92), chr(92) * 2)}]")
            i = close + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z")


_UNREADABLE = "cannot read: "


def inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is ``root`` or below it (both already resolved)."""
    return os.path.commonpath([os.fspath(path), os.fspath(root)]) == os.fspath(root)


def _walk(root: Path, *, recursive: bool, exclude: Path | None) -> list[tuple[Path, str | None]]:
    """Every non-hidden entry under ``root`` (sorted), each with why it is not read (``None``: read).

    Symlinks to files are followed wherever they point; to folders, when their resolved target
    stays inside ``root`` and does not contain the link (a loop). Folders are walked only with
    ``recursive``.
    """
    real_root = os.path.realpath(root)
    found: list[tuple[Path, str | None]] = []

    def walk(folder: Path, real_folder: str) -> None:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            found.append((folder, f"{_UNREADABLE}{type(exc).__name__}: {exc.strerror or exc}"))
            return
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = Path(entry.path)
            if entry.is_symlink():
                target = os.path.realpath(path)
                if not os.path.exists(target):
                    found.append((path, "dangling symlink (or a symlink loop): its target does not exist"))
                    continue
                if not inside(target, real_root):
                    if os.path.isfile(target):  # the user's own data stored elsewhere: read it
                        found.append((path, None))
                    elif os.path.isdir(target):
                        reason = f"symlink to a folder outside INPUT_DIR (to {target}): not followed"
                        found.append((path, reason + " (links to files are)"))
                    else:
                        found.append((path, "not a regular file"))
                    continue
                if os.path.isdir(target):
                    if not recursive:
                        continue  # like any folder without -r
                    if inside(real_folder, target):
                        found.append((path, "symlink to a folder that contains it (a loop): not followed"))
                        continue
                    if exclude is not None and target == os.fspath(exclude):
                        continue
                    walk(path, target)
                    continue
                found.append((path, None if os.path.isfile(target) else "not a regular file"))
            elif entry.is_dir(follow_symlinks=False):
                real = os.path.realpath(path)
                if recursive and (exclude is None or real != os.fspath(exclude)):
                    walk(path, real)
            elif entry.is_file(follow_symlinks=False):
                found.append((path, None))
            else:
                found.append((path, "not a regular file (FIFO, socket or device)"))

    walk(root, real_root)
    return found


def unwalked_folders(input_dir: Path, *, patterns: Sequence[str] = (), recursive: bool = False) -> list[str]:
    """Names of ``input_dir``'s subfolders that :func:`discover` does not walk (sorted): every
    non-hidden one without ``recursive`` (or a pattern with ``/`` or ``**``), else none.
    """
    if recursive or any("/" in p or "**" in p for p in patterns):
        return []
    try:
        entries = list(os.scandir(input_dir))
    except OSError:
        return []
    return sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir())


def discover(
    input_dir: Path,
    *,
    patterns: Sequence[str] = (),
    recursive: bool = False,
    exclude: Path | None = None,
) -> list[Candidate]:
    """Find the files of a batch run, sniffing each one's content.

    Args:
        input_dir: folder to walk.
        patterns: globs on the path relative to ``input_dir`` (:func:`glob_to_regex`); a file is
            kept when any matches. Empty: every file. A pattern containing ``/`` or ``**`` walks
            subfolders even without ``recursive``.
        recursive: walk subfolders.
        exclude: a folder not to walk (the output folder when it lies inside ``input_dir``).

    Returns:
        every matching entry, sendable or not (symlinks not followed and unreadable files
        included, with the reason), sorted by relative path.
    """
    regexes = [glob_to_regex(p) for p in patterns]
    recursive = recursive or any("/" in p or "**" in p for p in patterns)
    excluded = Path(os.path.realpath(exclude)) if exclude is not None else None
    candidates = []
    for path, skipped in _walk(input_dir, recursive=recursive, exclude=excluded):
        rel = PurePosixPath(path.relative_to(input_dir).as_posix())
        is_folder_link = skipped is not None and path.is_symlink() and os.path.isdir(path)
        if regexes and not is_folder_link and not any(r.match(str(rel)) for r in regexes):
            continue
        claimed = _claimed_kind(path.name)[1]
        if skipped is not None and skipped.startswith(_UNREADABLE):
            candidates.append(Candidate(path, rel, 0, None, claimed, unreadable=skipped))
            continue
        if skipped is not None:
            candidates.append(Candidate(path, rel, 0, None, claimed, skipped=skipped))
            continue
        try:
            kind = sniff_file(path)
            slide = slide_kind(path) if kind == "tiff" else None
            size = path.stat().st_size
        except OSError as exc:
            logger.warning("%s: cannot read (%s)", rel, exc)
            error = f"{_UNREADABLE}{type(exc).__name__}: {exc.strerror or exc}"
            candidates.append(Candidate(path, rel, 0, None, claimed, unreadable=error))
            continue
        candidates.append(Candidate(path, rel, size, kind, claimed, slide=slide))
    return sorted(candidates, key=lambda c: str(c.rel))


def output_format(
    kind: str | None,
    *,
    fmt: str | None = None,
    output: str | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> str:
    """The output format of one file, as the server will choose it (DESIGN "Interfaces in detail").

    Args:
        kind: input kind (``nifti``, ``png``, ``jpeg``, ``tiff``).
        fmt: ``--format``, if given.
        output: ``--output`` (``probabilities`` or ``labels``), if given.
        defaults: the model's ``defaults`` from ``/v1/models`` (``output``, ``format``).

    Returns:
        a key of :data:`FORMAT_SUFFIXES`: ``fmt`` when given, else the model's default format when
        it names one, else ``nii.gz`` for NIfTI, and for 2D input ``png`` for labels and ``tiff``
        for probabilities.
    """
    if fmt:
        return fmt
    defaults = defaults or {}
    default_fmt = defaults.get("format")
    if isinstance(default_fmt, str) and default_fmt in FORMAT_SUFFIXES:
        return default_fmt
    if kind == "nifti":
        return "nii.gz"
    out_kind = output or defaults.get("output") or "probabilities"
    return "png" if out_kind == "labels" else "tiff"


def output_relpath(rel: PurePosixPath, fmt: str) -> PurePosixPath:
    """The output path of input ``rel``: same folders and stem, suffix of ``fmt``.

    Raises:
        ValueError: ``fmt`` is not a key of :data:`FORMAT_SUFFIXES`.
    """
    try:
        suffix = FORMAT_SUFFIXES[fmt]
    except KeyError:
        raise ValueError(f"format={fmt!r} is not one of {sorted(FORMAT_SUFFIXES)}") from None
    stem, _ = _claimed_kind(rel.name)
    return rel.with_name(stem + suffix)
