"""The agents xfer-bench makes on either side: one per (transport, chunk size), configured here.

Both roles use it (``sweep`` on the initiator, ``target``), so neither imports the other."""

from __future__ import annotations

from dataclasses import replace

from xfer import AgentConfig, TransportKind
from xfer.agent import host_id
from xfer.settings import Settings

__all__ = ["agent_config", "host_id"]


def agent_config(transport: str, chunk_bytes: int | None, bind: str, timeout_s: float) -> AgentConfig:
    """The AgentConfig of one run. A pinned transport is the only one started; ``chunk_bytes``
    sets the local transport's chunks and the UCX staging slots (``XFER_UCX_CHUNK_BYTES``'s setting,
    given in code: the rest of the settings come from the environment as usual)."""
    pin = None if transport == "auto" else TransportKind(transport)
    kw: dict = dict(listen_host=bind, default_timeout_s=timeout_s, transport=pin, enable=None if pin is None else (pin,))
    settings = Settings.from_env()
    if chunk_bytes:
        kw["chunk_bytes"] = chunk_bytes
        settings = replace(settings, ucx=replace(settings.ucx, chunk_bytes=chunk_bytes))
    return AgentConfig(**kw, settings=settings)
