"""models.geometry.model_grid and models.geometry.resample: orientation against nibabel, resampling
against scipy, slabs.

Oracles written elsewhere: ``nibabel.as_closest_canonical`` and ``apply_orientation`` (orientation),
``scipy.ndimage.map_coordinates`` (linear resampling at the documented voxel centres), a
full-volume ``F.interpolate`` then argmax (the slab loop), and nilearn's MNI152 T1 (real data).
"""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
import textwrap

import nibabel as nib
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from nibabel.orientations import apply_orientation, axcodes2ornt, inv_ornt_aff, ornt_transform
from scipy import ndimage

import models.geometry.model_grid as geometry
from models.errors import InputError
from models.geometry.model_grid import GeometryError, plan_geometry
from models.geometry.resample import from_model_labels, from_model_probabilities, to_model

MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}


def _codes_ornt(src: str, dst: str) -> np.ndarray:
    return ornt_transform(axcodes2ornt(tuple(src)), axcodes2ornt(tuple(dst)))


def _as_codes(data: np.ndarray, affine: np.ndarray, codes: str) -> tuple[np.ndarray, np.ndarray]:
    """``data`` (RAS-ish, spatial only) permuted and flipped to ``codes``, with the affine to match."""
    ornt = _codes_ornt("".join(nib.aff2axcodes(affine)), codes)
    return np.ascontiguousarray(apply_orientation(data, ornt)), affine @ inv_ornt_aff(ornt, data.shape)


