"""Staging for the UCX transport: the shared slot pools, and the gather/scatter of one chunk (a
range of blocks x a range of layers, planned by ``xfer.transports.chunking``) into or out of a
slot, on a copy thread.

Host regions whose blocks are whole rows of their base tensors (every layout xfer names except
packed K|V) take one call per chunk each way: the gather is one torch ``index_select`` over a
read-only row view spanning every base tensor, the scatter one numpy fancy assignment of whole
rows (one ``np.void`` element a block) into a writable view of the same span. Measured on the
2-core CPU VM (GB/s, 16 MiB chunks of 32 KiB / 4 KiB blocks, 512 KiB of 512 B blocks): gather
index_select 4.8 / 5.5 / 6.5 against 1.5 / 1.1 / 0.1 for ``xfer.kernels.gather`` (numpy per
slot); scatter void rows 5.9 / 4.7 / 10.7 against 2.2 / 2.0 / 0.5 for torch ``index_copy_`` and
2.0 / 2.1 / 0.2 for ``xfer.kernels.scatter``. Everything else, CUDA regions and order
conversions included, goes through ``xfer.kernels.gather`` / ``scatter`` (one launch on CUDA).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import queue
import threading
from typing import Callable

import numpy as np
import torch

from ...kernels import StagingCopies
from ...kernels import staging_layout as kernel_staging_layout
from ...layout import KVLayout

__all__ = ["StagingPool", "Slot", "BlockCopier", "Copier", "sub_layout", "staging_layout", "host_rows"]


# Layouts of a chunk, memoized: building one checks every slot (~0.1 ms for 128 slots), and a
# transfer's chunks repeat a few (l0, l1, n) shapes. KVLayout is frozen and hashable (its hash is
# computed once), so the same objects also hit xfer.kernels' own per-layout caches.
@functools.lru_cache(maxsize=256)
def sub_layout(layout: KVLayout, l0: int, l1: int) -> KVLayout:
    """``layout`` restricted to layers ``l0:l1`` (same base tensors)."""
    if (l0, l1) == (0, layout.num_layers):
        return layout
    k = layout.num_kv
    d = layout.to_dict()
    d.update(num_layers=l1 - l0, slot_tensor=d["slot_tensor"][l0 * k:l1 * k],
             slot_offset=d["slot_offset"][l0 * k:l1 * k])
    return KVLayout.from_dict(d)


@functools.lru_cache(maxsize=256)
def staging_layout(layout: KVLayout, l0: int, l1: int, n: int) -> KVLayout:
    """The staging layout of ``n`` blocks of layers ``l0:l1`` of ``layout`` (a chunk's bytes)."""
    return kernel_staging_layout(sub_layout(layout, l0, l1), n)


class Slot:
    """One staging buffer: ``tensor`` (uint8, for copies) and ``wire`` (what ucxx sends from)."""

    __slots__ = ("index", "tensor", "wire", "owner", "sending", "device")

    def __init__(self, index: int, tensor: torch.Tensor, wire):
        self.index, self.tensor, self.wire, self.owner, self.sending = index, tensor, wire, None, False
        self.device = tensor.is_cuda  # device memory (UCX moves it GPU-direct)

    def view(self, nbytes: int):
        """(tensor view, wire view) of the first ``nbytes``."""
        return self.tensor[:nbytes], self.wire[:nbytes]


class StagingPool:
    """``count`` slots of ``nbytes`` in one allocation (one UCX registration cache entry); sends
    may hold at most ``send_cap`` of them at once (the rest is kept for receives: loop).

    ``kind``: "host" (page-aligned host memory), "pinned" (page-locked host, for CUDA regions
    staged through the host) or "cuda:N" (device memory, sent GPU-direct by UCX).
    """

    def __init__(self, kind: str, nbytes: int, count: int, send_cap: int | None = None):
        self.kind, self.nbytes, self.count = kind, nbytes, count
        self.send_cap = count if send_cap is None else send_cap
        self.sends = 0  # slots held by sends
        if kind.startswith("cuda"):
            base = torch.empty(nbytes * count, dtype=torch.uint8, device=kind)
            # the allocator may have returned memory that work still queued on this thread's
            # stream uses; copies on other streams and UCX will write it: let that work end first
            torch.cuda.current_stream(base.device).synchronize()
            wires = [base[i * nbytes:(i + 1) * nbytes] for i in range(count)]
        else:
            base = torch.empty(nbytes * count, dtype=torch.uint8, pin_memory=kind == "pinned")
            arr = base.numpy()
            wires = [arr[i * nbytes:(i + 1) * nbytes] for i in range(count)]
        self._base = base
        self.slots = [Slot(i, base[i * nbytes:(i + 1) * nbytes], wires[i]) for i in range(count)]
        self._free: collections.deque[int] = collections.deque(range(count))

    def __len__(self) -> int:
        return len(self._free)

    def free(self, sending: bool = False) -> bool:
        """Whether a slot can be taken now (for a send: within the send cap)."""
        return bool(self._free) and (not sending or self.sends < self.send_cap)

    def take(self, owner, sending: bool = False) -> Slot | None:
        if not self.free(sending):
            return None
        slot = self.slots[self._free.popleft()]
        slot.owner, slot.sending = owner, sending
        self.sends += sending
        return slot

    def give(self, slot: Slot) -> None:
        assert slot.owner is not None, "slot returned twice"
        self.sends -= slot.sending
        slot.owner, slot.sending = None, False
        self._free.append(slot.index)


@functools.lru_cache(maxsize=256)
def host_rows(layout: KVLayout) -> bool:
    """Whether every block of ``layout`` is a whole row of its base tensor (contiguous, at a multiple
    of its size): what the host fast path (and a chunk moved in place) needs. A property of the
    layout alone, so a peer's region can be judged from its metadata; memoized (it walks every
    slot, and each transfer's start asks it of the peer's layout)."""
    bn = layout.block_numel
    return bool(layout.block_contiguous and not layout.block_stride % bn and not any(o % bn for o in layout.slot_offset))


class BlockCopier:
    """Gathers / scatters chunks of one region (its layout and base tensors).

    Host fast path (blocks are whole rows of their base tensors): ``span`` is a view of rows at
    the gcd of all row addresses over the address range of every base tensor (rows may overlap
    and the range may hold gaps: only rows of the region's own blocks are ever indexed). A gather
    is ONE ``index_select`` from it; a scatter ONE numpy assignment into ``wspan``, the same rows
    as ``np.void`` elements of a block's bytes (the ids of a transfer that writes are unique, so
    no two written rows overlap).
    """

    def __init__(self, layout: KVLayout, tensors: list[torch.Tensor]):
        self.layout, self.tensors = layout, tensors
        self.device = tensors[0].device
        self.rows = host_rows(layout) if self.device.type == "cpu" else None
        self.span = self._span() if self.rows else None
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # CUDA: every copy runs on ``stream`` and is waited for before the call returns, so the
        # tensors need no record_stream (one per base tensor a call: 100+ on a 64-layer cache)
        self._kw = {"stream": self.stream, "record_stream": False} if self.stream is not None else {}
        # the staging slots are long-lived: each (slot, chunk shape) copy is checked and tabled once
        self._bounds = StagingCopies()

    @property
    def path(self) -> str:
        return "host rows" if self.rows else ("triton" if self.device.type == "cuda" else "torch reference")

    def _span(self):
        """(row view for reads, np.void rows for writes, row of block 0 per slot, row step)."""
        lay, isz = self.layout, self.layout.itemsize
        ptrs = [t.data_ptr() for t in self.tensors]
        addr = np.asarray([ptrs[t] + o * isz for t, o in zip(lay.slot_tensor, lay.slot_offset)], dtype=np.int64)
        lo = min(ptrs)
        hi = max(p + n * isz for p, n in zip(ptrs, lay.tensor_numel))
        step = lay.block_stride * isz
        unit = int(np.gcd.reduce(np.append(addr - lo, step)))
        raw = np.frombuffer((ctypes.c_uint8 * (hi - lo)).from_address(lo), dtype=np.uint8)
        nrows = (hi - lo - lay.block_nbytes) // unit + 1
        self._lo, self._unit = lo, unit
        rows = torch.from_numpy(raw).as_strided((nrows, lay.block_nbytes), (unit, 1))
        wrows = np.ndarray((nrows,), dtype=np.dtype((np.void, lay.block_nbytes)), buffer=raw, strides=(unit,))
        return rows, wrows, (addr - lo) // unit, step // unit

    def _index(self, ids: np.ndarray, l0: int, l1: int) -> np.ndarray:
        """Span rows of blocks ``ids`` for the slots of layers l0:l1, in staging order."""
        _, _, base, step = self.span
        k = self.layout.num_kv
        return (base[l0 * k:l1 * k, None] + ids[None, :] * step).reshape(-1)

    def iov(self, ids: np.ndarray, l0: int, l1: int) -> np.ndarray:
        """(address, length) of every block ``ids`` of layers l0:l1, in staging order: what a gather
        into a slot would lay out, for a scatter-gather send (host rows only). ``[n, 2]`` uint64."""
        rows = self._index(ids, l0, l1)
        out = np.empty((rows.size, 2), dtype=np.uint64)
        out[:, 0] = rows * self._unit + self._lo
        out[:, 1] = self.layout.block_nbytes
        return out

    def gather(self, ids: np.ndarray, l0: int, l1: int, out: torch.Tensor) -> None:
        """Blocks ``ids`` of layers l0:l1 into ``out`` (``[layers, K, len(ids), block]`` bytes)."""
        if not self.rows:
            return self._kernel_gather(ids, l0, l1, out)
        index = torch.from_numpy(self._index(ids, l0, l1))
        torch.index_select(self.span[0], 0, index, out=out.view(-1, self.layout.block_nbytes))

    def scatter(self, src: torch.Tensor, ids: np.ndarray, l0: int, l1: int, sender: KVLayout) -> None:
        """The reverse of ``gather``; ``sender`` is the peer's layout (its inner order is the staging's)."""
        if not self.rows or sender.inner_order != self.layout.inner_order:
            return self._kernel_scatter(src, ids, l0, l1, sender)
        wrows = self.span[1]
        wrows[self._index(ids, l0, l1)] = src.numpy().view(wrows.dtype)

    def _kernel_gather(self, ids, l0, l1, out) -> None:
        _wait(self.gather_async(ids, l0, l1, out))

    def _kernel_scatter(self, src, ids, l0, l1, sender) -> None:
        _wait(self.scatter_async(src, ids, l0, l1, sender))

    # A CUDA region's copies are queued on ``stream`` and return their event: the engine launches
    # them itself and polls the event (one kernel launch, tens of microseconds of host time), where
    # a copy thread that waits on each one cost ~0.35 ms a chunk on the H200 VM (GIL hand-offs).
    # The ids are the transfer's, checked when it was posted (initiator) or requested (target).
    def gather_async(self, ids: np.ndarray, l0: int, l1: int, out: torch.Tensor, wait_event=None):
        """Queue ``gather`` (kernel path: CUDA regions and conversions); its event (None on the host)."""
        n = len(ids)
        bound = self._bounds.gather(sub_layout(self.layout, l0, l1), self.tensors,
                                    staging_layout(self.layout, l0, l1, n), out)
        return self._launch(bound, ids, _arange(n), wait_event)

    def scatter_async(self, src: torch.Tensor, ids: np.ndarray, l0: int, l1: int, sender: KVLayout,
                      wait_event=None):
        """Queue ``scatter`` (kernel path); its event (None on the host)."""
        bound = self._bounds.scatter(staging_layout(sender, l0, l1, len(ids)), src, sub_layout(self.layout, l0, l1),
                                     self.tensors)
        return self._launch(bound, _arange(len(ids)), ids, wait_event)

    def _launch(self, bound, s_ids: np.ndarray, d_ids: np.ndarray, wait_event):
        return bound.copy(s_ids, d_ids, path=bound.select_path(None)[0], wait_event=wait_event, checked=True,
                          **self._kw)


@functools.lru_cache(maxsize=64)
def _arange(n: int) -> np.ndarray:
    """Staging positions 0..n-1 (shared: copies only read their ids; a read-only array would make
    torch warn where the reference path wraps it)."""
    return np.arange(n, dtype=np.int64)


def _wait(event) -> None:
    """A CUDA copy's event (None on the CPU paths): the chunk's bytes must be in place before the
    slot goes on the wire (gather) or back to the pool (scatter)."""
    if event is not None:
        event.synchronize()


class Copier:
    """One thread running gathers and scatters in order; ``done(result)`` is called on it after each."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, done: Callable) -> None:
        self._q.put((fn, done))

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, done = item
            try:
                fn()
                done(None)
            except Exception as exc:  # reported to the transfer that asked for the copy
                done(exc)
