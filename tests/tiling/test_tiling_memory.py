"""Peak memory follows the tile size, not the image size.

A float32 volume of 512x512x256 (256 MiB) is stored on disk as a ``numpy.memmap`` and processed by a
cheap conv predictor (a 3x3x3 box filter, i.e. ``avg_pool3d`` with stride 1: a convolution with
weights 1/27 and zero padding) into an on-disk ``out`` memmap, in a child process. The parent samples
the child's ``RssAnon`` (anonymous resident memory: heap copies count, file-backed page cache of the
memmaps does not) from ``/proc/<pid>/status`` every millisecond while ``tiled_inference`` runs. The
rise of the peak above the level just before the call must stay below 25% of the volume's size.

Two plans:

- ``abutting``: tile 64^3, halo 2, no overlap: no accumulator; the engine holds its batch buffers
  (two with the prefetch thread) and the predictor output. Measured here: 7-16 MiB (before the
  reusable buffers and the one-copy reader: 14 MiB; with 96^3 tiles 27-54 MiB from run to run and
  with 128^3 about 64 MiB, mostly freed heap that glibc keeps), so the tile is sized for a clear,
  reproducible margin under the default allocator.
- ``blended``: tile 48^3, overlap 4, gaussian: the accumulator holds one fp32 slab of about a tile's
  rows times the image cross-section (about 22 MiB here), allocated once at the longest row's size,
  and must not multiply it with temporaries (measured 28-33 MiB; 42 MiB before it was preallocated,
  53 MiB when a later row made it grow, old and new slab coexisting; before the accumulator reused
  its buffer and normalized in place, a 96^3 plan peaked at 241 MiB, 94% of the volume).

Each output is then checked slab by slab against ``avg_pool3d`` of the whole volume.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.slow  # heavy: run with -m slow

SHAPE = (1, 512, 512, 256)
VOLUME_BYTES = int(np.prod(SHAPE)) * 4  # 256 MiB
LIMIT = 0.25
MiB = 2**20

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    import tiling

    def rss_anon_kib():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
        raise RuntimeError("no RssAnon")

    shape = tuple(int(s) for s in sys.argv[3].split(","))
    kwargs = json.loads(sys.argv[4])
    x = np.memmap(sys.argv[1], dtype=np.float32, mode="r", shape=shape)
    out = np.memmap(sys.argv[2], dtype=np.float32, mode="w+", shape=shape)

    def predictor(t):
        return F.avg_pool3d(t, 3, stride=1, padding=1)  # count_include_pad: zero padding, weights 1/27

    print("ready", rss_anon_kib(), flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    result = tiling.tiled_inference(x, predictor, batch_size=1, out=out, **kwargs)
    assert result is out
    out.flush()
    print("done", rss_anon_kib(), time.perf_counter() - t0, flush=True)
    """
)


def _rss_anon_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 256 MiB input volume on disk, written 32 MiB at a time (the parent never holds it)."""
    path = tmp_path_factory.mktemp("memory") / "volume.f32"
    rng = np.random.default_rng(0)
    vol = np.memmap(path, dtype=np.float32, mode="w+", shape=SHAPE)
    for i in range(0, SHAPE[1], 32):
        vol[0, i : i + 32] = rng.standard_normal((32, *SHAPE[2:]), dtype=np.float32)
    vol.flush()
    del vol
    return path


def _run_child(script: Path, in_path: Path, out_path: Path, kwargs: dict) -> tuple[int, int, int, float]:
    """Run the child; return (baseline KiB, peak KiB, number of samples, seconds in tiled_inference)."""
    peak = [0]
    samples = [0]
    stop = threading.Event()

    def poll(pid: int) -> None:
        while not stop.is_set():
            value = _rss_anon_kib(pid)
            if value is None:
                return
            peak[0] = max(peak[0], value)
            samples[0] += 1
            time.sleep(0.001)

    repo = Path(__file__).resolve().parents[2]
    args = [
        sys.executable,
        str(script),
        str(in_path),
        str(out_path),
        ",".join(map(str, SHAPE)),
        json.dumps(kwargs),
    ]
    with subprocess.Popen(
        args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo
    ) as proc:
        try:
            ready = proc.stdout.readline().split()
            assert ready and ready[0] == "ready", f"child failed to start: {proc.stderr.read()}"
            baseline = int(ready[1])
            poller = threading.Thread(target=poll, args=(proc.pid,), daemon=True)
            poller.start()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            done = proc.stdout.readline().split()
            stop.set()
            poller.join()
            assert done and done[0] == "done", f"child failed: {proc.stderr.read()}"
            assert proc.wait(timeout=60) == 0, proc.stderr.read()
        finally:
            stop.set()
            if proc.poll() is None:
                proc.kill()
    return baseline, peak[0], samples[0], float(done[2])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"tile_shape": 64, "halo": 2}, id="abutting-tile64"),
        pytest.param({"tile_shape": 48, "halo": 2, "overlap": 4, "blend": "gaussian"}, id="blended-tile48"),
    ],
)
def test_peak_anonymous_memory_follows_tile_size(volume, tmp_path, record_diff, record_figure, kwargs):
    out_path = tmp_path / "out.f32"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    baseline, peak, samples, seconds = _run_child(script, volume, out_path, kwargs)
    rise = (peak - baseline) * 1024
    figure = (
        f"peak RssAnon rise {rise / MiB:.1f} MiB = {100 * rise / VOLUME_BYTES:.1f}% of the "
        f"{VOLUME_BYTES / MiB:.0f} MiB volume (limit {100 * LIMIT:.0f}%; baseline {baseline / 1024:.0f} MiB, "
        f"{samples} samples, tiled_inference {seconds:.1f} s)"
    )
    plan = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    record_figure(f"memory 512x512x256 float32 memmap -> memmap ({plan})", figure)
    assert samples > 100, f"too few RssAnon samples to trust the peak: {figure}"
    assert rise < LIMIT * VOLUME_BYTES, figure

    # The run really computed the box filter everywhere (halo 2 >= radius 1).
    x = np.memmap(volume, dtype=np.float32, mode="r", shape=SHAPE)
    y = np.memmap(out_path, dtype=np.float32, mode="r", shape=SHAPE)
    worst = 0.0
    step = 64
    for lo in range(0, SHAPE[1], step):
        a, b = max(lo - 1, 0), min(lo + step + 1, SHAPE[1])
        ref = F.avg_pool3d(torch.from_numpy(np.array(x[:, a:b])), 3, stride=1, padding=1)
        ref = ref[:, lo - a : lo - a + step].numpy()
        worst = max(worst, float(np.abs(y[:, lo : lo + step] - ref).max()))
    record_diff("memory-run-box-filter", np.float32(worst), np.float32(0))
    # Same op on the same values; blending divides sum(w * v) by sum(w): a few ulp of O(1) values.
    assert worst <= 1e-6, f"box filter differs by {worst:.3e}"
