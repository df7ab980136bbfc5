"""xfer.engine: prefill and decode instances of a disaggregated LLM server on the xfer API.

    from xfer.engine import Router, ModelSpec, PoolSpec
    with Router(ModelSpec(), num_prefill=2, num_decode=2) as router:
        results = router.run(requests)

Pieces, one per file: ``block_manager`` (free ids, ref counts), ``kv_pool`` (paged KV tensors in
an xfer layout, per-layer regions), ``paged_cache`` (a transformers ``Cache`` on the blocks),
``prefill`` / ``decode`` (the instances), ``streamer`` (layer-wise transfer), ``swap`` (host swap),
``router`` / ``worker`` (processes wired through the metadata store), ``metrics``.
Importing this package imports nothing heavy; names load on first use.
"""

from __future__ import annotations

import importlib
import os
import sys

__all__ = ["BlockManager", "KVPool", "PagedCache", "PrefillInstance", "DecodeInstance", "Router", "ModelSpec",
           "PoolSpec", "WaitMode", "Request", "build_model"]

_WHERE = {"BlockManager": "block_manager", "KVPool": "kv_pool", "PagedCache": "paged_cache",
          "PrefillInstance": "prefill", "DecodeInstance": "decode", "Router": "router", "ModelSpec": "config",
          "PoolSpec": "config", "WaitMode": "config", "Request": "protocol", "build_model": "model"}


def unshadow_kernels() -> None:
    """Take an xfer source checkout's root off ``sys.path`` (and forget a module imported from it
    as ``kernels``): its folder ``kernels/`` is ``xfer.kernels``, and as a top-level package it
    would shadow Hugging Face's ``kernels``, which transformers imports when installed (``cannot
    import name 'CUDAProperties' from 'kernels'``). ``python -m`` / ``-c`` from that root, and the
    forkserver the Router starts there, put the root on the path. xfer itself is found through
    its installation (or the package already imported); nothing else lives in that root."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # <checkout>/engine -> <checkout>
    if not (os.path.isdir(os.path.join(root, "xfer")) and os.path.isdir(os.path.join(root, "kernels"))):
        return  # an installed copy (site-packages/xfer/engine, beside xfer/kernels): nothing shadows
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    mod = sys.modules.get("kernels")
    if mod is not None and os.path.realpath(os.path.dirname(getattr(mod, "__file__", None) or "")) == \
            os.path.join(root, "kernels"):
        del sys.modules["kernels"]


unshadow_kernels()  # before any engine module imports transformers


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'xfer.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
