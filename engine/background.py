"""Work that waits on the network, kept off an engine's scheduler thread.

``Background.submit(fn, *args)`` runs ``fn`` on one of up to ``max_workers`` daemon threads and
returns a ``concurrent.futures.Future`` the engine thread polls (``done()``) and never waits on
past its own deadline. Threads are made on demand and are daemons: one stuck on a frozen peer
(each such call is bounded by its own deadline anyway) never holds up interpreter exit, unlike
``ThreadPoolExecutor``, whose threads are joined at exit. ``submit`` has the signature of
``Executor.submit``, so engines that expect an executor (SGLang's prefill-recompute hook) take one.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

__all__ = ["Background"]

log = logging.getLogger("xfer.engine.background")


class Background:
    """Up to ``max_workers`` daemon threads running submitted calls in order of submission.

    Calls beyond ``max_workers`` queue: a frozen peer can hold up to one thread per call waiting on
    it (each until its deadline), so the bound is generous (64) and threads are made only on demand."""

    def __init__(self, name: str, max_workers: int = 64):
        self.name, self.max_workers = name, max_workers
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting for work
        self._pending = 0  # calls queued, not yet taken
        self._closed = False

    def __repr__(self) -> str:
        return f"Background({self.name!r}, threads={self._threads}/{self.max_workers}, closed={self._closed})"

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(RuntimeError(f"{self!r} is closed"))
                return fut
            self._queue.put((fut, fn, args, kwargs))
            self._pending += 1
            if self._pending > self._idle and self._threads < self.max_workers:
                self._threads += 1
                threading.Thread(target=self._run, name=f"{self.name}-{self._threads}", daemon=True).start()
        return fut

    def _run(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            item = self._queue.get()
            with self._lock:
                self._idle -= 1
                self._pending -= item is not None
            if item is None:
                return
            fut, fn, args, kwargs = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # handed to whoever polls the future
                    fut.set_exception(exc)

    def close(self) -> None:
        """Cancel what has not started; running calls end by their own deadlines. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            n = self._threads
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(n):
            self._queue.put(None)
