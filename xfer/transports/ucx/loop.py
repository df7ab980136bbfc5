"""The UCX engine: one thread owns the ucxx worker and drives every connection and flow.

Progress model: the worker runs in UCX's blocking mode. The thread drains ``progress_once``,
handles what completed, then arms the worker and sleeps in ``epoll`` on the worker's event fd
and a wake eventfd (posts, copy completions, cancellations) until something happens or the
nearest deadline. No busy polling on host memory: an idle agent costs nothing, a busy one wakes
once per event. Device work is the exception: a CUDA event and a ``cuda_ipc`` completion wake no
fd, so while a device copy or a live flow's device UCX request is in flight the loop polls
(yielding the GIL each turn, napping 50 us after 1 ms without progress). All UCX calls happen on
this thread.

The engine's parts, each one file: the I/O back end, chosen once (``io_raw``: raw libucp calls
that can move host chunks in place; else ``io_ucxx``), the tables of connections and flows
(``tables``), the staging slots and why they cannot deadlock (``slots``), the data path
(``datapath``: arrivals and chunk I/O) and the control protocol (``protocol``).
"""

from __future__ import annotations

import collections
import ctypes
import os
import select
import threading
import time

from ...errors import TransportError
from . import wire
from .datapath import DataPath
from .io_raw import RawIO, iov_sender
from .io_ucxx import UcxxIO
from .listener import make_listener
from .protocol import Protocol
from .slots import Slots
from .staging import Copier
from .tables import Connections, Flows

__all__ = ["Engine", "choose_io"]


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


def choose_io(ucx, worker, settings):
    """(the I/O back end, why the raw one is not used or None): raw libucp calls where they can
    be bound and ``settings.iov`` is on (host chunks then move in place), else ucxx's API."""
    ucxx = UcxxIO(ucx, worker)
    if not settings.iov:
        return ucxx, "XFER_UCX_IOV=0"
    binding, why = iov_sender()
    if binding is None:
        return ucxx, why
    return RawIO(binding, worker, ucxx, receives_in_place=settings.iov_recv), None


class Engine:
    """The thread, its worker and listener; ``conns``, ``flows``, ``slots``, ``data``, ``proto``
    are its parts (see the module doc)."""

    def __init__(self, ctx, settings, ucx):
        self.ctx, self.settings, self.ucx = ctx, settings, ucx
        self.log = ctx.log
        u = ucx.libucxx
        self.u = u
        self.context = u.UCXContext(settings.context_options(),
                                    feature_flags=(u.Feature.TAG, u.Feature.WAKEUP, u.Feature.STREAM))
        self.worker = u.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self._conn_requests: list = []
        # bound to listen_host through raw libucp (ucxx's own listener takes every interface): listener.py
        self.listener, why = make_listener(ucx, self.worker, iov_sender()[0], ctx.config.listen_host, settings.port,
                                           self._conn_requests.append)
        if why is not None:
            self.log.warning("xfer ucx: the UCX listener of %s listens on every interface (port %d): %s; firewall it "
                             "(docs/security.md)", ctx.agent_name, self.listener.port, why)
        self.port = self.listener.port
        self._epoll = select.epoll()
        # posts wake the loop through an eventfd: one 8-byte write, one read resets it (a pipe took
        # a read more, ending in EAGAIN, on each wake-up)
        self._wake_r = self._wake_w = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._inbox: collections.deque = collections.deque()
        self._reqs: list = []  # (request, callback(err)) until completed
        # device work in flight: copies queued on a CUDA stream (tracked as requests, counted here)
        # and UCX requests on device memory (counted on their flows). Neither wakes the worker's fd
        # (a CUDA event has none; cuda_ipc completes inside progress): the loop polls meanwhile
        self._dev_copies = 0
        self._closing = False
        self._sleeping = False
        self._copier = Copier(f"xfer-ucx-copy-{ctx.agent_name}")
        self.io, self.io_why = choose_io(ucx, self.worker, settings)
        self.conns, self.slots = Connections(self), Slots(settings)
        self.flows = Flows(self, ctx.config.settings.fence.grace_s)
        self.data = DataPath(self, self.io)
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
            while not (self._closing and not self._reqs):
                busy = self._step()
                if busy:
                    idle_since = None
                    continue
                if self._dev_copies or self.flows.device_reqs():  # see __init__; bounded by the flows' deadlines
                    now = time.monotonic()
                    idle_since = idle_since or now
                    # sleep(0) lets other threads take the GIL; past 1 ms with nothing done (a copy
                    # waiting on the caller's stream, a slow peer) 50 us naps keep a core free
                    time.sleep(0 if now - idle_since < 1e-3 else 5e-5)
                    continue
                idle_since = None
                self._sleeping = True  # set before the last look at the inbox: no lost wake-up
                if not self._inbox and self.worker.arm():
                    for fd, _ in self._epoll.poll(max(self.flows.nearest(time.monotonic(), 1.0), 0.0)):
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
        busy |= self.data.take()
        busy |= self._check_reqs()
        busy |= self.slots.schedule()
        self.flows.expire(time.monotonic())
        return busy

    # ---- requests and copies -----------------------------------------------------------------
    def track(self, req, cb) -> None:
        """Poll ``req`` (``completed``, ``check_error()``) each loop turn; ``cb(error or None)`` once done."""
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
            cb(wire.request_error(req))
        return True

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

    # ---- stopping ----------------------------------------------------------------------------
    def _fail_all(self, err: Exception) -> None:
        self.conns.fail_all(err)
        self.flows.fail_initiators(err)

    def _begin_close(self) -> None:
        self._fail_all(TransportError(f"ucx transport of agent {self.ctx.agent_name!r} closed"))
        self._closing = True
        self.slots.clear_queues()
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
        # the engine stops here (no progress from now on, so nothing lands later): every transfer ends
        self.flows.release_all(TransportError(f"ucx transport of agent {self.ctx.agent_name!r} closed"))

    def _teardown(self) -> None:
        fd, self._wake_w = self._wake_r, -1  # a late call_soon writes to no fd (not a reused one)
        os.close(fd)
        self._epoll.close()
        self.listener.close()  # before the worker goes (raw endpoints and listener live on it)
        self.listener = None
        self.proto = None
        self.conns.clear()
        self.worker = None
        self.context = None
