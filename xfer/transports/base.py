"""The one abstract base every transport implements, and the records the agent hands it."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import numpy as np
import torch

from ..config import AgentConfig
from ..layout import KVLayout
from ..metadata import AgentMetadata, RegionRecord
from ..transfer import Op, Transfer
from . import TransportKind

__all__ = ["Transport", "TransportContext", "LocalRegion", "RegionState", "PeerHandle", "Job", "Selection"]


class RegionState:
    """What transports keep for one registered region (copiers, bound copies, staging copies),
    under keys they choose (their kind first). It lives on the region and dies with it: once the
    agent deregisters the region, nothing of it is kept anywhere."""

    __slots__ = ("_items", "_lock")

    def __init__(self) -> None:
        self._items: dict = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key, make: Callable):
        """The value under ``key``, made by ``make()`` on first use (once, whatever the threads)."""
        value = self._items.get(key)
        if value is None:
            with self._lock:
                value = self._items.get(key)
                if value is None:
                    value = self._items[key] = make()
        return value

    def peek(self, key):
        """The value under ``key`` if one was made, else None (nothing is made)."""
        return self._items.get(key)

    def drop(self, match: Callable) -> None:
        """Forget every entry whose key ``match(key)`` accepts (e.g. those of a disconnected peer)."""
        with self._lock:
            for key in [k for k in self._items if match(k)]:
                del self._items[key]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


@dataclass(eq=False)
class LocalRegion:
    """A region this agent registered: its base tensors and layout, and what transports keep for
    it (``state``). Compared and hashed by identity."""

    name: str
    tensors: list[torch.Tensor]
    layout: KVLayout
    state: RegionState = field(default_factory=RegionState, repr=False)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device


@dataclass
class PeerHandle:
    """A connected peer: its metadata and the control channel's request function."""

    metadata: AgentMetadata
    request: Callable  # request(header: dict, payload: bytes, *, deadline: float) -> (dict, bytes)

    @property
    def name(self) -> str:
        return self.metadata.name


@dataclass
class Job:
    """One validated transfer for a transport to carry out.

    ``local_ids`` / ``peer_ids``: int64 block ids, equal length; for a WRITE the local blocks
    are the source, for a READ the destination. ``ready``: for a CUDA local region, an event
    recorded on the caller's current stream when the transfer was posted; a transport makes its
    first access to the local blocks wait for it, so a transfer sees everything the caller queued
    before it (the KV a forward pass just wrote) without the caller synchronising.
    """

    transfer: Transfer
    op: Op
    local: LocalRegion
    peer: PeerHandle
    peer_region: RegionRecord
    local_ids: np.ndarray
    peer_ids: np.ndarray
    notify: bytes = b""
    ready: object = None  # torch.cuda.Event | None
    grant: int | None = None  # one-sided WRITE: the peer's grant of its blocks (xfer.transports.grants)
    started: float | None = None  # one-sided READ: when its copy began (time.monotonic), for its notice


@dataclass(frozen=True)
class Selection:
    """Which transport carries a route and why; ``rejected`` says why each transport preferred over
    it did not (kind value -> reason, in preference order).

    Printed, it is one line: the transport, then each refusal with its reason, e.g. ``ucx (local
    refused: peer region 'kv' of 'decode-0' is not in shared memory (...); ipc refused: no CUDA
    device in this process; ...)``; the reason it was chosen when nothing before it was refused
    (``local (first of [...] able to serve this pair)``, ``ucx (pinned by config)``).
    """

    kind: TransportKind
    reason: str
    rejected: dict = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.rejected:
            return f"{self.kind.value} ({self.reason})"
        return f"{self.kind.value} (" + "; ".join(f"{k} refused: {r}" for k, r in self.rejected.items()) + ")"

    def __repr__(self) -> str:
        return f"Selection({self})"


