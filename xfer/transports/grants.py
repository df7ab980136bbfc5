"""The target side's grants: which of this agent's blocks a peer's transfer may still write (the
destination of its WRITE) or read (the source of its READ), and the revocation of them.

Every transport's target side takes a :class:`Hold` on the blocks of an incoming transfer once it
admitted it (before any byte moves) and ends it once none of that transfer's bytes can land any
more: the one-sided transports when the initiator's notice (delivered or refused) or its end notice
arrives, or its process is gone; UCX once the flow completed or was dropped and its receives and
sends ended. :class:`Grants` owns the table (one per agent, any thread):

- ``hold`` refuses (:class:`~xfer.errors.BlocksBusyError`) a transfer that would write blocks an
  unfenced transfer of another *owner* still holds, or read blocks one still writes: a second
  writer never races the first one's late bytes; it is refused before any byte moves (retry once
  the first ended). The owner is the initiator's ordered channel (a UCX connection, a one-sided
  initiator process): its own overlapping transfers are its own order to keep, and a stop it
  reported was confirmed on that channel; a transfer stopped by closing its connection, whose
  late bytes may still land, belongs to the closed one.
- ``revoke`` marks the holds on some blocks revoked (no notice of them is delivered from then on;
  the transport's ``on_revoke`` stops what it can) and returns once each one ended, or raises
  :class:`~xfer.errors.FenceTimeoutError` after its timeout: the caller must then keep the blocks
  quarantined (a transfer may still write them: an initiator process stopped mid-copy).
- ``check_read``: a one-sided READ takes no hold (its initiator copies from this agent's memory at
  once, one round trip less); its notice says when its copy began, and it is refused when a hold
  that writes its blocks was live then or ended since, or the blocks were revoked since: a READ
  never reports DONE over bytes this agent changed or gave back meanwhile.

Busy counts live on the region (``region.state``) and die with it. The three a READ's check reads
(per block: write holds live, when one last ended, when last revoked) sit in one shared-memory
segment (:meth:`Grants.busy_segment`), which the one-sided transports publish with the region: an
initiator on this host reads them itself once its READ's copy ended (:func:`read_changed`, the same
check), without waiting for this agent's answer to its notice. The table writes in the order
such a reader needs (a write hold's end time before its count drops; a revocation's time before
any hold on the blocks ends; a deregistered region's blocks revoked for good: :meth:`Grants.retire`).
"""

from __future__ import annotations

import _thread
import itertools
import os
import threading
import time
from typing import Callable

import numpy as np
import torch

from ..errors import (BlocksBusyError, FenceTimeoutError, InvalidArgumentError, NotRegisteredError,
                      RevokedError)
from ..shm import lookup, pid_alive, shared_empty
from .base import LocalRegion

__all__ = ["Hold", "Grants", "read_changed"]


def read_changed(writes: np.ndarray, written: np.ndarray, revoked: np.ndarray, ids: np.ndarray,
                 started: float) -> tuple[type, str] | None:
    """(the refusal's error class, why) where a READ of blocks ``ids`` whose copy began at
    ``started`` (``time.monotonic`` of this host) may have read bytes changed or given back
    meanwhile, else None, from a region's busy counts (:class:`_Busy`; a reader in another process
    maps them). ``writes`` is read before ``written``: a write hold that ends meanwhile is seen
    live, or ended since ``started``."""
    if not len(ids):
        return None
    if writes[ids].any():
        return BlocksBusyError, "a transfer writing them is still running"
    if written[ids].max() >= started:
        return BlocksBusyError, "a transfer wrote them while it read them"
    if revoked[ids].max() >= started:
        return RevokedError, "this agent revoked them while it read them"
    return None


