"""Swap whole requests between the decode pool and host memory, overlapped with decoding.

On a GPU: the host pool is pinned, and ``xfer.kernels.swap_out`` / ``swap_in`` move every layer of
a request's blocks in one launch on a side stream, after an event recorded on the compute stream
(so the copy sees the last token written); the returned event is polled, and the device blocks are
freed (swap out) or used (swap in) only once it completed. On CPU the same flow runs the kernels'
torch path (``copy_blocks``) on a worker thread (torch copies release the GIL), and a future
stands in for the event. Either way the decode loop keeps stepping the other requests meanwhile.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from xfer.kernels import copy_blocks, swap_in, swap_out

from .block_manager import BlockManager
from .kv_pool import KVPool, pinned_empty

__all__ = ["Swapper", "SwapHandle"]


@dataclass
class SwapHandle:
    """One request's swap in flight: ``done()`` polls, ``wait()`` blocks; ``seconds`` once done."""

    req: str
    direction: str  # "out" | "in"
    device_blocks: list[int]
    host_blocks: list[int]
    started: float
    waitable: object  # torch.cuda.Event or concurrent.futures.Future
    finished: float | None = None

    def done(self) -> bool:
        w = self.waitable
        ok = w.query() if isinstance(w, torch.cuda.Event) else w.done()
        if ok and self.finished is None:
            if isinstance(w, Future):
                w.result()  # raise the copy's error here
            self.finished = time.perf_counter()
        return ok

    def wait(self) -> None:
        w = self.waitable
        w.synchronize() if isinstance(w, torch.cuda.Event) else w.result()
        self.done()

    @property
    def seconds(self) -> float:
        return (self.finished or time.perf_counter()) - self.started


class Swapper:
    """Host swap space of ``num_host_blocks`` blocks in the device pool's layout."""

    def __init__(self, pool: KVPool, num_host_blocks: int):
        self.pool = pool
        host_spec = pool.spec.with_blocks(num_host_blocks)
        self.host = KVPool(pool.model, host_spec, heads=pool.heads, device="cpu", zero=False,
                           empty=pinned_empty if pool.device.type == "cuda" else torch.empty)
        self.blocks = BlockManager(num_host_blocks, pool.block_size)
        self.on_gpu = pool.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=pool.device) if self.on_gpu else None
        self._worker = None if self.on_gpu else ThreadPoolExecutor(1, thread_name_prefix="swap")
        self.total_seconds = 0.0
        self.count = 0

    def can_swap_out(self, device_blocks: list[int]) -> bool:
        return self.blocks.can_allocate(len(device_blocks))

    def swap_out(self, req: str, device_blocks: list[int]) -> SwapHandle:
        """Start copying ``device_blocks`` to newly allocated host blocks (call ``can_swap_out`` first)."""
        host_ids = self.blocks.allocate(len(device_blocks))
        return self._start(req, "out", list(device_blocks), host_ids)

    def swap_in(self, req: str, host_blocks: list[int], device_blocks: list[int]) -> SwapHandle:
        """Start copying ``host_blocks`` back onto ``device_blocks`` (allocated by the caller)."""
        return self._start(req, "in", list(device_blocks), list(host_blocks))

    def finish(self, handle: SwapHandle) -> None:
        """Account a completed handle; a finished swap-in frees its host blocks."""
        self.total_seconds += handle.seconds
        self.count += 1
        if handle.direction == "in":
            self.blocks.free(handle.host_blocks)

    def _start(self, req: str, direction: str, dev: list[int], host: list[int]) -> SwapHandle:
        p, h = self.pool, self.host
        started = time.perf_counter()
        if self.on_gpu:
            ready = torch.cuda.Event()
            # on the compute stream of the pool's GPU (not necessarily the current device): the
            # copy starts after the last token written
            ready.record(torch.cuda.current_stream(p.device))
            move = swap_out if direction == "out" else swap_in
            event = move(p.layout, p.tensors, dev, h.layout, h.tensors, host, stream=self._stream, wait_event=ready)
            return SwapHandle(req, direction, dev, host, started, event)
        if direction == "out":
            job = (p.layout, p.tensors, dev, h.layout, h.tensors, host)
        else:
            job = (h.layout, h.tensors, host, p.layout, p.tensors, dev)
        return SwapHandle(req, direction, dev, host, started, self._worker.submit(copy_blocks, *job))

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
