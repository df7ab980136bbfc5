"""The UCX engine's tables: its connections (:class:`Connections`) and its flows (:class:`Flows`).

Each table is owned by one class; the engine, the protocol and the flows call its methods, never
its dicts. Both run on the engine thread only. Ending a flow or a connection is theirs too: a
failed flow is dropped from every index at once, its peer told (CANCEL) and its transfer failed,
except while UCX may still write its blocks (an in-place receive in flight), when it is *held*
until that receive ended (``HOLD_S`` at most, then its connection is closed to end it).
"""

from __future__ import annotations

import itertools
import time

from ... import error_codec
from ...errors import PeerDisconnectedError, TransferTimeoutError, TransportError, XferError
from . import wire
from .conn import Conn

__all__ = ["Connections", "Flows", "HOLD_S"]

HOLD_S = 0.2  # a failed flow's in-place receives may run this long before its connection is closed


class Connections:
    """Every connection of one engine, by the id this side gave it; the outgoing one per peer agent."""

    def __init__(self, engine):
        self._e = engine
        self._by_id: dict[int, Conn] = {}
        self._out: dict[str, Conn] = {}  # peer agent id -> our outgoing conn
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._by_id)

    def new_id(self) -> int:
        return next(self._ids)

    def add(self, conn: Conn) -> None:
        self._by_id[conn.local_id] = conn
        if conn.outgoing:
            self._out[conn.agent_id] = conn

    def get(self, local_id: int) -> Conn | None:
        return self._by_id.get(local_id)

    def outgoing(self, agent_id: str) -> Conn | None:
        return self._out.get(agent_id)

    def all(self) -> list[Conn]:
        return list(self._by_id.values())

    def fail(self, conn: Conn, err: Exception) -> None:
        """The connection is dead (peer gone, link down, bad message, closing): every flow on it
        fails (the peer is not told: it cannot hear), chunks held for it are consumed, and its
        endpoint closed unless UCX closed it already."""
        if conn.dead:
            return
        conn.dead, conn.error = True, err
        self._by_id.pop(conn.local_id, None)
        if self._out.get(conn.agent_id) is conn:
            del self._out[conn.agent_id]
        for flow in list(conn.flows):
            self._e.flows.fail(flow, err, notify_peer=False)
        for xid in list(conn.early):
            self._e.data.adopt_early(conn, xid, None)
        conn.waiting = []
        conn.ctrl_in.clear()
        if conn.ep is not None and conn.ep.alive:  # UCX closes a failed endpoint itself (closing it twice crashes)
            try:
                conn.ep.close()
            except Exception:
                pass

    def fail_all(self, err: Exception) -> None:
        for conn in self.all():
            self.fail(conn, err)

    def clear(self) -> None:
        self._by_id.clear()
        self._out.clear()


