"""Transfer handles and notifications.

A :class:`Transfer` always ends: DONE, or FAILED / CANCELLED / TIMED_OUT with a typed error.
Its deadline is enforced by whoever looks at it (``poll`` and ``wait``) and by the transport
between chunks, so a transfer nobody drives still reads TIMED_OUT once its deadline has passed.

Transports drive a transfer through four calls only: ``begin`` (it runs), ``mark`` (a phase it
reached), and exactly one of ``complete`` (every byte landed and the peer acknowledged) or
``fail(exc)`` (its flow ended without that), made once none of its bytes can land any more,
even when the transfer already reads terminal (the caller cancelled, the deadline passed): the
transport's report that it has fenced the transfer. :func:`state_for` is the one place an
exception is mapped to a state.
"""

from __future__ import annotations

import _thread
import enum
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import AgentClosedError, TransferCancelledError, TransferTimeoutError, TransportError, XferError

__all__ = ["TransferState", "Transfer", "Notification", "Op", "state_for"]

_ids = itertools.count(1)
# ids read "<counter>-<this process's start>": unique across restarts of an agent, one call to make
_EPOCH = f"{time.time_ns() & 0xFFFFFFFF:08x}"


class TransferState(enum.IntEnum):
    """Ordered so that ``min`` over ranks gives the state all agree on (FAILED lowest)."""

    FAILED = 0
    TIMED_OUT = 1
    CANCELLED = 2
    QUEUED = 3
    RUNNING = 4
    DONE = 5

    @property
    def terminal(self) -> bool:
        return self not in (TransferState.QUEUED, TransferState.RUNNING)


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
    """

    __slots__ = ("_n", "peer", "op", "num_blocks", "nbytes", "path", "copy_path", "deadline", "created",
                 "finished", "_state", "_error", "_lock", "_latch", "_on_cancel", "_keepalive", "_observer",
                 "marks")

    def __init__(self, *, peer: str, op: Op, num_blocks: int, nbytes: int, path: str, timeout: float,
                 observer=None):
        # every line here is a cost of each post, on a core whose caches are usually cold: the id
        # string is made when first read (on the transport's thread), the rest set in few statements
        self._n = next(_ids)
        self.peer, self.op, self.num_blocks, self.nbytes, self.path = peer, op, num_blocks, nbytes, path
        self.created = now = time.monotonic()
        self.deadline = now + timeout
        self._state = TransferState.QUEUED
        # state changes under a plain lock; waiters block on a latch (a lock held until the end)
        # made by the first of them (a Condition cost ~40 us of a cold post: an RLock, its bound
        # methods, a waiter deque; most transfers are waited on once, or polled)
        self._lock = _thread.allocate_lock()
        self.copy_path = self.finished = self._error = self._latch = self._on_cancel = self._keepalive = None
        self._observer = observer  # called once with the transfer when it ends (metrics, logs)
        self.marks: list[tuple[str, float]] = []  # (phase, time.monotonic()) the transport reached

    @property
    def id(self) -> str:
        """``<counter>-<process start>``, unique across restarts of an agent."""
        return f"{self._n:x}-{_EPOCH}"

    def __repr__(self) -> str:
        return (f"Transfer(id={self.id}, {self.op.value} {self.num_blocks} blocks {self.nbytes} B "
                f"peer={self.peer!r}, state={self._state.name}, path={self.path})")

    # ---- caller side -------------------------------------------------------------------------
    def poll(self) -> TransferState:
        """Current state; a transfer past its deadline is cancelled and reads TIMED_OUT."""
        if not self._state.terminal and time.monotonic() >= self.deadline:
            self._expire()
        return self._state

    def done(self) -> bool:
        """True once the transfer ended, successfully or not (see ``poll``/``error``)."""
        return self.poll().terminal

    @property
    def error(self) -> XferError | None:
        return self._error

    @property
    def elapsed(self) -> float:
        return (self.finished or time.monotonic()) - self.created

    def timeline(self) -> dict[str, float]:
        """Seconds from ``created`` to each phase the transport marked (e.g. ``started``,
        ``launched``, ``copied``, ``acked``) and to ``finished``: where a transfer's time went."""
        out = {name: t - self.created for name, t in self.marks}
        if self.finished is not None:
            out["finished"] = self.finished - self.created
        return out

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until the transfer ended; return ``TransferState.DONE`` when it succeeded, raise its
        typed error otherwise (:class:`TransferTimeoutError`, :class:`TransferCancelledError`, ...).

        ``timeout`` bounds this wait only; the transfer's own deadline always applies, and when
        it passes the transfer is cancelled and :class:`TransferTimeoutError` is raised.
        """
        limit = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        with self._lock:
            latch = self._latch
            if latch is None and not self._state.terminal:
                latch = self._latch = _thread.allocate_lock()
                latch.acquire()  # released once by _finish
        if latch is not None:
            left = limit - time.monotonic()
            if left > 0 and latch.acquire(timeout=left):
                latch.release()  # the next waiter's turn (a latch once released stays open)
        state = self.poll()
        if state is TransferState.DONE:
            return state
        if not state.terminal:  # the caller's timeout, shorter than the deadline
            raise TransferTimeoutError(f"transfer {self.id} still {state.name} after waiting {timeout:.3f} s "
                                       f"(its deadline is {self.deadline - time.monotonic():.3f} s away)")
        raise self._error

    def cancel(self) -> bool:
        """Ask the transport to stop; True if the transfer had not ended yet."""
        return self._finish(TransferState.CANCELLED,
                            TransferCancelledError(f"transfer {self.id} was cancelled by the caller"))

    # ---- transport side ----------------------------------------------------------------------
    @property
    def cancel_requested(self) -> bool:
        """Transports check this between chunks; it also turns true at the deadline."""
        if not self._state.terminal and time.monotonic() >= self.deadline:
            self._expire()
        return self._state.terminal

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def begin(self, on_cancel=None, keepalive=None) -> None:
        """The transport took the transfer: QUEUED -> RUNNING. ``on_cancel(transfer)`` is called once
        if it ends otherwise than by ``complete`` (cancel, deadline, agent closed): the transport's
        cue to stop its flow; ``keepalive`` is held until the end."""
        with self._lock:
            if self._state is TransferState.QUEUED:
                self._state = TransferState.RUNNING
            self._on_cancel, self._keepalive = on_cancel, keepalive

    def mark(self, phase: str) -> None:
        """Record that the transfer reached ``phase`` now (see :meth:`timeline`)."""
        self.marks.append((phase, time.monotonic()))

    def complete(self) -> bool:
        """Every byte landed and the peer acknowledged: DONE. False if it had already ended."""
        return self._finish(TransferState.DONE)

    def fail(self, exc: BaseException) -> bool:
        """The transport's flow ended without completing, with ``exc``: the state :func:`state_for`
        names (an exception that is not an XferError is reported as a TransportError). False if
        the transfer had already ended (its first ending stands)."""
        if not isinstance(exc, XferError):
            exc = TransportError(f"transfer {self.id} failed: {exc!r}")
        return self._finish(state_for(exc), exc)

    def _expire(self) -> None:
        self._finish(TransferState.TIMED_OUT, TransferTimeoutError(
            f"transfer {self.id} ({self.op.value} {self.num_blocks} blocks to {self.peer!r}) "
            f"reached its deadline of {self.deadline - self.created:.3f} s and was cancelled"))

    def _finish(self, state: TransferState, error: XferError | None = None) -> bool:
        """Move to a terminal state once; later calls lose. Returns True if this call won."""
        with self._lock:
            if self._state.terminal:
                return False
            self._state, self._error = state, error
            self.finished = time.monotonic()
            on_cancel, self._on_cancel, self._keepalive = self._on_cancel, None, None
            latch = self._latch
        if latch is not None:
            latch.release()
        if on_cancel is not None and state is not TransferState.DONE:
            on_cancel(self)
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
