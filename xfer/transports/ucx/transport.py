"""The ``ucx`` transport: blocks between agents on any hosts, through UCX (ucxx).

Data path (pipelined, two-sided): the sender gathers a chunk of blocks (all layers, K and V)
into a slot of a staging pool and tag-sends it; the receiver tag-receives into a slot of its
pool and scatters it. Host blocks of at least ``iov_min_bytes`` skip the gather: one UCX
scatter-gather send straight from the blocks; host blocks of at least ``iov_recv_min_bytes``
(any, by default) skip the scatter: one scatter-gather receive straight into them, where both
sides use the same block order and ``iov_recv`` (io_raw.py). Successive chunks overlap (up to
``depth`` in flight per transfer), and every transfer, whatever its size, uses at most ``slots``
slots of ``chunk_bytes`` per host memory kind (``device_slots`` of ``device_chunk_bytes`` on a
GPU). A CUDA region's gathers and scatters are queued on its copy stream by the engine, which
polls their events. Chunks above UCX's rendezvous threshold move by rendezvous: zero-copy RDMA
on InfiniBand with a verbs-enabled UCX, GPU-direct from device staging when UCX has CUDA support
(else CUDA blocks are staged through pinned host memory, and ``Transfer.path`` says so).

Control: a listener per agent (published in ``info()``); connections from peer metadata, a hello
that checks the peer's identity; each transfer starts with a request the target validates
(region, layout fingerprint, block ids) before any byte of its region is read or written (a
WRITE's chunks follow the request at once and wait, outside any staging slot, until it is
validated, or are discarded), and ends when the receiving side has landed every byte, delivered
its notification and acknowledged. Staging slots cannot deadlock (argued in slots.py).
Deadlines bound every wait; a dead peer or cut link fails the affected transfers (typed errors),
and the receiving side never delivers a notification for a transfer it dropped. A stop (cancel,
deadline) is a fence on both sides: the initiator sends CANCEL and reports the transfer ended
once the target answered STOPPED (its side dropped, its chunks settled) and its own chunks
settled; without an answer within ``settings.fence.grace_s`` the connection is closed (tables.py,
docs/reliability.md). Known gap: when every byte landed and the connection dies before the
acknowledgement arrives (a cut link, a lost host), the peer has been notified while the
initiator reports FAILED or TIMED_OUT. This is the two-generals problem (whichever side decides
last, a message that can be lost decides for the other): no protocol closes it; the blocks are
whole (a complete block reported failed, never a partial one reported complete), and the soak
counts such transfers apart. A second known limit: chunks sent eagerly (below UCX's rendezvous threshold)
that arrive faster than they are scattered wait in UCX's own unexpected-message buffers (bounded
by the transfers in flight, not by the staging slots).

The package, one concern a file: ``wire`` (format), ``conn`` (a connection), ``tables`` (the
connection and flow tables), ``flow`` (one transfer), ``slots`` and ``staging`` (slot pools,
gathers and scatters), ``datapath`` (arrivals and chunk I/O), ``io_raw`` / ``io_ucxx`` (the two
I/O back ends, one chosen when the engine starts and named in ``info()["io"]``), ``protocol``
(control messages) and ``loop`` (the engine thread and its progress model).

Settings: :class:`xfer.settings.UcxSettings` (``AgentConfig.settings.ucx``; ``XFER_UCX_*``
variables); UCX's own ``UCX_*`` variables (``UCX_TLS``, ``UCX_NET_DEVICES``,
``UCX_MAX_RNDV_RAILS``) apply.
"""

from __future__ import annotations

import os
import socket

from ...errors import PeerDisconnectedError, TransportError
from ...metadata import RegionRecord
from ...settings import UcxSettings
from ...transfer import Op
from .. import TransportKind
from ..base import Job, LocalRegion, PeerHandle, Transport
from ..completion import end_grants_soon
from .wire import VERSION

__all__ = ["UcxTransport"]


def _import_ucxx():
    # ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer knows: UCX would warn on every start
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as libucxx  # noqa: F401  (the synchronous core API)
    from ucxx._lib.arr import Array

    class _Ucx:  # what the engine uses, in one place
        pass

    _Ucx.libucxx, _Ucx.Array = libucxx, Array
    return _Ucx


class UcxTransport(Transport):
    kind = TransportKind.UCX

    def __init__(self, ctx, settings: UcxSettings | None = None) -> None:
        super().__init__(ctx)
        from .loop import Engine

        self.settings = settings or ctx.config.settings.ucx
        self._engine = Engine(ctx, self.settings, _import_ucxx())
        self._closed = False
        self.address = self.settings.address or self._default_address()

    @classmethod
    def probe(cls) -> str | None:
        try:
            _import_ucxx()
        except ImportError as exc:
            return f"ucx: needs ucxx (pip install ucxx-cu12 or ucxx-cu13), which cannot be imported: {exc}"
        return None

    def _default_address(self) -> str:
        host = self.ctx.config.listen_host
        if host in ("", "0.0.0.0", "::"):
            try:
                return socket.gethostbyname(socket.gethostname())
            except OSError:
                return "127.0.0.1"
        return host

    def info(self) -> dict:
        e = self._engine
        return {"version": VERSION, "address": self.address, "port": e.port, "host_id": self.ctx.host_id,
                "cuda": bool(e.context.cuda_support), "tls": e.context.config.get("TLS", ""),
                "chunk_bytes": self.settings.chunk_bytes, "device_chunk_bytes": self.settings.device_chunk_bytes,
                # the block sizes from which this side sends / receives host blocks in place (None:
                # never): the initiator plans fewer chunks where either side does (protocol)
                "iov_min_bytes": self.settings.iov_min_bytes if e.io.sends_in_place else None,
                "iov_recv_min_bytes": self.settings.iov_recv_min_bytes if e.io.receives_in_place else None,
                "io": e.io.name,  # the I/O back end, chosen once (io_raw or io_ucxx)
                "bind": e.listener.ip}  # the address the listener is bound to (listener.py)

    def export_region(self, region: LocalRegion) -> dict | None:
        return {"device": str(region.device)}

    def check_route(self, local: LocalRegion, peer: PeerHandle, peer_region: RegionRecord, op: Op) -> str | None:
        info = peer.metadata.transports.get(self.kind.value)
        if not info or not info.get("address") or not info.get("port"):
            return f"peer {peer.name!r} offers no ucx listener"
        if info.get("version") != VERSION:
            return f"peer {peer.name!r} speaks ucx wire version {info.get('version')!r}, this agent {VERSION}"
        if local.device.type not in ("cpu", "cuda"):
            return f"the ucx transport moves host or CUDA memory, local region is on {local.device}"
        if self._closed:
            return "the ucx transport is closed"
        return None

    def takes_grant(self, job: Job) -> bool:
        return True  # its REQ names the grant; the target ends it as it takes the transfer's own hold

    def post(self, job: Job) -> None:
        if self._closed:
            end_grants_soon(job, self.ctx.agent_name)
            job.transfer.fail(TransportError("ucx transport is closed"))
            return
        self._engine.call_soon(self._engine.proto.start, job)

    def disconnect(self, peer_agent_id: str) -> None:
        def drop():
            conn = self._engine.conns.outgoing(peer_agent_id)
            if conn is not None:
                self._engine.conns.fail(conn, PeerDisconnectedError(
                    f"peer {conn.name!r} was disconnected (or reconnected with new metadata)"))
        if not self._closed:
            self._engine.call_soon(drop)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine.close()
