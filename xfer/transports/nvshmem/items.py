"""The four kinds of transfer a lane runs, and the chunk steps they queue on its stream.

    WriteSend    this PE's WRITE          send lane (dst, write)   begin -> chunks -> last credit -> finish
    Receive      a peer's WRITE into us   recv lane (src, write)   chunks -> landed; delivered on finish
    ReadReceive  this PE's READ           recv lane (src, read)    read -> chunks -> landed -> notify
    ServeRead    a peer's READ of us      send lane (dst, read)    chunks -> last credit

Lanes, flow control and draining: :mod:`~xfer.transports.nvshmem.lanes`.
"""

from __future__ import annotations

import time

from ...errors import PeerDisconnectedError, TransferTimeoutError, TransportError, XferError
from ...kernels import staging_layout
from ...transfer import Notification, Op
from . import proto
from ..completion import notify_peer, raise_remote
from .lanes import ABORT_NOTICE_S, GRACE_S, FINISH_WAIT_S, _Item, _Stop, log

__all__ = ["WriteSend", "ServeRead", "Receive", "ReadReceive"]


def _as_xfer_error(exc: BaseException, what: str) -> XferError:
    if isinstance(exc, _Stop):
        return exc.error
    if isinstance(exc, XferError):
        return exc
    return TransportError(f"{what} failed: {exc!r}")


def _send_chunk(lane, item, k: int):
    """Sender stream, chunk k: wait for its position to be free, gather into it, put it."""
    rt, s = lane.rt, item.seq0 + k
    start, end = item.plan.bounds(k)
    nbytes = (end - start) * item.layout.bytes_per_block
    if s - rt.plan.depth >= 1:
        rt.wait_credit(lane.stream, lane.peer, lane.role, s - rt.plan.depth, check=lambda: item.check(lane))
    ready = getattr(getattr(item, "job", None), "ready", None)
    if k == 0 and ready is not None:  # the caller's stream had queued the KV this gathers
        lane.stream.wait_event(ready)
    keep = rt.gather(lane.stream, item.layout, item.tensors, item.ids[start:end], lane.peer, lane.role, s, nbytes,
                     item.bounds)
    rt.put_signal(lane.stream, lane.peer, lane.role, s, nbytes)
    return keep


def _recv_chunk(lane, item, k: int):
    """Receiver stream, chunk k: wait for its data, scatter it, free the position at the sender."""
    rt, s = lane.rt, item.seq0 + k
    start, end = item.plan.bounds(k)
    nbytes = (end - start) * item.layout.bytes_per_block
    rt.wait_data(lane.stream, lane.peer, lane.role, s, check=lambda: item.check(lane))
    keep = rt.scatter(lane.stream, lane.peer, lane.role, s, nbytes, item.layout, item.tensors, item.ids[start:end],
                      staging_layout(item.sender_layout, end - start), item.bounds)
    rt.send_credit(lane.stream, lane.peer, lane.role, s)
    return keep


def _preload(lane, item, sending: bool) -> None:
    """Before the item's first wait is queued: its chunks' copy kernels (full and last chunk)
    have run once in this process (see ``Runtime.preload``)."""
    if item.plan.chunks == 0:
        return
    sizes = {end - start for start, end in (item.plan.bounds(k) for k in {0, item.plan.chunks - 1})}
    for n in sorted(sizes):
        lane.enqueue(lambda n=n: lane.rt.preload(lane.stream, sending, lane.peer, lane.role, item.seq0, item.layout,
                                                 item.tensors, n, item.bounds,
                                                 None if sending else item.sender_layout))


def _send_all(lane, item) -> None:
    """Queue every chunk of a sending item and wait until the receiver has scattered the last."""
    _preload(lane, item, True)
    lane.enqueue(lambda: lane.rt.set_own_credit(lane.stream, lane.peer, lane.role, item.seq0 - 1))
    item.keep = lane.pump(item, item.plan.chunks, lambda k: _send_chunk(lane, item, k))
    done = lane.enqueue(lambda: (lane.rt.wait_credit(lane.stream, lane.peer, lane.role, item.last,
                                                     check=lambda: item.check(lane)),
                                 lane.rt.record(lane.stream))[1])
    lane.wait_event(item, done)


def _recv_all(lane, item) -> None:
    _preload(lane, item, False)
    item.keep = lane.pump(item, item.plan.chunks, lambda k: _recv_chunk(lane, item, k))
    lane.wait_event(item, item.keep[-1][0])


