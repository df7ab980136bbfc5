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
import enum
import functools
import json
import threading
import weakref
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from xfer import settings
from xfer.errors import InvalidArgumentError, TransportUnavailableError
from xfer.layout import KVLayout

from .reference import (apply_copy_ref, check_ids, check_overlap, empty_staging, host_run_views, sides_touch,
                        slot_addresses, staging_tensor, tensor_spans)

__all__ = ["CopyPath", "select_path", "copy_blocks", "BoundCopy", "StagingCopies", "staging_layout", "gather",
           "scatter", "swap_out", "swap_in", "copy_table", "set_copy_table", "DEFAULT_COPY_TABLE", "COPY_REQUESTS"]


class CopyPath(enum.Enum):
    """Which implementation moves the bytes."""

    TRITON = "triton"  # a CUDA side: one compiled Triton launch
    COPY_ENGINE_BATCH = "copy_engine_batch"  # a CUDA side: cudaMemcpyBatchAsync over the byte runs
    COPY_ENGINE_2D = "copy_engine_2d"  # a CUDA side: cudaMemcpy2DAsync per uniform-stride run set
    TRITON_INTERPRETER = "triton_interpreter"  # CPU tensors and TRITON_INTERPRET=1 (how CI tests the kernel)
    TORCH_REFERENCE = "torch_reference"  # CPU tensors otherwise


# request -> path; "auto" resolves through the table
COPY_REQUESTS = {"kernel": CopyPath.TRITON, "triton": CopyPath.TRITON, "batch": CopyPath.COPY_ENGINE_BATCH,
                 "copy_engine_batch": CopyPath.COPY_ENGINE_BATCH, "2d": CopyPath.COPY_ENGINE_2D,
                 "copy_engine_2d": CopyPath.COPY_ENGINE_2D, "auto": None}
_ENGINE_MODE = {CopyPath.COPY_ENGINE_BATCH: "batch", CopyPath.COPY_ENGINE_2D: "2d"}
_REQUEST_OF = {CopyPath.TRITON: "kernel", **_ENGINE_MODE}
DIRECTIONS = ("d2d", "d2h", "h2d")
# direction -> ((minimum slice bytes, path), ...) ascending: the last row a copy's slices reach wins.
# Measured on the H200 (bench/results/2026-12-02-h200-ipc-copy-paths.json, -copy-calibration.txt): the kernel beat
# cudaMemcpyBatchAsync, 2D and per-run copies at every slice size and direction of the seed case
# (16,384 slices): 32 KiB d2h 0.89 vs 0.79 of a contiguous pinned copy, h2d 0.93 vs 0.84; d2d and
# IPC the copy engines reach < 1 % (each run costs the engines ~4 us). So: the kernel everywhere.
DEFAULT_COPY_TABLE: dict[str, tuple[tuple[int, str], ...]] = {
    "d2d": ((0, "kernel"),),
    "d2h": ((0, "kernel"),),
    "h2d": ((0, "kernel"),),
}
_TABLE: list = []  # [(table, source, settings generation or None for set_copy_table's)] once resolved
_TABLE_LOCK = threading.Lock()


def _check_table(table: Mapping, source: str) -> dict[str, tuple[tuple[int, str], ...]]:
    if not isinstance(table, Mapping):
        raise InvalidArgumentError(f"copy table ({source}) must map directions to rows, got {type(table).__name__}")
    out = dict(DEFAULT_COPY_TABLE)
    for direction, rows in table.items():
        if direction not in DIRECTIONS:
            raise InvalidArgumentError(f"copy table ({source}) names direction {direction!r}; expected {DIRECTIONS}")
        try:
            rows = tuple((int(m), str(p)) for m, p in rows)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"copy table ({source}) rows of {direction} must be [min_bytes, path] pairs, "
                                       f"got {rows!r}") from None
        if not rows or rows[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(rows, rows[1:])):
            raise InvalidArgumentError(f"copy table ({source}) rows of {direction} must start at 0 bytes and grow "
                                       f"strictly, got {list(rows)}")
        for _, p in rows:
            if p not in COPY_REQUESTS or p == "auto":
                raise InvalidArgumentError(f"copy table ({source}) names path {p!r}; expected kernel, batch or 2d")
        out[direction] = rows
    return out


