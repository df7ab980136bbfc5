"""The UCX engine: one thread owns the ucxx worker and drives every connection and flow.

Progress model: the worker runs in UCX's blocking mode. The thread drains ``progress_once``,
handles what completed, then arms the worker and sleeps in ``epoll`` on the worker's event fd
and a wake pipe (posts, copy completions, cancellations) until something happens or the nearest
deadline. No busy polling on host memory: an idle agent costs nothing, a busy one wakes once per
event. Device work is the exception: a CUDA event and a ``cuda_ipc`` completion wake no fd, so
while a device copy or a live flow's device UCX request is in flight the loop polls (yielding
the GIL each turn, napping 50 us after 1 ms without progress).
All UCX calls happen on this thread.

Receiving: nothing is pre-posted. One wildcard probe takes every message the worker holds, in
arrival order: control messages are received at once (into a buffer of their size); a data chunk
is handed to its flow (by connection and xid) and waits there until a staging slot is free for it;
a chunk of no live flow is received into a throw-away buffer (a dropped transfer's late chunks);
a chunk whose REQ has not been processed yet (the initiator sends right behind its REQ) is held
on its connection until the REQ is. With the raw binding (io_raw) the probe and the receives are
raw UCX calls, and a host flow's chunk is received straight into its blocks; its slot is then
only a token of the pool's flow control, and the argument below holds unchanged (a receive that
took a slot needs nothing else to end). A failed flow with such a receive in flight is held (see
``fail``).

Staging slots, and why no interleaving deadlocks. Each memory kind has one pool of ``S`` slots.
Sends may hold at most ``S - S // 2`` of them; receives may take any free slot. Then:

  1. A receive takes a slot only for a chunk that has *arrived* (probed, handle in hand). Its
     completion needs no further slot anywhere: the bytes are here (eager) or sit in a slot of the
     sender whose send is already posted (rendezvous); the scatter after it is local work on the
     copy thread (finite, FIFO). So every receive slot comes back in bounded time, or at once
     when the connection fails (UCX fails the request).
  2. Sends never hold more than ``S - S // 2`` slots, so at least ``S // 2 >= 1`` slots are free or
     held by receives, which come back (1). Flows with arrived chunks are served round-robin, one
     chunk per turn, before any send takes a slot: every arrived chunk is received in finite time.
  3. A send holds its slot through the gather (local) and until UCX completes it, i.e. until the
     peer receives it: the peer's probe sees it (its worker progresses on its own thread) and (2)
     there gives it a slot in finite time. So every send slot comes back too.
  4. Nothing else waits while holding a slot: no chunk waits for a control message (the initiator
     sends right behind its REQ; the target holds early chunks without a slot), and control
     messages never need a slot.

A wait-for cycle would need a slot held while waiting for another slot; by (1)-(4) only a send
waits on anything remote, and what it waits for (a receive at the peer) never waits for a send.
So with any number of flows in both directions, any interleaving, all slots busy, progress is
made; fairness: round-robin among flows, receives first. A dead or frozen peer cannot make a
healthy one wait past its deadline either: deadlines end flows, whose late chunks are discarded
on arrival (a frozen peer can keep a send slot until it wakes or UCX's keepalive gives up on it).
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import os
import select
import threading
import time

import numpy as np

from ... import error_codec
from ...errors import PeerDisconnectedError, TransferTimeoutError, TransportError, XferError
from . import wire
from .conn import Conn
from .staging import Copier, StagingPool

__all__ = ["Engine", "RawProbe"]

PROBE_BATCH = 256  # messages taken per loop turn
HOLD_S = 0.2  # a failed flow's in-place receives may run this long before its connection is closed

# Chunks a connection may hold ahead of their REQs. A well-behaved initiator's early chunks are
# those sent between a REQ and its processing here (one loop turn); far more is a broken or
# hostile peer, whose connection is failed rather than buffered without bound.
EARLY_MAX = 1 << 16


class RawProbe:
    """A message taken by the raw probe: UCX's message handle and its length."""

    __slots__ = ("handle", "length")

    def __init__(self, handle: int, length: int):
        self.handle, self.length = handle, length


def _gil_held_write():
    """libc's ``write`` called with the GIL held (``os.write`` releases it around the syscall),
    with its arguments made once: no argtypes conversion on the call (a post's wake-up meets cold
    caches)."""
    try:
        fn = ctypes.PyDLL(None).write
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    return fn


