"""The UCX engine's data path: taking messages off the worker, and moving chunks.

Receiving: nothing is pre-posted. One wildcard probe takes every message the worker holds, in
arrival order: control messages go to the protocol at once; a data chunk is matched to its flow
by its tag (wire.py: the connection, the transfer's xid, and 32 bits keyed with the connection's
tag key, checked against the chunk the flow expects next, ``Conn.chunk_bits``) and waits there
until a staging slot is free for it. A chunk whose REQ has not been processed yet (the initiator
sends right behind its REQ) is held on its connection until the REQ is, once its tag verified
(``early_chunks`` at most, then the peer's connection is failed). Anything else is drained: a
zero-length receive that UCX truncates consumes the message without a buffer of its size (a
dropped transfer's late chunk quietly; a chunk whose tag does not verify, or a message for no
open connection, logged). With the raw back end (io_raw) a host flow's chunk may be received
straight into its blocks, and a host flow's chunk sent straight from them.

Every call here runs on the engine thread; requests are tracked by the engine (``track``).
"""

from __future__ import annotations

import time

import numpy as np

from ...errors import PeerDisconnectedError, XferError
from . import wire

__all__ = ["DataPath", "PROBE_BATCH"]

PROBE_BATCH = 256  # messages taken per loop turn


class DataPath:
    def __init__(self, engine, io):
        self.e, self.io = engine, io
        self.drained = 0  # messages drained unreceived (late, forged, oversized, unknown)

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
            try:
                if (tag >> 32) & 0xFFFF == 0:
                    proto.on_ctrl_probe(tag >> 48, msg)
                else:
                    self.on_data(tag >> 48, (tag >> 32) & 0xFFFF, tag & 0xFFFFFFFF, msg)
            except Exception as exc:  # noqa: BLE001 - no message may stop the engine (a bug: logged)
                proto.rejections("error", "handling a message of tag %#018x failed: %r", tag, exc)
        proto.gate.expire(time.monotonic())
        return got > 0

    def on_data(self, conn_id: int, low: int, bits: int, probe) -> None:
        conn = self.e.conns.get(conn_id)
        if conn is None or conn.dead:
            return self.drain(probe, "unknown", f"a {probe.length}-byte chunk for connection {conn_id}, which is not "
                                                f"open here")
        if conn.session is None:  # its hello (UCX's stream) is still on its way: checked once it is in
            if conn.n_early >= self.e.settings.early_chunks:
                return self.drain(probe, "early", f"a chunk for connection {conn_id} before its hello, past "
                                                  f"early_chunks")
            conn.early.setdefault(None, []).append((low, bits, probe))
            conn.n_early += 1
            return
        xid = wire.full_xid(low, conn.xid)
        flow = self.e.flows.receiver(conn_id, xid)
        if flow is not None:
            if bits != conn.chunk_bits(xid, flow.arrived, False):
                return self.drain(probe, "forged", f"a chunk on connection {conn_id} ({conn.name!r}) for transfer "
                                                   f"{flow.tid} whose tag does not verify (not from its peer)")
            err = flow.arrive(probe, flow.arrived & 0xFF)
            if err is not None:
                self.sink(probe)
                self.e.flows.fail(flow, err)
                return
            self.e.slots.want(flow)
            return
        if conn.outgoing or not wire.xid_after(xid, conn.xid):
            self.sink(probe)  # a dropped (or refused) transfer's late chunk
            return
        held = conn.early.setdefault(xid, [])
        if bits != conn.chunk_bits(xid, len(held), False):
            if not held:
                del conn.early[xid]
            return self.drain(probe, "forged", f"a chunk on connection {conn_id} ({conn.name!r}) ahead of its "
                                               f"request whose tag does not verify (not from its peer)")
        held.append((bits, probe))  # its REQ is on its way
        conn.n_early += 1
        if conn.n_early > self.e.settings.early_chunks:
            self.e.proto.gate.fail(conn, "early", f"it sent more than {self.e.settings.early_chunks} chunks ahead of "
                                                  f"their requests (early_chunks)")

    def after_hello(self, conn) -> None:
        """The chunks that came before ``conn``'s hello, checked now that its session exists."""
        early = conn.early.pop(None, ())
        conn.n_early -= len(early)
        for low, bits, probe in early:
            self.on_data(conn.local_id, low, bits, probe)

    def adopt_early(self, conn, xid: int, flow) -> None:
        """Chunks of ``xid`` that arrived before its REQ: to ``flow``, or discarded (flow None; xid
        None: those that came before the hello)."""
        early = conn.early.pop(xid, ())
        conn.n_early -= len(early)
        for *_, bits, probe in early:
            if flow is None or flow.dead:
                self.sink(probe)
            else:
                self.on_data(conn.local_id, xid & 0xFFFF, bits, probe)

    def discard_ctrl(self, conn) -> None:
        """A failed connection's queued control messages: those not received yet are drained."""
        for probe, buf, _, _ in conn.ctrl_in:
            if buf is None:
                self.sink(probe)
        conn.ctrl_in.clear()

    def sink(self, probe) -> None:
        """Consume a probed message nobody wants, unreceived (UCX truncates a zero-length receive)."""
        self.drained += 1
        try:
            self.e.track(self.io.drain(probe), lambda err: None)
        except Exception:  # its endpoint is gone: nothing to consume
            pass

    def drain(self, probe, reason: str, why: str) -> None:
        """``sink``, and log why (a rejection: rate-limited, counted by ``reason``)."""
        self.e.proto.rejections(reason, "drained %s", why)
        self.sink(probe)

    # ---- messages ----------------------------------------------------------------------------
    def send(self, conn, buf, tag: int, cb) -> None:
        """Tag-send ``buf`` (a numpy array or a CUDA tensor, contiguous); ``cb(error or None)`` once done."""
        self.e.track(self.io.send(conn, buf, tag), cb)

    def recv(self, buf, probe, cb) -> None:
        """Receive a probed message into ``buf`` (a numpy array or a CUDA tensor, contiguous)."""
        self.e.track(self.io.recv(buf, probe), cb)

    def recv_now(self, buf, probe, cb) -> None:
        """``recv``, calling ``cb`` right here when the receive completed at once (a small message:
        a control message is then handled before the next message is probed)."""
        req = self.io.recv(buf, probe)
        if not req.completed:
            self.e.track(req, cb)
            return
        cb(wire.request_error(req))

    # ---- chunks ------------------------------------------------------------------------------
    def send_chunk(self, flow, chunk, slot) -> None:
        """A gathered chunk from its slot."""
        flow.sends += 1
        _, wire_view = slot.view(chunk.nbytes)
        if flow.conn.dead:
            flow.sent(slot, flow.conn.error)
            return
        cb = lambda err: flow.sent(slot, self.ucx_error(flow, err))  # noqa: E731
        self.send(flow.conn, wire_view, flow.conn.chunk_tag(flow.xid, chunk.seq),
                  device_req(flow, cb) if slot.device else cb)

    def send_iov(self, flow, chunk, slot, iov: np.ndarray) -> None:
        """A chunk straight from the blocks (``iov``: their addresses in staging order)."""
        flow.sends += 1
        if flow.conn.dead or flow.conn.closed:  # a closed endpoint's handle may already be freed
            flow.sent(slot, flow.conn.error or PeerDisconnectedError(
                f"UCX endpoint to peer {flow.conn.name!r} closed; transfer {flow.tid or flow.key} reports no "
                f"block complete"))
            return
        tag = flow.conn.chunk_tag(flow.xid, chunk.seq)
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
