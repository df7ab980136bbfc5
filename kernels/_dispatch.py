"""Public block-copy ops: check, pick the path (Triton or the copy engines on CUDA, interpreter or torch on CPU), run.

Tensor arguments everywhere below:

- ``*_tensors``: the base tensors of a KV cache, exactly as its ``KVLayout`` describes them
  (``layout.check_tensors``): dtype ``layout.dtype``, one device per side. A side is CUDA memory
  (this process's, another GPU's with peer access, or CUDA-IPC-mapped from another process) or
  pinned host memory (``pin_memory()``; the kernel reads and writes it in place over PCIe,
  zero-copy, since CUDA's unified addressing makes host pointers valid in kernels). Pageable
  host memory works only when both sides are on the CPU.
- ``*_ids``: block ids, 1-D integers (list, numpy array or tensor of any device; they are read on
  the host). Source ids may repeat; destination ids must be unique.
- staging buffers: 1-D contiguous tensors of any dtype whose size in bytes is exactly
  ``n * layout.bytes_per_block``, laid out as ``layout.staging(n)``: ``[L, K, n, block]`` with the
  block in the layout's own inner order (slot-major).

Copies that touch CUDA memory go by the Triton kernel (SMs) or by the copy engines (DMA,
:mod:`xfer.kernels.copy_engine`). The ``path`` keyword of every op picks: ``kernel``,
``batch`` (``cudaMemcpyBatchAsync``), ``2d`` (``cudaMemcpy2DAsync`` over uniform-stride runs,
``cudaMemcpyAsync`` for the rest) or ``auto``; ``None`` takes the process default,
``xfer.settings.current().copy.path`` (``XFER_COPY_PATH``, read once; default ``auto``). ``auto`` looks the copy's direction (``d2d``, ``d2h``, ``h2d``) and slice size (the
bytes contiguous on both sides, before merging) up in :func:`copy_table`: the last row whose
minimum size the slices reach names the path. The default table is conservative, pending an H200
calibration (``python -m xfer.bench.copy_calibrate``): the kernel for device<->device at every
size (measured ~95-97 % of a contiguous copy from 512 B slices up), the copy engine's batch call
for host<->device slices of 4 KiB and more (the zero-copy kernel reaches 92-95 % of PCIe; DMA is
expected to reach the link rate), the kernel below. ``XFER_COPY_TABLE`` names a JSON file
holding a table to use instead (the calibration's output); :func:`set_copy_table` sets one.
Copies between two host sides ignore the request (no copy engine moves pageable host memory).
The event a CUDA copy returns says what ran: ``event.path`` (a :class:`CopyPath`) and
``event.reason``; :func:`select_path` answers the same before copying.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import numpy as np
import torch

from xfer.errors import InvalidArgumentError
from xfer.layout import KVLayout

from .reference import apply_copy_ref, check_ids, check_overlap, empty_staging, sides_touch, staging_tensor

__all__ = ["CopyPath", "select_path", "copy_blocks", "BoundCopy", "StagingCopies", "staging_layout", "gather",
           "order_after_stream",
           "scatter", "swap_out", "swap_in", "copy_table", "set_copy_table", "DEFAULT_COPY_TABLE", "COPY_REQUESTS"]

from .paths import (COPY_REQUESTS, DEFAULT_COPY_TABLE, CopyPath, _choose, _ENGINE_MODE, copy_table,  # noqa: F401
                    select_path, set_copy_table, slice_bytes)
from .sides import _Side, _pair, _ref_views, _side, _staging, _staging_side, _touching, staging_layout  # noqa: F401
class _KeepAliveEvent(torch.cuda.Event):
    """A CUDA event that also holds the copy's tensors and tables (``keep``) while it lives, and
    says which path ran (``path``, ``reason``)."""


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
_STREAMS_LOCK = threading.Lock()


def _batch_stream(stream: torch.cuda.Stream) -> torch.cuda.Stream | None:
    """A side stream for cudaMemcpyBatchAsync when ``stream`` is the legacy default stream."""
    if stream.cuda_stream not in (0, 1):
        return None
    index = stream.device.index
    if index not in _SIDE_STREAMS:
        with _STREAMS_LOCK:
            _SIDE_STREAMS.setdefault(index, torch.cuda.Stream(device=stream.device))
    return _SIDE_STREAMS[index]


def copy_blocks(src_layout: KVLayout, src_tensors: Sequence[torch.Tensor], src_ids,
                dst_layout: KVLayout, dst_tensors: Sequence[torch.Tensor], dst_ids, *,
                stream: torch.cuda.Stream | None = None,
                wait_event: torch.cuda.Event | None = None, path=None,
                record_stream: bool = True) -> torch.cuda.Event | None:
    """Copy blocks ``src_ids`` of the source cache onto blocks ``dst_ids`` of the destination.

    Every slot (all layers, K and V) moves in one kernel launch, converting between physical
    orders when the two layouts differ (same fingerprint required), or by the copy engines
    (``path``: ``kernel``, ``batch``, ``2d``, ``auto``; None: ``XFER_COPY_PATH``, else auto; see
    the module doc). Everything is checked before any byte moves: ``LayoutMismatchError``,
    ``BlockIdError`` (range; destination duplicates), ``LengthMismatchError``, ``LayoutError``
    (tensors), ``InvalidArgumentError`` (pageable host memory beside CUDA; overlapping source and
    destination blocks; an unknown path), ``TransportUnavailableError`` (a copy-engine path
    requested where the CUDA runtime lacks it). The tensor checks of a side are remembered while
    its tensor objects live at the same addresses.

    On CUDA the kernel runs on ``stream`` (default: the current stream) after ``wait_event``; the
    call returns an event recorded after it, which also holds every tensor of the copy until it is
    dropped: keep it (or the tensors) until it has completed; pinned host tensors are held by
    nothing else. With an explicit side ``stream`` the CUDA tensors are also ``record_stream``-ed
    on it, unless ``record_stream=False`` (a caller that holds the event until it completed: one
    ``record_stream`` per tensor costs microseconds, hundreds of tensors a call add up). On the CPU paths the copy is done on return (after ``wait_event.synchronize()``) and
    the call returns ``None``.
    """
    s_ids, d_ids = check_ids(src_layout, src_ids, dst_layout, dst_ids)
    src, dst = _side(src_layout, src_tensors), _side(dst_layout, dst_tensors)
    return _copy(src_layout, src, s_ids, dst_layout, dst, d_ids, stream, wait_event, path, record_stream)


def _launch_pair(pair, s_ids: np.ndarray, d_ids: np.ndarray, stream: torch.cuda.Stream, wait_event):
    """The kernel copy between two cached sides on ``stream`` (after ``wait_event``): every call
    takes the stream explicitly, so no stream switch, and a device switch only off the current
    device. Returns (its event, the tables and ids it reads: keep them with the event)."""
    index = stream.device_index
    with torch.cuda.device(index) if index != torch.cuda.current_device() else contextlib.nullcontext():
        if wait_event is not None:
            stream.wait_event(wait_event)
        entry, ids = pair.launch(s_ids, d_ids, stream)
        event = _KeepAliveEvent()
        event.record(stream)
    pair.release(entry, event)
    return event, (pair, ids)


def _copy(src_layout: KVLayout, src: _Side, s_ids: np.ndarray, dst_layout: KVLayout, dst: _Side, d_ids: np.ndarray,
          stream, wait_event, path, record_stream: bool):
    """copy_blocks between checked sides and checked ids."""
    check_overlap(src_layout, src.tensors, s_ids, dst_layout, dst.tensors, d_ids, spans=(src.spans, dst.spans),
                  touching=_touching(src, dst))
    path, reason = _choose(src.where, dst.where, slice_bytes(src_layout, dst_layout), path)
    if path not in (CopyPath.TRITON, *_ENGINE_MODE):
        if wait_event is not None:
            wait_event.synchronize()
        if path is CopyPath.TORCH_REFERENCE:
            views = _ref_views(src_layout, src, dst_layout, dst) if src.cached and dst.cached else None
            apply_copy_ref(src_layout, src.tensors, s_ids, dst_layout, dst.tensors, d_ids, views=views)
        elif s_ids.size:
            from . import copy  # imports triton
            copy.prepare(src_layout, src.addresses, s_ids, dst_layout, dst.addresses, d_ids,
                         torch.device("cpu")).launch()
        return None
    current = _current_stream() if stream is None else None
    stream = current if stream is None else stream
    plan = None
    used = [stream]
    if path is CopyPath.TRITON and s_ids.size and src.cached and dst.cached:
        # the common case, kept lean (it bounds how many transfers a second one thread can post):
        # two caches whose tables live on the device
        from . import copy  # imports triton
        event, plan = _launch_pair(_pair(copy, src_layout, src, dst_layout, dst, stream.device), s_ids, d_ids,
                                   stream, wait_event)
    else:
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            if wait_event is not None:
                stream.wait_event(wait_event)
            if s_ids.size and path is CopyPath.TRITON:
                from . import copy  # imports triton
                if src.cached and dst.cached:  # two caches: their address tables stay on the device
                    plan = _pair(copy, src_layout, src, dst_layout, dst, stream.device).plan(s_ids, d_ids)
                else:
                    plan = copy.prepare(src_layout, src.addresses, s_ids, dst_layout, dst.addresses, d_ids,
                                        stream.device)
                plan.launch()
            elif s_ids.size:
                from . import copy_engine
                mode = _ENGINE_MODE[path]
                plan = copy_engine.plan_for(src_layout, src.ptrs, s_ids, dst_layout, dst.ptrs, d_ids,
                                            stream.device.index)
                side = _batch_stream(stream) if mode == "batch" else None
                if side is None:
                    plan.launch(mode, stream.cuda_stream)
                else:  # the batch API refuses the legacy default stream: run on a side stream in its order
                    side.wait_stream(stream)
                    plan.launch(mode, side.cuda_stream)
                    stream.wait_stream(side)
                    used.append(side)
            event = _KeepAliveEvent()
            event.record(stream)
    if record_stream:
        if current is None:
            current = _current_stream(stream.device_index)
        for s in used:
            if s is not current and s != current:
                seen = set()
                for t in (*src.tensors, *dst.tensors):
                    if t.is_cuda and t.untyped_storage().data_ptr() not in seen:
                        seen.add(t.untyped_storage().data_ptr())
                        t.record_stream(s)
    event.keep = (src.tensors, dst.tensors, plan)
    event.path, event.reason = path, reason
    return event


class StagingCopies:
    """The bound copies between caches and the slots of a long-lived staging area (a transport's
    ring), made on first use and kept by (slot bytes, layouts): a chunk's gather or scatter then
    only uploads its ids, where a fresh view of the slot would be checked and tabled anew each
    time. Each copy holds its slot view, so the slot's address stays its own; at most ``cap``."""

    def __init__(self, cap: int = 256) -> None:
        self.cap, self._copies = cap, {}

    def __len__(self) -> int:
        return len(self._copies)

    def _get(self, key: tuple, make) -> "BoundCopy":
        bound = self._copies.get(key)
        if bound is None:
            if len(self._copies) >= self.cap:
                self._copies.clear()
            bound = self._copies[key] = make()
        return bound

    def gather(self, layout: KVLayout, tensors: Sequence[torch.Tensor], staging: KVLayout,
               buf: torch.Tensor) -> "BoundCopy":
        """The copy from ``layout``'s blocks into ``buf`` laid out as ``staging`` (1-D, its exact bytes)."""
        key = ("gather", buf.data_ptr(), buf.numel() * buf.element_size(), layout, staging)
        return self._get(key, lambda: BoundCopy(layout, tensors, staging, [staging_tensor(buf, staging, what="out")]))

    def scatter(self, staging: KVLayout, buf: torch.Tensor, layout: KVLayout,
                tensors: Sequence[torch.Tensor]) -> "BoundCopy":
        """The copy from ``buf`` laid out as ``staging`` onto ``layout``'s blocks."""
        key = ("scatter", buf.data_ptr(), buf.numel() * buf.element_size(), layout, staging)
        return self._get(key, lambda: BoundCopy(staging, [staging_tensor(buf, staging)], layout, tensors))


