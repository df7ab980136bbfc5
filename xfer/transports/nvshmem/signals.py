"""The order of a PE's signals to itself, kept as CUDA events (see :class:`SelfSignals`)."""

from __future__ import annotations

import threading

__all__ = ["SelfSignals"]


class SelfSignals:
    """A PE's signals to itself (two agents of one process: a self put), as CUDA events.

    A stream memory wait (``cuStreamWaitValue64``, NVSHMEM's on-stream wait) is invisible to CUDA's
    scheduler: the CUDA documentation warns that work it orders must also be ordered by events,
    else the scheduler may serialise independent streams behind it. Streams share a few hardware
    queues (``CUDA_DEVICE_MAX_CONNECTIONS``, default 8), so a receiver stream waiting on a word can
    hold up the sender stream of the same process that would set it. Between two processes
    there is no such sharing; inside one there is, so a self put orders its chunks by events:
    the setting side records an event after each value it sets (``post``), the waiting side's lane
    thread waits on the host until that event exists (checking its deadline: ``check``), then
    queues ``stream.wait_event``. ``floor`` lifts a word without an event (a lane's own
    initialisation and drain). Values are waited with ``>=``, as the words are.
    """

    KEEP = 256  # events kept per word behind the newest; older ones have completed

    def __init__(self):
        self._cond = threading.Condition()
        self._events: dict[tuple, dict[int, object]] = {}
        self._floor: dict[tuple, int] = {}
        self._top: dict[tuple, int] = {}

    def post(self, key: tuple, value: int, event) -> None:
        with self._cond:
            events = self._events.setdefault(key, {})
            events[value] = event
            self._top[key] = max(self._top.get(key, 0), value)
            for old in [v for v in events if v < value - self.KEEP]:
                del events[old]
            self._cond.notify_all()

    def floor(self, key: tuple, value: int) -> None:
        with self._cond:
            self._floor[key] = max(self._floor.get(key, 0), value)
            self._cond.notify_all()

    def wait(self, key: tuple, value: int, check=None, poll: float = 1e-3):
        """The event to order after for ``word >= value`` (None: nothing to wait for); blocks the
        calling thread until the setter has posted it, calling ``check()`` (which raises to stop)
        between polls."""
        with self._cond:
            while True:
                if self._floor.get(key, 0) >= value:
                    return None
                events = self._events.get(key, {})
                if value in events:
                    return events[value]
                if self._top.get(key, 0) >= value:  # posted, then dropped as long completed
                    return None
                if check is not None:
                    self._cond.release()
                    try:
                        check()
                    finally:
                        self._cond.acquire()
                self._cond.wait(poll)