_WRITE = _gil_held_write()
# an eventfd's increment (8 bytes), made once (the fd, a Python int, passes as a C int)
_INCR, _INCR_BYTES = ctypes.pointer(ctypes.c_uint64(1)), ctypes.c_size_t(8)


def _wake(fd: int) -> None:
    """Wake the engine from its epoll (``fd``: its eventfd) without handing it the GIL. Through
    ``os.write`` the woken engine thread took the GIL while the poster was inside the syscall, and
    the poster then waited out the engine's whole first burst of work (the REQ, a small chunk's
    gather and send): a 2 MiB write() call took ~0.8 ms of wall time for ~0.12 ms of its own CPU
    on the CPU VM. Now the engine runs once the poster blocks (``wait``) or its switch interval
    ends. A closed fd (-1 after teardown) is ignored: the engine is gone."""
    if _WRITE is not None:
        _WRITE(fd, _INCR, _INCR_BYTES)
        return
    try:
        os.eventfd_write(fd, 1)
    except OSError:
        pass


class EventRequest:
    """A queued CUDA copy as the engine tracks a request: ``completed`` once its event has (a CUDA
    error polling it completes it with that error), ``check_error`` raises the error."""

    __slots__ = ("event", "error")

    def __init__(self, event):
        self.event, self.error = event, None

    @property
    def completed(self) -> bool:
        try:
            return self.event.query()
        except Exception as exc:  # a CUDA error: the copy failed
            self.error = exc
            return True

    def check_error(self) -> None:
        if self.error is not None:
            raise self.error

    def abandon(self, *keep) -> None:
        """At close: the copy reads or writes slots and blocks; let it end before they are freed."""
        try:
            self.event.synchronize()
        except Exception:
            pass


def _address(buf) -> tuple[int, int]:
    """(address, bytes) of a contiguous numpy array or torch tensor (host or CUDA)."""
    if isinstance(buf, np.ndarray):
        return buf.ctypes.data, buf.nbytes
    return buf.data_ptr(), buf.numel() * buf.element_size()


