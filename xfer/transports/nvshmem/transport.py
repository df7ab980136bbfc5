"""The ``nvshmem`` transport: KV blocks between the PEs of one NVSHMEM group (nvshmem4py).

Exists only when the agent is configured with an :class:`~xfer.config.NvshmemGroup` (NVSHMEM PEs
form a fixed group, collectively, at construction); every agent of the group offers it and the
selection policy takes it when both agents do and ``check_route`` accepts the pair.

Two paths, chosen per transfer:

- *staged* (any two PEs, across nodes too): the source gathers the blocks (all layers, K/V) chunk by
  chunk into its symmetric send area, ``putmem_signal_on_stream`` moves each chunk into the
  receiver's slot and sets a signal word; the receiver's stream waits on it, scatters and returns a
  credit (:mod:`~xfer.transports.nvshmem.lanes`). A WRITE starts with ``nvshmem.begin`` (the receiver
  validates region, layout fingerprint, block ids) and ends with ``nvshmem.finish`` once the sender
  saw the last credit: the receiver delivers the notification, acknowledges, and the transfer is
  DONE. A READ asks the holder with ``nvshmem.read``; the initiator scatters, then notifies the
  holder. Staging: ``staging_bytes`` per peer PE, half for each initiator role, in DEPTH chunks.
- *direct* (the peer region lives on the symmetric heap, allocated with :meth:`symmetric_empty` or
  registered with :meth:`register_symmetric`, and NVSHMEM maps the peer's memory here, i.e. inside
  a node): one ``copy_blocks`` launch reads or writes the peer's blocks through ``nvshmem_ptr``,
  no staging; then the usual notify round trip (:mod:`~xfer.transports.onesided.transport`).

``stats`` counts what each path carried. Deadlines, what a failed transfer may leave behind and
teardown: see :mod:`~xfer.transports.nvshmem.lanes` and :mod:`~xfer.transports.nvshmem.runtime`; the
transfers, per role and side: :mod:`~xfer.transports.nvshmem.items`; messages: :mod:`~xfer.transports.nvshmem.proto`.
"""

from __future__ import annotations

import collections
import importlib.util
import math
import os
import threading

import torch

from ...errors import AgentClosedError, InvalidArgumentError, TransportError, TransportUnavailableError, XferError
from ...metadata import RegionRecord
from ...transfer import Op
from .. import TransportKind
from . import runtime as nvshmem_runtime
from . import lanes
from . import proto
from ..base import Job, LocalRegion, PeerHandle, Transport
from .items import ReadReceive, Receive, ServeRead, WriteSend
from ..completion import complete_notified
from ..onesided import OneSidedTransport

__all__ = ["NvshmemTransport", "check_group"]