def _oracle(x: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:
    """Linear resampling by scipy at ``(j + 0.5) * n_in / n_out - 0.5``, edges extended (float64)."""
    coords = np.meshgrid(
        *[(np.arange(m) + 0.5) * n / m - 0.5 for n, m in zip(x.shape[1:], out_shape, strict=True)],
        indexing="ij",
    )
    return np.stack(
        [ndimage.map_coordinates(c.astype(np.float64), coords, order=1, mode="nearest") for c in x]
    )


def _full_back(pred: np.ndarray, shape: tuple[int, ...], activation: str) -> torch.Tensor:
    """The reference the slab loop must equal: activation, then one full-volume F.interpolate."""
    t = torch.from_numpy(pred)
    t = torch.softmax(t, 0) if activation == "softmax" else torch.sigmoid(t) if activation == "sigmoid" else t
    if tuple(t.shape[1:]) == shape:
        return t
    return F.interpolate(t[None], size=shape, mode=MODES[len(shape)], align_corners=False)[0]


@pytest.fixture(scope="module")
def mni() -> nib.Nifti1Image:
    from nilearn.datasets import load_mni152_template

    img = load_mni152_template(resolution=2)
    assert img.shape == (99, 117, 95) and nib.aff2axcodes(img.affine) == ("R", "A", "S")
    return img


# --- orientation -------------------------------------------------------------------------------


@pytest.mark.parametrize("codes", ["RAS", "LPS", "PIL", "ASR", "LAI"])
def test_reorientation_matches_as_closest_canonical(rng, codes):
    ras = rng.standard_normal((7, 11, 5)).astype(np.float32)
    affine = np.diag([0.9, 1.1, 2.5, 1.0])
    affine[:3, 3] = [3.0, -4.0, 5.0]
    data, aff = _as_codes(ras, affine, codes)
    canonical = nib.as_closest_canonical(nib.Nifti1Image(data, aff))

    plan = plan_geometry(data.shape, aff, orientation="RAS")
    assert plan.input_codes == tuple(codes)
    assert plan.reorients == (codes != "RAS") and not plan.resamples
    x = to_model(data[None], plan)
    assert np.array_equal(x[0], np.asarray(canonical.dataobj))
    assert np.array_equal(x[0], ras)
    np.testing.assert_allclose(plan.model_affine, canonical.affine, atol=1e-12)
    # back at native spacing: the identity, bit for bit
    assert np.array_equal(from_model_probabilities(x, plan)[0], data)
    labels = (data > 0).astype(np.float32)
    assert np.array_equal(from_model_labels(to_model(labels[None], plan), plan, activation="none"), data > 0)


def test_oblique_affine_goes_to_its_closest_codes(rng):
    data = rng.standard_normal((6, 5, 4)).astype(np.float32)
    angle = np.deg2rad(20)
    rot = np.array([[np.cos(angle), -np.sin(angle), 0], [np.sin(angle), np.cos(angle), 0], [0, 0, 1]])
    aff = np.eye(4)
    aff[:3, :3] = rot @ np.diag([-1.0, 1.0, 2.0])  # closest codes L, A, S
    plan = plan_geometry(data.shape, aff, orientation="RAS")
    canonical = nib.as_closest_canonical(nib.Nifti1Image(data, aff))
    assert np.array_equal(to_model(data[None], plan)[0], np.asarray(canonical.dataobj))
    np.testing.assert_allclose(plan.model_affine, canonical.affine, atol=1e-12)


@pytest.mark.parametrize("codes", ["PIR", "LPS"])
def test_mni_in_other_axis_codes_maps_to_the_same_arrays(mni, codes):
    ras = np.asarray(mni.dataobj).astype(np.float32)
    data, aff = _as_codes(ras, mni.affine, codes)
    assert "".join(nib.aff2axcodes(aff)) == codes

    native = plan_geometry(data.shape, aff, orientation="RAS")
    assert np.array_equal(to_model(data[None], native)[0], ras)
    np.testing.assert_allclose(native.model_affine, mni.affine, atol=1e-9)

    # through a 3 mm model grid and back: the same arrays as the RAS original, once mapped back
    plan = plan_geometry(data.shape, aff, orientation="RAS", spacing_mm=(3.0, 3.0, 3.0))
    plan_ras = plan_geometry(ras.shape, mni.affine, orientation="RAS", spacing_mm=(3.0, 3.0, 3.0))
    assert plan.model_shape == plan_ras.model_shape == (66, 78, 63)
    x = to_model(data[None], plan)
    assert np.array_equal(x, to_model(ras[None], plan_ras))
    np.testing.assert_allclose(plan.model_affine, plan_ras.model_affine, atol=1e-9)
    # three "tissue" scores from the intensity: labels back on the input grid
    scores = np.concatenate([-8.0 * (x - m) ** 2 for m in (0.05, 0.45, 0.8)]).astype(np.float32)
    back = ornt_transform(axcodes2ornt(tuple("RAS")), axcodes2ornt(tuple(codes)))
    want = apply_orientation(from_model_labels(scores, plan_ras, activation="softmax"), back)
    got = from_model_labels(scores, plan, activation="softmax")
    assert got.shape == data.shape and np.array_equal(got, want)
    assert len(np.unique(got)) == 3
    want_p = from_model_probabilities(scores, plan_ras, activation="softmax")
    got_p = from_model_probabilities(scores, plan, activation="softmax")
    assert np.array_equal(got_p, np.moveaxis(apply_orientation(np.moveaxis(want_p, 0, -1), back), -1, 0))


def test_model_affine_names_the_world_points_that_were_sampled(rng):
    """One oracle for reorientation and resampling together: sample the input where the model says."""
    ras = rng.random((9, 8, 7)).astype(np.float32)
    affine = np.diag([1.2, 0.8, 2.0, 1.0])
    data, aff = _as_codes(ras, affine, "PIL")
    plan = plan_geometry(data.shape, aff, orientation="LAS", spacing_mm=(0.7, 1.3, 1.1))
    x = to_model(data[None], plan)[0]
    idx = np.stack(np.meshgrid(*[np.arange(m) for m in plan.model_shape], indexing="ij"), axis=-1)
    homog = np.concatenate([idx, np.ones((*idx.shape[:-1], 1))], axis=-1).reshape(-1, 4).T
    source = (np.linalg.inv(aff) @ plan.model_affine @ homog)[:3]  # continuous input voxel indices
    want = ndimage.map_coordinates(data.astype(np.float64), source, order=1, mode="nearest")
    assert np.abs(x.ravel() - want).max() < 1e-5
    assert "".join(nib.aff2axcodes(plan.model_affine)) == "LAS"


# --- resampling --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "zooms", "spacing"),
    [
        pytest.param((13, 7, 11), (0.7, 1.3, 2.9), (1.0, 1.0, 1.0), id="3d-primes-up-down"),
        pytest.param((1, 7, 2), (3.0, 1.0, 1.0), (1.0, 2.0, 5.0), id="3d-one-voxel-axes"),
        pytest.param((17, 23), (0.5, 2.0), (1.1, 0.9), id="2d"),
        pytest.param((29,), (1.0,), (0.3,), id="1d"),
    ],
)
def test_resampling_matches_scipy_both_ways(rng, shape, zooms, spacing):
    plan = plan_geometry(shape, zooms_mm=zooms, spacing_mm=spacing)
    want_shape = tuple(max(1, round(n * z / s)) for n, z, s in zip(shape, zooms, spacing, strict=True))
    assert plan.model_shape == want_shape and plan.resamples and not plan.reorients
    x = rng.random((2, *shape)).astype(np.float32)
    y = to_model(x, plan)
    assert y.shape == (2, *want_shape) and y.dtype == np.float32
    assert np.abs(y - _oracle(x, want_shape)).max() < 1e-5
    pred = rng.random((3, *want_shape)).astype(np.float32)
    back = from_model_probabilities(pred, plan)
    assert back.shape == (3, *shape)
    assert np.abs(back - _oracle(pred, shape)).max() < 1e-5


