"""The ``local`` transport: peers in this process (any device), or in another process on this
host whose region lives in shared host memory (``xfer.shared_empty``).

Data moves one-sided: the initiator maps the peer's base tensors and runs ``copy_blocks``
between them in chunks (checking the deadline between chunks); then it notifies the peer over
the control channel and completes when the peer acknowledges. A peer that dies or stops
answering turns the transfer into ``PeerDisconnectedError`` or ``TransferTimeoutError``; the
peer is never told about blocks that were not fully written.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import torch

from .. import shm
from ..errors import NotRegisteredError, PeerDisconnectedError, TransferTimeoutError, TransportError, XferError
from ..metadata import RegionRecord
from ..transfer import Op, TransferState
from . import TransportKind
from .base import Job, LocalRegion, PeerHandle, Transport
from .notify import notify_peer

__all__ = ["LocalTransport"]

# regions exported by agents of this process: (agent_id, region name) -> LocalRegion
_IN_PROCESS: dict[tuple[str, str], LocalRegion] = {}
_IN_PROCESS_LOCK = threading.Lock()


class LocalTransport(Transport):
    kind = TransportKind.LOCAL

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._jobs: queue.Queue = queue.Queue()
        self._mapped: dict[tuple[str, str], list[torch.Tensor]] = {}  # (peer agent id, region) -> tensors
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"xfer-local-{ctx.agent_name}", daemon=True)
        self._worker.start()

    def info(self) -> dict:
        return {"host_id": self.ctx.host_id, "pid": os.getpid()}

    def export_region(self, region: LocalRegion) -> dict | None:
        with _IN_PROCESS_LOCK:
            _IN_PROCESS[(self.ctx.agent_id, region.name)] = region
        segments = [shm.lookup(t) for t in region.tensors]
        return {"segments": [list(s) for s in segments] if all(segments) else None}

    def release_region(self, region: LocalRegion) -> None:
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

    def post(self, job: Job) -> None:
        if self._closed:
            job.transfer._finish(TransferState.FAILED, TransportError("local transport is closed"))
            return
        self._jobs.put(job)

    def disconnect(self, peer: str) -> None:
        for key in [k for k in self._mapped if k[0] == peer]:
            del self._mapped[key]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join(timeout=10)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.transfer._finish(TransferState.FAILED, TransportError("local transport closed"))
        self._mapped.clear()

    # ---- data path ---------------------------------------------------------------------------
    def _peer_tensors(self, job: Job) -> list[torch.Tensor]:
        md, rec = job.peer.metadata, job.peer_region
        if md.pid == os.getpid():
            region = _IN_PROCESS.get((md.agent_id, rec.name))
            if region is None:
                raise NotRegisteredError(f"peer {md.name!r} has no region {rec.name!r} (deregistered)")
            return region.tensors
        key = (md.agent_id, rec.name)
        if key not in self._mapped:
            layout, tensors = rec.layout, []
            for i, (name, offset) in enumerate(rec.exports[self.kind.value]["segments"]):
                if not shm.pid_alive(md.pid):
                    raise PeerDisconnectedError(f"peer {md.name!r} (pid {md.pid}) is gone")
                flat = shm.open_segment(name)
                need = layout.tensor_numel[i] * layout.itemsize
                if offset < 0 or offset + need > flat.numel() or offset % layout.itemsize:
                    raise TransportError(f"peer segment {name} of {flat.numel()} bytes cannot hold base "
                                         f"tensor {i} ({need} bytes at offset {offset})")
                tensors.append(flat[offset:offset + need].view(layout.dtype))
            self._mapped[key] = tensors
        return self._mapped[key]

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.transfer.poll().terminal:
                continue
            job.transfer._start()
            try:
                self._move(job)
                notify_peer(job, self.ctx.agent_name)
                job.transfer._finish(TransferState.DONE)
            except TransferTimeoutError as exc:
                job.transfer._finish(TransferState.TIMED_OUT, exc)
            except XferError as exc:
                job.transfer._finish(TransferState.FAILED, exc)
            except Exception as exc:  # never leave a transfer hanging on a bug
                job.transfer._finish(TransferState.FAILED, TransportError(f"local transport failed: {exc!r}"))

    def _move(self, job: Job) -> None:
        from xfer.kernels import copy_blocks

        peer_tensors = self._peer_tensors(job)
        local, rec = job.local, job.peer_region
        if job.op is Op.WRITE:
            src, src_t, src_ids, dst, dst_t, dst_ids = local.layout, local.tensors, job.local_ids, rec.layout, peer_tensors, job.peer_ids
        else:
            src, src_t, src_ids, dst, dst_t, dst_ids = rec.layout, peer_tensors, job.peer_ids, local.layout, local.tensors, job.local_ids
        per_chunk = max(1, self.ctx.config.chunk_bytes // max(1, local.layout.bytes_per_block))
        other_pid = job.peer.metadata.pid if job.peer.metadata.pid != os.getpid() else None
        for start in range(0, len(src_ids), per_chunk):
            if job.transfer.cancel_requested:
                raise job.transfer.error
            if other_pid is not None and not shm.pid_alive(other_pid):
                raise PeerDisconnectedError(f"peer {job.peer.name!r} (pid {other_pid}) died during transfer "
                                            f"{job.transfer.id}; its blocks are not reported complete")
            end = start + per_chunk
            event = copy_blocks(src, src_t, src_ids[start:end], dst, dst_t, dst_ids[start:end])
            if event is not None:
                while not event.query():
                    if job.transfer.cancel_requested:
                        event.synchronize()  # the kernel may still write; let it land before reporting
                        raise job.transfer.error
                    time.sleep(20e-6)
        if job.transfer.cancel_requested:
            raise job.transfer.error
