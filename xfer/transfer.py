"""Transfer handles and notifications.

A :class:`Transfer` always ends: DONE, or FAILED / CANCELLED / TIMED_OUT with a typed error.
Its end is a *fence*: it reads a terminal state only once none of its bytes can land any more in
memory this agent owns (see :class:`Transfer` for the promise and its bound per transport).
``cancel()`` and the deadline only *start* a stop: the transfer reads STOPPING until its transport
fenced it. The deadline is enforced by whoever looks at it (``poll`` and ``wait``) and by the
transport, so a transfer nobody drives still starts its stop once its deadline has passed.

Transports drive a transfer through four calls only: ``begin`` (it runs), ``mark`` (a phase it
reached), and exactly one of ``complete`` (every byte landed and the peer acknowledged) or
``fail(exc)`` (its flow ended without that), made once none of its bytes can land any more, also
after a stop began (the caller cancelled, the deadline passed): the transport's report that it
has fenced the transfer. ``stop(exc)`` starts a stop from outside the caller (the agent
closing). :func:`state_for` is the one place an exception is mapped to a state.
"""

from __future__ import annotations

import _thread
import enum
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import (AgentClosedError, FenceTimeoutError, TransferCancelledError, TransferTimeoutError, TransportError,
                     XferError)

__all__ = ["TransferState", "Transfer", "Notification", "Op", "state_for"]

_ids = itertools.count(1)
# ids read "<counter>-<this process's start>": unique across restarts of an agent, one call to make
_EPOCH = f"{time.time_ns() & 0xFFFFFFFF:08x}"


class TransferState(enum.IntEnum):
    """Ordered so that ``min`` over ranks gives the state all agree on (FAILED lowest): the ended
    failures, then STOPPING (ending without success, not fenced yet), then the live states.
    Terminal: FAILED, TIMED_OUT, CANCELLED, DONE."""

    FAILED = 0
    TIMED_OUT = 1
    CANCELLED = 2
    STOPPING = 3
    QUEUED = 4
    RUNNING = 5
    DONE = 6

    @property
    def terminal(self) -> bool:
        return self <= 2 or self == 6


def state_for(exc: BaseException) -> "TransferState":
    """The terminal state a transfer that ended with ``exc`` reads: its deadline (TIMED_OUT), a
    cancel or the agent closing (CANCELLED), anything else (FAILED)."""
    if isinstance(exc, TransferTimeoutError):
        return TransferState.TIMED_OUT
    if isinstance(exc, (TransferCancelledError, AgentClosedError)):
        return TransferState.CANCELLED
    return TransferState.FAILED


class Op(enum.Enum):
    WRITE = "write"  # local blocks -> peer blocks (push)
    READ = "read"  # peer blocks -> local blocks (pull)
    MESSAGE = "message"  # no blocks: a payload only (Agent.send)