def test_model_shape_rounds_and_never_reaches_zero():
    plan = plan_geometry((2, 5, 300), zooms_mm=(1.0, 0.5, 0.7), spacing_mm=(5.0, 1.0, 1.0))
    # 0.4 -> 1 (at least one voxel), 2.5 -> 2 (half to even), 210 -> 210
    assert plan.model_shape == (1, 2, 210)
    assert plan.model_zooms_mm == pytest.approx((2.0, 1.25, 1.0))


def test_anisotropic_copy_to_1mm_and_back(mni):
    """A 1 x 1 x 3 mm copy of the T1 (taken as 1 mm) resampled to 1 mm and back.

    The copy keeps the 1 mm slices 1, 4, 7, ...: with voxel centres at ``(k + 0.5) * 3 mm`` its
    slice ``k`` sits exactly on 1 mm slice ``3 k + 1``, so those come back unchanged.
    """
    iso = np.asarray(mni.dataobj)[10:90, 10:100, 0:93].astype(np.float32)  # intensities 0..1
    aniso = np.ascontiguousarray(iso[..., 1::3])
    plan = plan_geometry(aniso.shape, np.diag([1.0, 1.0, 3.0, 1.0]), spacing_mm=(1.0, 1.0, 1.0))
    assert plan.model_shape == iso.shape and plan.model_zooms_mm == (1.0, 1.0, 1.0)
    up = to_model(aniso[None], plan)[0]
    assert np.abs(up[..., 1::3] - iso[..., 1::3]).max() < 1e-6
    # the slices in between are reconstructed: linear beats repeating the nearest thick slice
    between = np.ones(93, bool)
    between[1::3] = False
    nearest = np.repeat(aniso, 3, axis=-1)
    err_linear = np.abs(up - iso)[..., between].mean()
    err_nearest = np.abs(nearest - iso)[..., between].mean()
    assert err_linear < err_nearest  # 0.0225 vs 0.0249
    # and back: each thick slice is sampled where it came from, the identity
    assert np.abs(from_model_probabilities(up[None], plan)[0] - aniso).max() < 1e-6
    labels = from_model_labels(np.stack([0.3 - up, up - 0.3]), plan, activation="none")
    wrong = labels != (aniso > 0.3)
    assert labels.dtype == np.uint8 and 0.1 < labels.mean() < 0.9
    assert np.all(np.abs(aniso[wrong] - 0.3) < 1e-6)  # only float ties at the threshold may differ


