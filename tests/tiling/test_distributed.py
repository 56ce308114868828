"""``tiling.distributed``: one volume across Dask workers equals the single-process result.

- Chunk planning (pure integers): chunks start on the stride grid, are regular, never shorter than
  the depth, and sum to the axis.
- Dask's local scheduler (no cluster): a random conv stack and argmax labels, dask/numpy/zarr inputs
  and outputs, the tile-dependent refusal, client-side validation, ``should_stop`` (also on a
  cluster, where the run's tasks are cancelled); a halo below the receptive-field
  radius is shown to *fail* the comparison (the tests can fail).
- A ``LocalCluster`` of two worker processes (one thread each): a random conv stack on a random
  volume with odd sizes, a stride-4 U-Net whose chunks are not all multiples of 4 at the far border,
  and nilearn's MNI152 T1 (2 mm) through a conv stack, each equal to the whole-volume pass and to
  single-process ``tiled_inference``; the model is loaded once per worker, not per task; a worker
  with a ``GPU`` resource takes every task when the run asks for one.
- ``slow``: a scheduler and two workers started as separate ``dask`` processes on 127.0.0.1 and
  addressed only by ``tcp://127.0.0.1:PORT``; one worker is killed with SIGKILL mid-run, a third
  joins, and Dask's own rescheduling still gives the same result.

Tolerance: 1e-5 max abs difference (the acceptance bound, for unit-range data); blocks and tiles of
different sizes change only fp32 rounding in the convolutions (measured 0 to ~1e-7 here).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from _dask_factories import NetFactory, loads_per_process
from _tiling_nets import pad_end, whole
from hypothesis import given, settings
from hypothesis import strategies as st

from tiling import GridError, RunCancelledError, ShapeMismatchError, tiled_inference
from tiling.distributed import (
    DistributedError,
    PredictorPlugin,
    TileDependentError,
    plan_chunks,
    release_predictor,
    tiled_inference_dask,
)

ATOL = 1e-5  # acceptance bound; see the module docstring
HERE = Path(__file__).resolve().parent
UNET_RADIUS = 13  # TinyUNet's measured receptive-field radius (asserted in test_strided.py)


def _labels(v: torch.Tensor) -> torch.Tensor:
    return v.argmax(0, keepdim=True).to(torch.uint8)


def _crop(y: np.ndarray, shape) -> np.ndarray:
    return y[(slice(None), *(slice(0, s) for s in shape))]


def _predictor_plugins(client) -> dict[str, list[str]]:
    return client.run(lambda dask_worker: sorted(n for n in dask_worker.plugins if n.startswith("tilewise")))


@pytest.fixture
def zarr_mod():
    return pytest.importorskip("zarr")


@pytest.fixture
def dask_array():
    return pytest.importorskip("dask.array")


def _to_zarr(zarr_mod, path: Path, x: np.ndarray, chunk: int):
    chunks = (x.shape[0],) + (chunk,) * (x.ndim - 1)
    z = zarr_mod.open_array(str(path), mode="w", shape=x.shape, chunks=chunks, dtype=x.dtype)
    z[...] = x
    return z


# ---------------------------------------------------------------------------------------------
# Chunk planning


@pytest.mark.parametrize(
    ("length", "chunk", "depth", "alignment", "expected"),
    [
        pytest.param(128, 32, 8, 4, (32, 32, 32, 32), id="exact"),
        pytest.param(70, 32, 8, 4, (28, 28, 14), id="short-remainder-smaller-chunk"),
        pytest.param(45, 16, 16, 4, (24, 21), id="short-remainder-larger-chunk"),
        pytest.param(37, 12, 4, 1, (11, 11, 11, 4), id="remainder-equals-depth"),
        pytest.param(5, 32, 8, 1, (5,), id="one-chunk"),
        pytest.param(50, 10, 0, 1, (10,) * 5, id="no-depth"),
        # 30 -> 32 leaves 4 < 16; 24 leaves 4; 40 leaves 20.
        pytest.param(100, 30, 16, 8, (40, 40, 20), id="rounded-up-to-alignment"),
        # 4 -> raised to the depth 12, which leaves 4; 16 leaves 4; 20 divides 100.
        pytest.param(100, 4, 12, 4, (20,) * 5, id="raised-to-depth"),
    ],
)
def test_plan_chunks_examples(length, chunk, depth, alignment, expected):
    assert plan_chunks((length,), chunk, depth=depth, alignment=alignment) == (expected,)


@settings(max_examples=300, deadline=None)
@given(
    length=st.integers(1, 400),
    chunk=st.integers(1, 120),
    depth_steps=st.integers(0, 6),
    alignment=st.sampled_from([1, 2, 4, 8, 16]),
)
def test_plan_chunks_properties(length, chunk, depth_steps, alignment):
    depth = depth_steps * alignment
    (chunks,) = plan_chunks((length,), chunk, depth=depth, alignment=alignment)
    assert sum(chunks) == length
    if len(chunks) > 1:
        c = chunks[0]
        assert c % alignment == 0 and all(k == c for k in chunks[:-1]) and 0 < chunks[-1] <= c
        assert min(chunks) >= depth, chunks
    else:
        assert chunks == (length,)


def test_plan_chunks_rejects_depth_off_the_grid():
    with pytest.raises(GridError, match=r"depth\[0\]=6 is not a multiple of alignment\[0\]=4"):
        plan_chunks((64,), 16, depth=6, alignment=4)
    with pytest.raises(GridError, match="chunk_shape"):
        plan_chunks((64, 64), (16, 0), depth=0)


def test_imports_without_dask():
    # `tiling` and `tiling.distributed` import where the extra is missing; the entry point says so.
    code = (
        "import sys\n"
        "for m in ('dask', 'distributed', 'zarr'): sys.modules[m] = None\n"
        "import numpy as np, tiling, tiling.distributed as d\n"
        "assert d.plan_chunks((10,), 4, depth=0) == ((4, 4, 2),)\n"
        "try:\n"
        "    d.tiled_inference_dask(np.zeros((1, 4), np.float32), print, halo=0)\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'tilewise[distributed]'" in proc.stdout


def test_predictor_plugin_loads_once_and_never_pickles_the_model():
    import pickle

    plugin = PredictorPlugin(NetFactory(c_in=1))
    first = plugin.predictor()
    assert plugin.predictor() is first and plugin.n_loads == 1
    copy = pickle.loads(pickle.dumps(plugin))
    assert copy._predictor is None and copy.n_loads == 0 and copy.model_factory == plugin.model_factory
    plugin.teardown(worker=None)
    assert plugin._predictor is None
    assert plugin.predictor() is not first and plugin.n_loads == 2


# ---------------------------------------------------------------------------------------------
# Dask's local scheduler (no distributed client)


def test_local_equals_whole_volume_and_single_process(zarr_mod, tmp_path, rng, record_diff):
    factory = NetFactory(c_in=2, c_out=3, dilations=(1, 2, 1), record_dir=str(tmp_path))
    net = factory.build()
    x = rng.standard_normal((2, 37, 29, 23), dtype=np.float32)
    z = _to_zarr(zarr_mod, tmp_path / "in.zarr", x, 16)
    y = tiled_inference_dask(z, factory, halo=4, tile_shape=16, chunk_shape=12)
    assert isinstance(y, zarr_mod.Array) and y.shape == (3, 37, 29, 23) and y.dtype == np.float32
    assert y.chunks == (3, 11, 12, 12)  # 37 = 3 * 11 + 4 (12 would leave 1 < depth 4)
    got = y[...]
    assert record_diff("dask-local-conv", got, whole(net, x)) <= ATOL
    assert record_diff("dask-local-conv", got, tiled_inference(x, net, 16, halo=4)) <= ATOL
    # One load in this process for the probe and all 4 * 3 * 2 blocks.
    assert loads_per_process(tmp_path) == {os.getpid(): 1}


def test_local_halo_below_radius_fails_the_comparison(rng):
    # Receptive radius 4; depth 3 leaves chunk borders inside the network's reach: a real mismatch.
    factory = NetFactory(c_in=1, dilations=(1, 2, 1))
    x = rng.standard_normal((1, 30, 22, 21), dtype=np.float32)
    y = tiled_inference_dask(x, factory, halo=3, chunk_shape=10)
    assert float(np.abs(y[...] - whole(factory.build(), x)).max()) > 1e-2


def test_local_labels_inputs_and_outputs(zarr_mod, dask_array, tmp_path, rng):
    factory = NetFactory(c_in=1, c_out=4, dilations=(1, 1))
    x = rng.standard_normal((1, 25, 19, 17), dtype=np.float32)
    want = whole(factory.build(), x)
    # dask input with its own (misaligned) chunks, argmax labels
    labels = tiled_inference_dask(dask_array.from_array(x, chunks=(1, 7, 7, 7)), factory, halo=2,
                                  alignment=2, reduce=_labels)  # fmt: skip
    assert labels.dtype == np.uint8 and labels.shape == (1, 25, 19, 17)
    # The input's 7 rounded up to the alignment 2 is 8; 25 = 3 * 8 + 1 and 17 = 2 * 8 + 1 leave a
    # last chunk shorter than the depth 2, so 10 and 6 are used there.
    assert labels.chunks == (1, 10, 8, 6)
    # With alignment 2 the volume is zero-padded at its far end to even sizes (what the network sees
    # in a whole-volume pass of that alignment), so the reference is that pass, cropped back.
    np.testing.assert_array_equal(
        labels[0], _crop(whole(factory.build(), pad_end(x, 2)), x.shape[1:]).argmax(0)
    )
    # numpy input into an existing zarr array with its own chunks (rechunked to them, whole chunks)
    out = zarr_mod.open_array(str(tmp_path / "o.zarr"), mode="w", shape=(4, 25, 19, 17),
                              chunks=(4, 5, 19, 17), dtype="f4")  # fmt: skip
    got = tiled_inference_dask(x, factory, halo=2, chunk_shape=9, out=out)
    assert got is out and float(np.abs(out[...] - want).max()) <= ATOL
    # a new zarr path; a second run refuses to replace it unless overwrite=True
    path = tmp_path / "new.zarr"
    first = tiled_inference_dask(x, factory, halo=2, chunk_shape=9, out=path)
    assert float(np.abs(first[...] - want).max()) <= ATOL
    with pytest.raises(Exception, match="exist"):
        tiled_inference_dask(x, factory, halo=2, chunk_shape=9, out=path)
    again = tiled_inference_dask(x, factory, halo=2, chunk_shape=9, out=str(path), overwrite=True)
    assert float(np.abs(again[...] - want).max()) <= ATOL


def test_local_progress_bar(capsys, rng):
    x = rng.standard_normal((1, 12, 12), dtype=np.float32)
    tiled_inference_dask(x, NetFactory(ndim=2, dilations=(1,)), halo=1, chunk_shape=6, progress=True)
    assert "100% Completed" in capsys.readouterr().out


def test_should_stop_cancels_a_local_run(rng):
    x = rng.standard_normal((1, 12, 12), dtype=np.float32)
    with pytest.raises(RunCancelledError, match="stopped"):
        tiled_inference_dask(
            x, NetFactory(ndim=2, dilations=(1,)), halo=1, chunk_shape=6, should_stop=lambda: True
        )


@pytest.mark.timeout(120)
def test_should_stop_cancels_a_cluster_run(zarr_mod, tmp_path, rng):
    # 0.2 s per forward pass, 27 blocks on one thread: stopped after about 1 s, well before the end.
    distributed = pytest.importorskip("distributed")
    x = rng.standard_normal((1, 24, 24, 24), dtype=np.float32)
    z = _to_zarr(zarr_mod, tmp_path / "in.zarr", x, 8)
    deadline = time.monotonic() + 1.0
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0")
        as cluster,
        distributed.Client(cluster, set_as_default=False) as c,
    ):  # fmt: skip
        with pytest.raises(RunCancelledError):
            tiled_inference_dask(z, NetFactory(c_in=1, delay_s=0.2), halo=2, tile_shape=8, chunk_shape=8,
                                 out=tmp_path / "out.zarr", client=c,
                                 should_stop=lambda: time.monotonic() > deadline)  # fmt: skip
    # stopped well before the end: counted in chunks written, not seconds (a loaded machine is slow)
    assert _chunk_files(tmp_path / "out.zarr") < 27


def test_tile_dependent_refused_across_chunks_allowed_in_one(rng):
    factory = NetFactory(c_in=1, dilations=(1, 1))
    x = rng.standard_normal((1, 20, 18, 16), dtype=np.float32)
    with pytest.raises(TileDependentError, match=r"tiling.tiled_inference.*chunk_shape >= \(20, 18, 16\)"):
        tiled_inference_dask(x, factory, halo=2, chunk_shape=8, tile_dependent=True)
    assert issubclass(TileDependentError, ValueError)
    # One chunk: no chunk border, so the result is in-process tiled_inference with the same tiles.
    net = factory.build()
    y = tiled_inference_dask(x, factory, halo=2, tile_shape=8, overlap=2, blend="gaussian",
                             chunk_shape=(20, 18, 16), tile_dependent=True)  # fmt: skip
    want = tiled_inference(x, net, 8, halo=2, overlap=2, blend="gaussian")
    assert float(np.abs(y[...] - want).max()) <= ATOL


def _never(*args):
    raise AssertionError("the model must not be loaded when the plan is invalid")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param({"scale": 2}, GridError, r"only scale=1 is supported", id="scale"),
        pytest.param(
            {"tile_shape": 10, "alignment": 4}, GridError, r"not a multiple of alignment", id="tile-off-grid"
        ),  # fmt: skip
        pytest.param({"tile_shape": 8, "halo": 4}, GridError, r"empty core", id="empty-core"),
        pytest.param({"batch_size": 0}, GridError, r"batch_size=0", id="batch-size"),
        pytest.param({"halo": (1, 2)}, GridError, r"halo=\(1, 2\) has 2 axes", id="halo-axes"),
        pytest.param(
            {"blocks_from": "read"}, GridError, r"needs a zarr.Array input, not ndarray", id="read-needs-zarr"
        ),  # fmt: skip
        pytest.param(
            {"blocks_from": "neighbours"},
            GridError,
            r"blocks_from='neighbours' is not one of",
            id="blocks-from",
        ),  # fmt: skip
        pytest.param(
            {"resources": {"GPU": 1}},
            DistributedError,
            r"need a distributed client",
            id="resources-without-client",
        ),  # fmt: skip
    ],
)
def test_invalid_plans_fail_before_any_model_load(rng, kwargs, error, match):
    x = rng.standard_normal((1, 20, 20, 20), dtype=np.float32)
    params = {"halo": 2, "chunk_shape": 16} | kwargs
    with pytest.raises(error, match=match):
        tiled_inference_dask(x, _never, **params)


def test_shape_errors_and_model_errors(zarr_mod, rng):
    with pytest.raises(ShapeMismatchError, match=r"expected \(C, \*spatial\)"):
        tiled_inference_dask(np.zeros(5, np.float32), NetFactory(), halo=1)
    x = rng.standard_normal((1, 10, 10, 10), dtype=np.float32)
    with pytest.raises(
        ShapeMismatchError, match=r"out has shape \(2, 10, 10, 10\); expected \(3, 10, 10, 10\)"
    ):
        tiled_inference_dask(x, NetFactory(), halo=4, out=zarr_mod.zeros(shape=(2, 10, 10, 10), dtype="f4"))

    def cropping():
        return lambda t: t[..., 1:-1]  # a "valid" network: its output is smaller than its input

    with pytest.raises(ShapeMismatchError, match="predictor output has shape"):
        tiled_inference_dask(x, cropping, halo=1)

    def broken():
        raise FileNotFoundError("no weights at /models/x.pt")

    with pytest.raises(FileNotFoundError, match="no weights"):
        tiled_inference_dask(x, broken, halo=4)


# ---------------------------------------------------------------------------------------------
# A LocalCluster of two worker processes


@pytest.fixture(scope="module")
def client():
    # Module scope: starting two worker processes that import torch takes several seconds on this
    # machine; the cluster holds no state between tests beyond what each test checks and cleans.
    # dashboard_address=":0": the scheduler's HTTP server takes a free port; on the default 8787,
    # taken by any other cluster on the machine, it warns, and warnings are errors here.
    distributed = pytest.importorskip("distributed")
    pytest.importorskip("zarr")
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")
        as cluster,
        distributed.Client(cluster, set_as_default=False) as c,
    ):  # fmt: skip
        yield c


@pytest.mark.timeout(180)
@pytest.mark.parametrize("blocks_from", ["read", "map_overlap"])
def test_cluster_conv_stack_equals_single_process(client, zarr_mod, tmp_path, rng, record_diff, blocks_from):
    factory = NetFactory(c_in=2, c_out=3, dilations=(1, 2, 1), record_dir=str(tmp_path))
    net = factory.build()
    x = rng.standard_normal((2, 37, 29, 23), dtype=np.float32)
    z = _to_zarr(zarr_mod, tmp_path / "in.zarr", x, 16)
    y = tiled_inference_dask(z, factory, halo=4, tile_shape=16, chunk_shape=12, batch_size=2,
                             out=tmp_path / "out.zarr", client=client, blocks_from=blocks_from)  # fmt: skip
    got = y[...]
    want = whole(net, x)
    assert record_diff("dask-cluster-conv", got, want) <= ATOL
    assert record_diff("dask-cluster-conv", got, tiled_inference(x, net, 16, halo=4)) <= ATOL
    labels = tiled_inference_dask(z, factory, halo=4, tile_shape=16, chunk_shape=12, reduce=_labels,
                                  out=tmp_path / "labels.zarr", client=client,
                                  blocks_from=blocks_from)  # fmt: skip
    np.testing.assert_array_equal(labels[0], want.argmax(0))
    # 2 runs x 4 * 3 * 2 = 48 block tasks, yet each worker process loaded the model once per run.
    loads = loads_per_process(tmp_path)
    assert os.getpid() not in loads and 1 <= len(loads) <= 2 and set(loads.values()) <= {1, 2}, loads
    assert sum(loads.values()) <= 4, loads
    # Without keep_loaded the plugin (and its model) is gone from the workers after the run.
    assert all(not names for names in _predictor_plugins(client).values())


@pytest.mark.timeout(180)
def test_cluster_keep_loaded_reuses_the_model(client, rng, tmp_path, zarr_mod):
    factory = NetFactory(c_in=1, dilations=(1, 1), record_dir=str(tmp_path / "loads"))
    (tmp_path / "loads").mkdir()
    x = rng.standard_normal((1, 24, 20, 18), dtype=np.float32)
    z = _to_zarr(zarr_mod, tmp_path / "in.zarr", x, 8)
    for k in range(2):
        tiled_inference_dask(z, factory, halo=2, out=tmp_path / f"o{k}.zarr", client=client, keep_loaded=True)
    assert sum(loads_per_process(tmp_path / "loads").values()) <= 2  # not 4: the second run reused
    assert all(len(names) == 1 for names in _predictor_plugins(client).values())
    release_predictor(client, factory)
    assert all(not names for names in _predictor_plugins(client).values())


@pytest.mark.timeout(180)
def test_cluster_unet_alignment_4_far_border(client, zarr_mod, tmp_path, rng, record_diff):
    # Sizes not multiples of 4: the last chunk of every axis ends off the stride grid, where the
    # whole-volume pass pads the volume at its end to a multiple of 4; depth = 13 rounded up = 16.
    factory = NetFactory(kind="unet", c_in=1, c_out=2)
    net = factory.build()
    shape = (45, 38, 37)
    x = rng.standard_normal((1, *shape), dtype=np.float32)
    z = _to_zarr(zarr_mod, tmp_path / "in.zarr", x, 16)
    y = tiled_inference_dask(z, factory, halo=UNET_RADIUS, alignment=4, out=tmp_path / "out.zarr",
                             client=client)  # fmt: skip
    assert y.chunks[1:] == (24, 20, 20)  # (24, 21), (20, 18), (20, 17): remainders >= depth 16
    want = _crop(whole(net, pad_end(x, 4)), shape)
    assert record_diff("dask-cluster-unet-align4", y[...], want) <= ATOL


@pytest.mark.timeout(180)
def test_cluster_mni152(client, zarr_mod, tmp_path, record_diff):
    datasets = pytest.importorskip("nilearn.datasets")
    t1 = np.asarray(datasets.load_mni152_template(resolution=2).get_fdata(), dtype=np.float32)
    x = (t1 / t1.max())[None]  # unit range: the tolerance is for unit-range data
    factory = NetFactory(c_in=1, c_out=3, dilations=(1, 2, 1))
    net = factory.build()
    z = _to_zarr(zarr_mod, tmp_path / "t1.zarr", x, 48)
    y = tiled_inference_dask(z, factory, halo=4, tile_shape=40, batch_size=2, out=tmp_path / "out.zarr",
                             client=client)  # fmt: skip
    assert y.shape == (3, 99, 117, 95)
    got = y[...]
    want = whole(net, x)
    assert record_diff("dask-cluster-mni152", got, want) <= ATOL
    assert record_diff("dask-cluster-mni152", got, tiled_inference(x, net, 40, halo=4, batch_size=2)) <= ATOL
    np.testing.assert_array_equal(got.argmax(0), want.argmax(0))


@pytest.mark.timeout(60)
def test_cluster_needs_a_shared_out_and_finds_the_current_client(client, rng):
    x = rng.standard_normal((1, 8, 8), dtype=np.float32)
    with pytest.raises(DistributedError, match="pass out= a zarr path"):
        tiled_inference_dask(x, NetFactory(ndim=2), halo=1, client=client)
    with client.as_current(), pytest.raises(DistributedError, match="pass out= a zarr path"):
        tiled_inference_dask(x, NetFactory(ndim=2), halo=1)
    zarr = pytest.importorskip("zarr")
    with pytest.raises(DistributedError, match="out is an in-memory zarr array"):
        tiled_inference_dask(x, NetFactory(ndim=2), halo=1, client=client, out=zarr.zeros(shape=(3, 8, 8)))


@pytest.mark.timeout(180)
def test_cluster_gpu_resource_sends_every_task_to_the_worker_that_has_it(client, zarr_mod, tmp_path, rng):
    # A third worker, started as its own `dask worker` process with a GPU=1 resource label, joins the
    # LocalCluster; a run that asks for {"GPU": 1} must load the model there and nowhere else.
    x = rng.standard_normal((1, 20, 20, 20), dtype=np.float32)
    z = _to_zarr(zarr_mod, tmp_path / "in.zarr", x, 10)
    (tmp_path / "loads").mkdir()
    factory = NetFactory(c_in=1, dilations=(1, 1), record_dir=str(tmp_path / "loads"))
    with _DaskProcesses(tmp_path) as procs:
        gpu = procs.worker(client.scheduler.address, "--resources", "GPU=1")
        client.wait_for_workers(3, timeout=120)
        y = tiled_inference_dask(z, factory, halo=2, chunk_shape=10, out=tmp_path / "out.zarr", client=client,
                                 resources={"GPU": 1})  # fmt: skip
        assert loads_per_process(tmp_path / "loads") == {gpu.pid: 1}
    assert float(np.abs(y[...] - whole(factory.build(), x)).max()) <= ATOL
    _wait_for(lambda: len(client.nthreads()) == 2, 60, "the GPU worker to leave")


@pytest.mark.timeout(120)
def test_threaded_worker_loads_once_and_reports_progress(zarr_mod, tmp_path, rng, capsys):
    # One worker with 2 threads in this process (processes=False): concurrent tasks share one load
    # (the plugin's lock), and progress=True prints Dask's own progress bar.
    distributed = pytest.importorskip("distributed")
    factory = NetFactory(c_in=1, dilations=(1, 1), record_dir=str(tmp_path))
    x = rng.standard_normal((1, 24, 20, 18), dtype=np.float32)
    z = _to_zarr(zarr_mod, tmp_path / "in.zarr", x, 8)
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0")
        as cluster,
        distributed.Client(cluster, set_as_default=False) as c,
    ):  # fmt: skip
        y = tiled_inference_dask(z, factory, halo=2, out=tmp_path / "out.zarr", client=c, progress=True)
    assert loads_per_process(tmp_path) == {os.getpid(): 1}
    assert float(np.abs(y[...] - whole(factory.build(), x)).max()) <= ATOL
    assert "100% Completed" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_cuda_worker(tmp_path, zarr_mod, rng, record_diff):
    distributed = pytest.importorskip("distributed")
    factory = NetFactory(c_in=1, c_out=3, dilations=(1, 2, 1), device="cuda")
    x = rng.standard_normal((1, 64, 48, 40), dtype=np.float32)
    z = _to_zarr(zarr_mod, tmp_path / "in.zarr", x, 32)
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0",
                                 resources={"GPU": 1}) as cluster,
        distributed.Client(cluster, set_as_default=False) as c,
    ):  # fmt: skip
        y = tiled_inference_dask(z, factory, halo=4, tile_shape=32, device="cuda", resources={"GPU": 1},
                                 out=tmp_path / "out.zarr", client=c)  # fmt: skip
    # TF32 is off in the factory: fp32 cuDNN vs CPU convolutions differ by rounding only.
    assert record_diff("dask-cuda-conv", y[...], whole(NetFactory(c_in=1, c_out=3).build(), x)) <= 1e-4


# ---------------------------------------------------------------------------------------------
# Separate `dask scheduler` / `dask worker` processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


class _DaskProcesses:
    """Starts ``dask scheduler`` / ``dask worker`` processes on 127.0.0.1; kills them all on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        path = [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}

    def __enter__(self) -> _DaskProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=30)

    def _start(self, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"dask-{len(self.procs)}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([sys.executable, "-m", "dask", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=self.env)  # fmt: skip
        log.close()
        self.procs.append(proc)
        return proc

    def scheduler(self) -> str:
        port = _free_port()
        self._start("scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard")
        return f"tcp://127.0.0.1:{port}"

    def worker(self, address: str, *extra: str) -> subprocess.Popen[bytes]:
        # --no-nanny: the process is the worker itself, so SIGKILL takes the worker down for good.
        return self._start("worker", address, "--host", "127.0.0.1", "--nthreads", "1", "--no-nanny",
                           "--no-dashboard", "--death-timeout", "60", *extra)  # fmt: skip


def _chunk_files(path: Path) -> int:
    return sum(
        1 for f in path.rglob("*") if f.is_file() and f.name not in ("zarr.json", ".zarray", ".zattrs")
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_separate_processes_survive_a_killed_worker(tmp_path, zarr_mod, rng, record_diff, record_figure):
    distributed = pytest.importorskip("distributed")
    x = rng.standard_normal((1, 48, 40, 36), dtype=np.float32)
    z = _to_zarr(zarr_mod, tmp_path / "in.zarr", x, 16)
    want = whole(NetFactory(c_in=1).build(), x)
    (tmp_path / "loads").mkdir()
    with _DaskProcesses(tmp_path) as procs:
        address = procs.scheduler()
        workers = [procs.worker(address), procs.worker(address)]
        with distributed.Client(address, timeout="60s", set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
            # Plain run: the same result as in process.
            y = tiled_inference_dask(z, NetFactory(c_in=1), halo=4, tile_shape=16, chunk_shape=16,
                                     out=tmp_path / "plain.zarr", client=client)  # fmt: skip
            assert record_diff("dask-processes", y[...], want) <= ATOL
            # Slow run (20 ms per forward pass, 27 blocks of 27 tiles): kill a busy worker mid-run.
            slow = NetFactory(c_in=1, record_dir=str(tmp_path / "loads"), delay_s=0.02)
            out = tmp_path / "killed.zarr"
            with ThreadPoolExecutor(1) as pool:
                run = pool.submit(tiled_inference_dask, z, slow, halo=4, tile_shape=16, chunk_shape=16,
                                  out=out, client=client)  # fmt: skip
                _wait_for(lambda: out.exists() and _chunk_files(out) >= 3, 200, "3 chunks to be written")
                loaded = set(loads_per_process(tmp_path / "loads"))
                victim = next(w for w in workers if w.pid in loaded)
                os.kill(victim.pid, signal.SIGKILL)
                written_at_kill = _chunk_files(out)
                procs.worker(address)  # a replacement joins; the survivor works on meanwhile
                y = run.result(timeout=300)
            assert victim.wait(timeout=30) == -signal.SIGKILL
            assert written_at_kill < 27, "the worker was killed after the run had finished"
            assert _chunk_files(out) == 27
            loads = loads_per_process(tmp_path / "loads")
            record_figure(
                "dask killed worker",
                f"SIGKILL after {written_at_kill}/27 chunks written; model loads per process {loads}",
            )
            assert record_diff("dask-processes-killed-worker", y[...], want) <= ATOL


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_worker_memory_follows_the_chunk_not_the_volume(tmp_path, record_figure):
    # benchmarks/dask_scaling.py on 192^3 (27 MiB) and 384^3 (216 MiB) float32 volumes, chunk 96,
    # tile 48, 2 worker processes: each worker's peak RSS rise over its level before the run.
    # Measured: +50 MiB at 192^3 and +71 MiB at 384^3 (0.33 of the volume). The 8x larger volume may
    # add at most 15% of its size (the extra is the 27 zarr chunks an inner block touches when it is
    # read, against 8 in the 2x2x2 plan of 192^3), and the rise stays under half the volume.
    pytest.importorskip("distributed")
    script = HERE.parents[1] / "benchmarks" / "dask_scaling.py"
    report = tmp_path / "scaling.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--sizes", "192", "384", "--chunk", "96", "--tile", "48",
         "--workers", "2", "--workdir", str(tmp_path), "--json", str(report)],
        capture_output=True, text=True, timeout=1400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    runs = {r["size"]: r for r in json.loads(report.read_text())["runs"]}
    rise = {size: max(w["rise_mib"] for w in run["workers"]) for size, run in runs.items()}
    volume = runs[384]["volume_mib"]
    text = f"peak RSS rise {rise[192]:.0f} MiB at 192^3, {rise[384]:.0f} MiB at 384^3 ({volume:.0f} MiB)"
    record_figure("dask worker memory", text)
    assert rise[384] < 0.5 * volume, rise
    assert rise[384] - rise[192] < 0.15 * volume, rise
