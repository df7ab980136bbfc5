"""Public block-copy ops: check, pick the path (Triton on CUDA, interpreter or torch on CPU), run.

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
"""

from __future__ import annotations

import enum
import functools
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from xfer.errors import InvalidArgumentError
from xfer.layout import KVLayout

from .reference import (apply_copy_ref, check_ids, check_overlap, empty_staging, slot_addresses, staging_tensor,
                        tensor_spans)

__all__ = ["CopyPath", "select_path", "copy_blocks", "gather", "scatter", "swap_out", "swap_in"]


class CopyPath(enum.Enum):
    """Which implementation moves the bytes."""

    TRITON = "triton"  # a CUDA side: one compiled Triton launch
    TRITON_INTERPRETER = "triton_interpreter"  # CPU tensors and TRITON_INTERPRET=1 (how CI tests the kernel)
    TORCH_REFERENCE = "torch_reference"  # CPU tensors otherwise


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _pick(src: tuple[str, bool], dst: tuple[str, bool]) -> tuple[CopyPath, str]:
    """Path for sides given as (device type, all pinned)."""
    for side, (dev, _) in (("source", src), ("destination", dst)):
        if dev not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"block copies take CUDA or host tensors, the {side} is on {dev}")
    if "cuda" in (src[0], dst[0]):
        for side, (dev, pinned) in (("source", src), ("destination", dst)):
            if dev == "cpu" and not pinned:
                raise InvalidArgumentError(f"{side} tensors are pageable host memory; a kernel reaches host "
                                           f"memory only when pinned: allocate them with pin_memory=True")
        return CopyPath.TRITON, "a side is on CUDA"
    if _interpret_requested():
        return CopyPath.TRITON_INTERPRETER, "CPU tensors and TRITON_INTERPRET=1"
    return CopyPath.TORCH_REFERENCE, "CPU tensors (set TRITON_INTERPRET=1 to run the Triton kernel)"


def _where(tensors: Sequence[torch.Tensor]) -> tuple[str, bool]:
    dev = tensors[0].device.type if tensors else "cpu"
    return dev, dev == "cpu" and torch.cuda.is_available() and all(t.is_pinned() for t in tensors)


def select_path(src_tensors: Sequence[torch.Tensor], dst_tensors: Sequence[torch.Tensor]) -> tuple[CopyPath, str]:
    """The path a copy between these tensors takes, and why; raises if no path can serve them."""
    return _pick(_where(src_tensors), _where(dst_tensors))


class _Side:
    """One side's tensors, checked by ``layout.check_tensors``, with their slot addresses."""

    __slots__ = ("tensors", "refs", "ptrs", "addresses", "spans", "where")

    def __init__(self, layout: KVLayout, tensors: list[torch.Tensor]) -> None:
        self.tensors = layout.check_tensors(tensors)
        self.refs = [weakref.ref(t) for t in self.tensors]
        self.ptrs = [t.data_ptr() for t in self.tensors]
        self.addresses = slot_addresses(layout, self.tensors)
        self.spans = tensor_spans(layout, self.tensors)
        self.where = _where(self.tensors)


_SIDES: OrderedDict[tuple, _Side] = OrderedDict()
_SIDES_LOCK = threading.Lock()  # copies may run on worker threads
_MAX_SIDES = 32


