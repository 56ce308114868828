"""``tilewise import-model``: TorchScript / ONNX files, MONAI bundles and nnU-Net v2 folders to specs.

One module per source kind (:mod:`.plain`, :mod:`.bundle`, :mod:`.nnunet_folder`); :mod:`.convert`
exports the network (TorchScript or ONNX, parity-checked) and writes ``DIR/NAME.yaml`` beside the
weights; :mod:`.probe` measures what a bare network file does not say. MONAI and nnU-Net are needed
here only (the ``import`` extra): serving the result needs neither.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from models.errors import ImportRefusedError
from models.importers.activation import ACTIVATIONS
from models.importers.convert import FORMATS, WrittenModel, export_tolerance
from models.importers.trust import untrusted_code

__all__ = ["FORMATS", "WrittenModel", "import_model", "source_kind"]


def source_kind(source: Path) -> str:
    """``monai-bundle``, ``nnunet`` or ``file`` (TorchScript / ONNX), from what ``source`` holds.

    Raises:
        ImportRefusedError: ``source`` does not exist, or is a folder of neither kind.
    """
    if source.is_dir():
        if (source / "configs" / "metadata.json").is_file():
            return "monai-bundle"
        if (source / "plans.json").is_file() or (source / "dataset.json").is_file():
            return "nnunet"
        raise ImportRefusedError(
            f"{source}: a folder that is neither a MONAI bundle (configs/metadata.json) nor an nnU-Net v2 "
            "trained-model folder (dataset.json, plans.json, fold_*/checkpoint_final.pth)"
        )
    if not source.is_file():
        raise ImportRefusedError(f"{source}: no such file or folder")
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as archive:
            if any(n.endswith("configs/metadata.json") for n in archive.namelist()):
                return "monai-bundle"
    return "file"


def import_model(
    source: Path,
    *,
    models_dir: Path,
    name: str | None = None,
    fmt: str | None = None,
    trust: bool = False,
    atol: float = 1e-4,
    activation: str | None = None,
) -> WrittenModel:
    """Import ``source`` into ``models_dir``: ``NAME.yaml`` and the weights beside it.

    Importing a MONAI bundle runs it (its ``$`` expressions and ``_target_``s); an nnU-Net plan names
    the class that is built. Unless ``trust``, a source holding code that is not MONAI's or
    nnU-Net's own (:func:`models.importers.trust.untrusted_code`) is refused before anything runs.

    Args:
        source: a TorchScript or ONNX file, a MONAI bundle (folder or zip) or an nnU-Net v2
            trained-model folder.
        models_dir: the model folder (created when missing).
        name: the model name (default: from the source).
        fmt: ``torchscript`` or ``onnx`` (default: the file's own format; TorchScript for bundles
            and nnU-Net folders).
        trust: run the source's own code (``$`` expressions, non-MONAI ``_target_``s).
        atol: largest max-abs difference accepted between the exported file and eager PyTorch.
        activation: ``softmax``, ``sigmoid`` or ``none`` for a TorchScript / ONNX file (default:
            probed, see :func:`models.importers.activation.choose_activation`); bundles and nnU-Net
            folders say their own.

    Raises:
        ImportRefusedError: what the source holds cannot be mapped (the message names the field or
            transform), or it holds code and ``trust`` is false (the message names the fields).
        ExportError: the conversion failed or lost parity.
    """
    if fmt is not None and fmt not in FORMATS:
        raise ImportRefusedError(f"--format {fmt!r} is not one of {list(FORMATS)}")
    if activation is not None and activation not in ACTIVATIONS:
        raise ImportRefusedError(f"--activation {activation!r} is not one of {list(ACTIVATIONS)}")
    kind = source_kind(source)
    if activation is not None and kind != "file":
        raise ImportRefusedError(f"{source}: --activation is for TorchScript / ONNX files; a {kind} says it")
    if not trust:
        code = untrusted_code(source, kind)
        if code:
            more = f" (and {len(code) - 2} more)" if len(code) > 2 else ""
            raise ImportRefusedError(
                f"{source}: importing it runs code that is not MONAI's or nnU-Net's own: "
                f"{'; '.join(code[:2])}{more}. Read the bundle, then pass --trust to run it"
            )
    with export_tolerance(atol):
        if kind == "file":
            from models.importers.plain import import_file

            return import_file(source, name=name, models_dir=models_dir, fmt=fmt, activation=activation)
        if kind == "monai-bundle":
            from models.importers.bundle import import_bundle

            return import_bundle(source, name=name, models_dir=models_dir, fmt=fmt or "torchscript")
        from models.importers.nnunet_folder import import_nnunet

        return import_nnunet(source, name=name, models_dir=models_dir, fmt=fmt or "torchscript")
