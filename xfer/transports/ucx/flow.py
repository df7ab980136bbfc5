"""One transfer as the UCX engine drives it, on either side.

A flow either *sends* chunks (gather into a slot -> tag send; host blocks: one scatter-gather
send from the blocks) or *receives* them (a chunk has arrived -> tag receive into a slot ->
scatter; host blocks: one scatter-gather receive into the blocks), at most ``depth`` chunks
holding a slot at once, slots taken from a shared pool in round-robin order among flows (see
slots.py for why this cannot deadlock). Roles:

    initiator, WRITE   sends from the start (no wait for the target); done on the target's ACK
    target,    WRITE   receives; after the last scatter delivers the notification, sends ACK
    initiator, READ    receives; after the last scatter sends FIN, done on the target's ACK
    target,    READ    sends once the REQ is valid; on FIN delivers the notification, sends ACK

Ending one (tables.Flows): a flow counts its chunks in flight (``inflight``: from taking a slot to
giving it back, gather, UCX request and scatter included); a dropped or stopping flow starts
nothing more and tells the table once the last one ended (``settled``), its fence.

Every method here runs on the engine thread; the copy thread only runs ``gather``/``scatter``.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from ...errors import PeerDisconnectedError
from ...layout import KVLayout
from ...transfer import Op, Transfer
from ..chunking import Chunk
from .staging import BlockCopier, Slot, host_rows

__all__ = ["Flow", "in_place", "peer_in_place"]

# Receives of one flow posted at once. One: a rendezvous chunk then has the wire to itself and
# lands whole before the next starts, so its scatter overlaps the next chunk's wire time (with
# several posted together UCX interleaves them and they all land at the end, scatters exposed).
RECV_AHEAD = 1
# A chunk received in place has no scatter to overlap: a second receive posted lets UCX start the
# next chunk's rendezvous while the engine handles the first one's end (CPU VM, loopback, same
# runs: 64 MiB case 2.47-2.63 GB/s with one, 2.79-2.80 with two, 2.96 with four)
RECV_AHEAD_IN_PLACE = 2
# Device chunks: the next chunk's cuda_ipc copy (or RDMA) runs while the engine launches this one's
# scatter (~0.1-0.3 ms of host time on the H200 VM); with one posted, that time added to every chunk
RECV_AHEAD_DEVICE = 2


def in_place(engine, sending: bool, copier: BlockCopier, pool, sender_layout: KVLayout) -> bool:
    """Whether this side's chunks move straight from (``sending``) or into its blocks: host rows,
    blocks of at least ``iov_min_bytes`` (a send) or ``iov_recv_min_bytes`` (a receive), an I/O
    back end that can (io_raw); a receive also needs the sender's block order (the bytes land as
    they were laid out)."""
    st = engine.settings
    if not (copier.rows and pool.kind == "host"
            and sender_layout.block_nbytes >= (st.iov_min_bytes if sending else st.iov_recv_min_bytes)):
        return False
    if sending:
        return engine.io.sends_in_place
    return engine.io.receives_in_place and sender_layout.inner_order == copier.layout.inner_order


def peer_in_place(info: dict, peer_region, peer_sends: bool, sender_layout: KVLayout) -> bool:
    """Whether the peer moves its side of a transfer in place (the mirror of ``in_place``), judged
    from its published UCX ``info`` (``iov_min_bytes`` / ``iov_recv_min_bytes``: None where its raw
    binding, or that direction of it, is off) and its region's record: host rows, blocks big enough,
    and for a receive the sender's block order. A peer that publishes neither (an older agent)
    counts as staging."""
    least = info.get("iov_min_bytes" if peer_sends else "iov_recv_min_bytes")
    if not isinstance(least, int) or isinstance(least, bool) or least < 0:
        return False
    layout = peer_region.layout
    if str(peer_region.device) != "cpu" or not host_rows(layout) or sender_layout.block_nbytes < least:
        return False
    return peer_sends or sender_layout.inner_order == layout.inner_order


class Flow:
    """State of one transfer; ``engine`` supplies slots, the wire and the copy thread."""

    __slots__ = ("engine", "key", "initiator", "op", "conn", "transfer", "deadline", "copier", "ids",
                 "sender_layout", "chunks", "xid", "next", "inflight", "finished_chunks", "arrived",
                 "pending", "dead", "pool", "tid", "region", "notify", "peer_name", "started", "sending",
                 "depth", "queued", "receiving", "ready", "iov", "iov_rx", "held", "dev_reqs", "stopping",
                 "stop_until", "peer_fenced", "confirm", "hold", "requested", "fin_sent", "peer_pid", "sends")

    def __init__(self, engine, *, key: int, initiator: bool, op: Op, conn, deadline: float,
                 copier: BlockCopier, ids: np.ndarray, sender_layout: KVLayout, chunks: tuple[Chunk, ...],
                 pool, transfer: Transfer | None = None, tid: str = "", region: str = "",
                 notify: bytes = b"", peer_name: str = ""):
        self.engine, self.key, self.initiator, self.op, self.conn = engine, key, initiator, op, conn
        self.transfer, self.deadline, self.copier, self.ids = transfer, deadline, copier, ids
        self.sender_layout, self.chunks, self.pool = sender_layout, chunks, pool
        self.tid, self.region, self.notify, self.peer_name = tid, region, notify, peer_name
        self.sending = initiator == (op is Op.WRITE)
        self.depth = engine.settings.depth
        self.xid = 0
        self.next = 0  # next chunk to start (gather, or receive of an arrived one)
        self.inflight = 0  # chunks holding a slot
        self.finished_chunks = 0  # chunks fully sent / scattered
        self.arrived = 0  # receiving: chunks seen by the engine's probe (in send order)
        self.pending: collections.deque = collections.deque()  # receiving: arrived, not yet received
        self.receiving = 0  # receives posted, not completed (at most RECV_AHEAD, RECV_AHEAD_IN_PLACE)
        self.dead = False
        self.queued = False  # in the engine's queue of flows wanting a slot
        self.started = time.monotonic()
        self.ready = None  # initiator, CUDA region: the caller's stream event the first copy waits for
        # sending from host rows: each chunk goes out as UCX scatter-gather from the blocks themselves
        # (its slot is then only a token of the pool's flow control; see io_raw)
        self.iov = self.sending and in_place(engine, True, copier, pool, sender_layout)
        # receiving into host rows of the sender's block order: each chunk lands straight in the
        # blocks (UCX scatter-gather receive), no slot and no scatter; a failure is then held until
        # UCX ended the chunk's receive (Flows.fail)
        self.iov_rx = not self.sending and in_place(engine, False, copier, pool, sender_layout)
        self.held = None  # (error, notify_peer) of a failure waiting for its chunks in flight to end
        self.dev_reqs = 0  # UCX requests on device slots in flight (the engine polls meanwhile)
        # initiator: the error of a stop under way (tables.Flows.stop), when to close the connection
        # if the target has not confirmed it by then, and whether it did (STOPPED, REFUSE, CANCEL)
        self.stopping, self.stop_until, self.peer_fenced = None, 0.0, False
        self.confirm = False  # target: the initiator stopped it; send STOPPED once settled
        self.hold = None  # target: its hold on the blocks (xfer.transports.grants)
        self.requested = False  # initiator: its REQ left (else it waits for the hello round)
        self.fin_sent = False  # initiator of a READ: every chunk landed, FIN sent (the target may deliver)
        self.peer_pid = None  # initiator: the peer's process where it runs on this host (its death is seen)
        self.sends = 0  # UCX sends in flight (on a closed connection they may never end, nor touch anything)

    def __repr__(self) -> str:
        side = "initiator" if self.initiator else "target"
        return (f"Flow(key={self.key}, {side} {self.op.value}, xid={self.xid}, chunks {self.finished_chunks}/"
                f"{len(self.chunks)}, inflight={self.inflight}, dead={self.dead})")

    def progress(self) -> str:
        """Where the flow stands, for its timeout message."""
        pool, n = self.pool, len(self.chunks)
        what = (f"{self.finished_chunks}/{n} chunks sent, {self.inflight} in flight" if self.sending else
                f"{self.arrived}/{n} chunks arrived, {self.finished_chunks} landed, {self.inflight} in flight")
        return f"{what}; staging slots free {len(pool)}/{pool.count}, held by sends {pool.sends}"

    def settled(self) -> bool:
        """No chunk of it can touch its blocks or slots any more: none in flight, or, once its
        connection is closed, none but UCX sends (a force-closed endpoint moves nothing more; UCX
        may never end a rendezvous send to a frozen peer, but nothing of it leaves or lands)."""
        return self.inflight - (self.sends if self.conn.dead else 0) <= 0

    def could_deliver(self) -> bool:
        """Initiator: whether the target may deliver this transfer (it had, or may still get,
        every chunk of a WRITE; the FIN of a READ)."""
        return self.fin_sent if self.op is Op.READ else self.next >= len(self.chunks)

    def wants_slot(self) -> bool:
        if self.dead or self.stopping is not None or self.inflight >= self.depth:
            return False
        if self.sending:  # chunks go out once the hello named the peer's connection id (after the REQ)
            return self.next < len(self.chunks) and self.conn.ready
        ahead = RECV_AHEAD_IN_PLACE if self.iov_rx else (RECV_AHEAD_DEVICE if self.pool.kind.startswith("cuda")
                                                         else RECV_AHEAD)
        return bool(self.pending) and self.receiving < ahead

    def all_landed(self) -> bool:
        return self.finished_chunks == len(self.chunks)

    # ---- arrivals (receiving) ----------------------------------------------------------------
    def arrive(self, probe, seq_byte: int) -> Exception | None:
        """A probed chunk for this flow: the ``arrived``-th sent. None, or why it is a protocol error."""
        k = self.arrived
        if k >= len(self.chunks):
            return PeerDisconnectedError(f"peer {self.conn.name!r} sent more chunks than transfer {self.tid} has")
        if seq_byte != k & 0xFF or probe.length != self.chunks[k].nbytes:
            return PeerDisconnectedError(f"peer {self.conn.name!r} sent chunk {seq_byte} ({probe.length} bytes) of "
                                         f"transfer {self.tid} where chunk {k} ({self.chunks[k].nbytes} bytes) was due")
        self.arrived += 1
        self.pending.append(probe)
        return None

    # ---- starting chunks ---------------------------------------------------------------------
    def start_chunk(self, slot: Slot) -> None:
        chunk = self.chunks[self.next]
        self.next += 1
        self.inflight += 1
        if self.sending:
            ids = self.ids[chunk.b0:chunk.b1]
            if self.iov:
                self.engine.data.send_iov(self, chunk, slot, self.copier.iov(ids, chunk.l0, chunk.l1))
                return
            view, _ = slot.view(chunk.nbytes)
            if self.copier.stream is not None:  # CUDA region: queued here, its event polled by the engine
                self.engine.copy_device(
                    lambda: self.copier.gather_async(ids, chunk.l0, chunk.l1, view, self._take_ready()),
                    lambda err: self._gathered(chunk, slot, err))
                return
            self.engine.copy(lambda: (self._wait_ready(), self.copier.gather(ids, chunk.l0, chunk.l1, view)),
                             lambda err: self._gathered(chunk, slot, err), chunk.nbytes)
        else:
            self.engine.data.recv_chunk(self, chunk, slot, self.pending.popleft())

    def _free(self, slot: Slot) -> None:
        """A chunk of this flow ended: its slot back; a dropped or stopping flow settled with its last."""
        self.engine.slots.release(self, slot)
        if (self.dead or self.stopping is not None) and self.settled():
            self.engine.flows.on_settled(self)

    def _ended_early(self, slot: Slot, err) -> bool:
        """End a chunk that must not go on (the flow ended or stops, or it failed); True if so."""
        if not (self.dead or self.stopping is not None or err is not None):
            return False
        if err is not None and not self.dead and self.stopping is None:
            self.engine.flows.fail(self, err)  # this chunk counts in flight until freed just below
        self._free(slot)
        return True

    def _gathered(self, chunk: Chunk, slot: Slot, err) -> None:
        if self._ended_early(slot, err):
            return
        if self.transfer is not None and chunk.seq == 0:
            self.transfer.mark("gathered")  # the first chunk (the pipeline's exposed head)
        self.engine.data.send_chunk(self, chunk, slot)

    # ---- chunk completions -------------------------------------------------------------------
    def _chunk_ended(self, slot: Slot, err) -> bool:
        """Free the chunk's slot; True when it counts (the flow lives and the chunk succeeded)."""
        if self._ended_early(slot, err):
            return False
        self.engine.slots.release(self, slot)
        self.finished_chunks += 1
        return True

    def sent(self, slot: Slot, err) -> None:
        self.sends -= 1
        if self._chunk_ended(slot, err) and self.transfer is not None and self.all_landed():
            self.transfer.mark("sent")  # UCX completed the last chunk's send; the peer's ACK follows
        # a READ target then waits for the initiator's FIN

    def received(self, chunk: Chunk, slot: Slot, err) -> None:
        self.receiving -= 1
        if self._ended_early(slot, err):  # a stopped flow scatters nothing more into its blocks
            return
        ids = self.ids[chunk.b0:chunk.b1]
        view, _ = slot.view(chunk.nbytes)
        self.engine.slots.want(self)  # the next arrived chunk can be received while this one is scattered
        if self.copier.stream is not None:  # CUDA region: queued here, its event polled by the engine
            self.engine.copy_device(
                lambda: self.copier.scatter_async(view, ids, chunk.l0, chunk.l1, self.sender_layout,
                                                  self._take_ready()),
                lambda e: self._scattered(slot, e))
            return
        self.engine.copy(lambda: (self._wait_ready(),
                                  self.copier.scatter(view, ids, chunk.l0, chunk.l1, self.sender_layout)),
                         lambda e: self._scattered(slot, e), chunk.nbytes)

    def landed_in_place(self, slot: Slot, err) -> None:
        """A chunk received straight into the blocks ended (``err``: UCX's failure)."""
        self.receiving -= 1
        if self._chunk_ended(slot, err) and self.all_landed():
            if self.transfer is not None:
                self.transfer.mark("landed")
            self.engine.proto.landed(self)

    def _wait_ready(self) -> None:
        """On the copy thread, before the first copy touching the local blocks: let the work the
        caller queued on its stream before posting (``Job.ready``) finish."""
        ready, self.ready = self.ready, None
        if ready is not None:
            ready.synchronize()

    def _take_ready(self):
        """The caller's stream event for the first copy to wait on (on the GPU), once."""
        ready, self.ready = self.ready, None
        return ready

    def _scattered(self, slot: Slot, err) -> None:
        if self._chunk_ended(slot, err) and self.all_landed():
            if self.transfer is not None:
                self.transfer.mark("landed")  # READ: every chunk scattered here; FIN and the ACK follow
            self.engine.proto.landed(self)