class Transfer:
    """Handle of one posted block-list transfer.

    ``nbytes`` is the payload (all layers and K/V of every block). ``path`` names the transport
    that carries it and why it was chosen. ``copy_path`` names what moved the bytes where the
    transport says (``xfer.kernels.CopyPath`` values: ``triton``, ``copy_engine_batch``,
    ``copy_engine_2d``, ...), else None.

    **The end is a fence.** A transfer reads a terminal state (DONE, CANCELLED, TIMED_OUT,
    FAILED) only once none of its bytes can land any more in memory this agent owns (a READ's
    destination blocks; a WRITE's source blocks are no longer read), and a peer is never notified
    of a transfer that reads anything but DONE. ``cancel()`` and the deadline *start* a stop: the
    transfer reads STOPPING (``error`` already names why) until the transport fenced it, then
    CANCELLED / TIMED_OUT (or DONE, when it completed before the stop reached it: the peer had
    landed every byte and been notified; or FAILED where the agent closed). Free or reuse the
    blocks once ``wait()`` returned or raised, or ``poll()`` reads a terminal state; never on
    STOPPING. How long a stop takes, per transport (the *fence bound*):

    - ``local`` (host copies): the copy chunk in flight (``AgentConfig.chunk_bytes``; the copy
      checks between chunks), then one notice to the peer closing its grant;
    - ``ipc`` / ``nvshmem``: the copy kernels already queued on the stream;
    - ``ucx``: the peer's confirmation that it dropped the transfer (one round trip, plus the
      chunk it was landing), or, when none comes within ``settings.fence.grace_s``
      (``XFER_FENCE_GRACE_S``), the connection closed and UCX's receives ended; a stop ended by
      that close is reported no earlier than the transfer's deadline, after which the peer lands
      and delivers nothing of it (it judges a request's age by its send time).

    So "ends by its deadline" reads "ends by its deadline plus the fence bound". ``wait()`` waits
    until ``deadline + settings.fence.bound_s`` (``XFER_FENCE_BOUND_S``) at most; a transfer
    still STOPPING then makes it raise :class:`~xfer.errors.FenceTimeoutError`: its blocks may
    still be written, keep them quarantined.
    """

    __slots__ = ("_n", "peer", "op", "num_blocks", "nbytes", "path", "copy_path", "deadline", "created",
                 "finished", "stopped_at", "fence_s", "_state", "_error", "_lock", "_latch", "_on_cancel",
                 "_keepalive", "_observer", "marks", "assist")

    def __init__(self, *, peer: str, op: Op, num_blocks: int, nbytes: int, path: str, timeout: float,
                 observer=None, fence_s: float = 5.0):
        # every line here is a cost of each post, on a core whose caches are usually cold: the id
        # string is made when first read (on the transport's thread), the rest set in few statements
        self._n = next(_ids)
        self.peer, self.op, self.num_blocks, self.nbytes, self.path = peer, op, num_blocks, nbytes, path
        self.created = now = time.monotonic()
        self.deadline = now + timeout
        self.fence_s = fence_s  # how long past the deadline wait() waits for a stop to be fenced
        self._state = TransferState.QUEUED
        # state changes under a plain lock; waiters block on a latch (a lock held until the end)
        # made by the first of them (a Condition cost ~40 us of a cold post: an RLock, its bound
        # methods, a waiter deque; most transfers are waited on once, or polled)
        self._lock = _thread.allocate_lock()
        self.copy_path = self.finished = self.stopped_at = self._error = self._latch = self._on_cancel = \
            self._keepalive = None
        self._observer = observer  # called once with the transfer when it ends (metrics, logs)
        self.marks: list[tuple[str, float]] = []  # (phase, time.monotonic()) the transport reached
        # (transport side) run by the first wait() that blocks with no timeout of its own, in the
        # caller's thread, before it blocks: the transport may finish the transfer there
        self.assist = None

    @property
    def id(self) -> str:
        """``<counter>-<process start>``, unique across restarts of an agent."""
        return f"{self._n:x}-{_EPOCH}"

    def __repr__(self) -> str:
        return (f"Transfer(id={self.id}, {self.op.value} {self.num_blocks} blocks {self.nbytes} B "
                f"peer={self.peer!r}, state={self._state.name}, path={self.path})")

    # ---- caller side -------------------------------------------------------------------------
    def poll(self) -> TransferState:
        """Current state; a transfer past its deadline starts its stop (STOPPING, then TIMED_OUT)."""
        state = self._state
        if state > 3 and state != 6 and time.monotonic() >= self.deadline:  # QUEUED or RUNNING
            self._expire()
            state = self._state
        return state

    def done(self) -> bool:
        """True once the transfer ended (and is fenced), successfully or not (see ``poll``/``error``)."""
        return self.poll().terminal

    @property
    def error(self) -> XferError | None:
        """Why it ended (or, while STOPPING, why it is stopping); None for DONE."""
        return self._error

    @property
    def elapsed(self) -> float:
        return (self.finished or time.monotonic()) - self.created

    @property
    def fence_time(self) -> float | None:
        """Seconds from the start of its stop (cancel, deadline, agent closed) to its terminal
        state: how long the fence took; None where no stop began (or it has not ended yet)."""
        if self.stopped_at is None or self.finished is None:
            return None
        return self.finished - self.stopped_at

    def timeline(self) -> dict[str, float]:
        """Seconds from ``created`` to each phase the transport marked (e.g. ``started``,
        ``launched``, ``copied``, ``acked``), to ``stopping`` and to ``finished``: where a
        transfer's time went."""
        out = {name: t - self.created for name, t in self.marks}
        if self.stopped_at is not None:
            out["stopping"] = self.stopped_at - self.created
        if self.finished is not None:
            out["finished"] = self.finished - self.created
        return out

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until the transfer ended; return ``TransferState.DONE`` when it succeeded, raise its
        typed error otherwise (:class:`TransferTimeoutError`, :class:`TransferCancelledError`, ...).
        It returns or raises the transfer's outcome only at a terminal state: the fence held.

        ``timeout`` bounds this wait only (a transfer still RUNNING or STOPPING then raises
        :class:`TransferTimeoutError` saying so: it has not ended, its blocks are not free). The
        transfer's own deadline always applies: when it passes the stop starts, and the wait goes
        on until the fence, ``fence_s`` past the deadline at most, then raises
        :class:`FenceTimeoutError` (still STOPPING: keep its blocks quarantined).
        """
        assist = self.assist
        if assist is not None and timeout is None and not self._state.terminal:
            self.assist = None  # once: a second waiter waits on the latch
            assist(self)  # returns once the transfer ended, or leaves it to the transport's thread
        end = self.deadline + self.fence_s
        limit = end if timeout is None else min(end, time.monotonic() + timeout)
        with self._lock:
            latch = self._latch
            if latch is None and not self._state.terminal:
                latch = self._latch = _thread.allocate_lock()
                latch.acquire()  # released once by _finish
        while latch is not None:
            now = time.monotonic()
            # wake at the deadline (to start the stop) unless the stop already began
            until = limit if self._state == 3 or now >= self.deadline else min(limit, self.deadline)
            if until - now > 0 and latch.acquire(timeout=until - now):
                latch.release()  # the next waiter's turn (a latch once released stays open)
                break
            if self.poll().terminal or time.monotonic() >= limit:
                break
        state = self.poll()
        if state is TransferState.DONE:
            return state
        if state.terminal:
            raise self._error
        if time.monotonic() >= end:
            raise FenceTimeoutError(f"transfer {self.id} is still STOPPING {time.monotonic() - self.deadline:.3f} s "
                                    f"past its deadline ({self._error}): its blocks may still be written, keep them "
                                    f"quarantined")
        raise TransferTimeoutError(f"transfer {self.id} still {state.name} after waiting {timeout:.3f} s "
                                   f"(its deadline is {self.deadline - time.monotonic():.3f} s away); it has not "
                                   f"ended: its blocks are not free")

    def cancel(self) -> bool:
        """Start stopping the transfer: True if this call started a stop (it had not ended and no
        stop had begun). It then reads STOPPING until the transport fenced it, then CANCELLED (or
        DONE, where it completed first); ``wait()`` returns at that point."""
        return self.stop(TransferCancelledError(f"transfer {self.id} was cancelled by the caller"))

    # ---- transport side ----------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """True once a stop began and the transfer has not ended yet (STOPPING)."""
        return self._state == 3

    @property
    def cancel_requested(self) -> bool:
        """Transports check this between chunks: true once a stop began (cancel, deadline, agent
        closed) or the transfer ended; the deadline passing starts the stop."""
        state = self._state
        if state > 3 and state != 6:
            if time.monotonic() < self.deadline:
                return False
            self._expire()
        return True

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def begin(self, on_cancel=None, keepalive=None) -> None:
        """The transport took the transfer: QUEUED -> RUNNING. ``on_cancel(transfer)`` is called once
        when a stop begins (cancel, deadline, agent closed): the transport's cue to stop its flow
        and fence it (then ``fail``); called at once when the stop began before this call.
        ``keepalive`` is held until the end."""
        with self._lock:
            if self._state is TransferState.QUEUED:
                self._state = TransferState.RUNNING
            stopping = self._state == 3
            self._on_cancel, self._keepalive = (None if stopping else on_cancel), keepalive
        if stopping and on_cancel is not None:
            on_cancel(self)

    def mark(self, phase: str) -> None:
        """Record that the transfer reached ``phase`` now (see :meth:`timeline`)."""
        self.marks.append((phase, time.monotonic()))

    def complete(self) -> bool:
        """Every byte landed and the peer acknowledged (it was notified): DONE, also where a stop
        had begun. False if it had already ended."""
        return self._finish(TransferState.DONE)

    def fail(self, exc: BaseException) -> bool:
        """The transport's flow ended without completing, with ``exc``, and is fenced: the state
        :func:`state_for` names (an exception that is not an XferError is reported as a
        TransportError). Where a stop had begun, the stop's cause stands (CANCELLED, TIMED_OUT).
        False if the transfer had already ended (its first ending stands)."""
        if not isinstance(exc, XferError):
            exc = TransportError(f"transfer {self.id} failed: {exc!r}")
        with self._lock:
            if self._state == 3:
                exc = self._error
        return self._finish(state_for(exc), exc)

    def stop(self, exc: XferError) -> bool:
        """Start a stop whose outcome is ``state_for(exc)`` (the caller's cancel, the deadline, the
        agent closing): STOPPING, and the transport's ``on_cancel`` hook runs. True if this call
        started it; False if a stop had begun or the transfer had ended."""
        with self._lock:
            if self._state.terminal or self._state == 3:
                return False
            self._state, self._error = TransferState.STOPPING, exc
            self.stopped_at = time.monotonic()
            on_cancel, self._on_cancel = self._on_cancel, None
        if on_cancel is not None:
            on_cancel(self)
        return True

    def _expire(self) -> None:
        self.stop(TransferTimeoutError(
            f"transfer {self.id} ({self.op.value} {self.num_blocks} blocks to {self.peer!r}) "
            f"reached its deadline of {self.deadline - self.created:.3f} s and was stopped"))

    def _finish(self, state: TransferState, error: XferError | None = None) -> bool:
        """Move to a terminal state once; later calls lose. Returns True if this call won."""
        with self._lock:
            if self._state.terminal:
                return False
            self._state, self._error = state, error
            self.finished = time.monotonic()
            self._on_cancel, self._keepalive, self.assist = None, None, None
            latch = self._latch
        if latch is not None:
            latch.release()
        if self._observer is not None:
            self._observer(self)
        return True


@dataclass(frozen=True)
class Notification:
    """Delivered to the passive side once a peer's transfer into (or out of) its blocks ended.

    ``blocks`` are this agent's block ids the transfer wrote (op WRITE) or read (op READ);
    ``payload`` is the initiator's opaque notification bytes.
    """

    peer: str
    transfer_id: str
    op: Op
    region: str
    blocks: np.ndarray = field(repr=False)
    payload: bytes = b""
    received: float = field(default_factory=time.monotonic)
