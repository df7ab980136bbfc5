"""A copy's two sides, checked once: :class:`_Side` (a cache's tensors with their slot addresses
and byte spans), the functional copies' memory of recently checked sides (:class:`_RecentSides`,
matched by the identity of the tensor objects), and what a pair of sides builds once (kernel
tables, host views, whether their bytes meet)."""

from __future__ import annotations

import functools
import operator
import threading
import weakref
from collections.abc import Sequence

import torch

from xfer.layout import KVLayout
from xfer.native import C as _native  # the optional C helpers (None where not built)

from .paths import _where
from .reference import host_run_views, sides_touch, slot_addresses, tensor_spans

_DEREF = weakref.ref.__call__
_DATA_PTR = torch.Tensor.data_ptr

__all__ = ["_Checked", "_Side", "_RecentSides", "_RecentStaging", "_staging_side", "_side", "_staging", "_touching", "_pair", "_remember", "_ref_views", "staging_layout"]


class _Checked:
    """What checking one side found (slot addresses, byte spans, where it lives) and what a pair of
    sides builds once (``pairs``: kernel tables, host views, whether their bytes meet, per
    destination). It refers to the tensors it checked only weakly: a cache of it never keeps the
    caller's memory alive."""

    __slots__ = ("layout", "refs", "ptrs", "addresses", "spans", "where", "pairs", "__weakref__")

    def __init__(self, layout: KVLayout, tensors: list[torch.Tensor]) -> None:
        self.layout = layout
        self.refs = tuple(weakref.ref(t) for t in tensors)
        self.ptrs = [t.data_ptr() for t in tensors]
        self.addresses = slot_addresses(layout, tensors)
        self.spans = tensor_spans(layout, tensors)
        self.where = _where(tensors)
        self.pairs: dict = {}

    def same(self, layout: KVLayout, tensors: list[torch.Tensor]) -> bool:
        """Whether this is ``layout`` over the very same tensor objects (by identity, each still
        alive), still at the addresses it checked."""
        refs = self.refs
        if not (len(refs) == len(tensors) and refs[0]() is tensors[0] and
                (self.layout is layout or self.layout == layout)):
            return False
        if _native is not None:  # one C loop (xfer/_native.c): 100+ tensors a side
            return _native.same_tensors(refs, tensors, self.ptrs, _DATA_PTR)
        # (map over C callables: no Python frame per tensor)
        return all(map(operator.is_, map(_DEREF, refs), tensors)) and self.ptrs == list(map(_DATA_PTR, tensors))


class _Side:
    """One side of a copy: the caller's tensors (held for as long as this object lives: one call,
    or a :class:`BoundCopy`) and what checking them found (``info``, a :class:`_Checked`, shared by
    every call over the same tensors while they live)."""

    __slots__ = ("layout", "tensors", "info", "ptrs", "addresses", "spans", "where", "pairs", "cached")

    def __init__(self, layout: KVLayout, tensors: list[torch.Tensor], info: _Checked | None = None) -> None:
        if info is None:
            tensors = layout.check_tensors(tensors)
            info = _Checked(layout, tensors)
        self.layout, self.tensors, self.info = layout, tensors, info
        self.ptrs, self.addresses, self.spans, self.where, self.pairs = \
            info.ptrs, info.addresses, info.spans, info.where, info.pairs
        self.cached = False  # a cache (kept by _RECENT or a BoundCopy), not a per-call staging buffer


class _RecentSides:
    """The sides functional copies (``copy_blocks`` and its wrappers) checked last, newest last, at
    most ``cap``: a call naming the same layout over the same tensor objects (compared by
    identity, never by ``id()``) reuses the checks (``check_tensors`` over 100+ tensors costs
    ~0.5 ms). Readers scan an immutable tuple; writers replace it under a lock (copies may run on
    worker threads). It keeps :class:`_Checked` records, which refer to their tensors weakly: a
    cache the caller dropped is freed at once (its record then matches nothing and ages out)."""

    def __init__(self, cap: int) -> None:
        self.cap, self._sides, self._lock = cap, (), threading.Lock()

    def get(self, layout: KVLayout, tensors: list[torch.Tensor]) -> _Checked | None:
        for info in reversed(self._sides):
            if info.same(layout, tensors):
                return info
        return None

    def add(self, info: _Checked) -> None:
        with self._lock:
            self._sides = (*self._sides[-(self.cap - 1):], info)

    def __len__(self) -> int:
        return len(self._sides)


