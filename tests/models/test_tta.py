"""``tta=mirror``: the mean over flips of every spatial axis; tiled TTA equals whole-image TTA."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from models import InferenceParams, Model, ParamError, parse_params, spec_from_mapping
from models.backends.eager import EagerPredictor

SPEC = {
    "name": "skew-2d",
    "backend": "analytic",
    "architecture": "gaussian",
    "spatial_dims": 2,
    "in_channels": 1,
    "out_channels": 2,
    "receptive_field": 2,
    "output": {"activation": "softmax"},
    "defaults": {"tile": 32, "halo": 2, "batch_size": 3},
}


def _skewed_model() -> tuple[Model, torch.nn.Conv2d]:
    """A 5x5 conv with random (asymmetric) weights: flipping the input changes its output."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(1, 2, 5, padding=2)
    spec = spec_from_mapping(SPEC)
    return Model(spec, EagerPredictor(spec, torch.device("cpu"), conv)), conv


def _whole_tta(conv: torch.nn.Conv2d, x: np.ndarray) -> np.ndarray:
    """Whole-image mirror TTA by hand: softmax of each flipped pass, flipped back, averaged."""
    outs = []
    for k in range(3):
        for axes in itertools.combinations((2, 3), k):
            t = torch.from_numpy(x)[None]
            with torch.inference_mode():
                y = torch.softmax(conv(t.flip(axes) if axes else t), dim=1)
            outs.append((y.flip(axes) if axes else y)[0].numpy())
    return np.mean(outs, axis=0)


def test_mirror_tta_tiled_equals_whole_image_tta(rng: np.random.Generator) -> None:
    model, conv = _skewed_model()
    x = rng.standard_normal((1, 45, 70)).astype(np.float32)  # several tiles, odd sizes
    plan = model.plan(x.shape[1:], parse_params({"tta": "mirror"}))
    assert plan.flips == ((), (0,), (1,), (0, 1)) and plan.n_tiles == 4 * plan.grid.n_tiles
    got = model.run(x, parse_params({"tta": "mirror"}))
    expected = _whole_tta(conv, x)
    np.testing.assert_allclose(got, expected, atol=1e-5)  # fp32 conv on different crops
    plain = model.run(x)
    assert np.abs(plain - expected).max() > 1e-3  # the flips matter for this net
    labels = model.run(x, InferenceParams(tta="mirror", output="labels"))
    np.testing.assert_array_equal(labels, np.argmax(expected, axis=0).astype(np.uint8))


def test_tta_from_spec_defaults_and_refused_values() -> None:
    spec = spec_from_mapping({**SPEC, "defaults": {**SPEC["defaults"], "tta": "mirror"}})
    assert spec.defaults.tta == "mirror" and spec.info()["defaults"]["tta"] == "mirror"
    assert InferenceParams().merged(spec.defaults).tta == "mirror"  # the spec's default applies
    assert InferenceParams(tta="none").merged(spec.defaults).tta == "none"  # a request overrides it
    with pytest.raises(ParamError, match="did you mean 'mirror'"):
        parse_params({"tta": "mirorr"})


def test_tta_average_logits_takes_the_activation_after_the_mean(rng: np.random.Generator) -> None:
    """``output.tta_average: logits`` (nnU-Net's way): softmax of the mean logits over the flips."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(1, 2, 5, padding=2)
    spec = spec_from_mapping({**SPEC, "output": {"activation": "softmax", "tta_average": "logits"}})
    model = Model(spec, EagerPredictor(spec, torch.device("cpu"), conv))
    x = rng.standard_normal((1, 45, 70)).astype(np.float32)
    logits = []
    for k in range(3):
        for axes in itertools.combinations((2, 3), k):
            t = torch.from_numpy(x)[None]
            with torch.inference_mode():
                y = conv(t.flip(axes) if axes else t)
            logits.append((y.flip(axes) if axes else y)[0])
    expected = torch.softmax(torch.stack(logits).mean(0), dim=0).numpy()
    got = model.run(x, parse_params({"tta": "mirror"}))
    np.testing.assert_allclose(got, expected, atol=1e-5)  # fp32 conv on different crops
    assert np.abs(got - _whole_tta(conv, x)).max() > 1e-4  # not the mean of the probabilities


@pytest.fixture(scope="module")
def backends_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The skewed conv as TorchScript and as ONNX (``mirror_axes: [1]``), with the eager module."""
    import yaml

    from models.export import export_onnx, export_torchscript

    folder = tmp_path_factory.mktemp("tta-backends")
    _, conv = _skewed_model()
    conv = conv.eval()
    export_torchscript(conv, folder / "skew.ts", in_channels=1, export_shape=(32, 32), alignment=1)
    export_onnx(conv, folder / "skew.onnx", in_channels=1, export_shape=(32, 32), alignment=1)
    for backend, file in (("torchscript", "skew.ts"), ("onnx", "skew.onnx")):
        spec = {**SPEC, "name": f"skew-{backend}", "backend": backend, "file": file, "mirror_axes": [1]}
        (folder / f"skew-{backend}.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    return folder, conv


@pytest.mark.parametrize("backend", ["eager", "torchscript", "onnx"])
def test_mirror_axes_for_every_backend(backends_dir: Any, backend: str, rng: np.random.Generator) -> None:
    """``mirror_axes: [1]``: two passes (none, axis 1 flipped); tiled equals whole-image TTA within 1e-5."""
    from models import ModelRepository

    folder, conv = backends_dir
    if backend == "eager":
        spec = spec_from_mapping({**SPEC, "mirror_axes": [1]})
        model = Model(spec, EagerPredictor(spec, torch.device("cpu"), conv))
    else:
        model = ModelRepository(folder, device="cpu").get(f"skew-{backend}")
    assert model.spec.mirror_axes == (1,) and model.spec.info()["mirror_axes"] == [1]
    x = rng.standard_normal((1, 45, 70)).astype(np.float32)
    plan = model.plan(x.shape[1:], InferenceParams(tta="mirror"))
    assert plan.flips == ((), (1,)) and plan.n_tiles == 2 * plan.grid.n_tiles > 2
    got = model.run(x, InferenceParams(tta="mirror"))
    t = torch.from_numpy(x)[None]
    with torch.inference_mode():
        passes = [torch.softmax(conv(t), 1), torch.softmax(conv(t.flip(3)), 1).flip(3)]
    expected = torch.stack(passes).mean(0)[0].numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5)  # fp32 conv on different crops


def test_mirror_axes_refused_when_out_of_range() -> None:
    from models import SpecError

    assert spec_from_mapping(SPEC).mirror_axes == (0, 1)  # default: every spatial axis
    for bad in ([2], [0, 0]):
        with pytest.raises(SpecError, match="mirror_axes"):
            spec_from_mapping({**SPEC, "mirror_axes": bad})