class BoundCopy:
    """Block copies between two fixed caches (e.g. a registered region and a peer's mapped
    one): the tensors are checked once, here, and each call checks only its ids. The caller
    keeps the tensors where they are (registered memory) for the object's lifetime.

    ``copy(src_ids, dst_ids, ...)`` takes the keywords of :func:`copy_blocks`; ``checked=True``
    says the ids were already validated (``KVLayout.check_block_ids``, unique destinations,
    equal lengths) and skips that too.
    """

    def __init__(self, src_layout: KVLayout, src_tensors: Sequence[torch.Tensor], dst_layout: KVLayout,
                 dst_tensors: Sequence[torch.Tensor]) -> None:
        src_layout.check_compatible(dst_layout, what="destination")
        self.src_layout, self.dst_layout = src_layout, dst_layout
        self.src, self.dst = _Side(src_layout, list(src_tensors)), _Side(dst_layout, list(dst_tensors))
        self.src.cached = self.dst.cached = True  # long-lived: keep their pair tables on the device
        self._slice = slice_bytes(src_layout, dst_layout)
        self._touch: bool | None = None  # whether the two sides' byte ranges meet (first stream copy)
        self._tables: dict = {}  # device index -> copy.PairTables (the stream copies' lean path)

    def select_path(self, path=None) -> tuple[CopyPath, str]:
        """The path a copy takes for the request ``path`` (see the module doc), and why."""
        return _choose(self.src.where, self.dst.where, self._slice, path)

    def preload(self, n: int, stream: torch.cuda.Stream | None = None) -> bool:
        """Have the kernel a default-path copy of ``n`` blocks launches run once in this process (a
        launch that moves nothing, on ``stream``, the first time; nothing on the copy engines or
        the host). For callers about to queue a stream wait that only this process's later work
        releases: CUDA may synchronize the whole context to load a kernel on its first launch
        (lazy loading), which then never returns. True if it launched."""
        if n <= 0 or not self.src.cached or not self.dst.cached or \
                self.select_path(None)[0] is not CopyPath.TRITON:
            return False
        from . import copy  # imports triton

        stream = torch.cuda.current_stream() if stream is None else stream
        other = stream.device_index != torch.cuda.current_device()
        with torch.cuda.device(stream.device_index) if other else contextlib.nullcontext():
            pair = _pair(copy, self.src_layout, self.src, self.dst_layout, self.dst, stream.device)
            return pair.preload(n, stream)

    def copy(self, src_ids, dst_ids, *, stream: torch.cuda.Stream | None = None,
             wait_event: torch.cuda.Event | None = None, path=None, record_stream: bool = True,
             checked: bool = False) -> torch.cuda.Event | None:
        if checked:
            s_ids, d_ids = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
            if path is CopyPath.TRITON and stream is not None and not record_stream and s_ids.size:
                return self._stream_copy(s_ids, d_ids, stream, wait_event)
        else:
            s_ids, d_ids = check_ids(self.src_layout, src_ids, self.dst_layout, dst_ids)
        return _copy(self.src_layout, self.src, s_ids, self.dst_layout, self.dst, d_ids, stream, wait_event, path,
                     record_stream)

    def _check_overlap(self, s_ids: np.ndarray, d_ids: np.ndarray) -> None:
        """Refuse source and destination blocks that share bytes (only where the two sides' byte
        ranges meet at all: found once per bound copy)."""
        touch = self._touch
        if touch is None:
            touch = self._touch = sides_touch(self.src.spans, self.dst.spans)
        if touch:
            check_overlap(self.src_layout, self.src.tensors, s_ids, self.dst_layout, self.dst.tensors, d_ids,
                          spans=(self.src.spans, self.dst.spans), touching=True)

    def stage(self, src_ids, dst_ids, stream: torch.cuda.Stream) -> tuple:
        """The first half of a kernel copy of *checked* ids on ``stream`` (the path the caller chose:
        ``select_path``): the overlap check and the ids' upload onto ``stream``, nothing launched.
        For a caller that must wait for something else (a peer's grant) before any byte moves:
        :meth:`launch_staged` launches it, :meth:`unstage` gives back one that will not launch."""
        from . import copy  # imports triton

        s_ids, d_ids = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
        self._check_overlap(s_ids, d_ids)
        with _on_device(stream):
            pair = self._tables.get(stream.device_index)
            if pair is None:
                pair = self._tables[stream.device_index] = _pair(copy, self.src_layout, self.src, self.dst_layout,
                                                                 self.dst, stream.device)
            ids, entry, shape = pair.stage(s_ids, d_ids, stream)
        return pair, ids, entry, shape, len(s_ids), stream

    def launch_staged(self, staged: tuple, wait_event: torch.cuda.Event | None = None) -> torch.cuda.Event:
        """The second half: the kernel launch of :meth:`stage`'s copy on its stream (after
        ``wait_event``); returns its event, which holds the tensors until the copy ended."""
        pair, ids, entry, shape, n, stream = staged
        with _on_device(stream):
            if wait_event is not None:
                stream.wait_event(wait_event)
            pair.launch_staged(ids, n, shape, stream)
            event = _KeepAliveEvent()
            event.record(stream)
        pair.release(entry, event)
        event.keep = (self.src.tensors, self.dst.tensors, (pair, ids))  # until the copy ended
        event.path, event.reason = CopyPath.TRITON, "kernel, chosen by the caller (select_path)"
        return event

    @staticmethod
    def unstage(staged: tuple) -> None:
        """Give back what :meth:`stage` took for a copy that will not launch (its ids' buffer,
        reusable once the upload queued on its stream ended). Nothing of it moved."""
        pair, _ids, entry, _shape, _n, stream = staged
        if entry is not None:
            with _on_device(stream):
                event = torch.cuda.Event()
                event.record(stream)
            pair.release(entry, event)

    def _stream_copy(self, s_ids: np.ndarray, d_ids: np.ndarray, stream: torch.cuda.Stream,
                     wait_event) -> torch.cuda.Event:
        """The kernel copy the caller already chose (``select_path``), of checked ids, on ``stream``:
        what ``_copy`` does on that path without re-deciding it per call (a transport posts one per
        transfer; on the GPU VM each layer of Python costs several microseconds)."""
        self._check_overlap(s_ids, d_ids)
        pair = self._tables.get(stream.device_index)
        if pair is None:
            from . import copy  # imports triton

            pair = self._tables[stream.device_index] = _pair(copy, self.src_layout, self.src, self.dst_layout,
                                                             self.dst, stream.device)
        event, plan = _launch_pair(pair, s_ids, d_ids, stream, wait_event)
        event.keep = (self.src.tensors, self.dst.tensors, plan)  # until the copy ended
        event.path, event.reason = CopyPath.TRITON, "kernel, chosen by the caller (select_path)"
        return event


