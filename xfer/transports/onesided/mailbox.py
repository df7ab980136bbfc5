"""Landing slots: a one-sided WRITE's notice travels while its copy runs (``XFER_NOTICE_EARLY``).

The initiator owns one small shared-memory segment of :data:`SLOTS` 64-bit words
(:class:`Mailbox`). For a lone WRITE it takes a free slot and a fresh sequence number, sends its
notice at the launch naming both (``landing``), and writes the number into the slot once its copy
ended, or the number negated when the copy ended without completing (a stop, a failure). The
target checks the notice when it comes and holds its reply (``xfer.control.Later``): its control
loop reads the slot (:class:`Boxes` maps a peer's segment once) and delivers only once it reads
the number. An initiator that dies mid-copy never writes it, so nothing half-written is
delivered; a slot that is not written by the transfer's deadline is refused with the grant left
held (the initiator ends it once its copy ended, as after any refused notice).

Same host only (the transports that use it, ``local`` and ``ipc``, are). On x86 an aligned 64-bit
store is seen whole, after every store before it: the copied bytes of a host copy, or (ipc) a
kernel whose event completed before the slot was written.
"""

from __future__ import annotations

import itertools
import re
import threading

import numpy as np
import torch

from ...errors import InvalidArgumentError, TransportError
from ...shm import lookup, open_segment, shared_empty

__all__ = ["SLOTS", "Mailbox", "Boxes"]

SLOTS = 1024  # lone WRITEs of one initiator waiting for their landing at once (more: the classic notice)
_NAME = re.compile(r"^xfer-(\d+)-\d+$")


class Mailbox:
    """The initiator's landing slots: :meth:`take` a (slot, sequence number), :meth:`land` it, and
    :meth:`give` the slot back once the target answered the notice naming it."""

    def __init__(self) -> None:
        self._words = shared_empty((SLOTS,), dtype=torch.int64)
        self._words.zero_()
        self.name = lookup(self._words)[0]
        self._np = self._words.numpy()
        self._free = list(range(SLOTS - 1, -1, -1))
        self._seq = itertools.count(1)  # never repeats: a stale reader of a reused slot never matches
        self._lock = threading.Lock()

    def take(self) -> tuple[int, int] | None:
        """A free slot and a fresh sequence number; None when every slot is taken."""
        with self._lock:
            if not self._free:
                return None
            return self._free.pop(), next(self._seq)

    def land(self, slot: int, seq: int, landed: bool = True) -> None:
        """The copy named ``seq`` ended: every byte landed (``landed``), or it stopped short."""
        self._np[slot] = seq if landed else -seq

    def give(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


class Boxes:
    """The mailboxes of this agent's peers, each mapped once (at most ``cap``; past it the oldest
    mapping is dropped), read by the control loop's thread."""

    def __init__(self, cap: int = 64) -> None:
        self.cap, self._views = cap, {}

    def view(self, name, pid) -> np.ndarray:
        """The slots of segment ``name``, which process ``pid`` (the notice's sender) must own:
        refused (typed) unless it is an xfer segment of that pid holding exactly :data:`SLOTS` words."""
        m = _NAME.match(name) if isinstance(name, str) and len(name) <= 64 else None
        if m is None or not isinstance(pid, int) or isinstance(pid, bool) or int(m.group(1)) != pid:
            raise InvalidArgumentError(f"a landing slot's segment must be one of the sender's (pid {pid!r}), "
                                       f"got {str(name)[:80]!r}")
        hit = self._views.get(name)
        if hit is None:
            flat = open_segment(name)  # TransportError when it does not exist
            if flat.numel() != SLOTS * 8:
                raise TransportError(f"landing segment {name!r} holds {flat.numel()} bytes, not {SLOTS * 8}")
            if len(self._views) >= self.cap:
                self._views.pop(next(iter(self._views)))
            hit = self._views[name] = flat.view(torch.int64).numpy()
        return hit