@dataclass
class TransportContext:
    """What the agent gives a transport.

    ``region(name)`` returns a registered local region or None; two-sided transports use it to
    land incoming blocks; ``regions()`` lists them. ``deliver(notification)`` hands a completed
    incoming transfer to the agent (checked block ids, payload); call it only once every byte has
    landed. ``grants`` (:class:`xfer.transports.grants.Grants`): the target side's holds on the
    blocks of incoming transfers; a transport takes one before any byte of an incoming transfer
    moves and ends it once none can land any more (the agent's ``revoke`` waits for that).
    """

    agent_name: str
    agent_id: str
    host_id: str
    config: AgentConfig
    log: logging.Logger
    auth: object = None  # xfer.auth.Authenticator: sign (stamp) and check transport messages; None = off
    region: Callable = lambda name: None  # (str) -> LocalRegion | None
    regions: Callable = lambda: []  # () -> list[LocalRegion]
    deliver: Callable = lambda notification: None  # (Notification) -> None
    grants: object = None  # xfer.transports.grants.Grants


class Transport(ABC):
    """Moves blocks between a local region and a peer's region.

    Life cycle: ``probe`` (class-level: usable in this process?) → ``__init__`` →
    ``export_region`` for each registered region (what peers need to reach it) →
    ``check_route`` per (local region, peer region, op) → ``post`` jobs → ``disconnect`` /
    ``close``. ``post`` must return quickly and end every job's transfer by its deadline (plus its
    fence bound) with exactly one ``transfer.complete()`` or ``transfer.fail(exc)``, made once none
    of its bytes can land any more, on either side (the fence: see ``xfer.transfer.Transfer``);
    blocks are reported complete only once all their bytes have landed and the peer was notified.
    A stop (cancel, deadline) reaches the transport through ``Transfer.begin``'s ``on_cancel`` hook
    or ``cancel_requested``.
    """

    kind: ClassVar[TransportKind]
    notices_early = False  # sends landing notices at a copy's launch: the agent opens each peer's lane at connect

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx

    @classmethod
    def probe(cls) -> str | None:
        """None when this transport can run in this process, else the reason it cannot."""
        return None

    def info(self) -> dict:
        """Transport-level facts published in the agent's metadata."""
        return {}

    def export_region(self, region: LocalRegion) -> dict | None:
        """A JSON-able descriptor peers use to reach ``region``; None if it cannot be exposed."""
        return None

    def release_region(self, region: LocalRegion) -> None:
        """Forget what ``export_region`` set up (``region.state`` goes with the region itself)."""

    @abstractmethod
    def check_route(self, local: LocalRegion, peer: PeerHandle, peer_region: RegionRecord, op: Op) -> str | None:
        """None if this transport can serve the pair, else the reason it cannot."""

    @abstractmethod
    def post(self, job: Job) -> None:
        """Start moving ``job``'s blocks; never blocks on the data."""

    def takes_grant(self, job: Job) -> bool:
        """Whether this WRITE can run under a grant its target issued ahead (``Job.grant`` set
        before ``post``: no grant is asked for; its notice ends it). False: the target side takes
        its own hold, and the agent gives the grant back before posting (xfer.ahead)."""
        return False

    def handle_control(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        """Answer a control message addressed to this transport.

        The agent routes every control message whose ``type`` starts with ``"<kind>."`` (e.g.
        ``"nvshmem.begin"``) here, from its control-server thread: answer quickly. Raise an
        :class:`~xfer.errors.XferError` to refuse; the initiator gets it back as that type
        (see ``notify.raise_remote``). Peers send with ``PeerHandle.request``.
        """
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"{self.kind.value} transport takes no control message {header.get('type')!r}")

    def disconnect(self, peer: str) -> None:
        """Drop what was cached for ``peer`` (mappings, endpoints); in-flight jobs fail."""

    @abstractmethod
    def close(self) -> None:
        """Stop; every job still in flight ends with an error. Idempotent."""