def _notice_abort(job, owner, role: int, upto: int) -> None:
    """Best effort: tell the other side that everything up to ``upto`` on this lane is dead."""
    header = {"type": "nvshmem.abort", **owner.member_fields(), "role": proto.ROLE_NAMES[role], "upto": upto}
    try:
        job.peer.request(header, b"", deadline=time.monotonic() + ABORT_NOTICE_S)
    except XferError:
        pass


def _fenced(t, error: XferError, drained: bool) -> None:
    """End ``t`` with ``error`` once its lane drained (nothing of it can land any more). A lane
    whose stream did not drain (a hung GPU) fences nothing: the transfer stays STOPPING (its
    ``wait()`` raises FenceTimeoutError: keep its blocks quarantined)."""
    if drained:
        t.fail(error)
        return
    t.stop(error)
    log.error("NVSHMEM transfer %s is not fenced: its lane's stream did not drain; it stays STOPPING, its blocks "
              "must stay quarantined", t.id)


class _Initiated(_Item):
    """An item for a transfer this agent posted (a Job): it also stops on cancellation."""

    def __init__(self, owner, job, plan):
        super().__init__(job.transfer.deadline)
        self.owner, self.job, self.plan = owner, job, plan
        self.layout, self.tensors, self.ids = job.local.layout, job.local.tensors, job.local_ids
        self.bounds = owner.bounds_for(job.local)
        md = job.peer.metadata
        self._pid, self._host = md.pid, md.host_id

    def check(self, lane) -> None:
        t = self.job.transfer
        if t.cancel_requested:
            raise _Stop(t.error)
        super().check(lane)

    def skip(self, lane, error: XferError) -> None:
        self.job.transfer.fail(error)


class WriteSend(_Initiated):
    """This PE's WRITE: begin -> chunks -> wait for the last credit -> finish (the peer delivers)."""

    def __repr__(self) -> str:
        return f"WriteSend(transfer {self.job.transfer.id} to {self.job.peer.name!r}, chunks {self.seq0}..{self.last})"

    def run(self, lane) -> None:
        job, t = self.job, self.job.transfer
        if t.cancel_requested:  # a stop before it started (cancel, deadline): nothing of it moves
            t.fail(t.error)
            return
        t.begin()
        lane.take_seqs(self, self.plan.chunks)
        queued = False
        try:
            reply, _ = job.peer.request(self.owner.begin_header(job, self, lane.dead_upto), job.notify,
                                        deadline=t.deadline)
            raise_remote(reply, job.peer.name)
            queued = True
            _send_all(lane, self)
            reply, _ = job.peer.request({"type": "nvshmem.finish", **self.owner.member_fields(),
                                         "transfer_id": t.id}, b"", deadline=t.deadline)
            raise_remote(reply, job.peer.name)
            t.complete()
        except BaseException as exc:  # noqa: BLE001 - every failure ends the transfer
            error = _as_xfer_error(exc, f"NVSHMEM write {t.id}")
            lane.dead_upto = max(lane.dead_upto, self.last)
            drained = lane.drain(self.last) if queued else True
            if not isinstance(error, PeerDisconnectedError):
                _notice_abort(job, self.owner, proto.ROLE_WRITE, self.last)
            _fenced(t, error, drained)
        finally:
            self.keep = None


class ServeRead(_Item):
    """A peer's READ of this PE's blocks: gather and put them into the initiator's slot."""

    def __init__(self, owner, req, region):
        super().__init__(time.monotonic() + req.timeout + GRACE_S)
        self.owner, self.req, self.plan = owner, req, req.plan
        self.layout, self.tensors, self.ids = region.layout, region.tensors, req.ids
        self.bounds = owner.bounds_for(region)
        self._pid, self._host = req.pid, req.host_id

    def __repr__(self) -> str:
        return f"ServeRead(transfer {self.req.transfer_id} for {self.req.initiator!r}, chunks {self.seq0}..{self.last})"

    def run(self, lane) -> None:
        try:
            _send_all(lane, self)
        except BaseException as exc:  # noqa: BLE001
            error = _as_xfer_error(exc, repr(self))
            log.warning("NVSHMEM %r stopped: %s", self, error, exc_info=not isinstance(exc, (XferError, _Stop)))
            lane.dead_upto = max(lane.dead_upto, self.last)
            lane.drain(self.last)
        finally:
            self.keep = None