def order_after_stream(device: torch.device) -> torch.cuda.Event | None:
    """What a copy queued on another stream waits for so that it comes after the work already
    queued on ``device``'s current stream: an event recorded there now, or None where that stream
    has nothing left to run (torch's ``Stream.query`` of the stream object kept by
    :func:`_current_stream`: the event, its record and the copy stream's wait cost a lone transfer
    ~15 us of host time on an H100 host). Work queued after this call is not ordered either way."""
    stream = _current_stream(torch.cuda.current_device() if device.index is None else device.index)
    if stream.query():
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


_CURRENT: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device, raw handle) -> its Stream object
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # device index -> current stream's handle


def _current_stream(index: int | None = None) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(index)`` by its raw handle (~0.5 us against ~4 us on a GPU host:
    the lookup builds a new Stream object each time). The objects are kept by (device, handle): a
    handle that a destroyed stream leaves to a new one names the same CUDA stream, which is all a
    copy uses of it."""
    if index is None:
        index = torch.cuda.current_device()
    if _RAW_STREAM is None:  # (a torch without the binding Triton also uses)
        return torch.cuda.current_stream(index)
    raw = _RAW_STREAM(index)
    stream = _CURRENT.get((index, raw))
    if stream is None:
        if len(_CURRENT) >= 256:
            _CURRENT.clear()
        stream = _CURRENT[(index, raw)] = torch.cuda.current_stream(index)
    return stream


def _on_device(stream: torch.cuda.Stream):
    """Make ``stream``'s device current where it is not (no device switch in the common case)."""
    return torch.cuda.device(stream.device_index) if stream.device_index != torch.cuda.current_device() else \
        contextlib.nullcontext()


