"""The built-in model zoo: analytic filters, ``tissue-3d`` (trained here), ``brain-mask-3d`` and
``text-det-2d`` (taken from PyPI wheels), and the architectures in code for the eager backend."""
