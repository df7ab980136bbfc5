"""An agent's inbox: the notifications delivered to it (peers' transfers into or out of its blocks,
and messages), in arrival order, until the caller drains them. One class owns the queue; the
control server's thread and the transports fill it, the caller's threads take from it.

Notices of one-sided transfers (``notify``, ``notify_batch``) are checked here before anything
is delivered (:func:`xfer.transports.incoming.check_request`); a batch's notices stand or fail
one by one.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

import numpy as np

from .error_codec import error_reply
from .errors import InvalidArgumentError, TransferTimeoutError, XferError
from .transfer import Notification, Op
from .transports.incoming import check_request

__all__ = ["Inbox"]


class Inbox:
    """``name``: the agent's (for messages); ``regions``: its region lookup (name -> region or None)."""

    def __init__(self, name: str, regions: Callable):
        self.name, self._regions = name, regions
        self._notes: collections.deque[Notification] = collections.deque()
        self._cond = threading.Condition()

    def deliver(self, note: Notification) -> None:
        with self._cond:
            self._notes.append(note)
            self._cond.notify_all()

    def take(self, peer: str | None = None) -> list[Notification]:
        """Drain the notifications received so far (from ``peer`` only, if given)."""
        with self._cond:
            taken = [n for n in self._notes if peer is None or n.peer == peer]
            for n in taken:
                self._notes.remove(n)
        return taken

    def wait(self, timeout: float, peer: str | None, closed: Callable[[], bool]) -> Notification | None:
        """The next notification (from ``peer``) within ``timeout`` seconds; None once ``closed()``."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for n in self._notes:
                    if peer is None or n.peer == peer:
                        self._notes.remove(n)
                        return n
                left = end - time.monotonic()
                if left <= 0 or closed():
                    break
                self._cond.wait(left)
        if closed():
            return None
        raise TransferTimeoutError(f"agent {self.name!r}: no notification{' from ' + repr(peer) if peer else ''} "
                                   f"within {timeout:.3f} s")

    def wake(self) -> None:
        """Wake every waiter (the agent closed)."""
        with self._cond:
            self._cond.notify_all()

    # ---- peers' notices ----------------------------------------------------------------------
    def notice(self, sender, entry: dict, payload: bytes) -> Notification:
        """The notification a peer's notice (``notify`` header or one ``notify_batch`` entry) describes."""
        op = Op(entry.get("op"))
        region, ids = check_request(self._regions, region=entry.get("region"), op=op, ids=entry.get("blocks"),
                                    what="notified block ids", agent=f"agent {self.name!r}")
        return Notification(peer=str(sender), transfer_id=str(entry.get("transfer_id")), op=op, region=region.name,
                            blocks=ids, payload=payload)

    def on_notify(self, header: dict, payload: bytes) -> dict:
        self.deliver(self.notice(header.get("from"), header, payload))
        return {"ok": True}

    def on_batch(self, header: dict, payload: bytes) -> dict:
        """Several transfers' notices at once: each stands or fails alone (``failed``: index -> error)."""
        entries = header.get("batch")
        if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
            raise InvalidArgumentError("notify_batch carries no list of notices")
        sizes = [e.get("payload_bytes") for e in entries]
        if not all(isinstance(n, int) and n >= 0 for n in sizes) or sum(sizes) != len(payload):
            raise InvalidArgumentError(f"notify_batch payload sizes {sizes} do not add up to {len(payload)} bytes")
        notes, failed, off = [], {}, 0
        for i, (entry, n) in enumerate(zip(entries, sizes)):
            try:
                notes.append(self.notice(header.get("from"), entry, payload[off:off + n]))
            except XferError as exc:
                failed[str(i)] = error_reply(exc)
            except (TypeError, ValueError) as exc:
                failed[str(i)] = error_reply(InvalidArgumentError(f"malformed notice: {exc}"))
            off += n
        for note in notes:
            self.deliver(note)
        return {"ok": True, "failed": failed}

    def on_message(self, header: dict, payload: bytes) -> dict:
        self.deliver(Notification(peer=str(header.get("from")), transfer_id="", op=Op.MESSAGE, region="",
                                  blocks=np.zeros(0, dtype=np.int64), payload=payload))
        return {"ok": True}
