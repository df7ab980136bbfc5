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

__all__ = ["TransportKind", "PREFERENCE", "load"]


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