def set_copy_table(table: Mapping | None, source: str = "set_copy_table") -> None:
    """Use ``table`` (``{direction: [[min_slice_bytes, "kernel"|"batch"|"2d"], ...]}``, the
    calibration's ``table``) for ``auto``; directions it omits keep the default. ``None``: back
    to the default (or ``XFER_COPY_TABLE``)."""
    checked = None if table is None else (_check_table(table, source), source, None)
    with _TABLE_LOCK:
        _TABLE[:] = [] if checked is None else [checked]
        _TABLE_GEN[0] += 1


def copy_table() -> tuple[dict[str, tuple[tuple[int, str], ...]], str]:
    """The table ``auto`` uses, and where it came from."""
    gen = settings.generation()
    with _TABLE_LOCK:
        if _TABLE and _TABLE[0][2] in (None, gen):
            return _TABLE[0][:2]
    path = (settings.current().copy.table or "").strip()
    if path:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(f"XFER_COPY_TABLE={path!r} cannot be read as JSON: {exc}") from None
        entry = (_check_table(doc.get("table", doc) if isinstance(doc, dict) else doc, f"XFER_COPY_TABLE={path}"),
                 f"XFER_COPY_TABLE={path}", gen)
    else:
        entry = (dict(DEFAULT_COPY_TABLE), "default table", gen)
    with _TABLE_LOCK:
        if not _TABLE or _TABLE[0][2] not in (None, gen):
            _TABLE[:] = [entry]
        return _TABLE[0][:2]


def _request(path) -> tuple[str, str]:
    """(normalized request, where it came from)."""
    source = "path argument"
    if path is None:
        path = (settings.current().copy.path or "").strip()
        path, source = (path, "XFER_COPY_PATH") if path else ("auto", "default")
    if isinstance(path, CopyPath):
        if path not in _REQUEST_OF:
            raise InvalidArgumentError(f"copy path {path} is chosen from the tensors, not requested; request "
                                       f"kernel, batch, 2d or auto")
        return _REQUEST_OF[path], source
    key = str(path).strip().lower()
    if key not in COPY_REQUESTS:
        raise InvalidArgumentError(f"copy path ({source}) must be one of kernel, batch, 2d, auto; got {path!r}")
    return {"triton": "kernel", "copy_engine_batch": "batch", "copy_engine_2d": "2d"}.get(key, key), source


def _interpret_requested() -> bool:
    return settings.current().copy.interpret


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


@functools.lru_cache(maxsize=256)
def slice_bytes(src_layout: KVLayout, dst_layout: KVLayout) -> int:
    """Bytes contiguous on both sides of one (block, slot): what ``auto`` sizes a copy by."""
    src_layout.check_compatible(dst_layout, what="destination")
    return src_layout.joint_runs(dst_layout)[0] * src_layout.itemsize


def _direction(src: tuple[str, bool], dst: tuple[str, bool]) -> str:
    return "d2d" if src[0] == dst[0] == "cuda" else "d2h" if src[0] == "cuda" else "h2d"


_CHOSEN: dict = {}  # memo of _choose where no copy-engine check was involved: it runs on every copy
_TABLE_GEN = [0]  # bumped by set_copy_table


def _choose(src: tuple[str, bool], dst: tuple[str, bool], size: int | None, path) -> tuple[CopyPath, str]:
    """Path for sides (device type, all pinned), slices of ``size`` bytes (None: unknown), a request."""
    key = (src, dst, size, path, settings.generation(), _TABLE_GEN[0])
    try:
        hit = _CHOSEN.get(key)
    except TypeError:  # an unhashable request: _request names it
        key, hit = None, None
    if hit is None:
        chosen, why, engines_checked = _choose_uncached(src, dst, size, path)
        hit = chosen, why
        if key is not None and not engines_checked:  # the copy engines' availability is not memoized
            if len(_CHOSEN) > 1024:
                _CHOSEN.clear()
            _CHOSEN[key] = hit
    return hit


