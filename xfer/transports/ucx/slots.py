"""The UCX engine's staging slots: one pool per memory kind, handed to flows round-robin.

Staging slots, and why no interleaving deadlocks. Each memory kind has one pool of ``S`` slots.
Sends may hold at most ``S - S // 2`` of them; receives may take any free slot. Then:

  1. A receive takes a slot only for a chunk that has *arrived* (probed, handle in hand). Its
     completion needs no further slot anywhere: the bytes are here (eager) or sit in a slot of the
     sender whose send is already posted (rendezvous); the scatter after it is local work on the
     copy thread (finite, FIFO). So every receive slot comes back in bounded time, or at once
     when the connection fails (UCX fails the request).
  2. Sends never hold more than ``S - S // 2`` slots, so at least ``S // 2 >= 1`` slots are free or
     held by receives, which come back (1). Flows with arrived chunks are served round-robin, one
     chunk per turn, before any send takes a slot: every arrived chunk is received in finite time.
  3. A send holds its slot through the gather (local) and until UCX completes it, i.e. until the
     peer receives it: the peer's probe sees it (its worker progresses on its own thread) and (2)
     there gives it a slot in finite time. So every send slot comes back too.
  4. Nothing else waits while holding a slot: no chunk waits for a control message (the initiator
     sends right behind its REQ; the target holds early chunks without a slot), and control
     messages never need a slot.

A wait-for cycle would need a slot held while waiting for another slot; by (1)-(4) only a send
waits on anything remote, and what it waits for (a receive at the peer) never waits for a send.
So with any number of flows in both directions, any interleaving, all slots busy, progress is
made; fairness: round-robin among flows, receives first. A dead or frozen peer cannot make a
healthy one wait past its deadline either: deadlines end flows, whose late chunks are discarded
on arrival (a frozen peer can keep a send slot until it wakes or UCX's keepalive gives up on it).

A chunk received straight into its blocks (``io_raw``) still takes a slot, as a token of the
pool's flow control: the argument holds unchanged (such a receive needs nothing else to end).
"""

from __future__ import annotations

import collections

from .staging import StagingPool

__all__ = ["Slots"]


class Slots:
    """Every staging pool of one engine (made on first use) and the queues of flows wanting a slot."""

    def __init__(self, settings):
        self.settings = settings
        self._pools: dict[str, StagingPool] = {}
        self._want_rx: dict[str, collections.deque] = {}  # per pool kind: receiving flows with arrived chunks
        self._want_tx: dict[str, collections.deque] = {}  # per pool kind: sending flows with chunks to start

    def pool(self, kind: str) -> StagingPool:
        if kind not in self._pools:
            s = self.settings.slot_count(kind)
            self._pools[kind] = StagingPool(kind, self.settings.slot_bytes(kind), s, send_cap=s - s // 2)
            self._want_rx[kind] = collections.deque()
            self._want_tx[kind] = collections.deque()
        return self._pools[kind]

    def want(self, flow) -> None:
        """Queue ``flow`` for a slot if it can start a chunk (at most once in its queue)."""
        if not flow.queued and flow.wants_slot():
            flow.queued = True
            (self._want_tx if flow.sending else self._want_rx)[flow.pool.kind].append(flow)

    def schedule(self) -> bool:
        """Give free slots to flows round-robin (one chunk per turn): receives first, then sends
        up to the pool's send cap (see the module docstring). True if a chunk started."""
        busy = False
        for kind, pool in self._pools.items():
            for queue, sending in ((self._want_rx[kind], False), (self._want_tx[kind], True)):
                while queue and pool.free(sending):
                    flow = queue.popleft()
                    flow.queued = False
                    if not flow.wants_slot():
                        continue
                    flow.start_chunk(pool.take(flow, sending))
                    busy = True
                    self.want(flow)
        return busy

    def release(self, flow, slot) -> None:
        """A chunk of ``flow`` ended: its slot back to the pool, the flow queued again if it lives."""
        flow.pool.give(slot)
        flow.inflight -= 1
        if not flow.dead:
            self.want(flow)

    def clear_queues(self) -> None:
        for queue in (*self._want_rx.values(), *self._want_tx.values()):
            queue.clear()