def test_identity_plans_return_the_input_untouched(rng):
    x = rng.random((2, 5, 6, 7)).astype(np.float32)
    plan = plan_geometry((5, 6, 7), np.diag([1.0, 1.0, 1.0, 1.0]), orientation="RAS", spacing_mm=(1, 1, 1))
    assert plan.is_identity
    assert to_model(x, plan) is x
    assert np.array_equal(from_model_probabilities(x, plan), x)
    plan2d = plan_geometry((6, 7), None)
    assert plan2d.is_identity and plan2d.zooms_mm is None and plan2d.model_affine is None
    assert np.array_equal(from_model_probabilities(x[:, 0], plan2d), x[:, 0])


def test_2d_with_a_nifti_slice_affine_and_with_zooms():
    aff = np.diag([0.5, 0.25, 3.0, 1.0])  # an (X, Y, 1) NIfTI read as a 2-D image
    plan = plan_geometry((40, 30), aff, spacing_mm=(1.0, 1.0))
    assert plan.zooms_mm == (0.5, 0.25) and plan.model_shape == (20, 8)
    assert plan_geometry((40, 30), zooms_mm=(0.5, 0.25), spacing_mm=(1.0, 1.0)).model_shape == (20, 8)
    assert plan.model_affine.shape == (4, 4) and plan.model_affine[2, 2] == 3.0


# --- back to the input grid, slab by slab --------------------------------------------------------


@pytest.mark.parametrize("activation", ["none", "sigmoid", "softmax"])
@pytest.mark.parametrize("max_slab_bytes", [1, 100_000, 10**9], ids=["1-row", "some-rows", "one-slab"])
def test_slab_labels_equal_full_volume_resample_then_argmax(rng, activation, max_slab_bytes):
    ras = rng.random((23, 19, 17))
    data, aff = _as_codes(ras, np.diag([0.7, 0.7, 1.5, 1.0]), "LPI")
    plan = plan_geometry(data.shape, aff, orientation="RAS", spacing_mm=(1.0, 1.0, 1.0))
    assert plan.model_shape == (16, 13, 26)
    # logits for sigmoid / softmax; with "none" the network's outputs are probabilities already
    logits = 2.0 * rng.standard_normal((4, *plan.model_shape))
    pred = (rng.random((4, *plan.model_shape)) if activation == "none" else logits).astype(np.float32)
    inverse = np.array(plan.inverse_ornt)
    full = _full_back(pred, plan.reoriented_shape, activation).numpy()
    want_labels = apply_orientation(full.argmax(0), inverse)
    want_p = np.moveaxis(apply_orientation(np.moveaxis(full, 0, -1), inverse), -1, 0)

    labels = from_model_labels(pred, plan, activation=activation, max_slab_bytes=max_slab_bytes)
    assert labels.dtype == np.uint8 and labels.shape == data.shape
    assert np.array_equal(labels, want_labels)
    probs = from_model_probabilities(pred, plan, activation=activation, max_slab_bytes=max_slab_bytes)
    assert np.abs(probs - want_p).max() <= 1e-6
    rows = plan.slab_rows(4, max_slab_bytes=max_slab_bytes)
    assert rows == {1: 1, 100_000: 2, 10**9: 23}[max_slab_bytes]
    assert rows == 1 or plan.slab_bytes(rows, 4) <= max_slab_bytes
    assert rows == 23 or plan.slab_bytes(rows + 1, 4) > max_slab_bytes


def test_one_channel_is_thresholded_and_2d_slabs_work(rng):
    plan = plan_geometry((31, 20), zooms_mm=(1.0, 1.0), spacing_mm=(2.0, 0.5))
    pred = rng.standard_normal((1, *plan.model_shape)).astype(np.float32)
    full = torch.sigmoid(_full_back(pred, (31, 20), "none"))[0].numpy()
    got = from_model_labels(pred, plan, activation="sigmoid", max_slab_bytes=1)
    want = (_full_back(pred, (31, 20), "sigmoid")[0].numpy() > 0.5).astype(np.uint8)
    assert np.array_equal(got, want) and 0 < got.mean() < 1
    # sigmoid then resample differs from resample then sigmoid: probabilities are what is interpolated
    assert not np.allclose(full, from_model_probabilities(pred, plan, activation="sigmoid")[0], atol=1e-3)
    got_03 = from_model_labels(pred, plan, activation="sigmoid", threshold=0.3)
    assert got_03.sum() > got.sum()


