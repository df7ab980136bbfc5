"""xfer: move paged KV-cache blocks between LLM prefill and decode instances.

    from xfer import Agent, KVLayout
    agent = Agent("decode-0"); agent.register("kv", tensors, KVLayout.vllm_flash_attn(tensors))

Importing xfer loads torch and numpy only; transports and kernels load on first use.
"""

from .agent import Agent
from .config import AgentConfig
from .errors import *  # noqa: F401,F403  (the exception hierarchy is part of the API)
from .errors import __all__ as _errors_all
from .layout import KVLayout, LayoutKind, make_kv_cache
from .shm import shared_empty
from .transfer import Notification, Op, Transfer, TransferState
from .transports import TransportKind

__version__ = "0.1.0"
__all__ = ["Agent", "AgentConfig", "KVLayout", "LayoutKind", "make_kv_cache", "shared_empty", "Transfer",
           "TransferState", "Notification", "Op", "TransportKind", *_errors_all]
