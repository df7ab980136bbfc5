"""One Triton launch that copies KV blocks between two layouts, every slot at once.

The work is cut into *rows*: one row is a chunk of one joint run (bytes contiguous on both sides)
of one (block pair, slot). When both layouts hold a block as one dense run in the same inner
order the run is the whole block (the fast path); otherwise (NHD <-> HND, packed K|V, ...) a block
splits into ``D0*D1*D2`` runs whose addresses the kernel derives from the strides. A program
copies ``ROWS x CHUNK`` words: the widest integer word that divides every address, stride and run
length, and the compiler is told the common alignment so it emits 16-byte accesses.

Addresses come only from the int64 tables (byte addresses of each slot's block 0): the slots may
live in other tensors, other processes (CUDA IPC) or pinned host memory (zero-copy over PCIe).
This module imports triton; ``xfer.kernels`` imports it only when a kernel is about to run.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from xfer import settings
from xfer.errors import InvalidArgumentError
from xfer.layout import KVLayout
from xfer.native import C as _C

__all__ = ["CopyPlan", "prepare"]

TILE_BYTES = 8 * 1024  # bytes a program moves on a GPU (H200 sweep: 8 KiB x 8 warps ~ 16 KiB x 16 best)
INTERPRETER_TILE_BYTES = 1 << 20  # the interpreter costs ~0.8 ms a program: few, large ones
PROGRAMS_PER_SM = 4  # small transfers shrink tiles until every SM has this many programs
MAX_ALIGN = 16  # widest access: 16-byte vectors (2 x int64 words)
SORT_BY_DESTINATION = True  # write each slot's blocks in address order (H200: +2-4 % scatter, 4 KiB)


def _copy_kernel(tab_ptr, ids_ptr, n, n_rows, s_blk, d_blk, s0, d0, s1, d1, s2, d2,
                 SLOTS: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                 RUN: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, ROWS: tl.constexpr,
                 WORD: tl.constexpr, WORD_BYTES: tl.constexpr, ALIGN: tl.constexpr):
    # tab_ptr: int64 [2*SLOTS] byte address of block 0 per slot, sources then destinations
    # ids_ptr: int64 [2*n] source block ids then destination block ids
    # s_blk, d_blk: block strides; s0..d2: strides of the outer dims of a block (all in words)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS] int32 < n_rows < 2**31
    ok = row < n_rows
    row = tl.where(ok, row, 0)
    # row = ((((slot * n + i) * D0 + r0) * D1 + r1) * D2 + r2) * CHUNKS + j: slot-major, so that
    # neighbouring programs move neighbouring blocks of one slot (measured 4-6 % faster on H200
    # than block-major for 32 KiB slices)
    j = row % CHUNKS
    t = row // CHUNKS
    r2 = t % D2
    t = t // D2
    r1 = t % D1
    t = t // D1
    r0 = t % D0
    t = t // D0
    slot = t // n
    i = t - slot * n
    src = tl.load(tab_ptr + slot)
    dst = tl.load(tab_ptr + SLOTS + slot)
    sid = tl.load(ids_ptr + i)
    did = tl.load(ids_ptr + n + i)
    first = j.to(tl.int64) * CHUNK  # first word of this row within its run
    r0, r1, r2 = r0.to(tl.int64), r1.to(tl.int64), r2.to(tl.int64)
    s_off = sid * s_blk + r0 * s0 + r1 * s1 + r2 * s2 + first  # int64 words: caches over 4 GiB
    d_off = did * d_blk + r0 * d0 + r1 * d1 + r2 * d2 + first
    # the hint on the pointers (not on the integers) is what lets the compiler vectorize
    sp = tl.multiple_of((src + s_off * WORD_BYTES).to(tl.pointer_type(WORD)), ALIGN)
    dp = tl.multiple_of((dst + d_off * WORD_BYTES).to(tl.pointer_type(WORD)), ALIGN)
    col = tl.arange(0, CHUNK)
    if RUN % CHUNK == 0:
        mask = ok[:, None]
    else:
        mask = ok[:, None] & ((first[:, None] + col[None, :]) < RUN)
    data = tl.load(sp[:, None] + col[None, :], mask=mask)  # (evict_first hints measured 6 % slower)
    tl.store(dp[:, None] + col[None, :], data, mask=mask)


_INTS = ["n", "n_rows", "s_blk", "d_blk", "s0", "d0", "s1", "d1", "s2", "d2"]


@functools.cache
def _kernel(interpret: bool):
    # built here, not with @triton.jit, so that TRITON_INTERPRET read at import time does not matter;
    # no value specialization of the integers or of the (allocator-aligned) table pointer: a compiled
    # kernel then depends only on the constexprs, num_warps and the integers' widths (see _launch)
    if interpret:
        return InterpretedFunction(_copy_kernel)
    return JITFunction(_copy_kernel, do_not_specialize=_INTS, do_not_specialize_on_alignment=["tab_ptr", "ids_ptr"])


_COMPILED: dict[tuple, object] = {}


def _launch_key(args: tuple, num_warps: int, device: int) -> tuple:
    """What a compiled kernel depends on: the device, the constexprs, num_warps, the integers' widths."""
    return device, args[12:], num_warps, tuple(-2**31 <= a < 2**31 for a in args[2:12])


