"""NVSHMEM data path: lanes, chunk pipelines on CUDA streams, and how a failure drains them.

The transfers a lane runs (one class per role and side) are in :mod:`~xfer.transports.nvshmem.items`.

A lane carries one direction and one role between this PE and one peer PE (roles: see
:mod:`~xfer.transports.nvshmem.proto`). It owns a CUDA stream, a thread that queues each
transfer's chunks on it, and a side stream used only to unblock it. For chunk number ``s``
(position ``s % DEPTH`` of the lane's slot):

    sender stream    wait credit >= s - DEPTH · gather blocks -> send position ·
                     put-with-signal send position -> receiver's position, receiver's data word := s
    receiver stream  wait data >= s · scatter position -> blocks · sender's credit word := s

A sender's transfer has landed once its credit word reaches the last ``s`` (the receiver has
scattered every chunk). No ``flush_on_stream`` is needed (NVSHMEM 3.4.5 lacks it): a put's source
may be reused after it in stream order, and the signal reaches the receiver after the data.

Host threads never block on the GPU: they poll events, queue at most ``AHEAD`` chunks past the
last completed one, and check the deadline, cancellation and the peer's liveness between polls.

Failures. An on-stream wait cannot be cancelled, so a side that gives a transfer up *drains* its
lane: from the side stream it sets its own blocking word (sender: credit, receiver: data) to the
transfer's last number, again every millisecond (a late write from the peer may lower it), until
the lane stream is idle (``DRAIN_TIMEOUT_S`` at most, else the lane is marked broken). A draining
receiver scatters whatever its slot holds into the dead transfer's destination blocks: a failed or
timed-out transfer may leave *its own* destination blocks partly written with bytes of this or an
earlier transfer, and is never delivered. Stale bytes left in a slot are never taken for a later
transfer's: every chunk waits for its own, larger number. After a failure the next transfer on the
lane names it (``dead_upto``) so that the other side drains first, and every sender sets its credit
word to ``seq0 - 1`` in stream order before its first chunk.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

from ...errors import AgentClosedError, PeerDisconnectedError, TransferTimeoutError, TransportError, XferError
from ...shm import pid_alive
from . import proto

__all__ = ["Lanes", "AHEAD", "DRAIN_TIMEOUT_S", "GRACE_S", "ABORT_NOTICE_S"]

log = logging.getLogger("xfer.nvshmem")

AHEAD = 2 * proto.DEPTH  # chunks queued on a stream beyond the last completed one
DRAIN_TIMEOUT_S = 5.0
GRACE_S = 1.0  # the passive side keeps a transfer this much longer than the initiator's deadline
FINISH_WAIT_S = 2.0
ABORT_NOTICE_S = 0.5
POLL_MIN_S, POLL_MAX_S = 20e-6, 1e-3
LIVENESS_EVERY_S = 0.1


class _Stop(Exception):
    """Internal: the item must stop; ``error`` says why (an XferError for the transfer)."""

    def __init__(self, error: XferError):
        super().__init__(str(error))
        self.error = error


class _Item:
    """One transfer as a lane runs it. ``last`` is its last sequence number once known."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.seq0 = self.last = 0
        self.stopped: XferError | None = None  # set by abort(); checked between polls
        self.finished = False
        self._pid, self._host, self._polled = 0, "", 0.0

    def abort(self, error: XferError) -> None:
        if self.stopped is None:
            self.stopped = error

    def expired_error(self) -> XferError:
        return TransferTimeoutError(f"{self} reached its deadline")

    def check(self, lane) -> None:
        """Raise _Stop when the item must end: aborted, lane closing, deadline, peer gone."""
        if self.stopped is not None:
            raise _Stop(self.stopped)
        if lane.closing:
            raise _Stop(AgentClosedError(f"NVSHMEM lane {lane.name} is closing"))
        if time.monotonic() >= self.deadline:
            raise _Stop(self.expired_error())
        now = time.monotonic()
        if self._pid and now - self._polled >= LIVENESS_EVERY_S:
            self._polled = now
            if self._pid != os.getpid() and self._host == lane.rt.host_id and not pid_alive(self._pid):
                raise _Stop(PeerDisconnectedError(f"{self}: the peer process (pid {self._pid}) is gone"))

    def skip(self, lane, error: XferError) -> None:
        """The lane drops this item before queuing any GPU work for it."""