def _side(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> _Side:
    """Check a side once per (layout, tensor objects): ``check_tensors`` over 100+ tensors costs
    ~0.5 ms; a repeat call only confirms the same tensors still sit at the same addresses.

    A cached side holds weak references whose callbacks drop it the moment any of its tensors
    dies, so a key hit (layout, ids of the tensor objects) names the very same live objects: ids
    are unique among live objects."""
    tensors = list(tensors)
    key = (layout, tuple(map(id, tensors)))
    side = _SIDES.get(key)
    if side is not None and side.ptrs == [t.data_ptr() for t in tensors]:
        return side
    side = _Side(layout, tensors)
    if len(tensors) > 2:  # caches, not per-call staging buffers
        forget = functools.partial(_forget_side, key)
        side.refs = [weakref.ref(t, forget) for t in tensors]
        with _SIDES_LOCK:
            _SIDES[key] = side
            if len(_SIDES) > _MAX_SIDES:
                _SIDES.popitem(last=False)  # the oldest checked (a hit does not refresh it: cheap enough)
    return side


def _forget_side(key, _ref) -> None:
    # a weakref callback may run inside any allocation, even one made under _SIDES_LOCK: no lock
    # here (a dict pop is atomic under the GIL)
    _SIDES.pop(key, None)


@functools.lru_cache(maxsize=64)
def _staging(layout: KVLayout, n: int) -> KVLayout:
    return layout.staging(n)  # building one checks every slot: ~0.1 ms for 128 slots


class _KeepAliveEvent(torch.cuda.Event):
    """A CUDA event that also holds the copy's tensors and tables (``keep``) while it lives."""


def copy_blocks(src_layout: KVLayout, src_tensors: Sequence[torch.Tensor], src_ids,
                dst_layout: KVLayout, dst_tensors: Sequence[torch.Tensor], dst_ids, *,
                stream: torch.cuda.Stream | None = None,
                wait_event: torch.cuda.Event | None = None,
                record_stream: bool = True) -> torch.cuda.Event | None:
    """Copy blocks ``src_ids`` of the source cache onto blocks ``dst_ids`` of the destination.

    Every slot (all layers, K and V) moves in one kernel launch, converting between physical
    orders when the two layouts differ (same fingerprint required). Everything is checked before
    any byte moves: ``LayoutMismatchError``, ``BlockIdError`` (range; destination duplicates),
    ``LengthMismatchError``, ``LayoutError`` (tensors), ``InvalidArgumentError`` (pageable host
    memory beside CUDA; overlapping source and destination blocks). The tensor checks of a side
    are remembered while its tensor objects live at the same addresses.

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
    check_overlap(src_layout, src.tensors, s_ids, dst_layout, dst.tensors, d_ids, spans=(src.spans, dst.spans))
    path, _ = _pick(src.where, dst.where)
    if path is not CopyPath.TRITON:
        if wait_event is not None:
            wait_event.synchronize()
        if path is CopyPath.TORCH_REFERENCE:
            apply_copy_ref(src_layout, src.tensors, s_ids, dst_layout, dst.tensors, d_ids)
        elif s_ids.size:
            from . import copy  # imports triton
            copy.prepare(src_layout, src.addresses, s_ids, dst_layout, dst.addresses, d_ids,
                         torch.device("cpu")).launch()
        return None
    stream = torch.cuda.current_stream() if stream is None else stream
    plan = None
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        if wait_event is not None:
            stream.wait_event(wait_event)
        if s_ids.size:
            from . import copy  # imports triton
            plan = copy.prepare(src_layout, src.addresses, s_ids, dst_layout, dst.addresses, d_ids, stream.device)
            plan.launch()
        event = _KeepAliveEvent()
        event.record(stream)
    if record_stream and stream != torch.cuda.current_stream(stream.device):
        seen = set()
        for t in (*src.tensors, *dst.tensors):
            if t.is_cuda and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                t.record_stream(stream)
    event.keep = (src.tensors, dst.tensors, plan)
    return event


def gather(layout: KVLayout, tensors: Sequence[torch.Tensor], block_ids, out: torch.Tensor,
           **kw) -> torch.cuda.Event | None:
    """Gather blocks ``block_ids`` of every slot into the staging buffer ``out``.

    ``out``: 1-D contiguous, any dtype, exactly ``len(block_ids) * layout.bytes_per_block`` bytes,
    CUDA or pinned host (or CPU when the cache is); receives ``layout.staging(n)``. ``kw``:
    ``stream``, ``wait_event`` as for :func:`copy_blocks`, whose return value this returns.
    """
    n = len(layout.check_block_ids(block_ids))
    if n == 0:  # no staging layout has zero blocks: check the buffer, then a copy of nothing
        empty_staging(out, what="out")
        return copy_blocks(layout, tensors, [], layout, tensors, [], **kw)
    staging = _staging(layout, n)
    buf = staging_tensor(out, staging, what="out")
    return copy_blocks(layout, tensors, block_ids, staging, [buf], np.arange(n), **kw)


def scatter(staging: torch.Tensor, layout: KVLayout, tensors: Sequence[torch.Tensor], block_ids, *,
            staging_layout: KVLayout | None = None, **kw) -> torch.cuda.Event | None:
    """Scatter a staging buffer onto blocks ``block_ids`` of every slot (the reverse of :func:`gather`).

    ``staging``: 1-D contiguous, any dtype, exactly the bytes of ``staging_layout``, which defaults
    to ``layout.staging(len(block_ids))``; pass the sender's staging layout (e.g.
    ``sender_layout.staging(n)``) to convert another inner order (NHD -> HND) on the way in.
    """
    n = len(layout.check_block_ids(block_ids, unique=True))
    if n == 0:
        empty_staging(staging, what="staging")
        return copy_blocks(layout, tensors, [], layout, tensors, [], **kw)
    staging_layout = _staging(layout, n) if staging_layout is None else staging_layout
    buf = staging_tensor(staging, staging_layout, what="staging")
    return copy_blocks(staging_layout, [buf], np.arange(n), layout, tensors, block_ids, **kw)


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
    """Copy device blocks ``block_ids`` onto pinned host blocks ``host_ids`` (kernel stores over PCIe).

    ``device_tensors``: CUDA base tensors of ``layout``; ``host_tensors``: pinned host base
    tensors of ``host_layout`` (same fingerprint, any order). ``kw`` as for :func:`copy_blocks`.
    """
    _check_swap(device_tensors, host_tensors)
    return copy_blocks(layout, device_tensors, block_ids, host_layout, host_tensors, host_ids, **kw)


def swap_in(layout: KVLayout, device_tensors: Sequence[torch.Tensor], block_ids, host_layout: KVLayout,
            host_tensors: Sequence[torch.Tensor], host_ids, **kw) -> torch.cuda.Event:
    """Copy pinned host blocks ``host_ids`` onto device blocks ``block_ids`` (kernel loads over PCIe).

    Same arguments as :func:`swap_out`; only the direction differs.
    """
    _check_swap(device_tensors, host_tensors)
    return copy_blocks(host_layout, host_tensors, host_ids, layout, device_tensors, block_ids, **kw)
