"""Connections of the UCX engine: one UCX endpoint per (peer agent, direction), a hello over
UCX's stream API to swap connection ids, identities and nonces, a PROOF each way, then tagged
messages only.

Each connection has its own session key (xfer.auth: HKDF from the deployment's secret, both
nonces and both agent ids; ``establish``). Its control messages are MAC'd with it and numbered
(``session``), and its data chunks are tagged with 32 bits keyed by a key derived from it
(``chunk_tag``): a message captured on one connection, or forged without the key, is worth
nothing on another. Without a secret the tag key comes from the two (public) nonces: it stops a
blind injection, not an eavesdropper (docs/security.md).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import struct
import time

import numpy as np

from ...auth import Session, new_nonce
from ...errors import MetadataError
from . import wire

__all__ = ["Conn"]

_TAG_IN = struct.Struct("!BIQ")  # direction, xid, chunk number


class Conn:
    """A UCX endpoint to one peer agent.

    ``local_id``: the id this side gave the connection (the peer tags its messages with it);
    ``remote_id``: the id the peer gave it (our tags to the peer carry it). ``outgoing``: this
    side connected (to the peer's listener) rather than accepted. ``waiting``: control messages held
    until the hello round is over. ``flows``: live flows on this connection. ``xid``: on an
    outgoing connection, the last transfer id issued; on an accepted one, the newest announced by
    a REQ (chunks of later ids arrived before their REQ and are held in ``early``, their tags
    verified). ``authed``: the peer's PROOF verified (before it, nothing else of it is taken).
    """

    __slots__ = ("ep", "local_id", "remote_id", "agent_id", "name", "ready", "dead", "outgoing", "waiting",
                 "flows", "hello_in", "hello_out", "address", "error", "xid", "early", "n_early", "ctrl_in",
                 "layout_ids", "layouts", "closed", "skew", "skew_at", "nonce", "session", "authed", "keyed",
                 "opened", "_tags", "host", "pumping")

    def __init__(self, ep, local_id: int, *, outgoing: bool, agent_id: str = "", name: str = "",
                 address: str = "", host: str = ""):
        self.ep, self.local_id, self.outgoing = ep, local_id, outgoing
        self.agent_id, self.name, self.address, self.host = agent_id, name, address, host
        self.remote_id = 0
        self.ready = False
        self.dead = False
        self.closed = False  # UCX reported the endpoint closed (its handle may be gone before ``dead``)
        self.error: Exception | None = None
        self.waiting: list = []
        self.flows: dict = {}  # live flows on it (an ordered set: flow -> None), kept by Flows
        self.xid = 0
        self.early: dict[int, list] = {}  # xid -> (tag bits, probe) of chunks that came before their REQ
        self.n_early = 0  # chunks held in ``early``
        # control messages in arrival order, [bytes, error, landed] each: handled strictly in this
        # order, though a big one (a REQ of thousands of ids goes by rendezvous) lands after a
        # small one behind it
        self.ctrl_in: collections.deque = collections.deque()  # [probe, buffer, landed, error] (protocol.pump)
        self.pumping = False
        # REQ layouts by per-connection id: sent once, then named (outgoing: ids given; accepted: received)
        self.layout_ids: dict = {}  # KVLayout -> id (this side's REQs)
        self.layouts: dict[int, object] = {}  # id -> KVLayout (the peer's REQs)
        # accepted: the least (arrival here - send time there) of the peer's REQs, and when it was
        # last moved: how late a REQ is beyond that is how long it waited (see ``req_delay``)
        self.skew: float | None = None
        self.skew_at = 0.0
        self.nonce = new_nonce()  # ours, in our hello
        self.session: Session | None = None  # once both hellos are in
        self.authed = False  # the peer's PROOF verified
        self.keyed = False  # the session key comes from the deployment's secret
        self.opened = time.monotonic()
        self._tags = None  # BLAKE2s keyed with the connection's tag key (copied per tag)
        self.hello_in = np.zeros(wire.HELLO_BYTES, dtype=np.uint8)
        self.hello_out: np.ndarray | None = None

    def __repr__(self) -> str:
        way = "to" if self.outgoing else "from"
        state = "dead" if self.dead else "ready" if self.authed else "connecting"
        return f"Conn({way} {self.name or '?'} at {self.address or '?'}, ids {self.local_id}/{self.remote_id}, {state})"

    def req_delay(self, sent: float, now: float) -> float:
        """Seconds a REQ sent at ``sent`` (the peer's monotonic clock) waited beyond the least delay
        of this connection's REQs: in a socket buffer while this process was stopped or swapped
        out, behind a congested link. Its deadline is that much nearer than its ``ttl`` says. Two
        clocks need no common origin, only a common rate: the floor rises by CLOCK_DRIFT a second,
        so drift in either direction never reads as delay (it may hide up to that much of one)."""
        sample = now - sent
        if self.skew is None:
            self.skew, self.skew_at = sample, now
            return 0.0
        floor = self.skew + wire.CLOCK_DRIFT * (now - self.skew_at)
        if sample <= floor:
            self.skew, self.skew_at = sample, now
            return 0.0
        return sample - floor

    def on_hello(self, auth, agent_id: str) -> None:
        """Check the peer's hello (raises a typed error when it is not the agent we expected) and
        derive the session: ``auth`` the deployment's Authenticator (None: no secret), ``agent_id``
        this side's."""
        conn, peer_id, name, nonce = wire.parse_hello(self.hello_in)
        if self.outgoing and self.agent_id and peer_id != self.agent_id:
            raise MetadataError(f"stale metadata for {self.name!r}: UCX listener {self.address} is served by agent "
                                f"{peer_id!r}, the metadata names {self.agent_id!r}")
        self.remote_id, self.agent_id, self.name = conn, peer_id, self.name or name
        init, acc = (agent_id, peer_id) if self.outgoing else (peer_id, agent_id)
        n_init, n_acc = (self.nonce, nonce) if self.outgoing else (nonce, self.nonce)
        key = None if auth is None else auth.session_key(b"ucx", init, acc, n_init, n_acc)
        tag_key = hmac.digest(key or hashlib.sha256(b"xfer-ucx-public-v1" + n_init + n_acc).digest(),
                              b"chunk tags", "sha256")
        self.session, self.keyed = Session(key, self.outgoing), key is not None
        self._tags = hashlib.blake2s(key=tag_key, digest_size=4)
        self.ready = True

    def chunk_bits(self, xid: int, seq: int, sending: bool) -> int:
        """The keyed 32 bits of chunk ``seq`` of transfer ``xid`` sent (``sending``) or received here."""
        h = self._tags.copy()
        h.update(_TAG_IN.pack(1 if self.outgoing == sending else 2, xid, seq))
        return int.from_bytes(h.digest(), "big")

    def chunk_tag(self, xid: int, seq: int) -> int:
        """The whole tag of chunk ``seq`` of transfer ``xid`` this side sends (wire.py's layout)."""
        return (self.remote_id & wire.CONN_MAX) << 48 | (xid & 0xFFFF) << 32 | self.chunk_bits(xid, seq, True)
