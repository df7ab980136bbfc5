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

import logging
import threading

__all__ = ["Metrics"]

log = logging.getLogger("xfer.transfer")
_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
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
            from prometheus_client import Counter, Histogram
        except ImportError:
            _METRICS = False
            return _METRICS
        _METRICS = {
            "transfers": Counter("xfer_transfers_total", "Transfers ended, by final state",
                                 ["agent", "op", "path", "state"]),
            "bytes": Counter("xfer_bytes_total", "Payload bytes of transfers that completed", ["agent", "op", "path"]),
            "seconds": Histogram("xfer_transfer_seconds", "Seconds from post to end", ["agent", "op", "path"],
                                 buckets=_BUCKETS),
            "errors": Counter("xfer_errors_total", "Transfers that ended in an error, by type",
                              ["agent", "op", "path", "error"]),
            "routes": Counter("xfer_routes_total", "Routes chosen", ["agent", "peer", "path"]),
        }
    return _METRICS


class Metrics:
    """One agent's view of the process-wide metrics; cheap no-ops when prometheus is absent."""

    def __init__(self, agent: str):
        self.agent = agent
        self._m = _create() or None
        self._children: dict = {}  # (op, path, state, error) -> labelled series (labels() is ~5 us a call)

    @property
    def enabled(self) -> bool:
        return self._m is not None

    def route(self, peer: str, path: str) -> None:
        if self._m:
            self._m["routes"].labels(self.agent, peer, path).inc()

    def ended(self, transfer) -> None:
        """Called once when ``transfer`` reaches its final state."""
        state = transfer._state.name
        path = transfer.path.split(" ", 1)[0]
        err = type(transfer.error).__name__ if transfer.error is not None else ""
        level = logging.DEBUG if not err else logging.WARNING
        if log.isEnabledFor(level):
            log.log(level, "transfer id=%s agent=%s peer=%s op=%s path=%s copy=%s blocks=%d bytes=%d state=%s "
                    "seconds=%.6f error=%s%s", transfer.id, self.agent, transfer.peer, transfer.op.value, path,
                    transfer.copy_path or "-", transfer.num_blocks, transfer.nbytes, state, transfer.elapsed,
                    err or "-", f' message="{transfer.error}"' if err else "")
        if not self._m:
            return
        op = transfer.op.value
        key = (op, path, state, err)
        series = self._children.get(key)
        if series is None:
            m, a = self._m, self.agent
            last = m["bytes"].labels(a, op, path) if state == "DONE" else m["errors"].labels(a, op, path, err)
            series = self._children[key] = (m["transfers"].labels(a, op, path, state),
                                            m["seconds"].labels(a, op, path), last)
        series[0].inc()
        series[1].observe(transfer.elapsed)
        series[2].inc(transfer.nbytes if state == "DONE" else 1)
