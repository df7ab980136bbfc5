"""The UCX engine's tables: its connections (:class:`Connections`) and its flows (:class:`Flows`).

Each table is owned by one class; the engine, the protocol and the flows call its methods, never
its dicts. Both run on the engine thread only. Ending a flow or a connection is theirs too, and
every ending is a fence (see ``xfer.transfer.Transfer``):

- a flow is *settled* once none of its chunks is in flight (``inflight == 0``: no gather, UCX send
  or receive, or scatter that reads or writes its blocks or slots); a failed flow is dropped from
  every index at once (late chunks are discarded) but *held* until it settled, and only then is
  its failure reported (its transfer failed, its hold on the blocks ended, its peer told);
- an initiator's flow that must end while its connection lives *stops*: it starts nothing more,
  tells the target (CANCEL) and ends once the target confirmed that it dropped and settled its
  side (STOPPED; or its own CANCEL, a REFUSE, or an ACK: then DONE) and its own chunks settled;
- past ``settings.fence.grace_s`` without that (a frozen peer), or past it for a held flow whose
  receives do not end, the connection is closed: UCX then ends its requests. A stopping flow whose
  connection died is reported once it settled and the peer cannot deliver it any more: it never
  had every chunk (WRITE) or its FIN (READ), its process is gone (same host), or the transfer's
  deadline passed (the peer refuses what reaches it later: its deadline is earlier).
"""

from __future__ import annotations

import itertools
import time

from ... import error_codec
from ...errors import PeerDisconnectedError, TransferTimeoutError, TransportError, XferError
from ...shm import pid_alive
from . import wire
from .conn import Conn