def check_group(group) -> None:
    """What ``NvshmemGroup.__post_init__`` does not check yet; raises InvalidArgumentError."""
    name = getattr(group, "name", None)
    if not isinstance(name, str) or not name or any(c in name for c in "/ \t\n"):
        raise InvalidArgumentError(f"NvshmemGroup.name must be a non-empty str without '/' or spaces, got {name!r}")
    if not isinstance(group.store, str) or "://" not in group.store:
        raise InvalidArgumentError(f"NvshmemGroup.store must be a store URL such as 'tcp://HOST:PORT', "
                                   f"got {group.store!r}")
    if group.device is not None and (not isinstance(group.device, int) or isinstance(group.device, bool)
                                     or group.device < 0):
        raise InvalidArgumentError(f"NvshmemGroup.device must be a CUDA device index or None, got {group.device!r}")
    for field in ("init_timeout_s", "close_timeout_s"):
        value = getattr(group, field, 1.0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise InvalidArgumentError(f"NvshmemGroup.{field} must be a finite number of seconds > 0, got {value!r}")


class _DirectPath(OneSidedTransport):
    """One ``copy_blocks`` straight into (or out of) the peer's symmetric KV pool."""

    kind = TransportKind.NVSHMEM

    def __init__(self, ctx, owner: NvshmemTransport) -> None:
        self._owner = owner
        super().__init__(ctx)

    def check_route(self, local, peer, peer_region, op) -> str | None:
        return None  # the owner decided

    def map_peer(self, job: Job) -> list[torch.Tensor]:
        views = self._owner.peer_views(job)
        if views is None:
            raise TransportError(f"peer {job.peer.name!r} region {job.peer_region.name!r} is no longer mapped")
        return views

    def stream(self, job: Job):
        return self._owner.rt.direct_stream()


class NvshmemTransport(Transport):
    kind = TransportKind.NVSHMEM

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        group = ctx.config.nvshmem
        if group is None:
            raise TransportUnavailableError("no NvshmemGroup configured (AgentConfig.nvshmem is None)")
        check_group(group)
        self.rt = nvshmem_runtime.acquire(group, ctx.host_id)
        self.stats: collections.Counter = collections.Counter()
        self._closed = False
        self._direct: _DirectPath | None = None
        self._views: dict[tuple[str, str], list | None] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"NvshmemTransport({self.ctx.agent_name!r}, {self.rt!r}, stats={dict(self.stats)})"

    @classmethod
    def probe(cls) -> str | None:
        missing = []
        if importlib.util.find_spec("nvshmem") is None:
            missing.append("nvshmem4py (pip install nvshmem4py-cu13), which is not installed")
        if not torch.cuda.is_available():
            missing.append("a CUDA device (none in this process)")
        return "nvshmem: needs " + " and ".join(missing) if missing else None

    def info(self) -> dict:
        rt = self.rt
        return {"group": rt.group.name, "session": rt.session, "pe": rt.pe, "size": rt.size,
                "host_id": self.ctx.host_id, "pid": os.getpid(), "device": str(rt.device), "status": rt.status,
                "chunk_cap": rt.plan.chunk_cap, "heap": rt.heap}

    # ---- regions and routes -----------------------------------------------------------------------
    def export_region(self, region: LocalRegion) -> dict | None:
        if region.device != self.rt.device:
            return None
        return {"pe": self.rt.pe, "symmetric": self.rt.symmetric_offsets(region.tensors, region.layout)}

    def check_route(self, local: LocalRegion, peer: PeerHandle, peer_region: RegionRecord, op: Op) -> str | None:
        info, rt = peer.metadata.transports.get(self.kind.value, {}), self.rt
        if info.get("group") != rt.group.name:
            return f"peer {peer.name!r} is in NVSHMEM group {info.get('group')!r}, this agent in {rt.group.name!r}"
        if info.get("session") != rt.session:
            return (f"peer {peer.name!r} is in NVSHMEM session {info.get('session')!r}, this PE in {rt.session!r} "
                    f"(stale metadata, or a peer from another run of the group)")
        pe = info.get("pe")
        if not isinstance(pe, int) or not 0 <= pe < rt.size:
            return f"peer {peer.name!r} reports PE {pe!r}; the group has PEs 0..{rt.size - 1}"
        if pe == rt.pe and info.get("pid") != os.getpid():
            return f"peer {peer.name!r} (pid {info.get('pid')}) claims PE {pe}, which is this process's PE"
        if local.device != rt.device:
            return f"local region {local.name!r} is on {local.device}; this process's NVSHMEM PE is on {rt.device}"
        if not peer_region.exports.get(self.kind.value):
            return f"peer region {peer_region.name!r} is on {peer_region.device}, not on its NVSHMEM PE's GPU"
        if local.layout.bytes_per_block > rt.plan.chunk_cap:
            return (f"a block is {local.layout.bytes_per_block} bytes (all layers, K/V); an NVSHMEM staging chunk "
                    f"holds {rt.plan.chunk_cap} (raise NvshmemGroup.staging_bytes)")
        return rt.lanes.broken(pe)

    def peer_views(self, job: Job) -> list | None:
        """The peer region's base tensors mapped here (direct path), or None."""
        export = job.peer_region.exports.get(self.kind.value) or {}
        offsets, layout = export.get("symmetric"), job.peer_region.layout
        if not isinstance(offsets, list) or len(offsets) != layout.num_tensors or \
                not all(isinstance(o, int) for o in offsets):
            return None
        key = (job.peer.metadata.agent_id, job.peer_region.name)
        with self._lock:
            if key not in self._views:
                pe = job.peer.metadata.transports[self.kind.value]["pe"]
                self._views[key] = self.rt.peer_views(offsets, layout, pe)
            return self._views[key]

    # ---- transfers -------------------------------------------------------------------------------
    def takes_grant(self, job: Job) -> bool:
        try:  # the direct path (one-sided, under grants); the staged one's target copies itself
            return self.peer_views(job) is not None
        except XferError:
            return False

    def post(self, job: Job) -> None:
        if self._closed:
            job.transfer.fail(AgentClosedError("the nvshmem transport is closed"))
            return
        try:
            if job.local_ids.size == 0:
                threading.Thread(target=self._empty, args=(job,), daemon=True).start()
                return
            if self.peer_views(job) is not None:
                with self._lock:
                    if self._direct is None:
                        self._direct = _DirectPath(self.ctx, self)
                self.stats[f"direct_{job.op.value}"] += 1
                self._direct.post(job)
                return
            pe = job.peer.metadata.transports[self.kind.value]["pe"]
            plan = proto.plan_chunks(int(job.local_ids.size), job.local.layout.bytes_per_block,
                                     self.rt.plan.chunk_cap, self.ctx.config.chunk_bytes)
            if job.op is Op.WRITE:
                self.rt.lanes.send(pe, proto.ROLE_WRITE).submit(WriteSend(self, job, plan))
            else:
                self.rt.lanes.recv(pe, proto.ROLE_READ).submit(ReadReceive(self, job, plan))
            self.stats[f"staged_{job.op.value}"] += 1
        except XferError as exc:
            job.transfer.fail(exc)

    def _empty(self, job: Job) -> None:
        """No blocks: nothing moves; the peer still hears of the transfer."""
        job.transfer.begin()
        complete_notified([job], self.ctx.agent_name)

    def member_fields(self) -> dict:
        rt = self.rt
        return {"from": self.ctx.agent_name, "group": rt.group.name, "session": rt.session, "pe": rt.pe,
                "pid": os.getpid(), "host_id": self.ctx.host_id}

    def begin_header(self, job: Job, item, dead_upto: int) -> dict:
        return {"type": "nvshmem.begin", **self.member_fields(), "transfer_id": job.transfer.id,
                "region": job.peer_region.name, "blocks": job.peer_ids.tolist(), "layout": job.local.layout.to_dict(),
                "per_chunk": item.plan.per, "seq0": item.seq0, "chunks": item.plan.chunks,
                "timeout": max(job.transfer.time_left(), 1e-3), "dead_upto": dead_upto}

    def read_header(self, job: Job, item, dead_upto: int) -> dict:
        return {"type": "nvshmem.read", **self.member_fields(), "transfer_id": job.transfer.id,
                "region": job.peer_region.name, "blocks": job.peer_ids.tolist(),
                "fingerprint": job.local.layout.fingerprint_hash(), "per_chunk": item.plan.per, "seq0": item.seq0,
                "chunks": item.plan.chunks, "timeout": max(job.transfer.time_left(), 1e-3), "dead_upto": dead_upto}

    # ---- the passive side ---------------------------------------------------------------------------
    def handle_control(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        if self._closed:
            raise AgentClosedError(f"agent {self.ctx.agent_name!r}: the nvshmem transport is closed")
        rt, kind = self.rt, header.get("type")
        pe = proto.parse_member(header, group=rt.group.name, session=rt.session, size=rt.size)
        if kind == "nvshmem.begin":
            begin, region = proto.parse_begin(header, pe=pe, region_lookup=self.ctx.region, chunk_cap=rt.plan.chunk_cap,
                                              agent=f"agent {self.ctx.agent_name!r}")
            self._check_local(region)
            lane = rt.lanes.recv(pe, proto.ROLE_WRITE)
            if begin.dead_upto and not lane.abort_upto(begin.dead_upto, TransportError("the sender gave it up"),
                                                       wait=lanes.DRAIN_TIMEOUT_S + 1):
                raise TransportError(f"NVSHMEM lane {lane.name} is still draining a failed transfer")
            lane.admit(Receive(self, begin, region, payload), begin.seq0, begin.plan.chunks, key=begin.transfer_id)
            self.stats["received_write"] += 1
        elif kind == "nvshmem.finish":
            tid = header.get("transfer_id")
            if not isinstance(tid, str):
                raise InvalidArgumentError(f"nvshmem.finish: transfer_id must be a str, got {tid!r}")
            rt.lanes.recv(pe, proto.ROLE_WRITE).finish(tid)
        elif kind == "nvshmem.read":
            req, region = proto.parse_read(header, pe=pe, region_lookup=self.ctx.region, chunk_cap=rt.plan.chunk_cap,
                                           agent=f"agent {self.ctx.agent_name!r}")
            self._check_local(region)
            lane = rt.lanes.send(pe, proto.ROLE_READ)
            if req.dead_upto:
                lane.abort_upto(req.dead_upto, TransportError("the initiator gave it up"))
            lane.admit(ServeRead(self, req, region), req.seq0, req.plan.chunks)
            self.stats["served_read"] += 1
        elif kind == "nvshmem.abort":
            role, upto = proto.parse_abort(header)
            lane = rt.lanes.recv(pe, role) if role == proto.ROLE_WRITE else rt.lanes.send(pe, role)
            lane.abort_upto(upto, TransportError(f"PE {pe} gave up its transfers up to chunk {upto}"),
                            wait=lanes.ABORT_NOTICE_S / 2)
        else:
            raise InvalidArgumentError(f"unknown NVSHMEM control message {kind!r}")
        return {"ok": True}, b""

    def _check_local(self, region) -> None:
        if region.device != self.rt.device:
            raise InvalidArgumentError(f"region {region.name!r} is on {region.device}; this PE is on {self.rt.device}")

    # ---- symmetric memory for engines ----------------------------------------------------------------
    def symmetric_empty(self, shape, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """Collective: a tensor on this PE's symmetric heap, usable as ``make_kv_cache(empty=...)``.

        Every PE of the group must make the same calls (same sizes, same order); the memory lives
        until the transport closes. KV pools allocated so take the direct path inside a node.
        """
        return self.rt.symmetric_empty(shape, dtype=dtype, device=device)

    def register_symmetric(self, tensors) -> list[torch.Tensor]:
        """Collective: register existing contiguous device tensors on the symmetric heap.

        Register before ``Agent.register`` so the region is exported as symmetric. NVSHMEM accepts
        CUDA VMM allocations only; otherwise :class:`TransportError` says so.
        """
        return self.rt.register_external(tensors)

    @staticmethod
    def bounds_for(region):
        """``region``'s copies to and from staging positions (``xfer.kernels.StagingCopies``), kept
        on the region: they die with it."""
        from xfer.kernels import StagingCopies

        return region.state.get(("nvshmem", "staging"), lambda: StagingCopies(cap=512))

    # ---- life cycle ---------------------------------------------------------------------------------
    def release_region(self, region) -> None:
        region.state.drop(lambda k: k == ("nvshmem", "staging"))
        if self._direct is not None:
            self._direct.release_region(region)

    def disconnect(self, peer_agent_id: str) -> None:
        with self._lock:
            for key in [k for k in self._views if k[0] == peer_agent_id]:
                del self._views[key]
        if self._direct is not None:
            self._direct.disconnect(peer_agent_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._direct is not None:
            self._direct.close()
        self._views.clear()
        for region in self.ctx.regions():
            self.release_region(region)
        nvshmem_runtime.release(self.rt)