class _Busy:
    """Per block of one region: how many unfenced holds write it, and how many read it; when a
    write hold on it last ended, and when it was last revoked (``time.monotonic``). ``owners``:
    the region's live holds by owner, so that a new hold looks for a clash among other owners'
    holds only (one initiator's burst over reused blocks would scan all of its own, every one)."""

    __slots__ = ("writes", "reads", "written", "revoked", "owners", "segment", "_keep")

    def __init__(self, n: int):
        try:  # writes, written, revoked: one shared segment, read by READ initiators on this host
            table = shared_empty((3, n), dtype=torch.float64)
            self.segment, self._keep = lookup(table)[0], table
            words = table.numpy()
        except (OSError, RuntimeError):  # no shared memory here: readers' notices are checked here only
            self.segment, self._keep = None, None
            words = np.empty((3, n))
        self.writes, self.written, self.revoked = words[0], words[1], words[2]
        self.writes[:] = 0  # (float64 counts: one word per block, as readers map them)
        self.written[:] = -np.inf
        self.revoked[:] = -np.inf
        self.reads = np.zeros(n, dtype=np.int32)
        self.owners: dict = {}  # owner -> {hold id: Hold}, live holds only


class Hold:
    """One incoming transfer's claim on blocks ``ids`` of ``region`` until it is fenced.

    ``peer``: the initiator's name; ``pid`` / ``host``: its process where known (a one-sided
    initiator on this host: once it is gone, its copies are too); ``revoked``: the target gave the
    blocks back (nothing of it may be delivered); ``on_revoke(hold)``: the transport's cue."""

    __slots__ = ("id", "region", "ids", "writes", "peer", "tid", "pid", "host", "owner", "revoked", "on_revoke",
                 "_latch")

    def __init__(self, hid: int, region: LocalRegion, ids: np.ndarray, writes: bool, peer: str, tid: str,
                 pid: int | None, host: str | None, owner, on_revoke: Callable | None):
        self.id, self.region, self.ids, self.writes, self.peer, self.tid = hid, region, ids, writes, peer, tid
        self.owner = owner
        self.pid, self.host, self.on_revoke, self.revoked = pid, host, on_revoke, False
        self._latch = _thread.allocate_lock()
        self._latch.acquire()  # released once, when the hold ends

    def __repr__(self) -> str:
        what = "writes" if self.writes else "reads"
        return (f"Hold({self.id}: transfer {self.tid} from {self.peer!r} {what} {self.ids.size} blocks of "
                f"{self.region.name!r}{', revoked' if self.revoked else ''})")

    def wait(self, timeout: float) -> bool:
        """True once the hold ended (within ``timeout`` seconds)."""
        if self._latch.acquire(timeout=max(timeout, 0.0)):
            self._latch.release()
            return True
        return False