def gather(layout: KVLayout, tensors: Sequence[torch.Tensor], block_ids, out: torch.Tensor,
           **kw) -> torch.cuda.Event | None:
    """Gather blocks ``block_ids`` of every slot into the staging buffer ``out``.

    ``out``: 1-D contiguous, any dtype, exactly ``len(block_ids) * layout.bytes_per_block`` bytes,
    CUDA or pinned host (or CPU when the cache is); receives ``layout.staging(n)``. ``kw``:
    ``stream``, ``wait_event``, ``path`` as for :func:`copy_blocks`, whose return value this returns.
    """
    s_ids = layout.check_block_ids(block_ids, what="source block ids")
    n = len(s_ids)
    if n == 0:  # no staging layout has zero blocks: check the buffer, then a copy of nothing
        empty_staging(out, what="out")
        return copy_blocks(layout, tensors, [], layout, tensors, [], **kw)
    staging = _staging(layout, n)  # (the staging layout of this layout: compatible, its ids 0..n-1)
    buf = staging_tensor(out, staging, what="out")
    d_ids = np.arange(n)
    return _copy_kw(layout, _side(layout, tensors), s_ids, staging, _staging_side(staging, out, buf), d_ids, **kw)


def scatter(staging: torch.Tensor, layout: KVLayout, tensors: Sequence[torch.Tensor], block_ids, *,
            staging_layout: KVLayout | None = None, **kw) -> torch.cuda.Event | None:
    """Scatter a staging buffer onto blocks ``block_ids`` of every slot (the reverse of :func:`gather`).

    ``staging``: 1-D contiguous, any dtype, exactly the bytes of ``staging_layout``, which defaults
    to ``layout.staging(len(block_ids))``; pass the sender's staging layout (e.g.
    ``sender_layout.staging(n)``) to convert another inner order (NHD -> HND) on the way in.
    """
    d_ids = layout.check_block_ids(block_ids, what="destination block ids", unique=True)
    n = len(d_ids)
    if n == 0:
        empty_staging(staging, what="staging")
        return copy_blocks(layout, tensors, [], layout, tensors, [], **kw)
    if staging_layout is None:  # this layout's own staging: compatible, its ids 0..n-1
        staging_layout = _staging(layout, n)
    else:  # a sender's staging layout (another inner order): the same fingerprint, n blocks within it
        check_ids(staging_layout, np.arange(n), layout, d_ids)
    buf = staging_tensor(staging, staging_layout, what="staging")
    s_ids = np.arange(n)
    return _copy_kw(staging_layout, _staging_side(staging_layout, staging, buf), s_ids, layout, _side(layout, tensors),
                    d_ids, **kw)