class Flows:
    """Every live flow: initiators by key, targets by (connection, key), receiving flows by
    (connection, xid) for their arriving chunks; failed flows held for their in-place receives."""

    def __init__(self, engine):
        self._e = engine
        self._initiators: dict[int, object] = {}  # key -> flow
        self._targets: dict[tuple[int, int], object] = {}  # (conn local id, key) -> flow
        self._rx: dict[tuple[int, int], object] = {}  # (conn local id, xid) -> receiving flow
        self._held: dict = {}  # failed flow -> when to force its connection closed
        self._keys = itertools.count(1)

    def new_key(self) -> int:
        return next(self._keys)

    def add(self, flow) -> None:
        """A new flow: indexed by its key, and by its xid where it receives chunks."""
        if flow.initiator:
            self._initiators[flow.key] = flow
        else:
            self._targets[(flow.conn.local_id, flow.key)] = flow
        if not flow.sending:
            self._rx[(flow.conn.local_id, flow.xid)] = flow
        flow.conn.flows[flow] = None

    def initiator(self, key):
        return self._initiators.get(key)

    def target(self, conn_id: int, key):
        return self._targets.get((conn_id, key))

    def receiver(self, conn_id: int, xid: int):
        return self._rx.get((conn_id, xid))

    def live(self):
        return itertools.chain(self._initiators.values(), self._targets.values())

    def device_reqs(self) -> bool:
        """Whether a live flow has a UCX request on device memory in flight (a dropped flow's
        requests may wait on a frozen peer: they are not polled for)."""
        return any(f.dev_reqs for f in self.live())

    def held(self) -> bool:
        return bool(self._held)

    def nearest(self, now: float, t: float) -> float:
        """The least of ``t`` and the seconds to the nearest deadline (of a flow or a hold)."""
        for flow in self.live():
            t = min(t, flow.deadline - now)
        for until in self._held.values():
            t = min(t, until - now)
        return t

    # ---- ending flows ------------------------------------------------------------------------
    def drop(self, flow) -> None:
        """Out of every index; its arrived, never received chunks are consumed."""
        flow.dead = True
        if flow.initiator:
            self._initiators.pop(flow.key, None)
        else:
            self._targets.pop((flow.conn.local_id, flow.key), None)
        flow.conn.flows.pop(flow, None)
        if not flow.sending:
            if self._rx.get((flow.conn.local_id, flow.xid)) is flow:
                del self._rx[(flow.conn.local_id, flow.xid)]
            while flow.pending:
                self._e.data.sink(flow.pending.popleft())

    def fail(self, flow, err: Exception, *, notify_peer: bool = True) -> None:
        """Drop ``flow``: its transfer ends with ``err``; the peer is told; late chunks are discarded.

        A flow with receives landing in place still in flight is dropped at once, but its failure
        is reported (to the peer by CANCEL, and to its caller unless the caller's own cancel or
        deadline already ended the transfer) only once UCX ended them: until then UCX may write
        its blocks. Past HOLD_S (or its deadline) the connection is closed, which makes UCX end
        them (on a later progress: see io_raw)."""
        if flow.dead:
            return
        if not isinstance(err, XferError):
            err = TransportError(f"ucx transfer failed: {err!r}")
        self.drop(flow)
        if flow.iov_rx and flow.receiving > 0:
            flow.held = (err, notify_peer)
            self._held[flow] = min(time.monotonic() + HOLD_S, flow.deadline)  # past its deadline: close now
            return
        self._report_failed(flow, err, notify_peer)

    def release_held(self, flow) -> None:
        """The last in-place receive of a held flow ended: report its failure now."""
        self._held.pop(flow, None)
        err, notify_peer = flow.held
        flow.held = None
        self._report_failed(flow, err, notify_peer)

    def _report_failed(self, flow, err: XferError, notify_peer: bool) -> None:
        if notify_peer and not flow.conn.dead and flow.conn.ready:
            self._e.proto.send_ctrl(flow.conn, wire.Kind.CANCEL, {"k": flow.key, "init": flow.initiator,
                                                                 "why": error_codec.encode(err)[0]})
        if flow.transfer is not None:
            flow.transfer.fail(err)

    def expire(self, now: float) -> None:
        """Holds past their time, and flows past their deadline (or whose caller ended them)."""
        for flow, until in list(self._held.items()):
            if now < until:
                continue
            if not flow.conn.dead:  # UCX then ends the receives (on a later progress)
                self._e.log.warning("ucx: in-place receives of failed transfer %s still running after %.1f s; "
                                    "closing the connection to %r to stop them", flow.tid or flow.key, HOLD_S,
                                    flow.conn.name)
                self._held[flow] = now + HOLD_S
                self._e.conns.fail(flow.conn, PeerDisconnectedError(
                    f"connection to {flow.conn.name!r} closed to stop the in-place receives of failed transfer "
                    f"{flow.tid or flow.key}"))
            else:  # closed and still not ended: report anyway rather than never (logged)
                self._e.log.error("ucx: UCX did not end the in-place receives of transfer %s after its connection "
                                  "closed; reporting its failure anyway", flow.tid or flow.key)
                self.release_held(flow)
        for flow in [f for f in self._initiators.values() if f.transfer.poll().terminal or now >= f.deadline]:
            self.fail(flow, flow.transfer.error or TransferTimeoutError(
                f"transfer {flow.tid} reached its deadline ({flow.progress()})"))
        for flow in [f for f in self._targets.values() if now >= f.deadline]:
            self.fail(flow, TransferTimeoutError(f"incoming transfer {flow.tid} from {flow.peer_name!r} reached "
                                                 f"its deadline ({flow.progress()}); dropped, no notification "
                                                 f"delivered"))

    def fail_initiators(self, err: Exception) -> None:
        for flow in list(self._initiators.values()):
            self.fail(flow, err, notify_peer=False)

    def release_all_held(self) -> None:
        """The engine stops: every held flow's failure is reported (every transfer still ends)."""
        for flow in list(self._held):
            self.release_held(flow)
