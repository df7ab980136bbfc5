"""Test-session set-up shared by every test module: importing ``xfer.engine`` takes the
repository root off ``sys.path`` (``python -m pytest`` puts it there), where the folder
``kernels/`` (installed as ``xfer.kernels``) would shadow Hugging Face's ``kernels`` package
that transformers imports; see ``xfer.engine.unshadow_kernels``."""

import xfer.engine  # noqa: F401

import os  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _settings_follow_the_environment():
    """xfer reads its ``XFER_*`` settings once (an agent when its config is made, the kernels on
    first use: ``xfer.settings.current()``). A test that changed the environment and re-read them
    (``xfer.settings.reload()``) leaves them as the next test's environment says."""
    from xfer import settings

    before, gen = {k.env: os.environ.get(k.env) for k in settings.KNOBS}, settings.generation()
    yield
    if {k.env: os.environ.get(k.env) for k in settings.KNOBS} != before or settings.generation() != gen:
        settings.reload()
