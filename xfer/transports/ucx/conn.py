"""Connections of the UCX engine: one UCX endpoint per (peer agent, direction), a hello over
UCX's stream API to swap connection ids and identities, then tagged messages only."""

from __future__ import annotations

import collections

import numpy as np

from ...errors import MetadataError, PeerDisconnectedError
from . import wire

__all__ = ["Conn"]


class Conn:
    """A UCX endpoint to one peer agent.

    ``local_id``: the id this side gave the connection (the peer tags its messages with it);
    ``remote_id``: the id the peer gave it (our tags to the peer carry it). ``outgoing``: this
    side connected (to the peer's listener) rather than accepted. ``waiting``: control messages held
    until the hello round is over. ``flows``: live flows on this connection. ``xid``: on an
    outgoing connection, the last transfer id issued; on an accepted one, the newest announced by
    a REQ (chunks of later ids arrived before their REQ and are held in ``early``).
    """

    __slots__ = ("ep", "local_id", "remote_id", "agent_id", "name", "ready", "dead", "outgoing", "waiting",
                 "flows", "hello_in", "hello_out", "address", "error", "xid", "early", "n_early", "ctrl_in",
                 "layout_ids", "layouts", "closed", "skew", "skew_at")

    def __init__(self, ep, local_id: int, *, outgoing: bool, agent_id: str = "", name: str = "",
                 address: str = ""):
        self.ep, self.local_id, self.outgoing = ep, local_id, outgoing
        self.agent_id, self.name, self.address = agent_id, name, address
        self.remote_id = 0
        self.ready = False
        self.dead = False
        self.closed = False  # UCX reported the endpoint closed (its handle may be gone before ``dead``)
        self.error: Exception | None = None
        self.waiting: list = []
        self.flows: dict = {}  # live flows on it (an ordered set: flow -> None), kept by Flows
        self.xid = 0
        self.early: dict[int, list] = {}  # xid -> probed chunks that came before their REQ
        self.n_early = 0  # chunks held in ``early``
        # control messages in arrival order, [bytes, error, landed] each: handled strictly in this
        # order, though a big one (a REQ of thousands of ids goes by rendezvous) lands after a
        # small one behind it
        self.ctrl_in: collections.deque = collections.deque()
        # REQ layouts by per-connection id: sent once, then named (outgoing: ids given; accepted: received)
        self.layout_ids: dict = {}  # KVLayout -> id (this side's REQs)
        self.layouts: dict[int, object] = {}  # id -> KVLayout (the peer's REQs)
        # accepted: the least (arrival here - send time there) of the peer's REQs, and when it was
        # last moved: how late a REQ is beyond that is how long it waited (see ``req_delay``)
        self.skew: float | None = None
        self.skew_at = 0.0
        self.hello_in = np.zeros(wire.HELLO_BYTES, dtype=np.uint8)
        self.hello_out: np.ndarray | None = None

    def __repr__(self) -> str:
        way = "to" if self.outgoing else "from"
        state = "dead" if self.dead else "ready" if self.ready else "connecting"
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

    def on_hello(self) -> None:
        """Check the peer's hello (raises a typed error when it is not the agent we expected)."""
        conn, agent_id, name = wire.parse_hello(self.hello_in)
        if self.outgoing and self.agent_id and agent_id != self.agent_id:
            raise MetadataError(f"stale metadata for {self.name!r}: UCX listener {self.address} is served by agent "
                                f"{agent_id!r}, the metadata names {self.agent_id!r}")
        if conn == 0:
            raise PeerDisconnectedError(f"peer {name!r} sent connection id 0 in its hello")
        self.remote_id, self.agent_id, self.name = conn, agent_id, self.name or name
        self.ready = True
