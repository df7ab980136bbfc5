"""Test-session set-up shared by every test module: importing ``xfer.engine`` takes the
repository root off ``sys.path`` (``python -m pytest`` puts it there), where the folder
``kernels/`` (installed as ``xfer.kernels``) would shadow Hugging Face's ``kernels`` package
that transformers imports; see ``xfer.engine.unshadow_kernels``."""

import xfer.engine  # noqa: F401