def _choose_uncached(src: tuple[str, bool], dst: tuple[str, bool], size: int | None,
                     path) -> tuple[CopyPath, str, bool]:
    """(path, why, whether the copy engines' availability was consulted)."""
    base, why = _pick(src, dst)
    if base is not CopyPath.TRITON:
        return base, why, False  # no CUDA side: the request does not apply
    req, source = _request(path)
    direction = _direction(src, dst)
    from . import copy_engine
    if req != "auto":
        chosen = COPY_REQUESTS[req]
        if chosen in _ENGINE_MODE:
            reason = copy_engine.available(_ENGINE_MODE[chosen])
            if reason:
                raise TransportUnavailableError(f"copy path {req!r} ({source}) cannot run here: {reason}")
        return chosen, f"{req} requested ({source}), {direction}", chosen in _ENGINE_MODE
    table, table_source = copy_table()
    rows = table[direction]
    row = rows[0] if size is None else [r for r in rows if r[0] <= size][-1]
    chosen = COPY_REQUESTS[row[1]]
    what = "slice size unknown" if size is None else f"{size}-byte slices"
    why = f"auto ({table_source}): {what} {direction} -> {row[1]} (row from {row[0]} B)"
    if chosen in _ENGINE_MODE:
        reason = copy_engine.available(_ENGINE_MODE[chosen])
        if reason and chosen is CopyPath.COPY_ENGINE_BATCH and copy_engine.available("2d") is None:
            return CopyPath.COPY_ENGINE_2D, f"{why}; batch unavailable ({reason}): 2d", True
        if reason:
            return CopyPath.TRITON, f"{why}; copy engine unavailable ({reason}): kernel", True
        return chosen, why, True
    return chosen, why, False


def select_path(src_tensors: Sequence[torch.Tensor], dst_tensors: Sequence[torch.Tensor], *,
                src_layout: KVLayout | None = None, dst_layout: KVLayout | None = None,
                path=None) -> tuple[CopyPath, str]:
    """The path a copy between these tensors takes, and why; raises if no path can serve them.

    ``path``: the request (see the module doc); with both layouts, ``auto`` decides by their
    slice size, without them by the table's smallest row.
    """
    size = slice_bytes(src_layout, dst_layout) if src_layout is not None and dst_layout is not None else None
    return _choose(_where(src_tensors), _where(dst_tensors), size, path)


class _Side:
    """One side's tensors, checked by ``layout.check_tensors``, with their slot addresses."""

    __slots__ = ("layout", "tensors", "ptrs", "addresses", "spans", "where", "pairs", "cached", "__weakref__")

    def __init__(self, layout: KVLayout, tensors: list[torch.Tensor]) -> None:
        self.layout = layout
        self.tensors = layout.check_tensors(tensors)
        self.ptrs = [t.data_ptr() for t in self.tensors]
        self.addresses = slot_addresses(layout, self.tensors)
        self.spans = tensor_spans(layout, self.tensors)
        self.where = _where(self.tensors)
        self.pairs: dict = {}  # per destination side: copy.PairTables (GPU kernel tables), host views
        self.cached = False  # kept by _RECENT (a cache, not a per-call staging buffer)

    def same(self, layout: KVLayout, tensors: list[torch.Tensor]) -> bool:
        """Whether this side is ``layout`` over the very same tensor objects (by identity), still at
        the addresses it checked."""
        mine = self.tensors
        return (len(mine) == len(tensors) and mine[0] is tensors[0] and (self.layout is layout or self.layout == layout)
                and all(a is b for a, b in zip(mine, tensors)) and self.ptrs == [t.data_ptr() for t in tensors])


class _RecentSides:
    """The sides functional copies (``copy_blocks`` and its wrappers) checked last, newest last, at
    most ``cap``: a call naming the same layout over the same tensor objects (compared by
    identity, never by ``id()``) reuses the checks (``check_tensors`` over 100+ tensors costs
    ~0.5 ms). Readers scan an immutable tuple; writers replace it under a lock (copies may run on
    worker threads). A kept side holds its tensors, as any cache of them must, until ``cap`` newer
    ones push it out."""

    def __init__(self, cap: int) -> None:
        self.cap, self._sides, self._lock = cap, (), threading.Lock()

    def get(self, layout: KVLayout, tensors: list[torch.Tensor]) -> _Side | None:
        for side in reversed(self._sides):
            if side.same(layout, tensors):
                return side
        return None

    def add(self, side: _Side) -> None:
        with self._lock:
            self._sides = (*self._sides[-(self.cap - 1):], side)

    def __len__(self) -> int:
        return len(self._sides)


_RECENT = _RecentSides(cap=32)


