"""Importing a bundle runs it: code in a bundle or nnU-Net plan is refused unless ``--trust`` (issue 24.7).

The oracle is the file system: a bundle whose config would write a marker file is refused without
``--trust`` and the marker never appears; with ``--trust`` MONAI's parser runs the expression (the
marker appears), so the refusal is what kept it from running.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _import_kit import need, nnunet_plans, write_monai_bundle, write_nnunet_folder

from models.importers.trust import untrusted_code
from service.cli import main


def _refusal(capsys: Any, *argv: str) -> str:
    capsys.readouterr()
    assert main(["import-model", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_bundle_writing_a_file_is_refused_without_trust(tmp_path: Path, capsys: Any) -> None:
    need("monai")
    bundle, marker = tmp_path / "bundle", tmp_path / "marker.txt"
    write_monai_bundle(bundle)
    path = bundle / "configs" / "inference.json"
    config = json.loads(path.read_text())
    attack = f"$__import__('pathlib').Path({str(marker)!r}).write_text('ran') and [8, 16, 32]"
    config["network_def"]["channels"] = attack
    path.write_text(json.dumps(config))
    err = _refusal(capsys, str(bundle), "--models", str(tmp_path / "m"))
    assert "network_def.channels: expression" in err and "--trust" in err, err
    assert not marker.exists() and not (tmp_path / "m").exists()
    # zipped, the same
    import zipfile

    with zipfile.ZipFile(tmp_path / "bundle.zip", "w") as archive:
        for file in bundle.rglob("*"):
            archive.write(file, Path("bundle") / file.relative_to(bundle))
    assert "network_def.channels" in _refusal(
        capsys, str(tmp_path / "bundle.zip"), "--models", str(tmp_path / "m")
    )
    assert not marker.exists()
    # with --trust MONAI runs the expression: the refusal above is what stopped it
    assert main(["import-model", str(bundle), "--models", str(tmp_path / "m"), "--trust"]) == 0
    assert marker.read_text() == "ran"


def test_what_counts_as_code_in_a_bundle(tmp_path: Path, capsys: Any) -> None:
    need("monai")
    bundle = tmp_path / "zoo"
    write_monai_bundle(bundle, code=True)  # model-zoo style: imports, device, network, output_dir
    found = untrusted_code(bundle, "monai-bundle")
    assert {line.split(": ")[0] for line in found} == {
        "configs/inference.json imports[0]",
        "configs/inference.json imports[1]",
        "configs/inference.json output_dir",
        "configs/inference.json device",
        "configs/inference.json network",
    }
    err = _refusal(capsys, str(bundle), "--models", str(tmp_path / "m"))
    assert "(and 3 more)" in err and "pass --trust" in err
    plain = tmp_path / "plain"
    write_monai_bundle(plain)  # no $ code, MONAI targets only (UNet, Compose, LoadImaged, ...)
    assert untrusted_code(plain, "monai-bundle") == []
    config = json.loads((plain / "configs" / "inference.json").read_text())
    config["preprocessing"]["transforms"].append({"_target_": "os.system", "command": "true"})
    config["postprocessing"]["transforms"].append({"_target_": "monai.transforms.Identityd", "keys": "pred"})
    config["inferer"]["cval"] = "$0.0"  # a literal: data, not code
    config["network_def"]["_mode_"] = "debug"
    (plain / "configs" / "inference.json").write_text(json.dumps(config))
    assert untrusted_code(plain, "monai-bundle") == [
        "configs/inference.json network_def._mode_: _mode_ 'debug'",
        "configs/inference.json preprocessing.transforms[6]._target_: _target_ 'os.system' (not MONAI's)",
    ]


def test_nnunet_plan_naming_another_class_is_refused_without_trust(tmp_path: Path, capsys: Any) -> None:
    need("nnunetv2")
    plans = nnunet_plans()
    plans["configurations"]["3d_fullres"]["architecture"]["network_class_name"] = "mypackage.nets.Evil"
    folder = write_nnunet_folder(tmp_path / "own", plans=nnunet_plans(), folds=(0,))
    assert untrusted_code(folder, "nnunet") == []
    (folder / "plans.json").write_text(json.dumps(plans))
    err = _refusal(capsys, str(folder), "--models", str(tmp_path / "m"))
    assert "network_class_name: class 'mypackage.nets.Evil'" in err and "--trust" in err


def test_help_says_that_importing_runs_code(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        main(["import-model", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Importing a MONAI bundle runs it" in text and "--trust" in text
    assert "The models folder is code too" in text
