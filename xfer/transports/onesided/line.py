"""The one-sided transports' completion line: the jobs whose copies were launched (or ran), in
launch order, each waiting for its copy to end and its peer's acknowledgement, and who finishes
each one.

The completer thread finishes them, one at a time and in order (several to one peer in one
message, where their copies ended). A caller blocked in ``Transfer.wait()`` on one of them may
finish that one itself instead (:meth:`Line.claim`): once it is the only one in the line and
nothing before it is being finished, so notices still leave in launch order, and a burst's
(several in the line) still go to the completer, which sends their notices together. The caller is the thread
the result goes to: finishing in it spares a lone transfer the completer's wake-up when the copy
ends and, at the end, the waiting thread's (with the GIL handed between threads each time: ~0.1
ms of a lone transfer on a GPU host, measured in ``bench/results``). A job a caller waits for is
left to that caller while it is alone in the line (the completer neither takes nor batches it),
until the caller gives up.

One lock guards the line's state; whoever finishes an item calls :meth:`Line.finished`."""

from __future__ import annotations

import collections
import threading
import time

__all__ = ["Line", "EMPTY"]

EMPTY = object()  # take(): nothing came before the timeout


class Line:
    """Items are ``(job, event)`` pairs (``event``: the copy's CUDA event, or None where the copy ran
    synchronously) or None, the worker's last item (the transport closes)."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._busy = False  # an item is being finished (by the completer or by a caller)
        self._held = None  # the transfer a caller is finishing, until its deadline passed (overdue)
        self._callers: dict = {}  # transfer -> callers waiting to finish it (Transfer.wait)
        self._closed = False
        self._kicked = False  # take() returns EMPTY once (the completer has other work: kick())

    def put(self, item) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify_all()

    def empty(self) -> bool:
        """No item waits to be taken (one may be being finished)."""
        return not self._items

    def take(self, timeout: float | None = None):
        """(completer) The first item once nothing is being finished and no caller waits to finish
        it: it is now being finished (:meth:`finished` ends that); None: the transport closes;
        :data:`EMPTY`: ``timeout`` seconds passed first, the deadline of the transfer a caller is
        finishing did (:meth:`overdue`), or :meth:`kick` was called."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                if self._kicked:
                    self._kicked = False
                    return EMPTY
                if self._items and not self._busy:
                    head = self._items[0]
                    if head is None or len(self._items) > 1 or head[0].transfer not in self._callers:
                        self._items.popleft()
                        self._busy = head is not None
                        return head
                now = time.monotonic()
                left = None if end is None else end - now
                if self._held is not None:  # wake at its deadline (the caller is busy finishing it)
                    due = self._held.deadline - now
                    left = due if left is None else min(left, due)
                if left is not None and left <= 0:
                    return EMPTY
                self._cv.wait(left)

    def overdue(self):
        """(completer) The transfer a caller is finishing, once its deadline passed (once): its stop
        is the completer's to begin, as the caller's wait() would have at the deadline."""
        with self._cv:
            held = self._held
            if held is None or time.monotonic() < held.deadline:
                return None
            self._held = None
            return held

    def take_next(self, peer):
        """(completer, while finishing an item) The next item too, if it is to the same ``peer``, its
        copy ended (its event completed, or it had none) and no caller waits for it; else None."""
        with self._cv:
            if not self._items:
                return None
            head = self._items[0]
            if head is None or head[0].peer is not peer or \
                    (len(self._items) == 1 and head[0].transfer in self._callers) or \
                    (head[1] is not None and not head[1].query()):
                return None
            return self._items.popleft()

    def finished(self) -> None:
        """The item being finished is done with (by whoever took it): the next one's turn."""
        with self._cv:
            self._busy, self._held = False, None
            if self._items or self._callers:  # (no one else waits for this: the completer sleeps on,
                self._cv.notify_all()  # the caller returns without handing the GIL to it)

    def claim(self, transfer, until: float):
        """(a caller in ``transfer.wait()``) Wait until ``transfer``'s item is first in the line with
        nothing being finished, and take it (the caller finishes it, then calls :meth:`finished`).
        None: the transfer ended meanwhile (or was taken by the completer before the caller came),
        the line closed, or ``until`` passed (the completer finishes it then)."""
        with self._cv:
            self._callers[transfer] = self._callers.get(transfer, 0) + 1
            try:
                while not self._closed and transfer.finished is None:
                    if self._items and not self._busy:
                        head = self._items[0]
                        if head is not None and head[0].transfer is transfer and len(self._items) == 1:
                            self._items.popleft()
                            self._busy, self._held = True, transfer
                            self._cv.notify_all()  # the completer now wakes at its deadline
                            return head
                    left = until - time.monotonic()
                    if left <= 0:
                        return None
                    self._cv.wait(left)
                return None
            finally:
                n = self._callers.pop(transfer) - 1
                if n:
                    self._callers[transfer] = n
                if self._items:
                    self._cv.notify_all()  # the completer may take what this caller leaves

    def wake(self) -> None:
        """A transfer ended outside the line (failed before its launch): its caller stops waiting."""
        with self._cv:
            self._cv.notify_all()

    def kick(self) -> None:
        """Have the completer's take() return (EMPTY) once: it has work besides the line (grant
        ends to send, added by another thread)."""
        with self._cv:
            self._kicked = True
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
