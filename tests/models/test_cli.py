"""``tilewise setup-models`` and ``tilewise export-onnx`` in process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from models.zoo.textdet import TEXT_DET_FILE
from service.cli import main


def test_setup_models_with_wheel(
    tmp_path: Path, wheel_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["setup-models", "--models", str(tmp_path), "--wheel", str(wheel_path)]) == 0
    assert (tmp_path / TEXT_DET_FILE).is_file() and (tmp_path / "text-det-2d.yaml").is_file()
    assert "text-det-2d ready" in capsys.readouterr().out
    # a second run finds the verified file and only rewrites the spec
    assert main(["setup-models", "--models", str(tmp_path), "--wheel", str(wheel_path)]) == 0


def test_setup_models_bad_wheel_fails(tmp_path: Path) -> None:
    bad = tmp_path / "x.whl"
    bad.write_bytes(b"nope")
    assert main(["setup-models", "--models", str(tmp_path / "m"), "--wheel", str(bad)]) == 1


def test_setup_models_env_folder(tmp_path: Path, wheel_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILEWISE_MODELS_DIR", str(tmp_path))
    assert main(["setup-models", "--wheel", str(wheel_path)]) == 0
    assert (tmp_path / TEXT_DET_FILE).is_file()


def test_export_onnx_refuses_non_eager_and_unknown(tmp_path: Path, text_det_dir: Path) -> None:
    assert main(["export-onnx", "text-det-2d", str(tmp_path / "x.onnx"), "--models", str(text_det_dir)]) == 2
    assert main(["export-onnx", "no-such-model", str(tmp_path / "x.onnx"), "--models", str(tmp_path)]) == 2
    assert (
        main(
            [
                "export-onnx",
                "sobel-2d",
                str(tmp_path / "x.onnx"),
                "--models",
                str(tmp_path),
                "--tile",
                "8,8,8",
            ]
        )
        == 2
    )


def test_export_onnx_fails_above_tolerance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # sobel's float32 rounding (~1e-6) exceeds an absurd tolerance of 0: exit status 1
    status = main(
        [
            "export-onnx",
            "sobel-2d",
            str(tmp_path / "s.onnx"),
            "--models",
            str(tmp_path),
            "--tile",
            "32",
            "--atol",
            "0",
        ]
    )
    out = capsys.readouterr().out
    assert status == 1 and "FAILED" in out and "differs from eager" in out


def test_export_onnx_says_the_stride_grid_and_the_file_keeps_to_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 25 item 5: the output names the sizes the file takes; onnxruntime agrees on both counts."""
    import numpy as np
    import onnxruntime as ort
    import yaml

    out = tmp_path / "tissue.onnx"
    assert main(["export-onnx", "tissue-3d", str(out), "--tile", "32", "--spec"]) == 0
    printed = capsys.readouterr().out
    assert "multiples of 4 per axis" in printed and "12x12x12 runs, 11x11x11 fails" in printed, printed
    assert "multiples of 4 per axis" in yaml.safe_load(out.with_suffix(".yaml").read_text())["description"]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    assert session.run(None, {name: np.zeros((1, 1, 12, 12, 12), np.float32)})[0].shape[2:] == (12, 12, 12)
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's own error types (a Concat mismatch)
        session.run(None, {name: np.zeros((1, 1, 11, 11, 11), np.float32)})


def test_setup_models_without_an_index_says_which_wheel_to_fetch(
    tmp_path: Path, wheel_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Offline, the deepbet download failed with pip's "No matching distribution" and nothing on
    # what to do; --deepbet-wheel is the way, and the error now names it.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no site index, mirror or find-links
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert main(["setup-models", "--models", str(tmp_path), "--wheel", str(wheel_path)]) == 1
    assert (tmp_path / TEXT_DET_FILE).is_file()  # the wheel given still works
    failed = [r.getMessage() for r in caplog.records if "setup-models failed" in r.getMessage()]
    assert len(failed) == 1 and "brain-mask-3d" in failed[0], failed
    assert "pip download --no-deps --only-binary=:all: deepbet==1.0.2" in failed[0]
    assert "pass it with --deepbet-wheel PATH" in failed[0]
