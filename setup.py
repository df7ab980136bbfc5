"""The optional C helpers (xfer/_native.c); everything else is in pyproject.toml.

Built where a C compiler and Python's headers are present (``optional``: a failed build leaves the
pure-Python path, which does the same work slower; ``xfer.native.available()`` says which is in use).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("xfer._native", ["xfer/_native.c"], optional=True,
                             extra_compile_args=["-O2", "-std=c11", "-Wall"], libraries=["dl"])])
