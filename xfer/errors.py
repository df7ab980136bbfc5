"""One exception hierarchy for xfer: every error a caller can see derives from ``XferError``.

Messages name the value received and the value expected. Nothing in xfer logs an error and
returns ``None``: it raises one of these.
"""

from __future__ import annotations

__all__ = [
    "XferError",
    "InvalidArgumentError",
    "BlockIdError",
    "LengthMismatchError",
    "LayoutError",
    "LayoutMismatchError",
    "NotRegisteredError",
    "AgentClosedError",
    "MetadataError",
    "PeerNotConnectedError",
    "TransportError",
    "TransportUnavailableError",
    "PeerDisconnectedError",
    "TransferTimeoutError",
    "TransferCancelledError",
    "FenceTimeoutError",
    "BlocksBusyError",
    "RevokedError",
    "StoreError",
    "StoreTimeoutError",
    "AuthenticationError",
]


class XferError(Exception):
    """Base of every error xfer raises."""


class InvalidArgumentError(XferError, ValueError):
    """A caller passed a value xfer cannot accept; raised before any byte moves."""


class BlockIdError(InvalidArgumentError):
    """A block id list is out of range, negative, duplicated (destination) or not integral."""


class LengthMismatchError(InvalidArgumentError):
    """Source and destination block lists differ in length."""


class LayoutError(InvalidArgumentError):
    """A KV layout cannot be built from the given tensors or numbers."""


class LayoutMismatchError(InvalidArgumentError):
    """Two layouts cannot exchange blocks; the message names the first differing field."""


class NotRegisteredError(XferError, KeyError):
    """A region name is not registered (locally or on the peer)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class AgentClosedError(XferError):
    """The agent (or the handle) was closed; no new work is accepted."""


class MetadataError(XferError):
    """Peer metadata is truncated, malformed, of another version, or fails its checksum."""


class PeerNotConnectedError(XferError, KeyError):
    """No connection to a peer of that name; call ``Agent.connect`` first."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class TransportError(XferError):
    """A transport failed to move data or could not be set up."""


class TransportUnavailableError(TransportError):
    """A (pinned) transport cannot serve this pair of agents; the message says why."""


class PeerDisconnectedError(TransportError):
    """The peer went away (process died, link cut, closed) before the transfer ended."""


class TransferTimeoutError(XferError, TimeoutError):
    """A transfer (or a wait) reached its deadline; the transfer was cancelled."""


class TransferCancelledError(XferError):
    """The transfer was cancelled by the caller before it completed."""


class FenceTimeoutError(TransportError):
    """A fence could not be confirmed in time: a stopping transfer's bytes may still land, or a
    revocation found a transfer still able to write the blocks. Keep those blocks quarantined
    (do not reuse them) until the transfer reads a terminal state or a later revoke succeeds.
    Deliberately not a TimeoutError: code that frees blocks on a timeout must not catch it."""


class BlocksBusyError(XferError):
    """An incoming transfer names blocks that an earlier transfer, not yet fenced, may still write
    (or read): refused before any byte moves (retry once the earlier one ended, or revoke it)."""


class RevokedError(TransportError):
    """The peer revoked its grant of the blocks (request aborted, lease over) before the transfer
    ended: nothing of it is reported complete, and the peer was not notified."""


class StoreError(XferError):
    """The metadata store failed or answered something unexpected."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A key did not appear in the metadata store before the timeout."""


class AuthenticationError(XferError):
    """A peer, message or metadata failed shared-secret authentication (missing, wrong or replayed)."""
