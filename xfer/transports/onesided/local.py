"""The ``local`` transport: peers in this process (any device), or in another process on this
host whose region lives in shared host memory (``xfer.shared_empty``). One-sided: see
:mod:`xfer.transports.onesided.transport`."""

from __future__ import annotations

import os
import threading

import torch

from ... import shm
from ...errors import NotRegisteredError, TransportError
from ...metadata import RegionRecord
from ...transfer import Op
from .. import TransportKind
from ..base import Job, LocalRegion, PeerHandle
from .transport import OneSidedTransport

__all__ = ["LocalTransport"]

# regions exported by agents of this process: (agent_id, region name) -> LocalRegion
_IN_PROCESS: dict[tuple[str, str], LocalRegion] = {}
_IN_PROCESS_LOCK = threading.Lock()


class LocalTransport(OneSidedTransport):
    kind = TransportKind.LOCAL

    def info(self) -> dict:
        return {"host_id": self.ctx.host_id, "pid": os.getpid(), "notify_batch": True, "landing": True,
                "grant_packed": self.ctx.config.max_notify_bytes}

    def export_region(self, region: LocalRegion) -> dict | None:
        with _IN_PROCESS_LOCK:
            _IN_PROCESS[(self.ctx.agent_id, region.name)] = region
        segments = [shm.lookup(t) for t in region.tensors]
        return {"segments": [list(s) for s in segments] if all(segments) else None, **self._busy_export(region)}

    def release_region(self, region: LocalRegion) -> None:
        super().release_region(region)
        with _IN_PROCESS_LOCK:
            _IN_PROCESS.pop((self.ctx.agent_id, region.name), None)

    def check_route(self, local: LocalRegion, peer: PeerHandle, peer_region: RegionRecord, op: Op) -> str | None:
        md = peer.metadata
        if md.transports.get(self.kind.value, {}).get("host_id") != self.ctx.host_id:
            return f"peer {md.name!r} is on host {md.hostname!r}, another host"
        peer_device = torch.device(peer_region.device)
        if md.pid == os.getpid():
            if peer_device.type != local.device.type:
                return f"local region is on {local.device}, peer region on {peer_device}; no direct kernel path"
            return None
        if local.device.type != "cpu" or peer_device.type != "cpu":
            return (f"cross-process local transport moves host memory only; local region is on {local.device}, "
                    f"peer region on {peer_device}")
        export = peer_region.exports.get(self.kind.value) or {}
        if not export.get("segments"):
            return (f"peer region {peer_region.name!r} of {md.name!r} is not in shared memory "
                    f"(allocate it with xfer.shared_empty)")
        return None

    def map_peer(self, job: Job) -> list[torch.Tensor]:
        md, rec = job.peer.metadata, job.peer_region
        if md.pid == os.getpid():
            region = _IN_PROCESS.get((md.agent_id, rec.name))
            if region is None:
                raise NotRegisteredError(f"peer {md.name!r} has no region {rec.name!r} (deregistered)")
            return region.tensors
        layout, tensors = rec.layout, []
        for i, (name, offset) in enumerate(rec.exports[self.kind.value]["segments"]):
            flat = shm.open_segment(name)
            need = layout.tensor_numel[i] * layout.itemsize
            if offset < 0 or offset + need > flat.numel() or offset % layout.itemsize:
                raise TransportError(f"peer segment {name} of {flat.numel()} bytes cannot hold base "
                                     f"tensor {i} ({need} bytes at offset {offset})")
            tensors.append(flat[offset:offset + need].view(layout.dtype))
        return tensors
