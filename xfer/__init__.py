"""xfer: move paged KV-cache blocks between LLM prefill and decode instances.

    from xfer import Agent, KVLayout
    agent = Agent("decode-0"); agent.register("kv", tensors, KVLayout.vllm_flash_attn(tensors))

Importing xfer is cheap: the error hierarchy loads at once, everything else (and torch) on first
use of a name; transports and kernels load when a transfer needs them.
"""

import importlib

from .errors import *  # noqa: F401,F403  (the exception hierarchy is part of the API)
from .errors import __all__ as _errors_all

__version__ = "0.1.0"

_LAZY = {
    "Agent": "agent", "AgentConfig": "config", "NvshmemGroup": "config", "KVLayout": "layout",
    "LayoutKind": "layout", "make_kv_cache": "layout", "shared_empty": "shm", "Transfer": "transfer",
    "TransferState": "transfer", "Notification": "transfer", "Op": "transfer", "TransportKind": "transports",
}
__all__ = [*_LAZY, *_errors_all]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
