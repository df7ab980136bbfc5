"""Prometheus metrics and structured transfer logs.

Metrics (labels: ``agent``, ``op``, ``path`` = transport kind):
``xfer_transfers_total`` (+ ``state``), ``xfer_bytes_total`` (bytes of DONE transfers),
``xfer_transfer_seconds`` (post to end, histogram), ``xfer_errors_total`` (+ ``error`` type),
``xfer_routes_total`` (+ ``peer``: each route chosen). Serve them with
``prometheus_client.start_http_server(port)`` or read ``prometheus_client.REGISTRY``.
Without prometheus-client installed (``pip install xfer[metrics]``) metrics are off; the logs
(logger ``xfer.transfer``, one ``key=value`` line per ended transfer) are always there.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading

__all__ = ["Metrics"]

log = logging.getLogger("xfer.transfer")
_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
_DRAIN_AT = 4096  # ended transfers waiting to be counted: past this the thread ending one counts two
_METRICS = None  # created once per process: prometheus refuses duplicate names in one registry
_LOCK = threading.Lock()  # agents may be constructed on several threads at once


def _create():
    global _METRICS
    with _LOCK:
        return _create_locked()


def _create_locked():
    global _METRICS
    if _METRICS is None:
        try:
            from prometheus_client import REGISTRY, Counter
        except ImportError:
            _METRICS = False
            return _METRICS
        tally = _Tally()
        REGISTRY.register(tally)
        _METRICS = {"tally": tally,
                    "routes": Counter("xfer_routes_total", "Routes chosen", ["agent", "peer", "path"])}
    return _METRICS


class _Tally:
    """The ended transfers' metrics of this process, a Prometheus collector: counted in plain Python
    when scraped, not when each transfer ends. An ended transfer is one deque append on the thread
    that ended it (often the caller about to return from ``wait()``); three labelled prometheus
    updates cost ~20 us there on a cold core (the 2-core CPU VM)."""

    def __init__(self) -> None:
        self._ended: collections.deque = collections.deque()  # (agent, Op, path, TransferState, error type, seconds, bytes)
        self._lock = threading.Lock()  # the counts below (a scrape; an ending thread past _DRAIN_AT)
        self._transfers: dict = {}  # (agent, op, path, state) -> count
        self._bytes: dict = {}  # (agent, op, path) -> payload bytes of DONE transfers
        self._errors: dict = {}  # (agent, op, path, error) -> count
        self._seconds: dict = {}  # (agent, op, path) -> [count per bucket (not cumulative)..., sum]

    def add(self, item: tuple) -> None:
        self._ended.append(item)
        # unscraped past the bound: this thread counts two (the backlog shrinks, no call counts it all);
        # never waiting for a scrape in progress
        if len(self._ended) > _DRAIN_AT and self._lock.acquire(blocking=False):
            try:
                self._count(2)
            finally:
                self._lock.release()

    def drain(self) -> None:
        """Count the ended transfers added so far."""
        with self._lock:
            self._count(None)

    def _count(self, limit: int | None) -> None:
        """(under the lock) Count the oldest ``limit`` ended transfers (None: all of them)."""
        ended = self._ended
        while ended and (limit is None or limit > 0):
            if limit is not None:
                limit -= 1
            agent, op, path, state, error, seconds, nbytes = ended.popleft()
            key = (agent, op.value, path.split(" ", 1)[0])
            state = key + (state.name,)
            self._transfers[state] = self._transfers.get(state, 0) + 1
            if error:
                self._errors[key + (error,)] = self._errors.get(key + (error,), 0) + 1
            else:
                self._bytes[key] = self._bytes.get(key, 0) + nbytes
            hist = self._seconds.get(key)
            if hist is None:
                hist = self._seconds[key] = [0] * (len(_BUCKETS) + 2)
            hist[bisect.bisect_left(_BUCKETS, seconds)] += 1
            hist[-1] += seconds

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        self.drain()
        base = ["agent", "op", "path"]
        out = []
        with self._lock:
            for name, doc, extra, counts in (
                    ("xfer_transfers", "Transfers ended, by final state", ["state"], self._transfers),
                    ("xfer_bytes", "Payload bytes of transfers that completed", [], self._bytes),
                    ("xfer_errors", "Transfers that ended in an error, by type", ["error"], self._errors)):
                family = CounterMetricFamily(name, doc, labels=base + extra)
                for key, n in counts.items():
                    family.add_metric(list(key), n)
                out.append(family)
            seconds = HistogramMetricFamily("xfer_transfer_seconds", "Seconds from post to end", labels=base)
            for key, hist in self._seconds.items():
                cumulative, buckets = 0, []
                for bound, n in zip(_BUCKETS + (float("inf"),), hist[:-1]):
                    cumulative += n
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
                seconds.add_metric(list(key), buckets, sum_value=hist[-1])
            out.append(seconds)
        return out


class Metrics:
    """One agent's view of the process-wide metrics; cheap no-ops when prometheus is absent."""

    def __init__(self, agent: str):
        self.agent = agent
        self._m = _create() or None
        self._tally = self._m["tally"] if self._m else None

    @property
    def enabled(self) -> bool:
        return self._m is not None

    def route(self, peer: str, path: str) -> None:
        if self._m:
            self._m["routes"].labels(self.agent, peer, path).inc()

    def ended(self, transfer) -> None:
        """Called once when ``transfer`` reaches its final state (on the thread that ended it: often
        the caller about to return from ``wait()``, so the success path only appends)."""
        error = transfer._error
        if error is not None or log.isEnabledFor(logging.DEBUG):
            self._log(transfer, error)
        if self._tally is not None:
            self._tally.add((self.agent, transfer.op, transfer.path, transfer._state,
                             "" if error is None else type(error).__name__, transfer.finished - transfer.created,
                             transfer.nbytes))

    def _log(self, transfer, error) -> None:
        err = type(error).__name__ if error is not None else ""
        level = logging.DEBUG if not err else logging.WARNING
        if log.isEnabledFor(level):
            log.log(level, "transfer id=%s agent=%s peer=%s op=%s path=%s copy=%s blocks=%d bytes=%d state=%s "
                    "seconds=%.6f error=%s%s", transfer.id, self.agent, transfer.peer, transfer.op.value,
                    transfer.path.split(" ", 1)[0], transfer.copy_path or "-", transfer.num_blocks, transfer.nbytes,
                    transfer._state.name, transfer.elapsed, err or "-", f' message="{error}"' if err else "")
