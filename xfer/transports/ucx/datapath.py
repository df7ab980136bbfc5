"""The UCX engine's data path: taking messages off the worker, and moving chunks.

Receiving: nothing is pre-posted. One wildcard probe takes every message the worker holds, in
arrival order: control messages go to the protocol at once (received into a buffer of their
size); a data chunk is handed to its flow (by connection and xid) and waits there until a staging
slot is free for it; a chunk of no live flow is received into a throw-away buffer (a dropped
transfer's late chunks); a chunk whose REQ has not been processed yet (the initiator sends right
behind its REQ) is held on its connection until the REQ is (``EARLY_MAX`` at most). With the raw
back end (io_raw) a host flow's chunk may be received straight into its blocks, and a host flow's
chunk sent straight from them.

Every call here runs on the engine thread; requests are tracked by the engine (``track``).
"""

from __future__ import annotations

import numpy as np

from ...errors import PeerDisconnectedError, XferError
from . import wire

__all__ = ["DataPath", "PROBE_BATCH", "EARLY_MAX"]

PROBE_BATCH = 256  # messages taken per loop turn

# Chunks a connection may hold ahead of their REQs. A well-behaved initiator's early chunks are
# those sent between a REQ and its processing here (one loop turn); far more is a broken or
# hostile peer, whose connection is failed rather than buffered without bound.
EARLY_MAX = 1 << 16


class DataPath:
    def __init__(self, engine, io):
        self.e, self.io = engine, io

    # ---- arrivals ----------------------------------------------------------------------------
    def take(self) -> bool:
        """Take up to PROBE_BATCH messages (any tag) in arrival order; True if any came."""
        got, probe, proto = 0, self.io.probe, self.e.proto
        while got < PROBE_BATCH:
            hit = probe()
            if hit is None:
                break
            tag, msg = hit
            got += 1
            if tag & 0xFFFFFFFF == 0:
                proto.on_ctrl_probe(tag >> 32, msg)
            else:
                self.on_data(tag >> 32, (tag >> 8) & 0xFFFFFF, tag & 0xFF, msg)
        return got > 0

    def on_data(self, conn_id: int, xid: int, seq_byte: int, probe) -> None:
        flow = self.e.flows.receiver(conn_id, xid)
        if flow is None:
            conn = self.e.conns.get(conn_id)
            if conn is not None and not conn.outgoing and not conn.dead and wire.xid_after(xid, conn.xid):
                conn.early.setdefault(xid, []).append((seq_byte, probe))  # its REQ is on its way
                conn.n_early += 1
                if conn.n_early > EARLY_MAX:
                    self.e.conns.fail(conn, PeerDisconnectedError(
                        f"peer {conn.name!r} sent more than {EARLY_MAX} chunks of transfers it never requested"))
            else:
                self.sink(probe)  # a dropped (or refused) transfer's late chunk
            return
        err = flow.arrive(probe, seq_byte)
        if err is not None:
            self.sink(probe)
            self.e.flows.fail(flow, err)
            return
        self.e.slots.want(flow)

    def adopt_early(self, conn, xid: int, flow) -> None:
        """Chunks of ``xid`` that arrived before its REQ: to ``flow``, or discarded (flow None)."""
        early = conn.early.pop(xid, ())
        conn.n_early -= len(early)
        for seq_byte, probe in early:
            if flow is None or flow.dead:
                self.sink(probe)
            else:
                self.on_data(conn.local_id, xid, seq_byte, probe)

    def sink(self, probe) -> None:
        """Receive a probed message nobody wants into a throw-away buffer (UCX must consume it)."""
        buf = np.empty(max(probe.length, 1), dtype=np.uint8)
        try:
            self.recv(buf, probe, lambda err, b=buf: None)
        except Exception:  # its endpoint is gone: nothing to consume
            pass

    # ---- messages ----------------------------------------------------------------------------
    def send(self, conn, buf, tag: int, cb) -> None:
        """Tag-send ``buf`` (a numpy array or a CUDA tensor, contiguous); ``cb(error or None)`` once done."""
        self.e.track(self.io.send(conn, buf, tag), cb)

    def recv(self, buf, probe, cb) -> None:
        """Receive a probed message into ``buf`` (a numpy array or a CUDA tensor, contiguous)."""
        self.e.track(self.io.recv(buf, probe), cb)

    # ---- chunks ------------------------------------------------------------------------------
    def send_chunk(self, flow, chunk, slot) -> None:
        """A gathered chunk from its slot."""
        flow.sends += 1
        _, wire_view = slot.view(chunk.nbytes)
        if flow.conn.dead:
            flow.sent(slot, flow.conn.error)
            return
        cb = lambda err: flow.sent(slot, self.ucx_error(flow, err))  # noqa: E731
        self.send(flow.conn, wire_view, wire.data_tag(flow.conn.remote_id, flow.xid, chunk.seq),
                  device_req(flow, cb) if slot.device else cb)

    def send_iov(self, flow, chunk, slot, iov: np.ndarray) -> None:
        """A chunk straight from the blocks (``iov``: their addresses in staging order)."""
        flow.sends += 1
        if flow.conn.dead or flow.conn.closed:  # a closed endpoint's handle may already be freed
            flow.sent(slot, flow.conn.error or PeerDisconnectedError(
                f"UCX endpoint to peer {flow.conn.name!r} closed; transfer {flow.tid or flow.key} reports no "
                f"block complete"))
            return
        tag = wire.data_tag(flow.conn.remote_id, flow.xid, chunk.seq)
        self.e.track(self.io.send_iov(flow.conn, iov, tag), lambda err: flow.sent(slot, self.ucx_error(flow, err)))

    def recv_chunk(self, flow, chunk, slot, probe) -> None:
        flow.receiving += 1
        if flow.iov_rx:  # straight into the blocks (the slot only counts toward the pool's flow control)
            iov = flow.copier.iov(flow.ids[chunk.b0:chunk.b1], chunk.l0, chunk.l1)
            self.e.track(self.io.recv_iov(probe, iov),
                         lambda err: flow.landed_in_place(slot, self.ucx_error(flow, err)))
            return
        _, wire_view = slot.view(chunk.nbytes)
        cb = lambda err: flow.received(chunk, slot, self.ucx_error(flow, err))  # noqa: E731
        self.recv(wire_view, probe, device_req(flow, cb) if slot.device else cb)

    @staticmethod
    def ucx_error(flow, err):
        """The typed error a chunk's UCX failure is reported as (its connection's, if it failed)."""
        if err is None or isinstance(err, XferError):
            return err
        if flow.conn.error is not None:
            return flow.conn.error
        return PeerDisconnectedError(f"UCX failed a chunk of transfer {flow.tid or flow.key} with peer "
                                     f"{flow.conn.name!r}: {err}")


def device_req(flow, cb):
    """``cb`` for a UCX request of ``flow`` on device memory: counted in flight until it ends
    (the engine polls while any is: a ``cuda_ipc`` completion wakes no fd)."""
    flow.dev_reqs += 1

    def ended(err):
        flow.dev_reqs -= 1
        cb(err)
    return ended