def _copy_kw(src_layout: KVLayout, src: _Side, s_ids: np.ndarray, dst_layout: KVLayout, dst: _Side, d_ids: np.ndarray, *,
             stream: torch.cuda.Stream | None = None, wait_event: torch.cuda.Event | None = None, path=None,
             record_stream: bool = True):
    """:func:`_copy` with :func:`copy_blocks`'s keywords (gather and scatter pass theirs on)."""
    return _copy(src_layout, src, s_ids, dst_layout, dst, d_ids, stream, wait_event, path, record_stream)


def _check_swap(device_tensors: Sequence[torch.Tensor], host_tensors: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(host_tensors):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_pinned():
            where = getattr(t, "device", type(t).__name__)
            raise InvalidArgumentError(f"swap host tensor {i} must be pinned host memory (pin_memory=True), "
                                       f"got {'pageable memory on ' if where == torch.device('cpu') else ''}{where}")
    for i, t in enumerate(device_tensors):
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise InvalidArgumentError(f"swap device tensor {i} must be a CUDA tensor, got "
                                       f"{getattr(t, 'device', type(t).__name__)}")


def swap_out(layout: KVLayout, device_tensors: Sequence[torch.Tensor], block_ids, host_layout: KVLayout,
             host_tensors: Sequence[torch.Tensor], host_ids, **kw) -> torch.cuda.Event:
    """Copy device blocks ``block_ids`` onto pinned host blocks ``host_ids`` (kernel stores over PCIe,
    or the copy engines: ``path``; ``auto`` uses the table's ``d2h`` rows).

    ``device_tensors``: CUDA base tensors of ``layout``; ``host_tensors``: pinned host base
    tensors of ``host_layout`` (same fingerprint, any order). ``kw`` as for :func:`copy_blocks`.
    """
    _check_swap(device_tensors, host_tensors)
    return copy_blocks(layout, device_tensors, block_ids, host_layout, host_tensors, host_ids, **kw)


def swap_in(layout: KVLayout, device_tensors: Sequence[torch.Tensor], block_ids, host_layout: KVLayout,
            host_tensors: Sequence[torch.Tensor], host_ids, **kw) -> torch.cuda.Event:
    """Copy pinned host blocks ``host_ids`` onto device blocks ``block_ids`` (kernel loads over PCIe,
    or the copy engines: ``path``; ``auto`` uses the table's ``h2d`` rows).

    Same arguments as :func:`swap_out`; only the direction differs.
    """
    _check_swap(device_tensors, host_tensors)
    return copy_blocks(host_layout, host_tensors, host_ids, layout, device_tensors, block_ids, **kw)