class Engine:
    def __init__(self, ctx, settings, ucx):
        self.ctx, self.settings, self.ucx = ctx, settings, ucx
        self.log = ctx.log
        u = ucx.libucxx
        self.u = u
        self.context = u.UCXContext(settings.context_options(),
                                    feature_flags=(u.Feature.TAG, u.Feature.WAKEUP, u.Feature.STREAM))
        self.worker = u.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self._any_tag, self._any_mask = u.UCXXTag(0), u.UCXXTagMask(0)
        self._conn_requests: list = []
        self.listener = u.UCXListener.create(self.worker, settings.port, self._conn_requests.append)
        self.port = self.listener.port
        self._epoll = select.epoll()
        # posts wake the loop through an eventfd: one 8-byte write, one read resets it (a pipe took
        # a read more, ending in EAGAIN, on each wake-up)
        self._wake_r = self._wake_w = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._inbox: collections.deque = collections.deque()
        self._reqs: list = []  # (ucxx request, callback(err)) until completed
        # device work in flight: copies queued on a CUDA stream (tracked as requests, counted here)
        # and UCX requests on device memory (counted on their flows). Neither wakes the worker's fd
        # (a CUDA event has none; cuda_ipc completes inside progress): the loop polls meanwhile
        self._dev_copies = 0
        self._conns: dict[int, Conn] = {}  # local id -> conn
        self._out: dict[str, Conn] = {}  # peer agent id -> our outgoing conn
        self._ids = itertools.count(1)
        self._keys = itertools.count(1)
        self._flows: dict[int, object] = {}  # key -> initiator flow
        self._targets: dict[tuple[int, int], object] = {}  # (conn local id, key) -> target flow
        self._rx: dict[tuple[int, int], object] = {}  # (conn local id, xid) -> receiving flow
        self._pools: dict[str, StagingPool] = {}
        self._want_rx: dict[str, collections.deque] = {}  # per pool kind: receiving flows with arrived chunks
        self._want_tx: dict[str, collections.deque] = {}  # per pool kind: sending flows with chunks to start
        self._closing = False
        self._sleeping = False
        self._copier = Copier(f"xfer-ucx-copy-{ctx.agent_name}")
        from .io_raw import iov_sender
        # raw tag calls on ucxx's libucp (None: ucxx's API, every chunk staged): scatter-gather
        # sends from host blocks, and probes and receives, so that a chunk can land in place
        self.iov, self.iov_off = iov_sender() if settings.iov else (None, "XFER_UCX_IOV=0")
        self.iov_rx = self.iov is not None and settings.iov_recv
        self._worker_handle = self.worker.handle
        self._info = (ctypes.c_uint64 * 2)()  # a raw probe's (sender tag, length)
        self._held: dict = {}  # failed flows whose in-place receives UCX has not ended -> when to force
        from .protocol import Protocol  # the control messages
        self.proto = Protocol(self)
        self._thread = threading.Thread(target=self._run, name=f"xfer-ucx-{ctx.agent_name}", daemon=True)
        self._thread.start()

    # ---- cross-thread entry points -----------------------------------------------------------
    def call_soon(self, fn, *args) -> None:
        self._inbox.append((fn, args))
        if not self._sleeping:  # awake: it reads the inbox before it sleeps (no syscall, no GIL ping-pong)
            return
        _wake(self._wake_w)

    def close(self) -> None:
        if self._closing:
            return
        self.call_soon(self._begin_close)
        self._thread.join(timeout=15)
        self._copier.close()

    # ---- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        idle_since = None
        try:
            while not (self._closing and not self._reqs_pending()):
                busy = self._step()
                if busy:
                    idle_since = None
                    continue
                if self._dev_copies or self._device_reqs():  # see __init__; bounded by the flows' deadlines
                    now = time.monotonic()
                    idle_since = idle_since or now
                    # sleep(0) lets other threads take the GIL; past 1 ms with nothing done (a copy
                    # waiting on the caller's stream, a slow peer) 50 us naps keep a core free
                    time.sleep(0 if now - idle_since < 1e-3 else 5e-5)
                    continue
                idle_since = None
                self._sleeping = True  # set before the last look at the inbox: no lost wake-up
                if not self._inbox and self.worker.arm():
                    for fd, _ in self._epoll.poll(self._timeout()):
                        if fd == self._wake_r:
                            try:
                                os.eventfd_read(self._wake_r)
                            except BlockingIOError:  # reset by an earlier read
                                pass
                self._sleeping = False
        except Exception:  # a bug: fail everything rather than leave transfers hanging
            self.log.exception("xfer ucx engine of %s crashed", self.ctx.agent_name)
            self._fail_all(TransportError("ucx engine crashed; see the log"))
        finally:
            self._teardown()

    def _step(self) -> bool:
        busy = False
        while self.worker.progress_once():
            busy = True
        while self._inbox:
            fn, args = self._inbox.popleft()
            fn(*args)
            busy = True
        while self._conn_requests:
            self.proto.accept(self._conn_requests.pop())
            busy = True
        busy |= self._probe()
        busy |= self._check_reqs()
        busy |= self._schedule()
        self._check_deadlines()
        return busy

    def _timeout(self) -> float:
        now, t = time.monotonic(), 1.0
        for flow in itertools.chain(self._flows.values(), self._targets.values()):
            t = min(t, flow.deadline - now)
        for until in self._held.values():
            t = min(t, until - now)
        return max(t, 0.0)

    def _reqs_pending(self) -> bool:
        return bool(self._reqs)

    # ---- requests ----------------------------------------------------------------------------
    def track(self, req, cb) -> None:
        self._reqs.append((req, cb))

    def _check_reqs(self) -> bool:
        if not self._reqs:
            return False
        done, keep = [], []
        for item in self._reqs:
            (done if item[0].completed else keep).append(item)
        if not done:
            return False
        self._reqs = keep
        for req, cb in done:
            try:
                req.check_error()
                err = None
            except Exception as exc:  # UCX error of this request
                err = exc
            cb(err)
        return True

    def tag_send(self, conn: Conn, buf, tag: int, cb) -> None:
        if self.iov is not None and not (conn.closed or conn.dead):
            # by the raw call (host bytes: control messages, host slots; device slots): ~30-50 us of
            # CPU less a send than ucxx's request objects on the 2-core VM, ~0.1 ms on the H200 VM
            # for a device slot. Only on a live endpoint: one UCX closed may have freed its handle
            # (ucxx's call below fails a dead one cleanly). UCX detects the memory type.
            self.track(self.iov.send_contig(conn.ep.handle, *_address(buf), tag, buf), cb)
            return
        self.track(conn.ep.tag_send(self.ucx.Array(buf), self.u.UCXXTag(tag)), cb)

    def recv_probed(self, buf, probe, cb) -> None:
        """Receive a probed message into ``buf`` (a numpy array or a CUDA tensor, contiguous)."""
        if isinstance(probe, RawProbe):
            self.track(self.iov.recv(self._worker_handle, probe.handle, *_address(buf), buf), cb)
        else:
            self.track(self.worker.tag_recv_with_handle(self.ucx.Array(buf), probe), cb)

    # ---- arrivals ----------------------------------------------------------------------------
    def _probe(self) -> bool:
        """Take up to PROBE_BATCH messages (any tag) in arrival order; see the module docstring."""
        got = 0
        while got < PROBE_BATCH:
            if self.iov is not None:
                handle = self.iov.probe(self._worker_handle, self._info)
                if handle is None:
                    break
                probe = RawProbe(handle, self._info[1])
                tag = self._info[0]
            else:
                probe = self.worker.tag_probe(self._any_tag, self._any_mask, remove=True)
                if not probe.matched:
                    break
                tag = probe.sender_tag.value
            got += 1
            if tag & 0xFFFFFFFF == 0:
                self.proto.on_ctrl_probe(tag >> 32, probe)
            else:
                self._on_data(tag >> 32, (tag >> 8) & 0xFFFFFF, tag & 0xFF, probe)
        return got > 0

    def _on_data(self, conn_id: int, xid: int, seq_byte: int, probe) -> None:
        flow = self._rx.get((conn_id, xid))
        if flow is None:
            conn = self._conns.get(conn_id)
            if conn is not None and not conn.outgoing and not conn.dead and wire.xid_after(xid, conn.xid):
                conn.early.setdefault(xid, []).append((seq_byte, probe))  # its REQ is on its way
                conn.n_early += 1
                if conn.n_early > EARLY_MAX:
                    self.conn_failed(conn, PeerDisconnectedError(
                        f"peer {conn.name!r} sent more than {EARLY_MAX} chunks of transfers it never requested"))
            else:
                self.sink(probe)  # a dropped (or refused) transfer's late chunk
            return
        err = flow.arrive(probe, seq_byte)
        if err is not None:
            self.sink(probe)
            self.fail(flow, err)
            return
        self.want(flow)

    def adopt_early(self, conn: Conn, xid: int, flow) -> None:
        """Chunks of ``xid`` that arrived before its REQ: to ``flow``, or discarded (flow None)."""
        early = conn.early.pop(xid, ())
        conn.n_early -= len(early)
        for seq_byte, probe in early:
            if flow is None or flow.dead:
                self.sink(probe)
            else:
                self._on_data(conn.local_id, xid, seq_byte, probe)

    def sink(self, probe) -> None:
        """Receive a probed message nobody wants into a throw-away buffer (UCX must consume it)."""
        buf = np.empty(max(probe.length, 1), dtype=np.uint8)
        try:
            self.recv_probed(buf, probe, lambda err, b=buf: None)
        except Exception:  # its endpoint is gone: nothing to consume
            pass

    # ---- slots and copies --------------------------------------------------------------------
    def pool(self, kind: str) -> StagingPool:
        if kind not in self._pools:
            s = self.settings.slot_count(kind)
            self._pools[kind] = StagingPool(kind, self.settings.slot_bytes(kind), s, send_cap=s - s // 2)
            self._want_rx[kind] = collections.deque()
            self._want_tx[kind] = collections.deque()
        return self._pools[kind]

    def want(self, flow) -> None:
        if not flow.queued and flow.wants_slot():
            flow.queued = True
            (self._want_tx if flow.sending else self._want_rx)[flow.pool.kind].append(flow)

    def _schedule(self) -> bool:
        """Give free slots to flows round-robin (one chunk per turn): receives first, then sends
        up to the pool's send cap (see the module docstring)."""
        busy = False
        for kind, pool in self._pools.items():
            for queue, sending in ((self._want_rx[kind], False), (self._want_tx[kind], True)):
                while queue and pool.free(sending):
                    flow = queue.popleft()
                    flow.queued = False
                    if not flow.wants_slot():
                        continue
                    flow.start_chunk(pool.take(flow, sending))
                    busy = True
                    self.want(flow)
        return busy

    def release(self, flow, slot) -> None:
        flow.pool.give(slot)
        flow.inflight -= 1
        if not flow.dead:
            self.want(flow)

    def copy_device(self, launch, done) -> None:
        """Queue a CUDA copy (``launch()`` returns its event) and call ``done(error or None)`` on
        this thread once the event completed: tracked like a UCX request (polled each loop turn)."""
        try:
            event = launch()
        except Exception as exc:  # reported to the transfer that asked for the copy
            done(exc)
            return
        self._dev_copies += 1

        def ended(err):
            self._dev_copies -= 1
            done(err)
        self.track(EventRequest(event), ended)

    @staticmethod
    def device_req(flow, cb):
        """``cb`` for a UCX request of ``flow`` on device memory: counted in flight until it ends."""
        flow.dev_reqs += 1

        def ended(err):
            flow.dev_reqs -= 1
            cb(err)
        return ended

    def _device_reqs(self) -> bool:
        """Whether a live flow has a UCX request on device memory in flight (a dropped flow's
        requests may wait on a frozen peer: they are not polled for)."""
        return any(f.dev_reqs for f in itertools.chain(self._flows.values(), self._targets.values()))

    def copy(self, fn, done, nbytes: int) -> None:
        """Run ``fn`` (a gather or scatter), then ``done(error or None)`` on this thread: right here
        for a small chunk, else on the copy thread (overlapping the wire)."""
        if nbytes > self.settings.inline_bytes:
            self._copier.submit(fn, lambda err: self.call_soon(done, err))
            return
        try:
            fn()
        except Exception as exc:  # reported to the transfer that asked for the copy
            done(exc)
            return
        done(None)

    def send_chunk(self, flow, chunk, slot) -> None:
        _, wire_view = slot.view(chunk.nbytes)
        if flow.conn.dead:
            flow.sent(slot, flow.conn.error)
            return
        cb = lambda err: flow.sent(slot, self._ucx_error(flow, err))  # noqa: E731
        self.tag_send(flow.conn, wire_view, wire.data_tag(flow.conn.remote_id, flow.xid, chunk.seq),
                      self.device_req(flow, cb) if slot.device else cb)

    def send_iov(self, flow, chunk, slot, iov: np.ndarray) -> None:
        """Send a chunk straight from the blocks (``iov``: their addresses in staging order)."""
        if flow.conn.dead or flow.conn.closed:  # a closed endpoint's handle may already be freed
            flow.sent(slot, flow.conn.error or PeerDisconnectedError(
                f"UCX endpoint to peer {flow.conn.name!r} closed; transfer {flow.tid or flow.key} reports no "
                f"block complete"))
            return
        tag = wire.data_tag(flow.conn.remote_id, flow.xid, chunk.seq)
        self.track(self.iov.send(flow.conn.ep.handle, iov, tag),
                   lambda err: flow.sent(slot, self._ucx_error(flow, err)))

    def recv_chunk(self, flow, chunk, slot, probe) -> None:
        flow.receiving += 1
        if flow.iov_rx:  # straight into the blocks (the slot only counts toward the pool's flow control)
            iov = flow.copier.iov(flow.ids[chunk.b0:chunk.b1], chunk.l0, chunk.l1)
            self.track(self.iov.recv_iov(self._worker_handle, probe.handle, iov),
                       lambda err: flow.landed_in_place(slot, self._ucx_error(flow, err)))
            return
        _, wire_view = slot.view(chunk.nbytes)
        cb = lambda err: flow.received(chunk, slot, self._ucx_error(flow, err))  # noqa: E731
        self.recv_probed(wire_view, probe, self.device_req(flow, cb) if slot.device else cb)

    def _ucx_error(self, flow, err):
        if err is None or isinstance(err, XferError):
            return err
        if flow.conn.error is not None:
            return flow.conn.error
        return PeerDisconnectedError(f"UCX failed a chunk of transfer {flow.tid or flow.key} with peer "
                                     f"{flow.conn.name!r}: {err}")

    # ---- ending flows ------------------------------------------------------------------------
    def landed(self, flow) -> None:
        self.proto.landed(flow)

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
            self.proto.send_ctrl(flow.conn, wire.Kind.CANCEL, {"k": flow.key, "init": flow.initiator,
                                                               "why": error_codec.encode(err)[0]})
        if flow.transfer is not None:
            flow.transfer.fail(err)

    def drop(self, flow) -> None:
        flow.dead = True
        if flow.initiator:
            self._flows.pop(flow.key, None)
        else:
            self._targets.pop((flow.conn.local_id, flow.key), None)
        flow.conn.flows.pop(id(flow), None)
        if not flow.sending:
            if self._rx.get((flow.conn.local_id, flow.xid)) is flow:
                del self._rx[(flow.conn.local_id, flow.xid)]
            while flow.pending:  # arrived, never received: consume them
                self.sink(flow.pending.popleft())

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for flow, until in list(self._held.items()):
            if now < until:
                continue
            if not flow.conn.dead:  # UCX then ends the receives (on a later progress)
                self.log.warning("ucx: in-place receives of failed transfer %s still running after %.1f s; "
                                 "closing the connection to %r to stop them", flow.tid or flow.key, HOLD_S,
                                 flow.conn.name)
                self._held[flow] = now + HOLD_S
                self.conn_failed(flow.conn, PeerDisconnectedError(
                    f"connection to {flow.conn.name!r} closed to stop the in-place receives of failed transfer "
                    f"{flow.tid or flow.key}"))
            else:  # closed and still not ended: report anyway rather than never (logged)
                self.log.error("ucx: UCX did not end the in-place receives of transfer %s after its connection "
                               "closed; reporting its failure anyway", flow.tid or flow.key)
                self.release_held(flow)
        for flow in [f for f in self._flows.values() if f.transfer.poll().terminal or now >= f.deadline]:
            self.fail(flow, flow.transfer.error or TransferTimeoutError(
                f"transfer {flow.tid} reached its deadline ({self._progress(flow)})"))
        for flow in [f for f in self._targets.values() if now >= f.deadline]:
            self.fail(flow, TransferTimeoutError(f"incoming transfer {flow.tid} from {flow.peer_name!r} reached "
                                                 f"its deadline ({self._progress(flow)}); dropped, no notification "
                                                 f"delivered"))

    def _progress(self, flow) -> str:
        """Where a flow stands, for its timeout message."""
        pool, n = flow.pool, len(flow.chunks)
        what = (f"{flow.finished_chunks}/{n} chunks sent, {flow.inflight} in flight" if flow.sending else
                f"{flow.arrived}/{n} chunks arrived, {flow.finished_chunks} landed, {flow.inflight} in flight")
        return f"{what}; staging slots free {len(pool)}/{pool.count}, held by sends {pool.sends}"

    def conn_failed(self, conn: Conn, err: Exception) -> None:
        if conn.dead:
            return
        conn.dead, conn.error = True, err
        self._conns.pop(conn.local_id, None)
        if self._out.get(conn.agent_id) is conn:
            del self._out[conn.agent_id]
        for flow in list(conn.flows.values()):
            self.fail(flow, err, notify_peer=False)
        for xid in list(conn.early):
            self.adopt_early(conn, xid, None)
        conn.waiting = []
        conn.ctrl_in.clear()
        if conn.ep is not None and conn.ep.alive:  # UCX closes a failed endpoint itself (closing it twice crashes)
            try:
                conn.ep.close()
            except Exception:
                pass

    def _fail_all(self, err: Exception) -> None:
        for conn in list(self._conns.values()):
            self.conn_failed(conn, err)
        for flow in list(self._flows.values()):
            self.fail(flow, err, notify_peer=False)

    def _begin_close(self) -> None:
        self._fail_all(TransportError(f"ucx transport of agent {self.ctx.agent_name!r} closed"))
        self._closing = True
        for q in itertools.chain(self._want_rx.values(), self._want_tx.values()):
            q.clear()
        self.proto.close()
        if self._reqs:  # give UCX a moment to complete what the closed endpoints failed
            end = time.monotonic() + 2.0
            while self._reqs and time.monotonic() < end:
                self.worker.progress_worker_event(10)
                self._check_reqs()
            for req, cb in self._reqs:
                if hasattr(req, "abandon"):  # an IOV send UCX may still read from: keep what it reads
                    req.abandon(cb)
            self._reqs = []
        for flow in list(self._held):  # the engine stops here: every transfer still ends
            self.release_held(flow)

    def _teardown(self) -> None:
        fd, self._wake_w = self._wake_r, -1  # a late call_soon writes to no fd (not a reused one)
        os.close(fd)
        self._epoll.close()
        self.listener = None
        self.proto = None
        self._conns.clear()
        self._out.clear()
        self.worker = None
        self.context = None

