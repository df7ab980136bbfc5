"""The optional C helpers of a block copy's per-call host work (``xfer/_native.c``, issue 32).

``setup.py`` builds them wherever a C compiler and Python's headers are present; a build that fails
is skipped, and every caller then takes the pure-Python path, which computes the same results
(``tests/test_native.py`` compares the two). ``C`` is the built module, or None without it.

What uses them: block-id checks (``KVLayout.check_block_ids``: up to 512 ids, lists of ints and
int64 arrays directly, tensors, other integer arrays and tuples once converted), the functional
copies' check that a side is still the same tensors at the same addresses (``xfer.kernels``), and
the kernel copies' ids upload and launch on CUDA (``cuMemcpyHtoDAsync`` and ``cuLaunchKernel`` of
Triton's compiled kernel, looked up in libcuda at run time; a kernel whose launch needs more than
that keeps Triton's launcher; ``XFER_NATIVE_LAUNCH=0`` turns the launch off). Its parameters are
checked against the PTX Triton compiles on any machine (``tests/test_native.py``); on an H100 it cut
a functional copy's host time by 20-50 % (``bench/results/2026-12-07-h100-native-launch.md``).
"""

from __future__ import annotations

import importlib

try:  # (by name: the layer check reads an import of the compiled module, which it cannot see, as one
    # of the package `xfer` itself; the C module imports nothing of xfer)
    C = importlib.import_module("xfer._native")
except ImportError:  # not built here (no compiler, or a source checkout without `pip install -e .`)
    C = None

__all__ = ["C", "available"]


def available() -> bool:
    """Whether the C helpers are built and importable in this process."""
    return C is not None
