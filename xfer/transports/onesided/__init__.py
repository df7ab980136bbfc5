"""One-sided transports: the initiator maps the peer's memory and copies; ``local`` (same process or
host shared memory) and ``ipc`` (CUDA IPC), both on :class:`OneSidedTransport`."""

from .transport import OneSidedTransport

__all__ = ["OneSidedTransport"]