class Receive(_Item):
    """A peer's WRITE into this PE: scatter every chunk; deliver on the sender's finish."""

    ACTIVE, LANDED, DELIVERED, DISCARDED = "active", "landed", "delivered", "discarded"

    def __init__(self, owner, begin, region, payload: bytes):
        super().__init__(time.monotonic() + begin.timeout + GRACE_S)
        self.owner, self.begin, self.plan, self.payload = owner, begin, begin.plan, payload
        self.layout, self.tensors, self.ids = region.layout, region.tensors, begin.ids
        self.bounds = owner.bounds_for(region)
        self.sender_layout = begin.sender_layout
        self.state, self.why = Receive.ACTIVE, ""
        self._pid, self._host = begin.pid, begin.host_id

    def __repr__(self) -> str:
        return (f"Receive(transfer {self.begin.transfer_id} from {self.begin.sender!r}, chunks {self.seq0}..{self.last}, "
                f"{self.state})")

    def skip(self, lane, error: XferError) -> None:
        with lane.cond:
            self.state, self.why = Receive.DISCARDED, str(error)

    def done(self, now: float) -> bool:
        """Nothing more will happen to it: delivered, discarded, or landed but never finished in time."""
        return self.state in (Receive.DELIVERED, Receive.DISCARDED) or (self.finished and now >= self.deadline)

    def run(self, lane) -> None:
        try:
            _recv_all(lane, self)
            with lane.cond:  # landed; unless the sender gave it up meanwhile (it sends no finish then)
                if self.stopped is None:
                    self.state = Receive.LANDED
                else:
                    self.state, self.why = Receive.DISCARDED, str(self.stopped)
                lane.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001
            error = _as_xfer_error(exc, repr(self))
            with lane.cond:
                self.state, self.why = Receive.DISCARDED, str(error)
            log.warning("NVSHMEM %r discarded: %s", self, error, exc_info=not isinstance(exc, (XferError, _Stop)))
            lane.dead_upto = max(lane.dead_upto, self.last)
            lane.drain(self.last)
        finally:
            self.keep = None

    def finish(self, lane) -> Notification:
        """On the sender's finish: deliver the notification, once every chunk landed here."""
        with lane.cond:
            lane.cond.wait_for(lambda: self.state != Receive.ACTIVE, timeout=FINISH_WAIT_S)
            if self.state != Receive.LANDED:
                raise TransferTimeoutError(f"the receiver discarded transfer {self.begin.transfer_id}: "
                                           f"{self.why or 'its chunks had not all landed'}")
            self.state = Receive.DELIVERED
        b = self.begin
        note = Notification(peer=b.sender, transfer_id=b.transfer_id, op=Op.WRITE, region=b.region, blocks=b.ids,
                            payload=self.payload)
        self.owner.ctx.deliver(note)  # the agent whose begin handler admitted it
        return note


class ReadReceive(_Initiated):
    """This PE's READ: ask the holder to serve it, scatter every chunk, notify the holder."""

    def __init__(self, owner, job, plan):
        super().__init__(owner, job, plan)
        self.sender_layout = job.peer_region.layout

    def __repr__(self) -> str:
        return f"ReadReceive(transfer {self.job.transfer.id} from {self.job.peer.name!r}, chunks {self.seq0}..{self.last})"

    def run(self, lane) -> None:
        job, t = self.job, self.job.transfer
        if t.cancel_requested:  # a stop before it started (cancel, deadline): nothing of it moves
            t.fail(t.error)
            return
        t.begin()
        lane.take_seqs(self, self.plan.chunks)
        queued = False
        try:
            reply, _ = job.peer.request(self.owner.read_header(job, self, lane.dead_upto), b"", deadline=t.deadline)
            raise_remote(reply, job.peer.name)
            queued = True
            _recv_all(lane, self)
            notify_peer(job, self.owner.ctx.agent_name)
            t.complete()
        except BaseException as exc:  # noqa: BLE001
            error = _as_xfer_error(exc, f"NVSHMEM read {t.id}")
            lane.dead_upto = max(lane.dead_upto, self.last)
            # before failing: the engine may reuse the blocks at once
            drained = lane.drain(self.last) if queued else True
            if not isinstance(error, PeerDisconnectedError):
                _notice_abort(job, self.owner, proto.ROLE_READ, self.last)
            _fenced(t, error, drained)
        finally:
            self.keep = None