_RECENT = _RecentSides(cap=32)


class _RecentStaging:
    """The CUDA staging buffers gather and scatter used last (at most ``cap``), by the identity of
    the caller's buffer object (weakly) and its address: a buffer reused across calls (a ring, a
    preallocated area) keeps its device tables, so such a call takes the lean launch path of two
    caches instead of building and uploading tables each time."""

    def __init__(self, cap: int) -> None:
        self.cap, self._entries, self._lock = cap, (), threading.Lock()

    def get(self, buf: torch.Tensor, layout: KVLayout) -> _Checked | None:
        ptr = buf.data_ptr()
        for ref, lay, at, info in reversed(self._entries):
            if ref() is buf and at == ptr and (lay is layout or lay == layout):
                return info
        return None

    def add(self, buf: torch.Tensor, layout: KVLayout, info: _Checked) -> None:
        with self._lock:
            live = tuple(e for e in self._entries if e[0]() is not None)
            self._entries = (*live[-(self.cap - 1):], (weakref.ref(buf), layout, buf.data_ptr(), info))

    def __len__(self) -> int:
        return len(self._entries)


_RECENT_STAGING = _RecentStaging(cap=8)


def _staging_side(layout: KVLayout, buf: torch.Tensor, view: torch.Tensor) -> _Side:
    """The staging side of a gather or scatter: ``view`` (this call's view of the caller's buffer
    ``buf`` as ``layout``'s one tensor). A CUDA buffer seen recently reuses its checks and tables."""
    if view.device.type != "cuda":
        return _side(layout, [view])
    info = _RECENT_STAGING.get(buf, layout)
    if info is None:
        side = _Side(layout, [view])
        _RECENT_STAGING.add(buf, layout, side.info)
    else:
        side = _Side(layout, [view], info)
    side.cached = True
    return side


def _side(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> _Side:
    """Check a side once per (layout, tensor objects); a repeat call only confirms the same tensors
    still sit at the same addresses (``_RecentSides``)."""
    tensors = list(tensors)
    info = _RECENT.get(layout, tensors)
    if info is not None:
        side = _Side(layout, tensors, info)
        side.cached = True
        return side
    side = _Side(layout, tensors)
    if len(tensors) > 2:  # caches, not per-call staging buffers
        side.cached = True
        _RECENT.add(side.info)
    return side


@functools.lru_cache(maxsize=256)
def _staging(layout: KVLayout, n: int) -> KVLayout:
    """``layout.staging(n)``, memoized: building one checks every slot (~0.1 ms for 128 slots)."""
    return layout.staging(n)


staging_layout = _staging  # public name (scatter's argument of that name shadows it there)

def _touching(src: _Side, dst: _Side) -> bool | None:
    """Whether two cached sides' byte ranges meet, computed once per pair (None: not cached)."""
    if not (src.cached and dst.cached):
        return None
    key = ("touch", weakref.ref(dst.info))
    hit = src.pairs.get(key)
    if hit is None:
        hit = src.pairs[key] = sides_touch(src.spans, dst.spans)
    return hit


def _pair(copy, src_layout: KVLayout, src: _Side, dst_layout: KVLayout, dst: _Side, device: torch.device):
    """The kernel tables between two checked sides, built once per (source, destination, device)."""
    key = (weakref.ref(dst.info), device)
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
    key = ("host views", weakref.ref(dst.info))
    hit = src.pairs.get(key)
    if hit is None or hit[0] is not src_layout or hit[1] is not dst_layout:
        hit = _remember(src, key, (src_layout, dst_layout,
                                   host_run_views(src_layout, src.tensors, dst_layout, dst.tensors)))
    return hit[2]