__all__ = ["Connections", "Flows"]


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
        """An id no open connection has, 1 .. wire.CONN_MAX (16 bits of a tag)."""
        while True:
            i = (next(self._ids) - 1) % wire.CONN_MAX + 1
            if i not in self._by_id:
                return i

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
        self._e.data.discard_ctrl(conn)  # its queued control messages (unreceived ones drained)
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
    """Every live flow: initiators by key (stopping ones too), targets by (connection, key),
    receiving flows by (connection, xid) for their arriving chunks; failed flows held until they
    settled, and stopping ones until they are fenced."""

    def __init__(self, engine, grace: float = 1.0):
        self._e = engine
        self._initiators: dict[int, object] = {}  # key -> flow
        self._targets: dict[tuple[int, int], object] = {}  # (conn local id, key) -> flow
        self._rx: dict[tuple[int, int], object] = {}  # (conn local id, xid) -> receiving flow
        self._held: dict = {}  # failed flow -> when to close its connection if it has not settled
        self._stopping: dict = {}  # stopping initiator flow -> None (an ordered set)
        self._keys = itertools.count(1)
        self.grace = grace  # settings.fence.grace_s: how long a stop waits for the peer, a hold for UCX

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
        """The least of ``t`` and the seconds to the nearest deadline (of a flow, a hold or a stop)."""
        for flow in self.live():
            t = min(t, flow.deadline - now)
        for until in self._held.values():
            t = min(t, until - now)
        for flow in self._stopping:
            t = min(t, flow.stop_until - now if not flow.conn.dead else flow.deadline - now)
        return t

    # ---- ending flows ------------------------------------------------------------------------
    def drop(self, flow) -> None:
        """Out of every index; its arrived, never received chunks are consumed."""
        flow.dead = True
        self._stopping.pop(flow, None)
        if flow.initiator:
            self._initiators.pop(flow.key, None)
        else:
            self._targets.pop((flow.conn.local_id, flow.key), None)
        flow.conn.flows.pop(flow, None)
        self._unreceive(flow)

    def _unreceive(self, flow) -> None:
        """No more chunks are received for ``flow``: later ones are discarded on arrival."""
        if not flow.sending:
            if self._rx.get((flow.conn.local_id, flow.xid)) is flow:
                del self._rx[(flow.conn.local_id, flow.xid)]
            while flow.pending:
                self._e.data.sink(flow.pending.popleft())

    def fail(self, flow, err: Exception, *, notify_peer: bool = True) -> None:
        """End ``flow`` with ``err`` (a fence, see the module doc). ``notify_peer`` False: the peer
        already dropped it (its REFUSE or CANCEL) or cannot hear (connection dead). An initiator's
        flow on a live connection that the peer has not dropped stops instead (CANCEL, then the
        peer's STOPPED); any other is dropped, held until it settled, then reported."""
        if flow.dead:
            return
        if not isinstance(err, XferError):
            err = TransportError(f"ucx transfer failed: {err!r}")
        if flow.stopping is not None:  # the peer dropped it, or the connection died: look again
            flow.peer_fenced |= notify_peer is False and not flow.conn.dead
            self.check_stopped(flow)
            return
        if flow.initiator and (notify_peer or flow.conn.dead):
            self.stop(flow, err)
            return
        self._end(flow, err, notify_peer)

    def stop(self, flow, err: XferError) -> None:
        """An initiator's flow must end without completing (its caller's cancel or deadline, a local
        failure, its connection died): start nothing more, tell the target, end once fenced."""
        if flow.dead or flow.stopping is not None:
            return
        flow.stopping, flow.stop_until = err, time.monotonic() + self.grace
        self._stopping[flow] = None
        self._unreceive(flow)
        conn = flow.conn
        if not conn.dead:  # behind its REQ if that still waits for the hello round (it may describe the
            # layout later REQs of the connection name: it must go out)
            self._e.proto.send_ctrl(conn, wire.Kind.CANCEL, {"k": flow.key, "init": True,
                                                             "why": error_codec.encode(err)[0]})
        elif not flow.requested:  # its REQ never left and never will: nothing of it moved
            flow.peer_fenced = True
        self.check_stopped(flow)

    def check_stopped(self, flow) -> None:
        """Report a stopping flow once fenced: its chunks settled, and the peer confirmed (or cannot
        deliver it any more: see the module doc)."""
        if flow.dead or flow.stopping is None or not flow.settled():
            return
        if not flow.peer_fenced:
            if not flow.conn.dead:
                return
            if flow.could_deliver() and time.monotonic() < flow.deadline and not self._peer_gone(flow):
                return
        self.drop(flow)
        if flow.transfer is not None:
            flow.transfer.fail(flow.stopping)

    @staticmethod
    def _peer_gone(flow) -> bool:
        """The peer's process is known to be gone (it runs on this host)."""
        pid = flow.peer_pid
        return pid is not None and not pid_alive(pid)

    def _end(self, flow, err: XferError, notify_peer: bool) -> None:
        self.drop(flow)
        if not flow.settled():  # UCX or a copy may still touch its blocks: report once it settled
            flow.held = (err, notify_peer)
            # the grace whatever its deadline: closing the connection fails every other flow on it too
            self._held[flow] = time.monotonic() + self.grace
            return
        self._report_failed(flow, err, notify_peer)

    def on_settled(self, flow) -> None:
        """The last chunk in flight of a dropped or stopping flow ended."""
        if flow.held is not None:
            self._held.pop(flow, None)
            (err, notify_peer), flow.held = flow.held, None
            self._report_failed(flow, err, notify_peer)
        elif flow.stopping is not None:
            self.check_stopped(flow)

    def _report_failed(self, flow, err: XferError, notify_peer: bool) -> None:
        if flow.hold is not None:
            self._e.ctx.grants.end(flow.hold)
        conn = flow.conn
        if not conn.dead and conn.ready:
            if notify_peer:
                self._e.proto.send_ctrl(conn, wire.Kind.CANCEL, {"k": flow.key, "init": flow.initiator,
                                                                 "why": error_codec.encode(err)[0]})
            elif flow.confirm:  # the initiator stopped it and waits for this side's fence
                self._e.proto.send_ctrl(conn, wire.Kind.STOPPED, {"k": flow.key})
        if flow.transfer is not None:
            flow.transfer.fail(err)

    def confirm_stopped(self, conn, key) -> None:
        """The initiator stopped transfer ``key`` and this side holds no live flow of it: confirm
        once a held one settled, at once otherwise."""
        for flow in self._held:
            if flow.conn is conn and flow.key == key and not flow.initiator:
                flow.confirm = True
                return
        self._e.proto.send_ctrl(conn, wire.Kind.STOPPED, {"k": key})

    def expire(self, now: float) -> None:
        """Holds and stops past their grace, flows past their deadline (or whose caller ended them)."""
        for flow, until in list(self._held.items()):
            if flow.conn.dead and flow.settled():  # its connection closed meanwhile: only sends were left
                self.on_settled(flow)
            elif now >= until and not flow.conn.dead:  # UCX then ends the requests (on a later progress)
                self._e.log.warning("ucx: chunks of failed transfer %s still in flight after %.1f s; closing the "
                                    "connection to %r to end them", flow.tid or flow.key, self.grace, flow.conn.name)
                self._held[flow] = float("inf")
                self._close(flow)
        for flow in list(self._stopping):
            if flow.conn.dead or (flow.peer_fenced and flow.settled()):
                self.check_stopped(flow)  # the deadline may have come
            elif now >= flow.stop_until:
                self._e.log.warning("ucx: the stop of transfer %s was not fenced within %.1f s (peer %r confirmed: "
                                    "%s; chunks in flight: %d); closing the connection to end it", flow.tid or flow.key,
                                    self.grace, flow.conn.name, flow.peer_fenced, flow.inflight)
                self._close(flow)
        for flow in [f for f in self._initiators.values()
                     if f.stopping is None and (f.transfer.cancel_requested or now >= f.deadline)]:
            self.stop(flow, flow.transfer.error or TransferTimeoutError(
                f"transfer {flow.tid} reached its deadline ({flow.progress()})"))
        for flow in [f for f in self._targets.values() if now >= f.deadline]:
            self.fail(flow, TransferTimeoutError(f"incoming transfer {flow.tid} from {flow.peer_name!r} reached "
                                                 f"its deadline ({flow.progress()}); dropped, no notification "
                                                 f"delivered"))

    def _close(self, flow) -> None:
        self._e.conns.fail(flow.conn, PeerDisconnectedError(
            f"connection to {flow.conn.name!r} closed to end transfer {flow.tid or flow.key} (its peer did not "
            f"confirm its stop, or UCX did not end its chunks, within {self.grace:.1f} s)"))

    def fail_initiators(self, err: Exception) -> None:
        for flow in list(self._initiators.values()):
            self.fail(flow, err, notify_peer=False)

    def release_all(self, err: Exception) -> None:
        """The engine stops (its worker and every endpoint go): every flow's failure is reported,
        fenced or not (no progress happens any more, so nothing lands later)."""
        for flow in list(self._held):
            self.on_settled(flow)
        for flow in list(self._stopping):
            self.drop(flow)
            flow.transfer.fail(flow.stopping)
        for flow in list(self.live()):
            self.drop(flow)
            self._report_failed(flow, err, False)