# ---- lanes -----------------------------------------------------------------------------------------
class _Lane:
    def __init__(self, rt, peer: int, role: int, sending: bool):
        self.rt, self.peer, self.role, self.sending = rt, peer, role, sending
        arrow = "->" if sending else "<-"
        self.name = f"pe{rt.pe}{arrow}pe{peer}/{proto.ROLE_NAMES[role]}"
        self.stream, self.side = rt.new_stream(), rt.new_stream()
        self.cond = threading.Condition()  # guards the fields below and items' state changes
        self.gpu = threading.Lock()  # held while queuing GPU work; close takes it last
        self.closing = False  # items stop; only draining may still queue work
        self.closed = False  # no more GPU work at all
        self.broken: str | None = None
        self.last_seq = 0  # highest sequence number admitted on this lane
        self.dead_upto = 0  # highest number of a transfer that did not end normally
        self.pending: list[_Item] = []
        self.receives: dict = {}  # recv lanes of ROLE_WRITE: Receive items by transfer id, until finished
        self._items: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"xfer-nvshmem-{self.name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        state = "broken" if self.broken else "closed" if self.closed else "open"
        return f"Lane({self.name}, {state}, last_seq={self.last_seq}, dead_upto={self.dead_upto})"

    # -- admission ---------------------------------------------------------------------------
    def take_seqs(self, item: _Item, chunks: int) -> None:
        """Number ``item``'s chunks (on lanes whose numbers this PE owns)."""
        with self.cond:
            item.seq0, item.last = self.last_seq + 1, self.last_seq + chunks
            self.last_seq = item.last

    def admit(self, item: _Item, seq0: int, chunks: int, key: str | None = None) -> None:
        """Admit an item numbered by the peer (numbers must grow); ``key``: keep it for ``finish``."""
        with self.cond:
            if self.broken:
                raise TransportError(f"NVSHMEM lane {self.name} is broken: {self.broken}")
            if self.closing:
                raise AgentClosedError(f"NVSHMEM lane {self.name} is closing")
            if seq0 <= self.last_seq:
                raise TransportError(f"NVSHMEM lane {self.name}: chunk number {seq0} is not after the last admitted "
                                     f"{self.last_seq} (a stale or replayed request)")
            item.seq0, item.last = seq0, seq0 + chunks - 1
            self.last_seq = item.last
            self.pending.append(item)
            if key is not None:
                now = time.monotonic()
                for k, r in list(self.receives.items()):
                    if r.done(now):
                        del self.receives[k]
                self.receives[key] = item
        self._items.put(item)

    def finish(self, transfer_id: str):
        """The sender's finish of a WRITE: deliver its notification once every chunk landed here."""
        with self.cond:
            rcv = self.receives.get(transfer_id)
        if rcv is None:
            raise TransferTimeoutError(f"NVSHMEM lane {self.name} knows no transfer {transfer_id!r} (discarded "
                                       f"after its deadline, or never begun)")
        try:
            return rcv.finish(self)
        finally:
            with self.cond:
                self.receives.pop(transfer_id, None)

    def submit(self, item: _Item) -> None:
        """Queue an item this PE initiated (numbered when it runs)."""
        with self.cond:
            if self.closing:
                raise AgentClosedError(f"NVSHMEM lane {self.name} is closing")
            self.pending.append(item)
        self._items.put(item)

    def abort_upto(self, upto: int, error: XferError, wait: float = 0.0) -> bool:
        """Stop every admitted item numbered up to ``upto``; with ``wait`` > 0, wait that long for
        them to finish draining. True when none is left running."""
        with self.cond:
            hit = [i for i in self.pending if i.last and i.last <= upto]
            for item in hit:
                item.abort(error)
            if wait > 0:
                self.cond.wait_for(lambda: all(i.finished for i in hit), timeout=wait)
            return all(i.finished for i in hit)

    # -- the lane thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        self.rt.bind_thread()
        while True:
            item = self._items.get()
            if item is None:
                return
            try:
                reason = item.stopped or (TransportError(f"NVSHMEM lane {self.name} is broken: {self.broken}")
                                          if self.broken else None)
                if reason is None and self.closing:
                    reason = AgentClosedError(f"NVSHMEM lane {self.name} is closing")
                if reason is not None:
                    item.skip(self, reason)
                else:
                    item.run(self)
            except BaseException as exc:  # a bug must not kill the lane
                log.exception("NVSHMEM lane %s: %r failed", self.name, item)
                item.skip(self, TransportError(f"NVSHMEM lane {self.name} failed: {exc!r}"))
            finally:
                with self.cond:
                    item.finished = True
                    if item in self.pending:
                        self.pending.remove(item)
                    self.cond.notify_all()

    def enqueue(self, fn):
        """Queue GPU work (``fn()``) unless the lane is closed; returns fn's value."""
        with self.gpu:
            if self.closed:
                raise _Stop(AgentClosedError(f"NVSHMEM lane {self.name} is closed"))
            return fn()

    def wait_event(self, item: _Item, event) -> None:
        delay = POLL_MIN_S
        while not event.query():
            try:
                item.check(self)
            except BaseException:
                log.warning("NVSHMEM lane %s: %r stopped while its GPU work was pending; %s", self.name, item,
                            getattr(self.rt, "describe", lambda: "")())
                raise
            time.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)

    def pump(self, item: _Item, chunks: int, chunk) -> list:
        """Queue ``chunk(k)`` for every chunk, at most AHEAD past the last completed; returns
        [(event, keepalive)] per chunk (keepalive holds what the GPU still reads)."""
        done = []
        for k in range(chunks):
            if k >= AHEAD:
                self.wait_event(item, done[k - AHEAD][0])
            item.check(self)
            done.append(self.enqueue(lambda k=k: (chunk(k), self.rt.record(self.stream))[::-1]))
        return done

    def drain(self, last: int) -> bool:
        """Unblock this lane's own on-stream waits up to ``last`` until its stream is idle."""
        unblock = self.rt.set_own_credit if self.sending else self.rt.set_own_data
        with self.gpu:
            if self.closed:
                return False
            tail = self.rt.record(self.stream)
        end = time.monotonic() + DRAIN_TIMEOUT_S
        while not tail.query():
            if time.monotonic() >= end:
                self.broken = (f"its stream did not drain within {DRAIN_TIMEOUT_S:g} s after a failed transfer "
                               f"(chunks up to {last}); the GPU may be hung")
                log.error("NVSHMEM lane %s is broken: %s", self.name, self.broken)
                return False
            with self.gpu:
                unblock(self.side, self.peer, self.role, last)
            time.sleep(1e-3)
        with self.gpu:  # remote completion of this lane's puts and signals, then the side stream
            self.rt.quiet(self.stream)
            events = (self.rt.record(self.stream), self.rt.record(self.side))
        end = time.monotonic() + DRAIN_TIMEOUT_S
        while not all(e.query() for e in events):
            if time.monotonic() >= end:
                self.broken = "quiet after a failed transfer did not complete"
                return False
            time.sleep(1e-3)
        return True

    def close(self, error: XferError) -> bool:
        """Stop the lane: abort every item, let the thread drain and exit. True if it ended cleanly."""
        with self.cond:
            self.closing = True
            for item in self.pending:
                item.abort(error)
        self._items.put(None)
        self._thread.join(DRAIN_TIMEOUT_S + 2 * ABORT_NOTICE_S + 2)
        with self.gpu:
            self.closed = True
        clean = not self._thread.is_alive() and self.broken is None
        if not clean:
            log.warning("NVSHMEM lane %s did not stop cleanly (%s)", self.name,
                        self.broken or "its thread is still in a control request")
        return clean


