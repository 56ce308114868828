"""Issue 11, first contact with the command line: --progress, output names, --version, --help."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from service.cli import build_parser, main


def test_progress_shows_a_bar_of_tiles(anatomical_path: Path, tmp_path: Path, capfd) -> None:
    out = tmp_path / "smooth.nii.gz"
    args = ["infer", str(anatomical_path), str(out), "--model", "gaussian-3d", "--tile", "24", "--progress"]
    assert main([*args, "--models", str(tmp_path / "no-models")]) == 0
    err = capfd.readouterr().err
    assert re.search(r"tiles: 100%\S* +\d+/\d+", err), err[-2000:]


def test_no_bar_without_progress(anatomical_path: Path, tmp_path: Path, capfd) -> None:
    out = tmp_path / "smooth.nii.gz"
    args = ["infer", str(anatomical_path), str(out), "--model", "gaussian-3d"]
    assert main([*args, "--models", str(tmp_path / "no-models")]) == 0
    assert "tiles:" not in capfd.readouterr().err


@pytest.mark.parametrize(
    ("name", "options", "fragment"),
    [
        ("out.jpg", [], "does not write .jpg"),
        ("out.JPEG", [], "does not write .jpeg"),
        ("out.bmp", [], "does not write .bmp"),
        ("out.dcm", ["--format", "nii"], "--format nii does not match 'out.dcm'"),
        ("out.tiff", ["--format", "png"], "--format png does not match"),
    ],
)
def test_an_output_named_for_another_format_is_refused(
    anatomical_path: Path, tmp_path: Path, capfd, name: str, options: list[str], fragment: str
) -> None:
    target = tmp_path / name
    status = main(["infer", str(anatomical_path), str(target), "--model", "gaussian-2d", *options])
    assert status == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert re.fullmatch(r"tilewise \d+\.\d+\S*\n", capsys.readouterr().out)


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"tilewise": parser, **{f"tilewise {name}": p for name, p in sub.choices.items()}}


@pytest.mark.parametrize("command", sorted(_commands()))
def test_help_is_plain_text_and_states_defaults(command: str) -> None:
    parser = _commands()[command]
    text = parser.format_help()
    assert "``" not in text and "`" not in text, text
    assert not re.search(r":(mod|func|class|meth|attr|data|exc|ref):", text), text
    assert "::" not in text
    lines = text.splitlines()
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        start = next(i for i, line in enumerate(lines) if line.strip().startswith(action.option_strings[0]))
        block = [lines[start]]
        for line in lines[start + 1 :]:
            if line.strip().startswith("-") or not line.startswith(" " * 8):
                break
            block.append(line)
        assert "default" in " ".join(block).lower(), (command, action.option_strings, block)
