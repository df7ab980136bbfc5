"""One transfer as the UCX engine drives it, on either side.

A flow either *sends* chunks (gather into a slot -> tag send) or *receives* them (tag receive
into a slot -> scatter), at most ``depth`` chunks in flight, slots taken from a shared pool in
round-robin order among flows. Roles:

    initiator, WRITE   sends; done on the target's ACK
    target,    WRITE   receives; after the last scatter delivers the notification, sends ACK
    initiator, READ    receives; after the last scatter sends FIN, done on the target's ACK
    target,    READ    sends; on FIN delivers the notification, sends ACK

Every method here runs on the engine thread; the copy thread only runs ``gather``/``scatter``.
"""

from __future__ import annotations

import time

import numpy as np

from ..layout import KVLayout
from ..transfer import Op, Transfer
from .ucx_stage import BlockCopier, Chunk, Slot

__all__ = ["Flow"]


class Flow:
    """State of one transfer; ``engine`` supplies slots, the wire and the copy thread."""

    __slots__ = ("engine", "key", "initiator", "op", "conn", "transfer", "deadline", "copier", "ids",
                 "sender_layout", "chunks", "xid", "accepted", "next", "inflight", "finished_chunks",
                 "ready", "dead", "pool", "tid", "region", "notify", "peer_name", "acked", "started", "posted")

    def __init__(self, engine, *, key: int, initiator: bool, op: Op, conn, deadline: float,
                 copier: BlockCopier, ids: np.ndarray, sender_layout: KVLayout, chunks: list[Chunk],
                 pool, transfer: Transfer | None = None, tid: str = "", region: str = "",
                 notify: bytes = b"", peer_name: str = ""):
        self.engine, self.key, self.initiator, self.op, self.conn = engine, key, initiator, op, conn
        self.transfer, self.deadline, self.copier, self.ids = transfer, deadline, copier, ids
        self.sender_layout, self.chunks, self.pool = sender_layout, chunks, pool
        self.tid, self.region, self.notify, self.peer_name = tid, region, notify, peer_name
        self.xid = 0
        self.accepted = False
        self.next = 0  # next chunk to start
        self.inflight = 0  # chunks holding a slot
        self.finished_chunks = 0  # chunks fully sent / scattered
        self.ready: list[tuple[Chunk, Slot]] = []  # gathered, waiting for ACCEPT
        self.posted: set[int] = set()  # chunks whose tag receive is posted and not completed
        self.dead = False
        self.acked = False
        self.started = time.monotonic()

    def __repr__(self) -> str:
        side = "initiator" if self.initiator else "target"
        return (f"Flow(key={self.key}, {side} {self.op.value}, xid={self.xid}, chunks {self.finished_chunks}/"
                f"{len(self.chunks)}, inflight={self.inflight}, dead={self.dead})")

    @property
    def sending(self) -> bool:
        return self.initiator == (self.op is Op.WRITE)

    def wants_slot(self) -> bool:
        if self.dead or self.next >= len(self.chunks) or self.inflight >= self.engine.settings.depth:
            return False
        return self.sending or self.accepted or self.initiator  # a READ initiator posts before REQ

    def all_landed(self) -> bool:
        return self.finished_chunks == len(self.chunks)

    # ---- starting chunks ---------------------------------------------------------------------
    def start_chunk(self, slot: Slot) -> None:
        chunk = self.chunks[self.next]
        self.next += 1
        self.inflight += 1
        if self.sending:
            ids = self.ids[chunk.b0:chunk.b1]
            view, _ = slot.view(chunk.nbytes)
            self.engine.copy(lambda: self.copier.gather(ids, chunk.l0, chunk.l1, view),
                             lambda err: self._gathered(chunk, slot, err))
        else:
            self.engine.recv_chunk(self, chunk, slot)

    def _gathered(self, chunk: Chunk, slot: Slot, err) -> None:
        if self.dead:
            self.engine.release(self, slot)
            return
        if err is not None:
            self.engine.release(self, slot)
            self.engine.fail(self, err)
            return
        if self.accepted:
            self.engine.send_chunk(self, chunk, slot)
        else:
            self.ready.append((chunk, slot))

    def on_accept(self, xid: int) -> None:
        self.accepted = True
        if self.sending:
            self.xid = xid
            ready, self.ready = self.ready, []
            for chunk, slot in ready:
                self.engine.send_chunk(self, chunk, slot)

    # ---- chunk completions -------------------------------------------------------------------
    def sent(self, slot: Slot, err) -> None:
        self.engine.release(self, slot)
        if self.dead:
            return
        if err is not None:
            self.engine.fail(self, err)
            return
        self.finished_chunks += 1  # a READ target then waits for the initiator's FIN

    def received(self, chunk: Chunk, slot: Slot, err) -> None:
        self.posted.discard(chunk.seq)
        if self.dead or err is not None:
            self.engine.release(self, slot)
            if err is not None and not self.dead:
                self.engine.fail(self, err)
            return
        ids = self.ids[chunk.b0:chunk.b1]
        view, _ = slot.view(chunk.nbytes)
        self.engine.copy(lambda: self.copier.scatter(view, ids, chunk.l0, chunk.l1, self.sender_layout),
                         lambda e: self._scattered(slot, e))

    def _scattered(self, slot: Slot, err) -> None:
        self.engine.release(self, slot)
        if self.dead:
            return
        if err is not None:
            self.engine.fail(self, err)
            return
        self.finished_chunks += 1
        if self.all_landed():
            self.engine.landed(self)
