"""tilewise benchmarks: side by side with MONAI, TorchIO and the whole-image pass (issues 7, 15).

Run ``python -m benchmarks`` (full, about 20 minutes on 2 cores) or ``--quick`` (a few minutes,
what the smoke test runs); ``python benchmarks/run.py`` still works. Every contender of every case
runs in a fresh subprocess (``python -m benchmarks --worker JOB.json``) with
``torch.set_num_threads`` fixed, is warmed up on the shapes it will see, then timed over
``--repeats`` runs (median reported). Peak memory is the peak of the process's anonymous resident
memory (``RssAnon`` in ``/proc/self/status``, sampled by a thread every 2 ms) above its level just
before the call, so it counts buffers and outputs held in RAM but not the input already loaded, nor
an on-disk (memory-mapped) output, whose pages are file-backed. The workers run with
``MALLOC_MMAP_THRESHOLD_`` fixed, so that freed buffers go back to the system and each run starts
from the same level. The seam error is the max / mean abs difference to the whole-image output (one
forward pass over the image zero-padded to the network's alignment). ``work`` is the voxels the
contender fed to the network divided by the image's voxels, counted at the network's input.

Outputs (``--out``, default ``benchmarks/out``): ``results.json``, ``results.md`` (the Markdown
tables and the targets, also printed) and ``speed_vs_seam.png`` (needs matplotlib).

Cases (``--cases``), one module each under ``benchmarks/cases/``: ``3d`` and ``instance`` (MNI152 T1
through a fixed-seed MONAI BasicUNet, batch norm in eval mode, and instance norm), ``sweep`` (time
against seam error), ``shallow`` (analytic Laplacian of Gaussian with ``halo="auto"``), ``2d``
(RG1_UNCR.dcm and a text page through ``text-det-2d``), ``scaling`` (64^3 to 384^3, in memory and
on-disk ``out`` against MONAI), ``service`` (HTTP against in process) and ``prefetch`` (the engine's
reading thread on and off, with a cheap network). A contender whose package is missing (MONAI,
TorchIO, the ONNX file, the service) is skipped with a message, not failed.

Modules: ``config`` (modes), ``harness`` (parent: workers, budget, report), ``worker`` (child: one
timed contender), ``contenders`` (runners), ``nets``, ``data``, ``memory``, ``rows``, ``report``,
``env``, ``cli``. ``gpu.sh`` runs :mod:`benchmarks.gpu` on a CUDA machine.

Source: none (original).
"""
