"""Transports: the kinds, a lazy-import factory and the selection order.

Importing this package imports no transport module; ``load`` imports one on demand, so a
missing optional dependency (ucxx, nvshmem4py, a GPU) only disables that transport, and the
reason is reported by the agent's route selection.

One package per transport, each exposing its class: ``onesided`` (``local``, ``ipc``: the
initiator maps the peer's memory and copies), ``ucx`` and ``nvshmem``; beside them the pieces
they share: ``base`` (the abstract Transport, the records the agent hands it, region state),
``completion`` (ending a transfer the initiator moved itself: notify, then complete or fail),
``incoming`` (the one check of a peer's request) and ``chunking`` (the one chunk planner).
"""

from __future__ import annotations

import importlib

from ..config import TransportKind
from ..errors import TransportUnavailableError

__all__ = ["TransportKind", "PREFERENCE", "load", "start"]


# tried in this order when no transport is pinned: the most direct path first
PREFERENCE = (TransportKind.LOCAL, TransportKind.IPC, TransportKind.NVSHMEM, TransportKind.UCX)

_MODULES = {
    TransportKind.LOCAL: ("xfer.transports.onesided.local", "LocalTransport"),
    TransportKind.IPC: ("xfer.transports.onesided.ipc", "IpcTransport"),
    TransportKind.NVSHMEM: ("xfer.transports.nvshmem", "NvshmemTransport"),
    TransportKind.UCX: ("xfer.transports.ucx", "UcxTransport"),
}


def load(kind: TransportKind):
    """The transport class of ``kind``, or a string saying why it cannot be used here."""
    module, cls = _MODULES[TransportKind(kind)]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return f"{kind.value}: not part of this xfer build ({module} is missing)"
        return f"{kind.value}: needs {exc.name!r}, which is not installed"
    except ImportError as exc:
        return f"{kind.value}: import failed: {exc}"
    return getattr(mod, cls)


def start(config, ctx) -> tuple[dict, dict]:
    """Start every transport ``config`` enables (``AgentConfig.enable``; None: all) that can run
    here, in ``PREFERENCE`` order: (started transports by kind, why each other one is not)."""
    started, unavailable = {}, {}
    for kind in PREFERENCE:
        if config.enable is not None and kind not in config.enable:
            unavailable[kind] = f"{kind.value}: not enabled (AgentConfig.enable)"
            continue
        cls = load(kind)
        reason = cls if isinstance(cls, str) else cls.probe()
        if reason is None:
            try:
                started[kind] = cls(ctx)
            except TransportUnavailableError as exc:  # e.g. nvshmem without a group configured
                reason = f"{kind.value}: {exc}"
        if reason is not None:
            unavailable[kind] = reason
    return started, unavailable
