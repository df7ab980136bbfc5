"""The ``ipc`` transport: CUDA IPC between processes of one node. The initiator maps the peer's
registered device memory once (through torch's own CUDA IPC: legacy ``cudaIpcMemHandle`` of the
allocation base plus the offset in it, or the shareable handles of expandable segments) and
``copy_blocks`` reads (pull) or writes (push) the peer's blocks directly through the UVA/P2P
mapping, on a dedicated stream: one Triton launch, or the copy engines (``cudaMemcpyBatchAsync``
/ ``cudaMemcpy2DAsync``) as ``AgentConfig.copy_path`` / ``XFER_COPY_PATH`` / the auto table say;
``Transfer.path`` names the one used and why. No staging. One-sided: see
:mod:`xfer.transports.onesided.transport`.

The handle kind is reported per region (``handle``: ``legacy`` or ``expandable``); when two GPUs
cannot reach each other, ``check_route`` names both devices and the selection policy moves on.
"""

from __future__ import annotations

import base64
import os

import torch

from ...errors import TransportError
from ...metadata import RegionRecord
from ...transfer import Op
from .. import TransportKind
from ..base import Job, LocalRegion, PeerHandle
from .transport import OneSidedTransport

__all__ = ["IpcTransport", "encode_share", "decode_share"]


def _b64(x) -> str | None:
    return None if x is None else base64.b64encode(bytes(x)).decode()


def _unb64(x):
    return None if x is None else base64.b64decode(x)


def encode_share(share: tuple, tensor_offset: int, uuid: str) -> dict:
    """JSON form of ``UntypedStorage._share_cuda_()`` plus where the base tensor starts in it."""
    device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = share
    return {"device": int(device), "uuid": uuid, "handle": _b64(handle), "size": int(size), "offset": int(offset),
            "ref_counter": _b64(rc_handle), "ref_counter_offset": int(rc_offset), "event": _b64(ev_handle),
            "event_sync": bool(ev_sync), "tensor_offset": int(tensor_offset)}


def decode_share(d: dict) -> tuple:
    """The argument tuple of ``UntypedStorage._new_shared_cuda`` from :func:`encode_share`'s dict."""
    try:
        return (int(d["device"]), _unb64(d["handle"]), int(d["size"]), int(d["offset"]), _unb64(d["ref_counter"]),
                int(d["ref_counter_offset"]), _unb64(d["event"]), bool(d["event_sync"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise TransportError(f"malformed CUDA IPC descriptor: {exc!r}") from None


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class IpcTransport(OneSidedTransport):
    kind = TransportKind.IPC
    describe_copy = True  # Transfer.path: "ipc (copy: <CopyPath value>; <why>)"
    spin_wait = True  # its copies wait for nothing but the caller's stream
    notice_early_default = True  # a lone WRITE's notice leaves at its launch (H100: 0.74 against 1.14-1.17 ms)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._local_uuids = {_uuid(i): i for i in range(torch.cuda.device_count())}

    @classmethod
    def probe(cls) -> str | None:
        if not torch.cuda.is_available():
            return "ipc: no CUDA device in this process"
        return None

    def info(self) -> dict:
        return {"host_id": self.ctx.host_id, "pid": os.getpid(), "gpus": sorted(self._local_uuids),
                "notify_batch": True,
                "landing": True, "grant_packed": self.ctx.config.max_notify_bytes}

    def export_region(self, region: LocalRegion) -> dict | None:
        if region.device.type != "cuda":
            return None
        bases = []
        for i, t in enumerate(region.tensors):
            storage = t.untyped_storage()
            try:
                share = storage._share_cuda_()
            except RuntimeError as exc:  # not from torch's CUDA allocator (e.g. an NVSHMEM symmetric heap)
                return {"unshareable": f"base tensor {i} cannot be exported by CUDA IPC: {str(exc).splitlines()[0]}"}
            bases.append(encode_share(share, t.data_ptr() - storage.data_ptr(), _uuid(t.device.index)))
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
        handle = "expandable" if "expandable_segments:True" in conf.replace(" ", "") else "legacy"
        return {"bases": bases, "handle": handle, "uuid": _uuid(region.device.index), **self._busy_export(region)}

    def check_route(self, local: LocalRegion, peer: PeerHandle, peer_region: RegionRecord, op: Op) -> str | None:
        md = peer.metadata
        if md.transports.get(self.kind.value, {}).get("host_id") != self.ctx.host_id:
            return f"peer {md.name!r} is on host {md.hostname!r}, another host"
        export = peer_region.exports.get(self.kind.value)
        if not export:
            return f"peer region {peer_region.name!r} is on {peer_region.device}, not a CUDA device"
        if "unshareable" in export:
            return f"peer region {peer_region.name!r}: {export['unshareable']}"
        if local.device.type != "cuda":
            return f"local region {local.name!r} is on {local.device}; ipc moves device memory"
        peer_index = self._local_uuids.get(export["uuid"])
        if peer_index is None:
            return (f"peer GPU {export['uuid']} is not visible in this process "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
        mine = local.device.index
        if peer_index != mine and not torch.cuda.can_device_access_peer(mine, peer_index):
            return (f"GPU {mine} ({_uuid(mine)}) cannot reach GPU {peer_index} ({export['uuid']}) by peer-to-peer "
                    f"access (PCIe without P2P?)")
        return None

    def stream(self, job: Job) -> torch.cuda.Stream:
        index = job.local.device.index
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]

    def map_peer(self, job: Job) -> list[torch.Tensor]:
        rec = job.peer_region
        layout, export = rec.layout, rec.exports[self.kind.value]
        tensors = []
        with torch.cuda.device(job.local.device.index):
            for i, base in enumerate(export["bases"]):
                args = decode_share(base)
                index = self._local_uuids.get(base.get("uuid"), job.local.device.index)
                try:
                    storage = torch.UntypedStorage._new_shared_cuda(index, *args[1:])
                except RuntimeError as exc:
                    raise TransportError(f"cannot open CUDA IPC handle of peer {job.peer.name!r} region "
                                         f"{rec.name!r} base {i}: {exc}") from None
                flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage)
                start, need = base["tensor_offset"], layout.tensor_numel[i] * layout.itemsize
                if start < 0 or start + need > flat.numel() or start % layout.itemsize:
                    raise TransportError(f"peer {job.peer.name!r} base {i}: {need} bytes at offset {start} do not "
                                         f"fit its {flat.numel()}-byte allocation")
                tensors.append(flat[start:start + need].view(layout.dtype))
        return tensors
