"""The UCX engine: one thread owns the ucxx worker and drives every connection and flow.

Progress model: the worker runs in UCX's blocking mode. The thread drains ``progress_once``,
handles what completed, then arms the worker and sleeps in ``epoll`` on the worker's event fd
and a wake pipe (posts, copy completions, cancellations) until something happens or the nearest
deadline. No busy polling: an idle agent costs nothing, a busy one wakes once per event.
All UCX calls happen on this thread.
"""

from __future__ import annotations

import collections
import itertools
import os
import select
import threading
import time

import numpy as np

from .. import errors
from ..errors import PeerDisconnectedError, TransferTimeoutError, TransportError, XferError
from ..transfer import TransferState
from . import ucx_wire as wire
from .ucx_conn import Conn
from .ucx_stage import Copier, StagingPool

__all__ = ["Engine", "error_class"]

GRAVE_S = 30.0  # how long a dropped transfer's late chunks are drained


class Engine:
    def __init__(self, ctx, settings: wire.UcxSettings, ucx):
        self.ctx, self.settings, self.ucx = ctx, settings, ucx
        self.log = ctx.log
        u = ucx.libucxx
        self.u = u
        self.context = u.UCXContext(settings.context_options(),
                                    feature_flags=(u.Feature.TAG, u.Feature.WAKEUP, u.Feature.STREAM))
        self.worker = u.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self._conn_requests: list = []
        self.listener = u.UCXListener.create(self.worker, settings.port, self._conn_requests.append)
        self.port = self.listener.port
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._inbox: collections.deque = collections.deque()
        self._reqs: list = []  # (ucxx request, callback(err)) until completed
        self._conns: dict[int, Conn] = {}  # local id -> conn
        self._out: dict[str, Conn] = {}  # peer agent id -> our outgoing conn
        self._ids = itertools.count(1)
        self._xids = itertools.count(1)
        self._keys = itertools.count(1)
        self._flows: dict[int, object] = {}  # key -> initiator flow
        self._targets: dict[tuple[int, int], object] = {}  # (conn local id, key) -> target flow
        self._pools: dict[str, StagingPool] = {}
        self._want: dict[str, collections.deque] = {}
        self._grave: dict[tuple[int, int], float] = {}  # (conn local id, xid) -> drain until
        self._closing = False
        self._sleeping = False
        self._copier = Copier(f"xfer-ucx-copy-{ctx.agent_name}")
        from .ucx_proto import Protocol  # the control messages
        self.proto = Protocol(self)
        self._thread = threading.Thread(target=self._run, name=f"xfer-ucx-{ctx.agent_name}", daemon=True)
        self._thread.start()

    # ---- cross-thread entry points -----------------------------------------------------------
    def call_soon(self, fn, *args) -> None:
        self._inbox.append((fn, args))
        if not self._sleeping:  # awake: it reads the inbox before it sleeps (no syscall, no GIL ping-pong)
            return
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the engine is awake anyway

    def close(self) -> None:
        if self._closing:
            return
        self.call_soon(self._begin_close)
        self._thread.join(timeout=15)
        self._copier.close()

    # ---- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not (self._closing and not self._reqs_pending()):
                busy = self._step()
                if busy:
                    continue
                self._sleeping = True  # set before the last look at the inbox: no lost wake-up
                if not self._inbox and self.worker.arm():
                    for fd, _ in self._epoll.poll(self._timeout()):
                        if fd == self._wake_r:
                            try:
                                while os.read(self._wake_r, 4096):
                                    pass
                            except BlockingIOError:
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
        busy |= self.proto.probe()
        busy |= self._check_reqs()
        busy |= self._schedule()
        self._check_deadlines()
        if self._grave:
            busy |= self._drain_grave()
        return busy

    def _timeout(self) -> float:
        now, t = time.monotonic(), (0.05 if self._grave else 1.0)
        for flow in itertools.chain(self._flows.values(), self._targets.values()):
            t = min(t, flow.deadline - now)
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
        self.track(conn.ep.tag_send(self.ucx.Array(buf), self.u.UCXXTag(tag)), cb)

    def tag_recv(self, buf, tag: int, cb) -> None:
        self.track(self.worker.tag_recv(self.ucx.Array(buf), self.u.UCXXTag(tag)), cb)

    # ---- slots and copies --------------------------------------------------------------------
    def pool(self, kind: str) -> StagingPool:
        if kind not in self._pools:
            self._pools[kind] = StagingPool(kind, self.settings.chunk_bytes, self.settings.slots)
            self._want[kind] = collections.deque()
        return self._pools[kind]

    def want(self, flow) -> None:
        if flow.wants_slot():
            self._want[flow.pool.kind].append(flow)

    def _schedule(self) -> bool:
        """Give free slots to flows round-robin (one chunk per turn)."""
        busy = False
        for kind, queue in self._want.items():
            pool = self._pools[kind]
            while queue and len(pool):
                flow = queue.popleft()
                if not flow.wants_slot():
                    continue
                flow.start_chunk(pool.take(flow))
                busy = True
                if flow.wants_slot():
                    queue.append(flow)
        return busy

    def release(self, flow, slot) -> None:
        flow.pool.give(slot)
        flow.inflight -= 1
        if not flow.dead and flow.wants_slot() and flow not in self._want[flow.pool.kind]:
            self._want[flow.pool.kind].append(flow)

    def copy(self, fn, done) -> None:
        self._copier.submit(fn, lambda err: self.call_soon(done, err))

    def send_chunk(self, flow, chunk, slot) -> None:
        _, wire_view = slot.view(chunk.nbytes)
        if flow.conn.dead:
            flow.sent(slot, flow.conn.error)
            return
        self.tag_send(flow.conn, wire_view, wire.data_tag(flow.conn.remote_id, flow.xid, chunk.seq),
                      lambda err: flow.sent(slot, self._ucx_error(flow, err)))

    def recv_chunk(self, flow, chunk, slot) -> None:
        _, wire_view = slot.view(chunk.nbytes)
        flow.posted.add(chunk.seq)
        self.tag_recv(wire_view, wire.data_tag(flow.conn.local_id, flow.xid, chunk.seq),
                      lambda err: flow.received(chunk, slot, self._ucx_error(flow, err)))

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
        """Drop ``flow``: its transfer ends with ``err``; the peer is told; late chunks are drained."""
        if flow.dead:
            return
        if not isinstance(err, XferError):
            err = TransportError(f"ucx transfer failed: {err!r}")
        self.drop(flow)
        if notify_peer and not flow.conn.dead and flow.conn.ready:
            self.proto.send_ctrl(flow.conn, wire.Kind.CANCEL, {"k": flow.key, "init": flow.initiator,
                                                               "why": type(err).__name__})
        if flow.transfer is not None:
            state = TransferState.TIMED_OUT if isinstance(err, TransferTimeoutError) else TransferState.FAILED
            flow.transfer._finish(state, err)

    def drop(self, flow) -> None:
        flow.dead = True
        if flow.initiator:
            self._flows.pop(flow.key, None)
        else:
            self._targets.pop((flow.conn.local_id, flow.key), None)
        flow.conn.flows.pop(id(flow), None)
        for _, slot in flow.ready:
            self.release(flow, slot)
        flow.ready = []
        if not flow.sending and flow.xid:
            if not flow.conn.dead:
                self._grave[(flow.conn.local_id, flow.xid)] = time.monotonic() + GRAVE_S
            self._unpost(flow)

    def _unpost(self, flow) -> None:
        """Complete this flow's posted receives with empty messages sent to ourselves (UCX tag
        receives belong to the worker, not to an endpoint: a dead peer does not end them)."""
        for seq in flow.posted:
            self.proto.self_send(wire.data_tag(flow.conn.local_id, flow.xid, seq))
        flow.posted = set()

    def _drain_grave(self) -> bool:
        now, busy = time.monotonic(), False
        for (conn_id, xid), until in list(self._grave.items()):
            if now > until or conn_id not in self._conns:
                del self._grave[(conn_id, xid)]
                continue
            probe = self.worker.tag_probe(self.u.UCXXTag(wire.data_tag(conn_id, xid, 0)),
                                          self.u.UCXXTagMask(0xFFFFFFFFFFFFFF00), remove=True)
            if probe.matched:
                sink = np.empty(max(probe.length, 1), dtype=np.uint8)
                self.track(self.worker.tag_recv_with_handle(self.ucx.Array(sink), probe), lambda err, s=sink: None)
                busy = True
        return busy

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for flow in [f for f in self._flows.values() if f.transfer.poll().terminal or now >= f.deadline]:
            self.fail(flow, flow.transfer.error or TransferTimeoutError(
                f"transfer {flow.tid} reached its deadline"))
        for flow in [f for f in self._targets.values() if now >= f.deadline]:
            self.fail(flow, TransferTimeoutError(f"incoming transfer {flow.tid} from {flow.peer_name!r} reached "
                                                 f"its deadline; dropped, no notification delivered"))

    def conn_failed(self, conn: Conn, err: Exception) -> None:
        if conn.dead:
            return
        conn.dead, conn.error = True, err
        self._conns.pop(conn.local_id, None)
        if self._out.get(conn.agent_id) is conn:
            del self._out[conn.agent_id]
        for flow in list(conn.flows.values()):
            self.fail(flow, err, notify_peer=False)
        conn.waiting = []
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
        self._want.clear()
        self.proto.close()
        if self._reqs:  # give UCX a moment to complete what the closed endpoints failed
            end = time.monotonic() + 2.0
            while self._reqs and time.monotonic() < end:
                self.worker.progress_worker_event(10)
                self._check_reqs()
            self._reqs = []

    def _teardown(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._epoll.close()
        self.listener = None
        self.proto = None
        self._conns.clear()
        self._out.clear()
        self.worker = None
        self.context = None


def error_class(name) -> type:
    cls = getattr(errors, name, None) if isinstance(name, str) and name in errors.__all__ else None
    return cls if isinstance(cls, type) and issubclass(cls, errors.XferError) else errors.TransportError