def _launch(grid: int, args: tuple, num_warps: int, device: int, stream: torch.cuda.Stream | None = None,
            key: tuple | None = None) -> None:
    """Launch through Triton's compiled-kernel cache, skipping its per-call argument binding;
    on ``stream`` (None: the current stream)."""
    key = _launch_key(args, num_warps, device) if key is None else key
    compiled = _COMPILED.get(key)
    if compiled is None:  # the first launch compiles (on the current stream)
        if stream is None:
            _COMPILED[key] = _kernel(False)[(grid,)](*args, num_warps=num_warps)
        else:
            with torch.cuda.stream(stream):
                _COMPILED[key] = _kernel(False)[(grid,)](*args, num_warps=num_warps)
    elif stream is None:
        compiled[(grid, 1, 1)](*args)
    else:
        compiled[(grid, 1, 1)](*args, stream=stream.cuda_stream)


def _native_spec(key: tuple, grid: int, args: tuple, device: int) -> bytes | None:
    """The fixed part of a launch of the compiled kernel ``key`` by xfer's C helpers
    (``xfer.native``: ``cuLaunchKernel`` with the arguments packed once), or None where that
    kernel's launch needs more than a plain ``cuLaunchKernel`` (scratch memory, clusters, launch
    hooks, an argument list other than two int64 pointers and ten integers) or it is not compiled yet:
    Triton's launcher then keeps launching it."""
    compiled = _COMPILED.get(key)
    if compiled is None:
        return None
    try:
        md, src = compiled.metadata, compiled.src
        kinds = [src.signature[name] for name in src.fn.arg_names if src.signature[name] != "constexpr"]
        knobs = getattr(triton, "knobs", None)  # (a profiler's launch hooks: checked when the spec is made)
        hooks = knobs is not None and (_hooked(knobs.runtime.launch_enter_hook) or
                                       _hooked(knobs.runtime.launch_exit_hook))
        if (hooks or kinds[:2] != ["*i64", "*i64"] or len(kinds) != 12 or
                any(k not in ("i32", "i64") for k in kinds[2:]) or getattr(md, "num_ctas", 1) != 1 or
                getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False) or
                getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0) or
                md.shared > 227 * 1024 or getattr(compiled.run, "gsan_enabled", False)):
            return None
        compiled._init_handles()
        wide = sum(1 << i for i, k in enumerate(kinds[2:]) if k == "i64")
        return _C.pack_spec(compiled.function, args[0].data_ptr(), grid, md.num_warps * getattr(md, "warp_size", 32),
                            md.shared, device, tuple(args[2:12]), wide)
    except (AttributeError, KeyError, TypeError, ValueError):  # another Triton's internals: its own launcher
        return None


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set (a hook chain counts only with a hook in it)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def native_launch(device: torch.device) -> bool:
    """Whether kernel copies between long-lived sides on ``device`` upload their ids and launch by
    xfer's C helpers (built, ``XFER_NATIVE_LAUNCH`` not off, a CUDA device, libcuda's entry points found)."""
    return _C is not None and device.type == "cuda" and settings.current().copy.native_launch and _C.driver()


