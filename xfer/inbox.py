"""An agent's inbox: the notifications delivered to it (peers' transfers into or out of its blocks,
and messages), in arrival order, until the caller drains them. One class owns the queue; the
control server's thread and the transports fill it, the caller's threads take from it.

The one-sided transports' target side lives here too, on the control server's thread:

- ``grant``: before it copies a byte, an initiator asks for its transfers (one message for
  several): each is checked here (:func:`xfer.transports.incoming.check_request`: region, layout
  fingerprint, ids in range and unique where written; its ttl and send time: a late one is
  refused) and holds its blocks (:class:`xfer.transports.grants.Grants`: a transfer into blocks an
  unfenced one still holds is refused); the reply names each one's grant or refusal.
- ``notify`` / ``notify_batch``: once its copy ended, the initiator's notice names its grant; it
  is delivered only when the grant was not revoked and the notice is not late (its ttl and send
  time), and either way it ends the grant (the initiator copies nothing more). A READ takes no
  grant (it writes only the initiator's memory): its notice names the blocks and when its copy
  began, and is refused when they were written or revoked since (``Grants.check_read``). Other
  notices without a grant (NVSHMEM's reads, whose blocks its read request checked) are checked as
  before.
- ``grant_end``: the initiator's transfers stopped or failed after their grants; their copies
  ended: the grants end, nothing is delivered.
- a ``notify`` naming a ``landing`` slot (``XFER_NOTICE_EARLY``) came at its copy's launch (a
  WRITE's under its grant, or a READ's): its time is checked now, and its reply waits
  (``xfer.frames.Later``, polled by the control loop) until the initiator writes the slot: then it
  is the notice above (a READ's blocks checked then, after its copy ended); the slot negated (the
  copy stopped short) ends the grant, nothing delivered; nothing by the deadline: refused, the
  grant left held (the initiator ends it once its copy ended). See xfer.transports.onesided.mailbox.

A batch's entries stand or fail one by one.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

import numpy as np

from .error_codec import error_reply
from .errors import (InvalidArgumentError, NotRegisteredError, RevokedError, TransferCancelledError,
                     TransferTimeoutError,
                     XferError)
from .frames import Later
from .guard import packed_ids
from .transfer import Notification, Op
from .transports.incoming import ClockFloor, check_request, check_time, check_ttl, local_deadline
from .transports.onesided.mailbox import SLOTS, Boxes

__all__ = ["Inbox"]


class Inbox:
    """``name``: the agent's (for messages); ``regions``: its region lookup (name -> region or None);
    ``grants``: the agent's holds (xfer.transports.grants.Grants); ``host``: this host's id."""

    def __init__(self, name: str, regions: Callable, grants=None, host: str = "", claims=None):
        self.name, self._regions, self._grants, self._host = name, regions, grants, host
        self._claims = claims  # the tokens of grants issued ahead this agent was handed (xfer.ahead.Claims)
        self._notes: collections.deque[Notification] = collections.deque()
        self._cond = threading.Condition()
        # per initiator (name, pid, host): the least delay of its messages (control-server thread only)
        self._floors: dict[tuple, ClockFloor] = {}
        self._boxes = Boxes()  # peers' landing slots (control-server thread only)

    def handle(self, kind, header: dict, payload: bytes) -> dict | None:
        """The reply to a control message this inbox answers, or None when it is not one of them."""
        if kind == "grant":
            return self.on_grant(header, payload)
        if kind == "notify":
            return self.on_notify(header, payload)
        if kind == "notify_batch":
            return self.on_batch(header, payload)
        if kind == "grant_end":
            return self.on_grant_end(header)
        if kind == "message":
            return self.on_message(header, payload)
        if kind == "grant_release" and self._claims is not None:
            return self._claims.on_release(header)
        return None

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

    # ---- peers' grants and notices -------------------------------------------------------------
    def _late(self, header: dict, entry: dict, what: str) -> float:
        """How long past its peer's usual delay ``entry`` (with ``ttl`` and ``sent``) arrived; a
        malformed time is refused (InvalidArgumentError)."""
        sent = entry.get("sent")
        check_ttl(entry.get("ttl"), sent, what=what)
        if sent is None:
            raise InvalidArgumentError(f"{what} carries no send time")
        who = (str(header.get("from")), header.get("pid"), header.get("host"))
        floor = self._floors.get(who)
        if floor is None:
            if len(self._floors) >= 4096:
                self._floors.clear()
            now = time.monotonic()  # a peer on this host shares this monotonic clock: its first wait counts
            floor = self._floors[who] = ClockFloor(0.0 if who[2] == self._host else None, now)
        return floor.delay(float(sent), time.monotonic())

    def on_grant(self, header: dict, payload: bytes = b"") -> dict:
        """Check and hold each transfer of a ``grant`` request; ``grants``: index -> id, ``failed``:
        index -> error. Block ids: each transfer's ``blocks``, or packed in ``payload`` (``nblocks``
        each; see ``xfer.guard.packed_ids``)."""
        entries = header.get("transfers")
        if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
            raise InvalidArgumentError("grant carries no list of transfers")
        packed = packed_ids(entries, payload, "a grant request")
        sender, pid, host = str(header.get("from")), header.get("pid"), header.get("host")
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
        granted, failed = {}, {}
        for i, e in enumerate(entries):
            try:
                op = Op(e.get("op"))
                if op is Op.MESSAGE:
                    raise InvalidArgumentError("a grant is for a WRITE or a READ")
                what = f"transfer {e.get('transfer_id')} from {sender!r}"
                region, ids = check_request(self._regions, region=e.get("region"), op=op,
                                            ids=e.get("blocks") if packed is None else packed[i],
                                            what="granted block ids", agent=f"agent {self.name!r}", initiator=sender,
                                            fingerprint=e.get("fingerprint"))
                local_deadline(e.get("ttl"), self._late(header, e, what), time.monotonic(), what=what)
                hold = self._grants.hold(region, ids, writes=op is Op.WRITE, peer=sender,
                                         tid=str(e.get("transfer_id")), owner=(sender, pid, str(host)), pid=pid,
                                         host=str(host))
                granted[str(i)] = hold.id
            except XferError as exc:
                failed[str(i)] = error_reply(exc)
            except (TypeError, ValueError) as exc:
                failed[str(i)] = error_reply(InvalidArgumentError(f"malformed grant request: {exc}"))
        return {"ok": True, "grants": granted, "failed": failed}

    def on_grant_end(self, header: dict) -> dict:
        """The initiator's granted transfers ended without a notice; their copies are over."""
        ids = header.get("grants")
        if not isinstance(ids, list):
            raise InvalidArgumentError("grant_end carries no list of grants")
        sender, tids = str(header.get("from")), header.get("tids")
        with self._grants.closing():
            for hid in ids[:4096]:
                self._grants.take_locked(hid, sender)
            if isinstance(tids, list):  # the grant's reply was lost: named by transfer id
                self._grants.end_transfers(sender, {str(t) for t in tids[:4096]})
        return {"ok": True}

    def _check_notice(self, sender, entry: dict, payload: bytes):
        """(the notification a peer's notice describes, its grant's hold or None): checked, not
        delivered. A notice naming a grant ends it, delivered or not."""
        op = Op(entry.get("op"))
        if "grant" not in entry:
            region, ids = check_request(self._regions, region=entry.get("region"), op=op, ids=entry.get("blocks"),
                                        what="notified block ids", agent=f"agent {self.name!r}")
            # a one-sided READ: nothing it read changed since (unless its initiator checked that itself,
            # from this agent's busy counts: readcheck; the check protects the reader's bytes only)
            if op is Op.READ and "started" in entry and entry.get("reader_checked") is not True:
                changed = self._grants.check_read(region, ids, check_time(entry["started"], what="a READ's start"))
                if changed is not None:
                    cls, why = changed
                    raise cls(f"agent {self.name!r} refuses the notice of READ {entry.get('transfer_id')}: {why}; "
                              f"its bytes may be mixed, none is reported complete")
            return Notification(peer=str(sender), transfer_id=str(entry.get("transfer_id")), op=op,
                                region=region.name, blocks=ids, payload=payload)
        hold = self._grants.take_locked(entry["grant"], str(sender))
        if hold is None:
            raise NotRegisteredError(f"agent {self.name!r} holds no grant {entry['grant']!r} of {sender!r} (ended, "
                                     f"or never granted)")
        if hold.revoked:
            raise RevokedError(f"agent {self.name!r} revoked its blocks of transfer {hold.tid} before its notice "
                               f"came: not delivered")
        if hold.region is not self._regions(hold.region.name):
            raise NotRegisteredError(f"region {hold.region.name!r} was deregistered")
        return Notification(peer=str(sender), transfer_id=str(entry.get("transfer_id")), op=op,
                            region=hold.region.name, blocks=hold.ids, payload=payload)

    def notice(self, header: dict, entry: dict, payload: bytes) -> Notification:
        """The notification a peer's notice (``notify`` header or one ``notify_batch`` entry) describes,
        once it passed its checks (its grant and its time: a late notice is refused)."""
        sender = header.get("from")
        what = f"the notice of transfer {entry.get('transfer_id')} from {sender!r}"
        with self._grants.closing():  # the revoked check and the delivery in one step
            note = self._check_notice(sender, entry, payload)  # ends its grant, delivered or not
            if "ttl" in entry or "sent" in entry:
                local_deadline(entry.get("ttl"), self._late(header, entry, what), time.monotonic(), what=what)
            self.deliver(note)
        return note

    def on_notify(self, header: dict, payload: bytes) -> dict | Later:
        if "landing" in header:
            return self._landing(header, payload)
        self.notice(header, header, payload)
        return {"ok": True}

    def _landing(self, header: dict, payload: bytes) -> Later:
        """A WRITE's or a READ's notice sent at its copy's launch: checked now (its slot, its time),
        answered once the initiator wrote the slot (see the module doc): a WRITE's grant and a READ's
        blocks are checked then, after the copy ended."""
        landing, sender = header.get("landing"), header.get("from")
        if not isinstance(landing, dict) or ("grant" not in header and header.get("op") != Op.READ.value):
            raise InvalidArgumentError("a notice waiting for its landing names a landing slot and its grant (a "
                                       "READ's: its blocks)")
        slot, seq = landing.get("slot"), landing.get("seq")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (slot, seq)) or not 0 <= slot < SLOTS \
                or not 0 < seq < 1 << 62:
            raise InvalidArgumentError(f"malformed landing slot {slot!r} / sequence number {seq!r}")
        words = self._boxes.view(landing.get("box"), header.get("pid"))
        what = f"the notice of transfer {header.get('transfer_id')} from {sender!r}"
        deadline = local_deadline(header.get("ttl"), self._late(header, header, what), time.monotonic(), what=what)
        entry = {k: v for k, v in header.items() if k not in ("landing", "reader_checked")}
        if landing.get("reader_checks") is True and header.get("op") == Op.READ.value:
            entry["reader_checked"] = True

        def poll(now: float):
            word = int(words[slot])
            if word == seq:  # every byte landed
                self.notice(header, entry, payload)
                return {"ok": True}, b""
            if word == -seq:  # the copy stopped short: its grant ends (a WRITE's), nothing delivered
                if "grant" in entry:
                    with self._grants.closing():
                        self._grants.take_locked(entry["grant"], str(sender))
                raise TransferCancelledError(f"{what}: its copy stopped before it completed; not delivered")
            if now > deadline:
                raise TransferTimeoutError(f"{what}: its copy was not reported landed by the deadline; not "
                                           f"delivered (the grant stays until the initiator ends it)")
            return None
        return Later(poll)

    def on_batch(self, header: dict, payload: bytes) -> dict:
        """Several transfers' notices at once: each stands or fails alone (``failed``: index -> error)."""
        entries = header.get("batch")
        if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
            raise InvalidArgumentError("notify_batch carries no list of notices")
        sizes = [e.get("payload_bytes") for e in entries]
        if not all(isinstance(n, int) and n >= 0 for n in sizes) or sum(sizes) != len(payload):
            raise InvalidArgumentError(f"notify_batch payload sizes {sizes} do not add up to {len(payload)} bytes")
        failed, off = {}, 0
        for i, (entry, n) in enumerate(zip(entries, sizes)):
            try:
                self.notice(header, entry, payload[off:off + n])
            except XferError as exc:
                failed[str(i)] = error_reply(exc)
            except (TypeError, ValueError) as exc:
                failed[str(i)] = error_reply(InvalidArgumentError(f"malformed notice: {exc}"))
            off += n
        return {"ok": True, "failed": failed}

    def on_message(self, header: dict, payload: bytes) -> dict:
        self.deliver(Notification(peer=str(header.get("from")), transfer_id="", op=Op.MESSAGE, region="",
                                  blocks=np.zeros(0, dtype=np.int64), payload=payload))
        return {"ok": True}