def test_read_only_and_float64_predictions(rng, tmp_path):
    plan = plan_geometry((9, 8, 7), zooms_mm=(1.0, 1.0, 1.0), spacing_mm=(2.0, 2.0, 2.0))
    pred = rng.standard_normal((3, *plan.model_shape)).astype(np.float32)
    path = tmp_path / "pred.npy"
    np.save(path, pred)
    ro = np.load(path, mmap_mode="r")
    want = from_model_labels(pred, plan, activation="softmax")
    assert np.array_equal(from_model_labels(ro, plan, activation="softmax"), want)
    assert np.array_equal(from_model_labels(pred.astype(np.float64), plan, activation="softmax"), want)
    assert np.array_equal(from_model_labels(pred[:, ::-1][:, ::-1], plan, activation="softmax"), want)


def test_slab_rows_is_the_largest_within_budget():
    plan = plan_geometry(
        (512, 512, 300), np.diag([-0.7, -0.7, 1.5, 1.0]), orientation="RAS", spacing_mm=(1, 1, 1)
    )
    assert plan.model_shape == (358, 358, 450)
    rows = plan.slab_rows(3)
    assert rows == 5 and plan.slab_bytes(5, 3) <= geometry.DEFAULT_SLAB_BYTES < plan.slab_bytes(6, 3)
    # the docstring's arithmetic
    assert round(plan.slab_bytes(1, 3) / 1e6, 1) == 18.7 and round(plan.slab_bytes(5, 3) / 1e6, 1) == 58.7
    assert round(3 * 4 * np.prod(plan.model_shape) / 1e6) == 692