class Grants:
    """Every live hold of one agent (``host``: this host's id, for the liveness of initiators)."""

    def __init__(self, host: str):
        self._host, self._pid = host, os.getpid()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._live: dict[int, Hold] = {}

    def __len__(self) -> int:
        return len(self._live)

    @staticmethod
    def _busy(region: LocalRegion) -> _Busy:
        return region.state.get(("grants", "busy"), lambda: _Busy(region.layout.num_blocks))

    def busy_segment(self, region: LocalRegion) -> str | None:
        """The shared segment of ``region``'s busy counts (3 rows of ``num_blocks`` float64: write
        holds live, last write end, last revocation), for READ initiators on this host; None where
        there is no shared memory."""
        return self._busy(region).segment

    def retire(self, region: LocalRegion) -> None:
        """``region`` is deregistered (or its agent closes): every block revoked for good, so a READ
        still copying from it is refused, by its initiator's own check too."""
        busy = region.state.peek(("grants", "busy"))  # (none made yet: no reader has it mapped)
        if busy is not None:
            with self._lock:
                busy.revoked[:] = np.inf

    def _gone(self, hold: Hold) -> bool:
        """The initiator's process is known to be gone (a one-sided copier on this host)."""
        return hold.pid is not None and hold.host == self._host and hold.pid != self._pid and not pid_alive(hold.pid)

    def hold(self, region: LocalRegion, ids: np.ndarray, *, writes: bool, peer: str, tid: str, owner=None,
             pid: int | None = None, host: str | None = None, on_revoke: Callable | None = None,
             replaces=None) -> Hold:
        """Claim blocks ``ids`` (checked) of ``region`` for an incoming transfer of ``owner`` (its
        initiator's ordered channel), or raise BlocksBusyError naming the unfenced transfer of
        another owner that holds some of them. ``replaces``: the id of a grant issued ahead to
        ``peer`` for exactly these blocks (xfer.ahead), ended in the same step (RevokedError,
        ended too, when it was revoked; nothing of the transfer has landed yet)."""
        busy = self._busy(region)
        with self._lock:
            if replaces is not None:
                self._replace(replaces, region, ids, writes, peer)
            if busy.writes[ids].any() or (writes and busy.reads[ids].any()):
                other = self._clashing(busy, ids, writes, owner)
                if other is not None:
                    self._reap(region)  # holds of initiators that died meanwhile
                    other = self._clashing(busy, ids, writes, owner)
                if other is not None:
                    raise BlocksBusyError(
                        f"{'writing' if writes else 'reading'} blocks of region {region.name!r} that "
                        f"{other!r} may still {'write' if other.writes else 'read'} (not fenced yet): refused "
                        f"before any byte moved")
            h = Hold(next(self._ids), region, ids, writes, peer, tid, pid, host, owner, on_revoke)
            if writes:  # a write's ids are unique
                busy.writes[ids] += 1
            else:
                np.add.at(busy.reads, ids, 1)
            self._live[h.id] = h
            busy.owners.setdefault(owner, {})[h.id] = h
        return h

    def _of(self, hid, peer: str) -> Hold | None:
        """(under the lock) The live hold ``hid`` (a peer's int, unchecked) of ``peer``, or None."""
        h = self._live.get(hid) if isinstance(hid, int) and not isinstance(hid, bool) else None
        return h if h is not None and h.peer == peer else None

    def _replace(self, hid, region: LocalRegion, ids: np.ndarray, writes: bool, peer: str) -> None:
        """(under the lock) End grant ``hid`` issued ahead to ``peer`` for this transfer's blocks."""
        h = self._of(hid, peer)
        if h is None:
            raise NotRegisteredError(f"no grant {hid!r} of {peer!r} is live here (ended, or never granted)")
        if not (writes and h.writes and h.region is region and np.array_equal(h.ids, ids)):
            raise InvalidArgumentError(f"grant {hid} covers other blocks than the transfer naming it")
        self._end(h)
        if h.revoked:
            raise RevokedError(f"the blocks of grant {hid} were revoked before its write began: nothing landed")

    def end_ahead(self, hid, peer: str) -> None:
        """End grant ``hid`` issued ahead to ``peer``: the transfer naming it was refused before any
        byte of it landed (a grant serves one transfer). No such grant: nothing."""
        with self._lock:
            h = self._of(hid, peer)
            if h is not None:
                self._end(h)

    @staticmethod
    def _clashing(busy: _Busy, ids: np.ndarray, writes: bool, owner) -> Hold | None:
        """A live hold of another owner (any, where ``owner`` is None) on some of ``ids`` of the
        region ``busy`` counts that conflicts (either side writes)."""
        mask = np.zeros(busy.writes.size, dtype=bool)
        mask[ids] = True
        for o, holds in busy.owners.items():
            if owner is not None and o == owner:
                continue
            for h in holds.values():
                if (h.writes or writes) and mask[h.ids].any():
                    return h
        return None

    def _reap(self, region: LocalRegion | None) -> None:
        """End the holds (of ``region``) whose initiator process is gone (under the lock)."""
        for h in [h for h in self._live.values() if (region is None or h.region is region) and self._gone(h)]:
            self._end(h)

    def _end(self, h: Hold) -> None:
        if self._live.pop(h.id, None) is None:
            return
        busy = self._busy(h.region)
        mine = busy.owners.get(h.owner)
        if mine is not None:
            mine.pop(h.id, None)
            if not mine:
                del busy.owners[h.owner]
        if h.writes:  # a write's ids are unique; its end time first: a reader reads the count first
            busy.written[h.ids] = time.monotonic()
            busy.writes[h.ids] -= 1
        else:
            np.add.at(busy.reads, h.ids, -1)
        h._latch.release()

    def end(self, hold: Hold) -> None:
        """The hold's transfer is fenced: no byte of it can land any more. Idempotent."""
        with self._lock:
            self._end(hold)

    def closing(self):
        """The table's lock: a notice's revoked check and its delivery inside it cannot interleave
        with a revocation (a notice delivered before ``revoke`` returned is in the inbox; none after)."""
        return self._lock

    def take_locked(self, hid, peer: str) -> Hold | None:
        """End hold ``hid`` of ``peer`` (its initiator's notice or end notice came) and return it
        (check ``revoked`` before delivering anything of it); None if there is no such hold. The
        caller holds :meth:`closing`, so the check and a delivery are one step."""
        h = self._of(hid, peer)
        if h is None:
            return None
        self._end(h)
        return h

    def check_read(self, region: LocalRegion, ids: np.ndarray, started: float) -> tuple[type, str] | None:
        """(error class, why) where a one-sided READ of blocks ``ids`` whose copy began at
        ``started`` (this host's monotonic clock) may have read bytes changed or given back
        meanwhile (:func:`read_changed`), else None. Call it holding :meth:`closing` (one step with
        the notice's delivery)."""
        busy = self._busy(region)
        return read_changed(busy.writes, busy.written, busy.revoked, ids, started)

    def end_locked(self, hold: Hold) -> None:
        """:meth:`end` for a caller holding :meth:`closing`."""
        self._end(hold)

    def end_transfers(self, peer: str, tids: set) -> None:
        """End ``peer``'s holds of transfers ``tids`` (caller holds :meth:`closing`)."""
        for h in [h for h in self._live.values() if h.peer == peer and h.tid in tids]:
            self._end(h)

    def holds(self, region: LocalRegion | None = None) -> list[Hold]:
        with self._lock:
            return [h for h in self._live.values() if region is None or h.region is region]

    def revoke(self, regions: list[LocalRegion], blocks, timeout: float, *, strict: bool = True) -> int:
        """Revoke every hold on ``blocks`` (checked ids) of ``regions``; return how many there were
        once each ended, or raise FenceTimeoutError after ``timeout`` seconds naming those that did
        not (their blocks must stay quarantined). ``strict`` False: ids past a region's end are
        skipped for that region (one id list over regions of different sizes)."""
        end = time.monotonic() + timeout
        picked = []
        with self._lock:
            for region in regions:
                if not strict:
                    arr = np.asarray(blocks, dtype=np.int64).reshape(-1)
                    blocks_here = arr[(arr >= 0) & (arr < region.layout.num_blocks)]
                    if not blocks_here.size:
                        continue
                else:
                    blocks_here = blocks
                ids = region.layout.check_block_ids(blocks_here, what="revoked block ids")
                self._busy(region).revoked[ids] = time.monotonic()  # reads begun before: refused
                here = [h for h in self._live.values() if h.region is region]
                if not here:  # the usual case: nothing to look for (no mask over every block)
                    continue
                mask = np.zeros(region.layout.num_blocks, dtype=bool)
                mask[ids] = True
                for h in here:
                    if mask[h.ids].any():
                        h.revoked = True
                        picked.append(h)
        for h in picked:
            if h.on_revoke is not None:
                h.on_revoke(h)
        left = picked
        while left:
            left = [h for h in left if not h.wait(min(0.05, max(end - time.monotonic(), 0.0)))]
            if left:
                with self._lock:
                    for h in left:
                        if self._gone(h):
                            self._end(h)
                left = [h for h in left if h.id in self._live]
            if left and time.monotonic() >= end:
                raise FenceTimeoutError(
                    f"{len(left)} transfer(s) may still write the revoked blocks after {timeout:.3f} s "
                    f"({', '.join(map(repr, left[:4]))}): keep those blocks quarantined, revoke again later")
        return len(picked)