_WORDS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@functools.lru_cache(maxsize=256)
def _geometry(src: KVLayout, dst: KVLayout) -> tuple[int, tuple[int, int, int], tuple[int, ...], tuple[int, ...]]:
    """(run bytes, outer sizes D0..D2, src strides bytes (block, o0..o2), dst strides bytes)."""
    run, outer = src.joint_runs(dst)
    outer = [(1, 0, 0)] * (3 - len(outer)) + outer
    isz = src.itemsize
    sizes = tuple(d[0] for d in outer)
    s_str = tuple(x * isz for x in (src.block_stride, *(d[1] for d in outer)))
    d_str = tuple(x * isz for x in (dst.block_stride, *(d[2] for d in outer)))
    return run * isz, sizes, s_str, d_str


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


class CopyPlan:
    """A block copy resolved to addresses and tables, ready to launch (again) on the current stream.

    ``table``: int64 ``[2*slots]`` on the launch device: slot addresses (sources, then
    destinations); ``ids``: int64 ``[2*n]``: source block ids, then destination block ids.
    """

    __slots__ = ("table", "ids", "n", "slots", "sizes", "s_str", "d_str", "run_words", "word_bytes", "align",
                 "interpret", "device", "tiles")

    def __init__(self, table: torch.Tensor, n: int, slots: int, geometry, word_bytes: int, align: int,
                 interpret: bool, ids: torch.Tensor | None = None, tiles: dict | None = None) -> None:
        run_bytes, self.sizes, s_str, d_str = geometry
        self.table, self.n, self.slots = table, n, slots
        self.ids = table[2 * slots:] if ids is None else ids
        self.word_bytes, self.align, self.interpret = word_bytes, align, interpret
        self.s_str = tuple(x // word_bytes for x in s_str)
        self.d_str = tuple(x // word_bytes for x in d_str)
        self.run_words = run_bytes // word_bytes
        self.device = table.device
        self.tiles = tiles  # (n, tile_bytes, num_warps) -> launch shape, shared by a pair's plans

    def __repr__(self) -> str:
        return (f"CopyPlan(n={self.n}, slots={self.slots}, runs/block={math.prod(self.sizes)}, "
                f"run={self.run_words}x{self.word_bytes}B, align={self.align}, device={self.device})")

    def tiling(self, tile_bytes: int | None = None) -> tuple[int, int, int, int]:
        """(CHUNK words, CHUNKS a run, ROWS a program, programs) for a tile of ``tile_bytes``."""
        w = self.word_bytes
        if tile_bytes is None:
            tile_bytes = INTERPRETER_TILE_BYTES if self.interpret else TILE_BYTES
        chunk = min(triton.next_power_of_2(self.run_words), _pow2_floor(tile_bytes // w))
        chunks = triton.cdiv(self.run_words, chunk)
        n_rows = self.n * self.slots * math.prod(self.sizes) * chunks
        if n_rows >= 2**31:
            raise InvalidArgumentError(f"a copy of {n_rows} runs is over the 2**31 one launch handles; "
                                       f"split the {self.n} blocks into smaller calls")
        rows = min(_pow2_floor(tile_bytes // (chunk * w)), triton.next_power_of_2(n_rows))
        if not self.interpret:
            sms = _sm_count(self.device)
            while rows > 1 and triton.cdiv(n_rows, rows) < PROGRAMS_PER_SM * sms:
                rows //= 2
        return chunk, chunks, rows, triton.cdiv(n_rows, rows)

    def launch(self, tile_bytes: int | None = None, num_warps: int | None = None,
               stream: torch.cuda.Stream | None = None) -> None:
        """Launch the kernel on ``stream`` (None: the current stream; the interpreter runs it right away).

        ``tile_bytes`` / ``num_warps`` override the tuned defaults (for benchmarks).
        """
        if self.n == 0:
            return
        programs, warps, n_rows, consts, key = self.shape(tile_bytes, num_warps)
        args = (self.table, self.ids, self.n, n_rows, *consts)
        if self.interpret:
            _kernel(True)[(programs,)](*args)
        else:
            _launch(programs, args, warps, self.device.index, stream, key)

    def shape(self, tile_bytes: int | None = None, num_warps: int | None = None) -> tuple:
        """(programs, num_warps, rows, the kernel's arguments after ``n_rows``, compiled-kernel key):
        what a launch of ``n`` blocks needs besides the tables, shared through ``tiles``."""
        shape_key = (self.n, tile_bytes, num_warps)
        shape = None if self.tiles is None else self.tiles.get(shape_key)
        if shape is None:
            chunk, chunks, rows, programs = self.tiling(tile_bytes)
            warps = num_warps
            if warps is None:  # a warp per KiB of tile: 2 16-byte vectors a thread
                warps = max(2, min(16, rows * chunk * self.word_bytes // 1024))
            n_rows = self.n * self.slots * math.prod(self.sizes) * chunks
            consts = (self.s_str[0], self.d_str[0], self.s_str[1], self.d_str[1], self.s_str[2], self.d_str[2],
                      self.s_str[3], self.d_str[3], self.slots, *self.sizes, self.run_words, chunk, chunks, rows,
                      _WORDS[self.word_bytes], self.word_bytes, self.align)
            key = None if self.interpret else _launch_key((None, None, self.n, n_rows, *consts), warps,
                                                          self.device.index)
            shape = (programs, warps, n_rows, consts, key)
            if self.tiles is not None:
                self.tiles[shape_key] = shape
        return shape


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def prepare(src_layout: KVLayout, src_addr: np.ndarray, src_ids: np.ndarray, dst_layout: KVLayout,
            dst_addr: np.ndarray, dst_ids: np.ndarray, device: torch.device) -> CopyPlan:
    """Build the tables of a *validated* copy on ``device``.

    ``src_addr`` / ``dst_addr``: int64 numpy ``[slots]`` from ``reference.slot_addresses``;
    ``src_ids`` / ``dst_ids``: int64 numpy ``[n]``. On a CUDA device the table is copied from
    pinned memory on the current stream; on CPU the plan runs in Triton's interpreter.
    """
    geometry = _geometry(src_layout, dst_layout)
    run_bytes, _, s_str, d_str = geometry
    if SORT_BY_DESTINATION and len(dst_ids) > 1:  # pairs are independent (destination ids unique)
        order = np.argsort(dst_ids)
        src_ids, dst_ids = src_ids[order], dst_ids[order]
    host = np.concatenate([src_addr, dst_addr, src_ids, dst_ids]).astype(np.int64, copy=False)
    g = int(np.gcd.reduce(np.concatenate([host[:2 * len(src_addr)], [MAX_ALIGN, run_bytes, *s_str, *d_str]])))
    align = g & -g  # largest power of two dividing every address, stride and run length
    interpret = device.type == "cpu"
    if interpret:
        table = torch.from_numpy(host)
    else:
        staged = torch.empty(host.shape, dtype=torch.int64, pin_memory=True)
        staged.numpy()[:] = host
        table = staged.to(device, non_blocking=True)  # the host allocator keeps `staged` until copied
    return CopyPlan(table, len(src_ids), src_layout.num_slots, geometry, min(align, 8), align, interpret)


class _IdsRing:
    """Pinned host and device buffers for the block ids of one pair's launches, reused once the
    launch that last read one has completed (its event): a repeat copy then costs one
    ``cudaMemcpyAsync`` on its stream, no allocation and no stream switch."""

    SIZE = 8  # buffers at first
    MAX = 128  # buffers at most: launches queued back to back each hold one until their event completed

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.entries: list[list | None] = [None] * self.SIZE  # [host, device buffer, event | None]
        self.next = 0
        self.lock = threading.Lock()  # copies may run on several threads

    def upload(self, src_ids: np.ndarray, dst_ids: np.ndarray, stream: torch.cuda.Stream, put):
        """(device ids ``[src..., dst...]``, the entry to release) or None when every entry (``MAX``)
        is busy. ``put(entry, src_ids, dst_ids, stream)`` fills the entry's pinned buffer and queues its
        upload on ``stream`` (:func:`_put_memcpy`, :func:`_put_native`)."""
        with self.lock:
            return self._upload(src_ids, dst_ids, stream, put)

    def _upload(self, src_ids, dst_ids, stream, put):
        n = len(src_ids)
        size = len(self.entries)
        for _ in range(size):
            i = self.next
            self.next = (i + 1) % size
            entry = self.entries[i]
            if entry is not None and entry[2] is not None:
                if not entry[2].query():
                    continue
                entry[2] = None
            if entry is None or entry[0].numel() < 2 * n:
                size = max(256, triton.next_power_of_2(2 * n))
                host = torch.empty(size, dtype=torch.int64, pin_memory=True)
                # allocated on the copy's stream: on the caller's current stream the allocator may
                # hand back a block that work still queued there uses, and the copy's stream does
                # not wait for that work (seen as wrong KV in the engine's TP test on the H200)
                with torch.cuda.stream(stream):
                    dev = torch.empty(size, dtype=torch.int64, device=self.device)
                # [pinned, device, event, pinned as numpy, addresses, device views by n]
                entry = self.entries[i] = [host, dev, None, host.numpy(), (dev.data_ptr(), host.data_ptr()), {}]
            put(entry, src_ids, dst_ids, stream)
            entry[2] = _PENDING  # until the launch's event is set: not reusable
            view = entry[5].get(n)
            if view is None:
                view = entry[5][n] = entry[1][:2 * n]
            return view, entry
        if size < self.MAX:  # every buffer still read by a queued launch: one more, kept for later calls
            self.entries.append(None)
            self.next = size
            return self._upload(src_ids, dst_ids, stream, put)
        return None


def _put_native(entry: list, src_ids: np.ndarray, dst_ids: np.ndarray, stream: torch.cuda.Stream) -> None:
    """Fill a ring entry by xfer's C helpers: the pairs ordered by destination id (if
    ``SORT_BY_DESTINATION``) and one ``cuMemcpyHtoDAsync`` on ``stream``, in one call."""
    dev, host = entry[4]
    try:
        _C.put_ids(host, entry[0].numel(), src_ids, dst_ids, SORT_BY_DESTINATION, dev, stream.cuda_stream,
                   stream.device_index)
    except TypeError:  # a strided id array (the C side reads contiguous int64 only)
        _C.put_ids(host, entry[0].numel(), np.ascontiguousarray(src_ids), np.ascontiguousarray(dst_ids),
                   SORT_BY_DESTINATION, dev, stream.cuda_stream, stream.device_index)


def _put_memcpy(memcpy):
    """The Python way to fill a ring entry (ids already ordered): numpy writes and ``cudaMemcpyAsync``
    by ctypes (``memcpy``: the runtime's, from ``copy_engine``)."""
    def put(entry: list, src_ids: np.ndarray, dst_ids: np.ndarray, stream: torch.cuda.Stream) -> None:
        n, host = len(src_ids), entry[3]
        host[:n] = src_ids
        host[n:2 * n] = dst_ids
        rc = memcpy(*entry[4], 16 * n, 1, stream.cuda_stream)  # 1: H2D
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyAsync of the block ids failed with error {rc}")
    return put


class _Pending:
    def query(self) -> bool:
        return False


_PENDING = _Pending()


class PairTables:
    """What a copy between two fixed sides needs besides the block ids, built once: the kernel
    geometry, the common alignment of every address and stride, and the slot-address table
    already on the device. A repeat copy between the same caches then uploads only its ids
    (into reused buffers, on the copy's own stream) and reuses its launch shape."""

    __slots__ = ("src_layout", "dst_layout", "geometry", "align", "table", "device", "slots", "tiles", "ring",
                 "_put", "native")

    def __init__(self, src_layout: KVLayout, src_addr: np.ndarray, dst_layout: KVLayout, dst_addr: np.ndarray,
                 device: torch.device) -> None:
        self.src_layout, self.dst_layout, self.device = src_layout, dst_layout, device
        self.geometry = _geometry(src_layout, dst_layout)
        run_bytes, _, s_str, d_str = self.geometry
        addr = np.concatenate([src_addr, dst_addr]).astype(np.int64, copy=False)
        g = int(np.gcd.reduce(np.concatenate([addr, [MAX_ALIGN, run_bytes, *s_str, *d_str]])))
        self.align = g & -g
        self.slots = src_layout.num_slots
        self.table = torch.from_numpy(addr.copy()).to(device)  # once per pair: a blocking upload is fine
        self.tiles: dict = {}
        self.ring = _IdsRing(device)
        self._put = None  # how the ring's entries are filled (_put_native, _put_memcpy), chosen on first use
        # n -> the C helpers' launch of an n-block copy (_native_spec), None where Triton's launcher keeps it
        self.native: dict[int, bytes | None] | None = {} if native_launch(device) else None

    def _upload(self, src_ids: np.ndarray, dst_ids: np.ndarray, stream: torch.cuda.Stream | None) -> tuple:
        """(device ids ``[src..., dst...]`` sorted by destination, the ring entry holding them or
        None): with a stream, into a reused ring buffer by one ``cudaMemcpyAsync`` on it; without
        one, or with every buffer busy, a fresh upload (on ``stream``, else the current stream)."""
        put = None
        if stream is not None:
            put = self._put
            if put is None:
                put = self._put = self._filler()
            if put is _put_native:  # (it orders the pairs itself)
                hit = self.ring.upload(src_ids, dst_ids, stream, put)
                if hit is not None:
                    return hit
                put = None  # every buffer busy: a fresh upload below
        if SORT_BY_DESTINATION and len(dst_ids) > 1:  # pairs are independent (destination ids unique)
            order = np.argsort(dst_ids)
            src_ids, dst_ids = src_ids[order], dst_ids[order]
        if put:
            hit = self.ring.upload(src_ids, dst_ids, stream, put)
            if hit is not None:
                return hit
        n = len(src_ids)
        staged = torch.empty(2 * n, dtype=torch.int64, pin_memory=True)
        host = staged.numpy()
        host[:n], host[n:] = src_ids, dst_ids
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            return staged.to(self.device, non_blocking=True), None  # the host allocator keeps `staged` until copied

    def _filler(self):
        """How this pair fills its ids ring: by the C helpers, else by ctypes' cudaMemcpyAsync, else
        False (no runtime found: every upload a fresh tensor copy)."""
        if self.native is not None:
            return _put_native
        from . import copy_engine

        rt = copy_engine._runtime()
        return False if isinstance(rt, str) else _put_memcpy(rt.memcpy)

    def _go(self, ids: torch.Tensor, entry, n: int, shape: tuple, stream: torch.cuda.Stream) -> None:
        """Launch an ``n``-block copy of the uploaded ``ids`` (``entry``: its ring entry, or None) on
        ``stream``: by the C helpers where they launch this kernel, else by Triton's launcher (which
        compiles it the first time)."""
        programs, warps, n_rows, consts, key = shape
        native = self.native
        if native is not None:
            spec = native.get(n)
            if spec is None and n not in native and key in _COMPILED:
                args = (self.table, ids, n, n_rows, *consts)
                spec = native[n] = _native_spec(key, programs, args, self.device.index)
            if spec is not None:
                _C.launch(spec, ids.data_ptr() if entry is None else entry[4][0], stream.cuda_stream)
                return
        _launch(programs, (self.table, ids, n, n_rows, *consts), warps, self.device.index, stream, key)

    def _shape(self, n: int) -> tuple:
        """The default launch shape of an ``n``-block copy (``CopyPlan.shape``), kept in ``tiles``."""
        shape = self.tiles.get((n, None, None))
        if shape is None:
            shape = CopyPlan(self.table, n, self.slots, self.geometry, min(self.align, 8), self.align, False,
                             ids=self.table, tiles=self.tiles).shape()
        return shape

    def launch(self, src_ids: np.ndarray, dst_ids: np.ndarray, stream: torch.cuda.Stream) -> tuple:
        """Launch a copy of *validated* ids on ``stream``, the lean way a repeat copy between
        long-lived caches takes: the ids go into a reused buffer by one ``cudaMemcpyAsync``, the
        launch shape comes from ``tiles``, no plan object is built. Returns (ring entry, ids
        tensor): give the entry to :meth:`release` with the launch's event, and keep the ids
        tensor until that event completed."""
        ids, entry = self._upload(src_ids, dst_ids, stream)
        n = len(src_ids)
        self._go(ids, entry, n, self._shape(n), stream)
        return entry, ids

    def stage(self, src_ids: np.ndarray, dst_ids: np.ndarray, stream: torch.cuda.Stream) -> tuple:
        """The first half of :meth:`launch`: the ids' upload onto ``stream`` and the launch shape,
        nothing launched. Returns (ids tensor, ring entry, shape) for :meth:`launch_staged`; an
        entry that will not launch goes back by :meth:`release` with an event recorded after it."""
        ids, entry = self._upload(src_ids, dst_ids, stream)
        return ids, entry, self._shape(len(src_ids))

    def launch_staged(self, ids: torch.Tensor, n: int, shape: tuple, stream: torch.cuda.Stream) -> None:
        """The second half of :meth:`launch`: the kernel of ``n`` staged blocks on ``stream``."""
        self._go(ids, None, n, shape, stream)

    def preload(self, n: int, stream: torch.cuda.Stream) -> bool:
        """Make sure the kernel a copy of ``n`` blocks between these sides launches has run once in
        this process: the first time, one launch on ``stream`` that moves nothing. True if it launched.

        CUDA may synchronize the whole context to load a kernel on its first launch (lazy loading);
        were a stream of this process then waiting on memory that only later work of this process
        sets (an NVSHMEM signal wait its own drain releases), that first launch would never return."""
        programs, warps, n_rows, consts, key = self._shape(n)
        if key in _COMPILED:
            return False
        with torch.cuda.stream(stream):  # allocated where it is used (see _IdsRing)
            ids = torch.zeros(2 * n, dtype=torch.int64, device=self.device)
        # n_rows 0: every row is masked off; only the tables' first words are read
        _launch(1, (self.table, ids, n, 0, *consts), warps, self.device.index, stream, key)
        return True

    @staticmethod
    def release(entry, event) -> None:
        """The ids buffer ``entry`` (from :meth:`launch`) may be reused once ``event`` completed."""
        if entry is not None:
            entry[2] = event

    def plan(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> CopyPlan:
        """A plan for *validated* ids, their upload queued on the current stream."""
        ids, _ = self._upload(src_ids, dst_ids, None)
        return CopyPlan(self.table, len(src_ids), self.slots, self.geometry, min(self.align, 8), self.align, False,
                        ids=ids, tiles=self.tiles)