def _side(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> _Side:
    """Check a side once per (layout, tensor objects); a repeat call only confirms the same tensors
    still sit at the same addresses (``_RecentSides``)."""
    tensors = list(tensors)
    side = _RECENT.get(layout, tensors)
    if side is not None:
        return side
    side = _Side(layout, tensors)
    if len(tensors) > 2:  # caches, not per-call staging buffers
        side.cached = True
        _RECENT.add(side)
    return side


@functools.lru_cache(maxsize=256)
def _staging(layout: KVLayout, n: int) -> KVLayout:
    """``layout.staging(n)``, memoized: building one checks every slot (~0.1 ms for 128 slots)."""
    return layout.staging(n)


staging_layout = _staging  # public name (scatter's argument of that name shadows it there)

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


def _touching(src: _Side, dst: _Side) -> bool | None:
    """Whether two cached sides' byte ranges meet, computed once per pair (None: not cached)."""
    if not (src.cached and dst.cached):
        return None
    key = ("touch", weakref.ref(dst))
    hit = src.pairs.get(key)
    if hit is None:
        hit = src.pairs[key] = sides_touch(src.spans, dst.spans)
    return hit


def _pair(copy, src_layout: KVLayout, src: _Side, dst_layout: KVLayout, dst: _Side, device: torch.device):
    """The kernel tables between two checked sides, built once per (source, destination, device)."""
    key = (weakref.ref(dst), device)
    pair = src.pairs.get(key)
    if pair is None or (pair.src_layout is not src_layout and pair.src_layout != src_layout) or \
            (pair.dst_layout is not dst_layout and pair.dst_layout != dst_layout):
        pair = _remember(src, key, copy.PairTables(src_layout, src.addresses, dst_layout, dst.addresses, device))
    return pair


def _remember(side: _Side, key, value):
    """Keep ``value`` in ``side.pairs`` (what a side builds once per destination), at most 8."""
    if len(side.pairs) >= 8:
        side.pairs.clear()
    side.pairs[key] = value
    return value


def _ref_views(src_layout: KVLayout, src: _Side, dst_layout: KVLayout, dst: _Side):
    """The host copy's numpy views between two checked cached sides, built once (None off the host)."""
    key = ("host views", weakref.ref(dst))
    hit = src.pairs.get(key)
    if hit is None or hit[0] is not src_layout or hit[1] is not dst_layout:
        hit = _remember(src, key, (src_layout, dst_layout,
                                   host_run_views(src_layout, src.tensors, dst_layout, dst.tensors)))
    return hit[2]


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
    stream = torch.cuda.current_stream() if stream is None else stream
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
        for s in used:
            if s != torch.cuda.current_stream(stream.device):
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

    def _stream_copy(self, s_ids: np.ndarray, d_ids: np.ndarray, stream: torch.cuda.Stream,
                     wait_event) -> torch.cuda.Event:
        """The kernel copy the caller already chose (``select_path``), of checked ids, on ``stream``:
        what ``_copy`` does on that path without re-deciding it per call (a transport posts one per
        transfer; on the GPU VM each layer of Python costs several microseconds)."""
        touch = self._touch
        if touch is None:
            touch = self._touch = sides_touch(self.src.spans, self.dst.spans)
        if touch:
            check_overlap(self.src_layout, self.src.tensors, s_ids, self.dst_layout, self.dst.tensors, d_ids,
                          spans=(self.src.spans, self.dst.spans), touching=True)
        pair = self._tables.get(stream.device_index)
        if pair is None:
            from . import copy  # imports triton

            pair = self._tables[stream.device_index] = _pair(copy, self.src_layout, self.src, self.dst_layout,
                                                             self.dst, stream.device)
        event, plan = _launch_pair(pair, s_ids, d_ids, stream, wait_event)
        event.keep = (self.src.tensors, self.dst.tensors, plan)  # until the copy ended
        event.path, event.reason = CopyPath.TRITON, "kernel, chosen by the caller (select_path)"
        return event


def gather(layout: KVLayout, tensors: Sequence[torch.Tensor], block_ids, out: torch.Tensor,
           **kw) -> torch.cuda.Event | None:
    """Gather blocks ``block_ids`` of every slot into the staging buffer ``out``.

    ``out``: 1-D contiguous, any dtype, exactly ``len(block_ids) * layout.bytes_per_block`` bytes,
    CUDA or pinned host (or CPU when the cache is); receives ``layout.staging(n)``. ``kw``:
    ``stream``, ``wait_event``, ``path`` as for :func:`copy_blocks`, whose return value this returns.
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
