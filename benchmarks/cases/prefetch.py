"""The engine's prefetch thread on and off, on the 3D case's volume with a cheap CPU network.

The network is ``box-3d`` (a 3x3x3 mean and the input: almost free), so reading and padding the
tiles is a visible share of the time. Two sources: the volume as a memory-mapped ``.npy`` (reading
is a copy from the page cache) and as a ``.nii.gz`` read through nibabel's lazy ``dataobj`` (each
tile decompresses up to its slice). For each: tilewise with ``prefetch=True`` and ``False``, and the
two parts alone (reading and padding every tile; the network on as many tiles of the same shape), so
the overlap can be read against its bound ``max(read, network)``. The network runs on
``prefetch_threads`` torch threads (default 1: on a 2-core machine the reading thread gets the
other core; with every core busy there is nothing to overlap into). A third source row uses the
``.nii.gz`` with a *simulated accelerator*: the same network plus a wait of ``prefetch_sleep_s`` per
tile that holds no CPU, as a GPU's network time leaves the host's cores free.
"""

from __future__ import annotations

from benchmarks.data import mni_volume, nifti_copy
from benchmarks.env import shape_of
from benchmarks.harness import Bench


def case_prefetch(bench: Bench) -> None:
    m = bench.mode
    npy = mni_volume(bench.cache, spacing_mm=m.prefetch_spacing_mm)
    sources = [("npy memmap", {"data": str(npy), "input": "disk"}),
               ("nii.gz", {"data": str(nifti_copy(npy, compressed=True)), "input": "nifti"})]  # fmt: skip
    base = {
        "model": "box-3d",
        "tile": m.prefetch_tile,
        "halo": m.prefetch_halo,
        "threads": m.prefetch_threads,
    }
    accelerator = {"model": "box-3d-sleep", "seconds_per_tile": m.prefetch_sleep_s}
    for label, source, net in [*((lb, src, {}) for lb, src in sources),
                               ("nii.gz, simulated accelerator", sources[1][1], accelerator)]:  # fmt: skip
        job = {**base, **source, **net}
        bench.add("prefetch", f"{label}: read and pad only", {**job, "kind": "read-only"})
        bench.add("prefetch", f"{label}: network only", {**job, "kind": "network-only"})
        for prefetch in (True, False):
            bench.add(
                "prefetch",
                f"{label}: tilewise prefetch {'on' if prefetch else 'off'}",
                {**job, "kind": "tilewise", "prefetch": prefetch},
            )
    bench.notes.append(
        f"prefetch case: MNI152 T1 at {m.prefetch_spacing_mm} mm ({shape_of(npy)}), network `box-3d`, "
        f"tile {m.prefetch_tile}, halo {m.prefetch_halo}, {m.prefetch_threads} network thread(s); "
        "`read and pad only` and `network only` are the two parts alone: ideal overlap = the larger."
    )