_PEAK_SCRIPT = textwrap.dedent(
    """
    import json
    import numpy as np, torch, torch.nn.functional as F
    from models.geometry.model_grid import plan_geometry
    from models.geometry.resample import from_model_labels

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    def reset():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak RSS := current RSS
        return status("VmRSS")

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    plan = plan_geometry((128, 128, 128), zooms_mm=(0.5, 0.5, 0.5), spacing_mm=(1.0, 1.0, 1.0))
    pred = rng.standard_normal((3, 64, 64, 64)).astype(np.float32)
    small = plan_geometry((6, 6, 6), zooms_mm=(0.5, 0.5, 0.5), spacing_mm=(1.0, 1.0, 1.0))
    from_model_labels(pred[:, :3, :3, :3], small, activation="softmax")  # warm up kernels and threads
    budget = 2 * 2**20
    base = reset()
    labels = from_model_labels(pred, plan, activation="softmax", max_slab_bytes=budget)
    slab_peak = status("VmHWM") - base
    base = reset()
    full = F.interpolate(torch.softmax(torch.from_numpy(pred), 0)[None], size=(128,) * 3, mode="trilinear")
    want = full[0].argmax(0).to(torch.uint8).numpy()
    full_peak = status("VmHWM") - base
    rows = plan.slab_rows(3, max_slab_bytes=budget)
    scratch = plan.slab_bytes(rows, 3)
    equal = bool((labels == want).all())
    print(json.dumps({"slab_peak": slab_peak, "full_peak": full_peak, "scratch": scratch, "equal": equal}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS reset needs Linux /proc")
def test_peak_memory_is_labels_plus_one_slab():
    # A fixed mmap threshold makes glibc return every freed slab, so resident memory follows what
    # is live; with its adaptive default, freed slabs stay on the heap (up to ~2.5x more here).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    cmd = [sys.executable, "-c", _PEAK_SCRIPT]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    labels_bytes = 128**3  # uint8, 2.1 MB
    full_float = 3 * 4 * 128**3  # what must never exist: 25 MB
    assert got["equal"] and got["scratch"] <= 2 * 2**20
    # measured with the same probe: the full-volume path allocates the float volume (and more) ...
    assert got["full_peak"] > full_float
    # ... the slab path only the labels and one slab (+ 2 MiB: thread stacks, index arrays, pages)
    assert got["slab_peak"] < labels_bytes + got["scratch"] + 2 * 2**20


# --- errors --------------------------------------------------------------------------------------


_RANK2 = np.array([[1.0, 1.0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])  # two columns alike


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        pytest.param(((4, 4, 4, 4), None), {}, "1 to 3 axes", id="4d"),
        pytest.param(((4, 0, 4), None), {}, "1 to 3 axes", id="empty-axis"),
        pytest.param(((4, 4, 4), np.eye(3)), {}, r"affine has shape \(3, 3\)", id="affine-shape"),
        pytest.param(((4, 4, 4), np.diag([1.0, 0.0, 1.0, 1.0])), {}, "zero or non-finite", id="affine-zero"),
        pytest.param(((4, 4, 4), _RANK2), {"orientation": "RAS"}, "no closest axis codes", id="affine-rank2"),
        pytest.param(((4, 4, 4), np.eye(4)), {"orientation": "RA"}, "three axis codes", id="codes-short"),
        pytest.param(((4, 4, 4), np.eye(4)), {"orientation": "RAX"}, "three axis codes", id="codes-letter"),
        pytest.param(((4, 4, 4), np.eye(4)), {"orientation": "RLS"}, "world axis twice", id="codes-dup"),
        pytest.param(((4, 4), np.eye(3)), {"orientation": "RAS"}, "needs a 3-D volume", id="codes-2d"),
        pytest.param(
            ((4, 4, 4), None), {"orientation": "RAS"}, "needs the input's affine", id="codes-no-affine"
        ),
        pytest.param(
            ((4, 4, 4), np.eye(4)), {"spacing_mm": (1.0, 1.0)}, "expected 3 positive", id="spacing-len"
        ),
        pytest.param(((4, 4, 4), np.eye(4)), {"spacing_mm": (1.0, -1.0, 1.0)}, "positive", id="spacing-neg"),
        pytest.param(((4, 4), None), {"spacing_mm": (1.0, 1.0)}, "spacing=native", id="spacing-no-zooms"),
        pytest.param(((4, 4), None), {"zooms_mm": (1.0,)}, "zooms_mm", id="zooms-len"),
    ],
)
def test_plan_errors_name_the_parameter(args, kwargs, match):
    with pytest.raises(GeometryError, match=match):
        plan_geometry(*args, **kwargs)


def test_degenerate_affine_without_orientation_has_no_codes():
    plan = plan_geometry((4, 4, 4), _RANK2)
    assert plan.input_codes is None and plan.is_identity


def test_array_errors():
    plan = plan_geometry((4, 5, 6), zooms_mm=(1.0, 1.0, 1.0), spacing_mm=(2.0, 2.0, 2.0))
    with pytest.raises(GeometryError, match=r"volume has shape \(1, 4, 5\)"):
        to_model(np.zeros((1, 4, 5), np.float32), plan)
    with pytest.raises(GeometryError, match=r"pred has shape \(2, 4, 5, 6\).*S_m"):
        from_model_labels(np.zeros((2, 4, 5, 6), np.float32), plan, activation="none")
    pred = np.zeros((2, *plan.model_shape), np.float32)
    with pytest.raises(GeometryError, match="activation='relu'"):
        from_model_probabilities(pred, plan, activation="relu")
    with pytest.raises(GeometryError, match="max_slab_bytes=0"):
        from_model_labels(pred, plan, activation="none", max_slab_bytes=0)
    wide = from_model_labels(np.zeros((257, *plan.model_shape), np.float32), plan, activation="none")
    assert wide.dtype == np.uint16  # issue 23 item 7: more than 256 classes are uint16 labels
    assert issubclass(GeometryError, InputError) and issubclass(GeometryError, ValueError)


def test_docstring_examples():
    result = doctest.testmod(geometry, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 1 and result.failed == 0