class Lanes:
    """Every lane of one PE, made on first use."""

    def __init__(self, rt):
        self.rt = rt
        self._lanes: dict[tuple[bool, int, int], _Lane] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        with self._lock:
            lanes = list(self._lanes.values())
        return "Lanes(" + ", ".join(f"{lane!r} pending={len(lane.pending)}" for lane in lanes) + ")"

    def send(self, dst: int, role: int) -> _Lane:
        return self._get(True, dst, role)

    def recv(self, src: int, role: int) -> _Lane:
        return self._get(False, src, role)

    def _get(self, sending: bool, peer: int, role: int) -> _Lane:
        with self._lock:
            key = (sending, peer, role)
            if key not in self._lanes:
                self._lanes[key] = _Lane(self.rt, peer, role, sending)
            return self._lanes[key]

    def broken(self, peer: int) -> str | None:
        for (_, p, _), lane in list(self._lanes.items()):
            if p == peer and lane.broken:
                return f"NVSHMEM lane {lane.name} is broken: {lane.broken}"
        return None

    def close(self) -> bool:
        error = AgentClosedError("the NVSHMEM transport is closing")
        with self._lock:
            lanes = list(self._lanes.values())
        results = [lane.close(error) for lane in lanes]  # close every lane, then judge
        return all(results)
