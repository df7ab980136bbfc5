"""Plug xfer into SGLang, whose transfer backends are a closed enum (``TransferBackend``, picked
with ``--disaggregation-transfer-backend``): xfer takes the place of one value (``mooncake`` by
default) by wrapping ``sglang.srt.disaggregation.utils.get_kv_class``.

- Launch SGLang through xfer (every spawned scheduler rank gets the hook too)::

      python -m xfer.engine.sglang_plugin [--replace mooncake] -- <sglang.launch_server arguments>

- Or in a process you control: ``install()`` (SGLang already imported) or ``install_import_hook()``
  (patches as soon as SGLang's disaggregation utils load), before SGLang builds its queues.
  For processes SGLang spawns, export ``XFER_SGLANG_REPLACE=mooncake`` and put ``hook_dir()`` on
  ``PYTHONPATH`` (its ``sitecustomize`` calls ``install_import_hook``).

Importing this module imports neither SGLang nor the backend classes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import os
import sys

__all__ = ["install", "install_import_hook", "hook_dir", "main"]

log = logging.getLogger("xfer.engine.sglang")

_USERS = ("sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode",
          "sglang.srt.managers.disagg_service")


def install(replace: str = "mooncake", module=None) -> None:
    """Make ``get_kv_class(TransferBackend(replace), ...)`` return the xfer classes, in
    ``sglang.srt.disaggregation.utils`` (``module``) and every loaded module that imported it."""
    from .sglang_conn import CLASSES

    utils = module or importlib.import_module("sglang.srt.disaggregation.utils")
    original = utils.get_kv_class
    if getattr(original, "xfer_replaces", None) is not None:
        return
    target = utils.TransferBackend(replace)

    def get_kv_class(transfer_backend, class_type):
        if transfer_backend == target and class_type.value in CLASSES:
            return CLASSES[class_type.value]
        return original(transfer_backend, class_type)

    get_kv_class.xfer_replaces = replace
    utils.get_kv_class = get_kv_class
    for name in _USERS:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "get_kv_class", None) is original:
            mod.get_kv_class = get_kv_class
    log.info("xfer: SGLang transfer backend %r now runs on xfer", replace)


class _HookFinder(importlib.abc.MetaPathFinder):
    """Runs ``install`` right after ``sglang.srt.disaggregation.utils`` is first imported."""

    def __init__(self, replace: str):
        self.replace = replace

    def find_spec(self, name, path, target=None):
        if name != "sglang.srt.disaggregation.utils":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module, replace = spec.loader.exec_module, self.replace

        def exec_and_install(module):
            exec_module(module)
            install(replace, module=module)
        spec.loader.exec_module = exec_and_install
        return spec


def install_import_hook(replace: str = "mooncake") -> None:
    """``install`` now if SGLang's utils are loaded, else as soon as they are."""
    if "sglang.srt.disaggregation.utils" in sys.modules:
        install(replace)
    elif not any(isinstance(f, _HookFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _HookFinder(replace))


def hook_dir() -> str:
    """A directory with a ``sitecustomize.py`` that installs the hook when ``XFER_SGLANG_REPLACE`` is set."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_hook")


def main(argv: list[str] | None = None) -> None:
    """``python -m xfer.engine.sglang_plugin [--replace BACKEND] -- <sglang.launch_server args>``."""
    import runpy
    argv = list(sys.argv[1:] if argv is None else argv)
    replace = "mooncake"
    if argv[:1] == ["--replace"]:
        replace, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    os.environ["XFER_SGLANG_REPLACE"] = replace  # spawned scheduler processes install it too
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (hook_dir(), os.environ.get("PYTHONPATH")) if p)
    install_import_hook(replace)
    sys.argv = ["sglang.launch_server", *argv, "--disaggregation-transfer-backend", replace]
    runpy.run_module("sglang.launch_server", run_name="__main__")


if __name__ == "__main__":
    main()
