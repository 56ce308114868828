"""The first hour through the real ``tilewise`` command (issue 25 items 4, 10, 11, 12, 16).

Latency is checked without a clock: ``python -X importtime`` lists every module a run imports,
and a mistyped model name or a missing file must be answered before torch is imported.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def tilewise(*args: str, importtime: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, **env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    flags = ["-X", "importtime"] if importtime else []
    cmd = [sys.executable, *flags, "-m", "service.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=600, cwd=REPO)


def _imported(stderr: str) -> set[str]:
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("command", ["infer", "plan"])
def test_mistyped_model_is_answered_before_torch_loads(tmp_path: Path, command: str) -> None:
    volume = tmp_path / "in.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((9, 8, 7), np.float32), np.eye(4)), volume)
    args = [command, str(volume)] + ([str(tmp_path / "out.nii.gz")] if command == "infer" else [])
    done = tilewise(*args, "--model", "tisue-3d", importtime=True)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "did you mean 'tissue-3d'" in done.stderr
    assert "torch" not in _imported(done.stderr)


def test_missing_input_says_no_such_file(tmp_path: Path) -> None:
    missing, out = str(tmp_path / "nope.nii.gz"), str(tmp_path / "o.nii.gz")
    done = tilewise("infer", missing, out, "--model", "gaussian-3d", importtime=True)
    assert done.returncode == 2
    assert "nope.nii.gz: no such file" in done.stderr and "is not a file" not in done.stderr
    assert "torch" not in _imported(done.stderr)
    (tmp_path / "dir.nii.gz").mkdir()
    done = tilewise("plan", str(tmp_path / "dir.nii.gz"), "--model", "gaussian-3d")
    assert done.returncode == 2 and "is a folder, not a file" in done.stderr


def test_unknown_model_same_exit_status_in_infer_and_batch(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    nib.save(nib.Nifti1Image(np.zeros((9, 8, 7), np.float32), np.eye(4)), tmp_path / "in" / "a.nii.gz")
    source, out = str(tmp_path / "in" / "a.nii.gz"), str(tmp_path / "o.nii.gz")
    infer = tilewise("infer", source, out, "--model", "nope")
    # batch asks a server; none listens: the refusal must still not differ for the same mistake
    batch = tilewise("batch", str(tmp_path / "in"), str(tmp_path / "out"), "--model", "nope",
                     "--url", "http://127.0.0.1:9", "--retries", "0", "--retry-for", "0")  # fmt: skip
    assert infer.returncode == 2
    assert batch.returncode == 2, batch.stderr[-1500:]


def test_setup_models_unwritable_folder_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    done = tilewise("setup-models", "--models", str(blocker / "models"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "cannot create the model folder" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_serve_help_states_every_default() -> None:
    done = tilewise("serve", "--help")
    assert done.returncode == 0
    from service.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    missing = [
        a.option_strings[0]
        for a in serve._actions
        if a.option_strings and a.dest != "help" and "default" not in (a.help or "")
    ]
    assert not missing, missing


def test_models_dir_keeps_user_folder_models(tmp_path: Path) -> None:
    """--models DIR adds to the built-ins and to what setup-models put in the user's folder."""
    user, own = tmp_path / "user", tmp_path / "own"
    user.mkdir()
    own.mkdir()
    spec = {"name": "smooth-extra", "backend": "analytic", "architecture": "gaussian", "spatial_dims": 2,
            "in_channels": 1, "out_channels": 1, "params": {"sigma": 1.0}, "receptive_field": 4}  # fmt: skip
    (user / "smooth-extra.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    (own / "mine.yaml").write_text(yaml.safe_dump({**spec, "name": "mine"}), encoding="utf-8")
    from models import ModelRepository
    from models.names import model_names

    names = ModelRepository(own, device="cpu", user_models_dir=user).names()
    assert {"smooth-extra", "mine", "gaussian-3d", "tissue-3d"} <= set(names)
    assert model_names(own, user) == names  # the CLI's torch-free check lists the same
    # a name in both: the --models folder wins
    wider = yaml.safe_dump({**spec, "params": {"sigma": 2.0}})
    (own / "smooth-extra.yaml").write_text(wider, encoding="utf-8")
    repo = ModelRepository(own, device="cpu", user_models_dir=user)
    assert repo.spec("smooth-extra").params["sigma"] == 2.0 and not repo.unavailable()


def test_plan_reuses_measurements_and_agrees_with_infer(tmp_path: Path) -> None:
    """``tilewise plan`` measures the footprint once; after ``infer`` it plans that run's halo."""
    rng = np.random.default_rng(0)
    volume = tmp_path / "in.nii.gz"
    nib.save(nib.Nifti1Image(rng.random((41, 37, 29), dtype=np.float32), np.eye(4)), volume)
    env = {"TILEWISE_MEASUREMENTS_DIR": str(tmp_path / "measured"), "TILEWISE_DEVICE": "cpu"}
    options = ["--model", "gaussian-3d", "--tile", "24", "--log-level", "INFO"]
    first = tilewise("--log-level", "INFO", "plan", str(volume), *options[:4], **env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "footprint: batch" in first.stderr  # measured once
    second = tilewise("--log-level", "INFO", "plan", str(volume), *options[:4], **env)
    assert "footprint: batch" not in second.stderr and "measurements read from" in second.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["eta_s"] == b["eta_s"] and a["footprint"] == b["footprint"] and a["halo"] == b["halo"]

    out = tmp_path / "out.nii.gz"
    ran = tilewise("--log-level", "INFO", "infer", str(volume), str(out), *options[:4], "--halo", "auto",
                   **env)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-2000:]
    after = tilewise("plan", str(volume), *options[:4], "--halo", "auto", **env)
    plan = json.loads(after.stdout)
    header = next(line for line in ran.stderr.splitlines() if "wrote" in line)
    assert f"halo={','.join(str(h) for h in plan['halo'])}" in header, (header, plan["halo"])


def test_extra_hint_names_the_checkout_when_installed_from_one() -> None:
    """A checkout install is told to install the extra from the checkout, not from PyPI."""
    from importlib import metadata

    from models.extras import install_hint

    raw = metadata.distribution("tilewise").read_text("direct_url.json")
    hint = install_hint("import")
    if raw and json.loads(raw).get("url", "").startswith("file://"):
        assert "tilewise[import]" not in hint and hint.endswith("[import]'")
        assert Path(hint.split("'")[1][: -len("[import]")]).resolve() == REPO.resolve() or "-e" not in hint
    else:
        assert hint == "pip install 'tilewise[import]'"


def test_serve_on_a_taken_port_fails_at_once() -> None:
    # A second `tilewise serve` (the first still running in another terminal) used to load and warm
    # every model, fail to bind, and exit 0.
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = tilewise("serve", "--port", str(port), "--no-warmup", importtime=True)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"cannot listen on http://127.0.0.1:{port}: address already in use" in done.stderr
    assert "torch" not in _imported(done.stderr)  # said before any model loads


@pytest.mark.parametrize("command", ["infer", "plan", "batch"])
def test_inference_options_state_one_default(command: str) -> None:
    # `--output-dtype` said "float32 (default) ... (default: the model's)", `--tilt` "refuse
    # (default, 422) ... (default: the model's)", `--series` "(default: the model's)" (no model
    # has a series).
    from service.cli import build_parser

    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    helps = {a.option_strings[0]: a.help or "" for a in sub._actions if a.dest.startswith("param_")}
    assert {"--output-dtype", "--tilt", "--series", "--tile"} <= set(helps)
    suffix = "(default: the model's)"
    doubled = [o for o, h in helps.items() if h.lower().count("default") > 1 and h.endswith(suffix)]
    assert not doubled, doubled
    assert all("default" in h.lower() for h in helps.values()), helps
    assert "the model's" not in helps["--series"] and "the model's" not in helps["--level"]


def test_batch_says_which_subfolders_it_did_not_walk(tmp_path: Path) -> None:
    # A folder whose scans sit in subfolders gave "0 files found" and nothing more.
    subject = tmp_path / "in" / "subject-01"
    subject.mkdir(parents=True)
    nib.save(nib.Nifti1Image(np.zeros((9, 8, 7), np.float32), np.eye(4)), subject / "t1.nii")
    args = [
        str(tmp_path / "in"),
        str(tmp_path / "out"),
        "--model",
        "gaussian-3d",
        "--url",
        "http://127.0.0.1:9",
    ]
    done = tilewise("batch", *args, "--retries", "0", "--retry-for", "0")
    assert done.returncode == 0, done.stderr[-1500:]
    assert "1 subfolder(s) of" in done.stderr and "(subject-01): add -r (--recursive)" in done.stderr
    done = tilewise("batch", *args, "--retries", "0", "--retry-for", "0", "-r")  # walks: needs the server
    assert "not walked" not in done.stderr


def test_serve_help_defaults_are_values() -> None:
    # "(default: loopback: loopback)", "(default: basic authentication)" and "(default: prefer the
    # environment variable)" were notes that `with_default` turned into defaults.
    from service.cli import build_parser

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    helps = {a.option_strings[0]: a.help or "" for a in serve._actions if a.option_strings}
    assert all("(default: none)" in helps[o] for o in ("--dicomweb-username", "--dicomweb-password"))
    assert "(default: loopback names on loopback)" in helps["--allowed-hosts"]
    bad = [o for o, h in helps.items() if re.search(r"\(default: (prefer|basic|loopback: loopback)", h)]
    assert not bad, bad


def test_example_network_help_does_not_say_transformers_are_refused() -> None:
    # It said "UNETR and SwinUNETR bundles are refused at import" while both import (at one tile,
    # tests/models/test_import_transformers.py) and the README's table says so.
    from service.cli import build_parser

    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices["import-model"]  # type: ignore[union-attr]
    text = next(a.help or "" for a in sub._actions if "--example-network" in a.option_strings)
    assert "UNETR" in text and "refused" not in text and "one tile" in text


def test_log_level_is_checked_and_taken_after_the_command(tmp_path: Path) -> None:
    # `--log-level quiet` was a ValueError traceback; `tilewise plan ... --log-level WARNING`
    # was "unrecognized arguments".
    done = tilewise("--log-level", "quiet", "plan", "x", "--model", "gaussian-3d")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "invalid choice: 'QUIET'" in done.stderr
    missing = str(tmp_path / "nope.nii.gz")
    done = tilewise("plan", missing, "--model", "gaussian-3d", "--log-level", "warning")
    assert done.returncode == 2 and "no such file" in done.stderr and "unrecognized" not in done.stderr
    from service.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["--log-level", "debug", "demo"]).log_level == "DEBUG"
    assert parse(["--log-level", "debug", "demo", "--log-level", "error"]).log_level == "ERROR"
