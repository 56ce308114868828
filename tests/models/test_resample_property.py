"""models.geometry.resample there and back, a property test (issue 23 item 1).

Over axis codes (every permutation and flip), voxel sizes (anisotropic, some equal to the model's so
one axis is not resampled), odd sizes and slab budgets (one row to all rows at once): the model-grid
input equals ``nib.as_closest_canonical`` then ``scipy.ndimage.map_coordinates`` at the documented
voxel centres, and the way back equals ``map_coordinates`` of the model-grid output at each input
voxel's own world position (through the canonical affine). Before the fix, an axis whose size the
model grid keeps but whose rows ran over several slabs answered ``could not broadcast`` (the MNI152
reoriented to PIR or LPS through ``tissue-3d``).
"""

from __future__ import annotations

import itertools

import nibabel as nib
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import ndimage

from models.geometry.model_grid import plan_geometry
from models.geometry.resample import from_model_labels, from_model_probabilities, to_model

ORNTS = list(itertools.product(itertools.permutations(range(3)), itertools.product((1, -1), repeat=3)))
ZOOMS = (0.5, 0.7, 1.0, 1.5, 3.0)
SPACINGS = (0.5, 1.0, 1.5, 2.0)
ODD = st.sampled_from((1, 3, 5, 7, 9, 11, 13))


def _affine(perm: tuple[int, ...], flips: tuple[int, ...], zooms: tuple[float, ...]) -> np.ndarray:
    """Array axis ``i`` runs along world axis ``perm[i]`` (sign ``flips[i]``, ``zooms[i]`` mm)."""
    aff = np.eye(4)
    aff[:3, :3] = 0.0
    for i, (axis, flip, zoom) in enumerate(zip(perm, flips, zooms, strict=True)):
        aff[axis, i] = flip * zoom
    aff[:3, 3] = (-12.5, 7.0, 3.25)
    return aff


def _centres(n: int, m: int) -> np.ndarray:
    """Continuous index on an axis of ``n`` voxels that voxel ``j`` of ``m`` sits at (shared extent)."""
    return (np.arange(m) + 0.5) * n / m - 0.5


@settings(max_examples=60, deadline=None)
@given(
    ornt=st.sampled_from(ORNTS),
    shape=st.tuples(ODD, ODD, ODD),
    zooms=st.tuples(*[st.sampled_from(ZOOMS)] * 3),
    spacing=st.tuples(*[st.sampled_from(SPACINGS)] * 3),
    slab=st.sampled_from((1, 2_000, 20_000, 1 << 30)),
    seed=st.integers(0, 2**16),
)
def test_there_and_back_match_canonical_and_scipy(
    ornt: tuple[tuple[int, ...], tuple[int, ...]],
    shape: tuple[int, int, int],
    zooms: tuple[float, float, float],
    spacing: tuple[float, float, float],
    slab: int,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    affine = _affine(*ornt, zooms)
    data = rng.standard_normal(shape).astype(np.float32)
    plan = plan_geometry(shape, affine, orientation="RAS", spacing_mm=spacing)

    canonical = nib.as_closest_canonical(nib.Nifti1Image(data, affine))
    c = np.asarray(canonical.dataobj, dtype=np.float64)
    c_zooms = canonical.header.get_zooms()
    m_shape = tuple(max(1, round(n * z / s)) for n, z, s in zip(c.shape, c_zooms, spacing, strict=True))
    assert plan.reoriented_shape == c.shape and plan.model_shape == m_shape

    # there: canonical, then linear at the model voxels' centres
    there = np.meshgrid(*[_centres(n, m) for n, m in zip(c.shape, m_shape, strict=True)], indexing="ij")
    expected = ndimage.map_coordinates(c, there, order=1, mode="nearest")
    np.testing.assert_allclose(to_model(data[None], plan)[0], expected, atol=2e-5)

    # back: each input voxel's world position -> canonical index -> model index -> linear
    pred = rng.standard_normal((3, *m_shape)).astype(np.float32)
    index = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), axis=-1).reshape(-1, 3)
    world = index @ affine[:3, :3].T + affine[:3, 3]
    canon_index = (world - canonical.affine[:3, 3]) @ np.linalg.inv(canonical.affine[:3, :3]).T
    model_index = [
        (canon_index[:, a] + 0.5) * m_shape[a] / c.shape[a] - 0.5 for a in range(3)
    ]  # inverse of _centres
    back = np.stack(
        [ndimage.map_coordinates(p.astype(np.float64), model_index, order=1, mode="nearest") for p in pred]
    ).reshape(3, *shape)
    got = from_model_probabilities(pred, plan, max_slab_bytes=slab)
    np.testing.assert_allclose(got, back, atol=2e-5)

    # labels: softmax on the model grid, resampled, argmax (where no two classes nearly tie)
    soft = np.exp(pred - pred.max(0)) / np.exp(pred - pred.max(0)).sum(0)
    probs = np.stack(
        [ndimage.map_coordinates(p.astype(np.float64), model_index, order=1, mode="nearest") for p in soft]
    ).reshape(3, *shape)
    labels = from_model_labels(pred, plan, activation="softmax", max_slab_bytes=slab)
    top2 = np.sort(probs, axis=0)[-2:]
    clear = (top2[1] - top2[0]) > 1e-4
    np.testing.assert_array_equal(labels[clear], probs.argmax(0)[clear])
