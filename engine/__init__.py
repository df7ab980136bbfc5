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

__all__ = ["BlockManager", "KVPool", "PagedCache", "PrefillInstance", "DecodeInstance", "Router", "ModelSpec",
           "PoolSpec", "WaitMode", "Request", "build_model"]

_WHERE = {"BlockManager": "block_manager", "KVPool": "kv_pool", "PagedCache": "paged_cache",
          "PrefillInstance": "prefill", "DecodeInstance": "decode", "Router": "router", "ModelSpec": "config",
          "PoolSpec": "config", "WaitMode": "config", "Request": "protocol", "build_model": "model"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'xfer.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
