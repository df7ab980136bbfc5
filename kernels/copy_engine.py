"""Block copies by the GPU's copy engines (DMA), the alternative to the Triton kernel's SM copies.

A copy is a list of byte *runs* ``(dst, src, nbytes)``: absolute unified addresses, so a side
may be this process's device memory, a CUDA-IPC mapping of another process's, or pinned host
memory. Runs come from :func:`xfer.layout.pair_runs` (merged where consecutive runs continue on
both sides) and go to the CUDA runtime in one of three ways (``MODES``):

- ``batch``: ``cudaMemcpyBatchAsync`` (CUDA runtime >= 12.8), at most :data:`MAX_BATCH` runs a
  call. Its C signature differs by runtime major version, and this module calls the runtime
  library torch loaded through ctypes with the signature of that library's version:

  - 12.8 / 12.9: ``cudaError_t cudaMemcpyBatchAsync(void **dsts, void **srcs, size_t *sizes,
    size_t count, cudaMemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
    size_t *failIdx, cudaStream_t stream)``
  - 13.x: the same without ``failIdx`` (``... size_t numAttrs, cudaStream_t stream)``); see
    cuda-python 13.3's ``cuda/bindings/cyruntime.pxd`` (generated from ``cuda_runtime_api.h``).

  ``cudaMemcpyAttributes`` is ``{cudaMemcpySrcAccessOrder srcAccessOrder; cudaMemLocation
  srcLocHint; cudaMemLocation dstLocHint; unsigned int flags}`` with ``cudaMemLocation`` =
  ``{cudaMemLocationType type; int id}`` (24 bytes, 4-byte fields). One attribute entry covers
  the whole batch: ``srcAccessOrder = cudaMemcpySrcAccessOrderStream`` (the source is read in
  stream order, after what the stream did before: KV written by a prior kernel), zeroed location
  hints (they apply only to managed / pageable memory) and no flags. The batch API refuses the
  legacy default stream; :func:`launch` callers give it another one (the dispatcher detours
  through a side stream).
- ``2d``: runs that repeat with one source pitch and one destination pitch (equal widths, both
  pitches >= the width and <= the device's max pitch, same base tensors) become one
  ``cudaMemcpy2DAsync`` each (DistServe's trick for copying a block range of one layer, or a
  head range of every layer, in one call); the rest go one ``cudaMemcpyAsync`` each.
- ``runs``: one ``cudaMemcpyAsync`` per run (the baseline the other two are measured against).

All three use ``cudaMemcpyDefault`` (the direction comes from the unified addresses). A
:class:`CopyEnginePlan` is built once per (layouts, tensor addresses, block ids): int64 arrays,
so ``batch`` makes one ctypes call per :data:`MAX_BATCH` runs with no Python work per run;
``2d`` and ``runs`` make one call per operation from lists prepared at plan time.

Nothing here imports triton; plan building is pure numpy and runs (and is tested) without a GPU.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import threading
from collections import OrderedDict

import numpy as np

from xfer.errors import InvalidArgumentError, TransportError, TransportUnavailableError
from xfer.layout import KVLayout, pair_runs

__all__ = ["MODES", "MAX_BATCH", "CopyEnginePlan", "build_runs", "coalesce_2d", "prepare", "plan_for",
           "available", "runtime_info"]

MODES = ("batch", "2d", "runs")
MAX_BATCH = 4096  # runs per cudaMemcpyBatchAsync call: no documented limit; bounded to keep each call short
DEFAULT_MAX_PITCH = (1 << 31) - 1  # cudaDevAttrMaxPitch on current NVIDIA GPUs; queried per device on a GPU
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault
SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
BATCH_MIN_VERSION = 12080
_DEV_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch
_LEGACY_STREAMS = (0, 1)  # the NULL stream and cudaStreamLegacy: refused by cudaMemcpyBatchAsync


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``cudaMemcpyAttributes`` (CUDA 12.8+, unchanged in 13.x)."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


# ---- the CUDA runtime torch uses ----------------------------------------------------------------
_CUDART_NAME = re.compile(r"libcudart\.so(\.\d+)*$")


def _loaded_cudart() -> list[str]:
    """Paths of libcudart mapped into this process (torch's own, when torch links it dynamically)."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if _CUDART_NAME.search(os.path.basename(path)) and path not in found:
                        found.append(path)
    except OSError:
        pass
    return found


def _candidate_cudart() -> list[str]:
    """libcudart paths to try: those mapped into this process first (torch's own major version and
    site-packages before others: other packages may load a second copy), then files next to torch."""
    out = _loaded_cudart()
    try:
        import torch
        lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        site = os.path.dirname(os.path.dirname(torch.__file__))
        major = (torch.version.cuda or "").split(".")[0]
        out.sort(key=lambda p: (bool(major) and f".so.{major}" not in p, not p.startswith(site)))
        for pattern in (os.path.join(lib, "libcudart.so*"), os.path.join(site, "nvidia", "*", "lib", "libcudart.so*"),
                        os.path.join(site, "nvidia", "cuda_runtime", "lib", "libcudart.so*")):
            for path in sorted(glob.glob(pattern)):
                if path not in out and (not major or f".so.{major}" in path):
                    out.append(path)
    except ImportError:
        pass
    return out


class _Runtime:
    """ctypes entry points of one libcudart, typed for its version."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        self.lib = lib
        version = ctypes.c_int(0)
        lib.cudaRuntimeGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaRuntimeGetVersion.restype = ctypes.c_int
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
            raise OSError(f"cudaRuntimeGetVersion failed in {path}")
        self.version = version.value
        vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self.memcpy = lib.cudaMemcpyAsync
        self.memcpy.argtypes, self.memcpy.restype = [vp, vp, sz, i32, vp], i32
        self.memcpy2d = lib.cudaMemcpy2DAsync
        self.memcpy2d.argtypes, self.memcpy2d.restype = [vp, sz, vp, sz, sz, sz, i32, vp], i32
        lib.cudaGetErrorName.argtypes, lib.cudaGetErrorName.restype = [i32], ctypes.c_char_p
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [i32], ctypes.c_char_p
        lib.cudaGetLastError.argtypes, lib.cudaGetLastError.restype = [], i32
        lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), i32, i32]
        lib.cudaDeviceGetAttribute.restype = i32
        self.batch = None
        self.batch_has_fail_idx = False
        self.batch_missing = None
        if self.version < BATCH_MIN_VERSION:
            self.batch_missing = (f"cudaMemcpyBatchAsync needs CUDA runtime >= 12.8; {os.path.basename(path)} "
                                  f"is {self.version // 1000}.{self.version % 1000 // 10}")
        else:
            fn = getattr(lib, "cudaMemcpyBatchAsync", None)
            if fn is None:
                self.batch_missing = f"{path} (CUDA {self.version}) exports no cudaMemcpyBatchAsync"
            else:
                self.batch_has_fail_idx = self.version < 13000  # 13.0 dropped the failIdx argument
                args = [vp, vp, vp, sz, ctypes.POINTER(MemcpyAttributes), vp, sz]
                if self.batch_has_fail_idx:
                    args.append(ctypes.POINTER(ctypes.c_size_t))
                fn.argtypes, fn.restype = args + [vp], i32
                self.batch = fn
        self.attrs = MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0), 0)
        self.attr_idx = np.zeros(1, dtype=np.uint64)
        self._pitch: dict[int, int] = {}

    def error(self, what: str, rc: int, detail: str = "") -> TransportError:
        self.lib.cudaGetLastError()  # clear it: torch checks the last error after its own launches
        name = (self.lib.cudaGetErrorName(rc) or b"?").decode()
        text = (self.lib.cudaGetErrorString(rc) or b"").decode()
        return TransportError(f"{what} failed: {name} ({rc}): {text}{detail}")

    def max_pitch(self, device: int) -> int:
        if device not in self._pitch:
            v = ctypes.c_int(0)
            rc = self.lib.cudaDeviceGetAttribute(ctypes.byref(v), _DEV_ATTR_MAX_PITCH, device)
            self._pitch[device] = v.value if rc == 0 and v.value > 0 else DEFAULT_MAX_PITCH
            if rc:
                self.lib.cudaGetLastError()
        return self._pitch[device]


_RUNTIME: list = []  # [_Runtime | str]: loaded once; a str says why it could not be
_RUNTIME_LOCK = threading.Lock()


def _runtime() -> "_Runtime | str":
    with _RUNTIME_LOCK:
        if not _RUNTIME:
            _RUNTIME.append(_load_runtime())
        return _RUNTIME[0]


def _load_runtime() -> "_Runtime | str":
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device in this process"
    torch.cuda.init()
    errors = []
    for path in _candidate_cudart():
        try:
            return _Runtime(path)
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
    return "found no usable libcudart (" + ("; ".join(errors) or "none mapped into this process") + ")"


def runtime_info() -> dict:
    """Which libcudart the copy engine calls and what it offers (for reports)."""
    rt = _runtime()
    if isinstance(rt, str):
        return {"available": False, "reason": rt}
    return {"available": True, "library": rt.path, "version": rt.version, "batch": rt.batch is not None,
            "batch_signature": None if rt.batch is None else ("12.8 (with failIdx)" if rt.batch_has_fail_idx
                                                              else "13.x (no failIdx)"),
            "batch_missing": rt.batch_missing}


def available(mode: str) -> str | None:
    """None when ``mode`` can run in this process; otherwise why not."""
    if mode not in MODES:
        raise InvalidArgumentError(f"copy-engine mode must be one of {MODES}, got {mode!r}")
    rt = _runtime()
    if isinstance(rt, str):
        return f"copy engine unavailable: {rt}"
    if mode == "batch" and rt.batch is None:
        return rt.batch_missing
    return None


# ---- run lists (pure numpy) -----------------------------------------------------------------------
def build_runs(src_layout: KVLayout, src_ptrs, src_ids, dst_layout: KVLayout, dst_ptrs, dst_ids,
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Absolute byte runs of a block copy: (dst, src, nbytes, dst tensor, src tensor), int64.

    ``*_ptrs``: ``data_ptr()`` of each base tensor of the layout. Runs are merged where they
    continue on both sides within one base tensor (``pair_runs``); the ids are checked there.
    """
    src_ptrs = np.asarray(src_ptrs, dtype=np.int64).reshape(-1)
    dst_ptrs = np.asarray(dst_ptrs, dtype=np.int64).reshape(-1)
    if src_ptrs.size != src_layout.num_tensors or dst_ptrs.size != dst_layout.num_tensors:
        raise InvalidArgumentError(f"need {src_layout.num_tensors} source and {dst_layout.num_tensors} destination "
                                   f"base pointers, got {src_ptrs.size} and {dst_ptrs.size}")
    if (src_ptrs <= 0).any() or (dst_ptrs <= 0).any():
        raise InvalidArgumentError("base tensor pointers must be non-null addresses")
    p = pair_runs(src_layout, src_ids, dst_layout, dst_ids)
    return (dst_ptrs[p.dst_tensor] + p.dst_offset, src_ptrs[p.src_tensor] + p.src_offset, p.nbytes.astype(np.int64),
            p.dst_tensor, p.src_tensor)


def _chains(group: np.ndarray, s: np.ndarray, d: np.ndarray, w: np.ndarray, max_pitch: int):
    """Cut ordered runs into chains that repeat with one (source, destination) pitch.

    A link joins run ``i`` to ``i+1`` when both are in one group, of one width, and each
    address steps forward by at least the width and at most ``max_pitch``. Consecutive links
    with one (step, step) form a segment; where two segments touch, the later one gives up its
    first link, so every run is in exactly one chain and a chain's links all share their steps.
    Returns (start indices, heights, source pitch, destination pitch).
    """
    n = s.size
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z
    ds, dd = np.diff(s), np.diff(d)
    valid = (group[1:] == group[:-1]) & (w[1:] == w[:-1]) & (ds >= w[:-1]) & (dd >= w[:-1]) & \
        (ds <= max_pitch) & (dd <= max_pitch)
    prev_valid = np.concatenate(([False], valid[:-1]))
    same_as_prev = prev_valid & np.concatenate(([False], (ds[1:] == ds[:-1]) & (dd[1:] == dd[:-1])))
    seg_start = valid & ~same_as_prev
    touching = np.flatnonzero(seg_start & prev_valid)  # link i starts a segment, link i-1 ends another
    seg = np.cumsum(seg_start) - 1  # segment of each valid link
    length = np.bincount(seg[valid], minlength=int(seg_start.sum())) if valid.any() else np.zeros(0, np.int64)
    # the shorter of two touching segments gives up its link at the shared run
    later_shorter = length[seg[touching]] <= length[seg[touching - 1]]
    used = valid.copy()
    used[touching[later_shorter]] = False
    used[touching[~later_shorter] - 1] = False
    # give a dropped link back where neither neighbour link is used (and the previous one is not
    # given back too): it then joins two runs no other link joins
    pad = np.concatenate(([False], used, [False]))
    free = valid & ~used & ~pad[:-2] & ~pad[2:]
    used |= free & ~np.concatenate(([False], free[:-1]))
    starts = np.flatnonzero(~np.concatenate(([False], used)))
    heights = np.diff(np.append(starts, n))
    link = np.minimum(starts, max(n - 2, 0))
    tall = heights > 1
    spitch = np.where(tall, ds[link] if n > 1 else 0, w[starts])
    dpitch = np.where(tall, dd[link] if n > 1 else 0, w[starts])
    return starts, heights, spitch, dpitch


def coalesce_2d(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, group: np.ndarray | None = None,
                max_pitch: int = DEFAULT_MAX_PITCH) -> dict[str, np.ndarray]:
    """2-D copy operations covering the runs exactly once.

    ``group``: runs may share an operation only within one group (the dispatcher uses the pair
    of base tensors, so that no operation spans two allocations). Tries the runs in source
    address order and in destination address order and keeps the one with fewer operations.
    Returns int64 arrays ``dst, dpitch, src, spitch, width, height``; operation ``k`` copies row
    ``r < height[k]`` of ``width[k]`` bytes from ``src[k] + r*spitch[k]`` to
    ``dst[k] + r*dpitch[k]`` (height 1: a plain copy).
    """
    dst, src, nbytes = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (dst, src, nbytes))
    if not dst.size == src.size == nbytes.size:
        raise InvalidArgumentError(f"run arrays differ in length: {dst.size} dst, {src.size} src, {nbytes.size} sizes")
    group = np.zeros(dst.size, dtype=np.int64) if group is None else np.asarray(group, dtype=np.int64).reshape(-1)
    best = None
    for key in (src, dst):
        order = np.lexsort((key, nbytes, group))
        s, d, w, g = src[order], dst[order], nbytes[order], group[order]
        starts, heights, sp, dp = _chains(g, s, d, w, max_pitch)
        if best is None or starts.size < best["height"].size:
            best = {"dst": d[starts], "dpitch": dp, "src": s[starts], "spitch": sp, "width": w[starts],
                    "height": heights}
    return best


def expand_2d(ops: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs (dst, src, nbytes) that 2-D operations copy, in operation order (for tests)."""
    h = ops["height"]
    rows = np.arange(int(h.sum())) - np.repeat(np.cumsum(h) - h, h)
    rep = lambda a: np.repeat(a, h)  # noqa: E731
    return rep(ops["dst"]) + rows * rep(ops["dpitch"]), rep(ops["src"]) + rows * rep(ops["spitch"]), rep(ops["width"])


# ---- plans --------------------------------------------------------------------------------------
class CopyEnginePlan:
    """The runs of one block copy, ready to hand to the copy engines (again) on any stream.

    ``dst``, ``src``, ``nbytes``: int64 ``[R]`` absolute runs; ``group``: the base-tensor pair of
    each run (2-D operations never mix groups). 2-D operations are derived on first use.
    """

    __slots__ = ("dst", "src", "nbytes", "group", "device", "max_pitch", "_ops2d", "_runs_list", "_ops_list",
                 "_batch_arrays")

    def __init__(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, group: np.ndarray | None = None,
                 device: int | None = None, max_pitch: int = DEFAULT_MAX_PITCH) -> None:
        self.dst = np.ascontiguousarray(dst, dtype=np.int64)
        self.src = np.ascontiguousarray(src, dtype=np.int64)
        self.nbytes = np.ascontiguousarray(nbytes, dtype=np.int64)
        if not self.dst.shape == self.src.shape == self.nbytes.shape or self.dst.ndim != 1:
            raise InvalidArgumentError(f"run arrays must be 1-D of one length, got {self.dst.shape}, {self.src.shape}, "
                                       f"{self.nbytes.shape}")
        if self.nbytes.size and (int(self.nbytes.min()) <= 0 or int(self.dst.min()) <= 0 or int(self.src.min()) <= 0):
            raise InvalidArgumentError("runs must have positive sizes and non-null addresses")
        self.group = np.zeros(self.dst.size, dtype=np.int64) if group is None else \
            np.ascontiguousarray(group, dtype=np.int64)
        self.device, self.max_pitch = device, max_pitch
        self._ops2d = self._runs_list = self._ops_list = self._batch_arrays = None

    def __len__(self) -> int:
        return int(self.nbytes.size)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def __repr__(self) -> str:
        ops = "" if self._ops2d is None else f", 2d ops={self._ops2d['height'].size}"
        return f"CopyEnginePlan(runs={len(self)}, bytes={self.total_bytes}{ops}, device={self.device})"

    def ops_2d(self) -> dict[str, np.ndarray]:
        if self._ops2d is None:
            self._ops2d = coalesce_2d(self.dst, self.src, self.nbytes, self.group, self.max_pitch)
        return self._ops2d

    def num_calls(self, mode: str) -> int:
        """CUDA API calls ``launch(mode)`` makes."""
        if mode == "batch":
            return -(-len(self) // MAX_BATCH)
        if mode == "2d":
            return int(self.ops_2d()["height"].size)
        if mode == "runs":
            return len(self)
        raise InvalidArgumentError(f"copy-engine mode must be one of {MODES}, got {mode!r}")

    def launch(self, mode: str, stream: int) -> None:
        """Enqueue every run on the CUDA stream handle ``stream`` (``torch.cuda.Stream.cuda_stream``).

        The current CUDA device must be the stream's. ``batch`` refuses the legacy default
        stream (handle 0 or 1): the runtime would. Raises :class:`TransportUnavailableError` when
        the mode cannot run here and :class:`TransportError` when the runtime refuses a call (runs
        of earlier calls of this launch may have been enqueued by then).
        """
        reason = available(mode)
        if reason:
            raise TransportUnavailableError(reason)
        if not len(self):
            return
        rt = _runtime()
        stream = int(stream)
        if mode == "batch":
            if stream in _LEGACY_STREAMS:
                raise InvalidArgumentError("cudaMemcpyBatchAsync cannot run on the legacy default stream; "
                                           "pass another stream")
            self._launch_batch(rt, stream)
        elif mode == "2d":
            self._launch_2d(rt, stream)
        else:
            if self._runs_list is None:
                self._runs_list = list(zip(self.dst.tolist(), self.src.tolist(), self.nbytes.tolist()))
            fn = rt.memcpy
            for i, (d, s, n) in enumerate(self._runs_list):
                rc = fn(d, s, n, MEMCPY_DEFAULT, stream)
                if rc:
                    raise rt.error("cudaMemcpyAsync", rc, f" at run {i} of {len(self)} ({n} bytes {s:#x} -> {d:#x})")

    def _launch_batch(self, rt: _Runtime, stream: int) -> None:
        if self._batch_arrays is None:  # size_t / pointer arrays the runtime reads during each call
            self._batch_arrays = (self.dst.view(np.uint64), self.src.view(np.uint64), self.nbytes.view(np.uint64))
        dst, src, size = self._batch_arrays
        attrs, idx = ctypes.byref(rt.attrs), rt.attr_idx.ctypes.data
        fail = ctypes.c_size_t(0)
        for start in range(0, len(self), MAX_BATCH):
            count = min(MAX_BATCH, len(self) - start)
            args = (dst.ctypes.data + 8 * start, src.ctypes.data + 8 * start, size.ctypes.data + 8 * start, count,
                    attrs, idx, 1)
            rc = rt.batch(*args, ctypes.byref(fail), stream) if rt.batch_has_fail_idx else rt.batch(*args, stream)
            if rc:
                where = f" (copy {start + fail.value})" if rt.batch_has_fail_idx and fail.value < count else ""
                raise rt.error("cudaMemcpyBatchAsync", rc,
                               f" in runs {start}..{start + count - 1} of {len(self)}{where}")

    def _launch_2d(self, rt: _Runtime, stream: int) -> None:
        if self._ops_list is None:
            ops = self.ops_2d()
            keys = ("dst", "dpitch", "src", "spitch", "width", "height")
            self._ops_list = list(zip(*(ops[k].tolist() for k in keys)))
        m1, m2 = rt.memcpy, rt.memcpy2d
        for i, (d, dp, s, sp, w, h) in enumerate(self._ops_list):
            if h == 1:
                rc = m1(d, s, w, MEMCPY_DEFAULT, stream)
            else:
                rc = m2(d, dp, s, sp, w, h, MEMCPY_DEFAULT, stream)
            if rc:
                raise rt.error("cudaMemcpy2DAsync" if h > 1 else "cudaMemcpyAsync", rc,
                               f" at operation {i} of {len(self._ops_list)} ({h} rows of {w} bytes)")


def prepare(src_layout: KVLayout, src_ptrs, src_ids, dst_layout: KVLayout, dst_ptrs, dst_ids,
            device: int | None = None) -> CopyEnginePlan:
    """Build the plan of a block copy (ids are checked; tensors must already be checked)."""
    dst, src, nbytes, dt, st = build_runs(src_layout, src_ptrs, src_ids, dst_layout, dst_ptrs, dst_ids)
    group = st * (dst_layout.num_tensors + 1) + dt
    pitch = DEFAULT_MAX_PITCH
    if device is not None:
        rt = _runtime()
        if not isinstance(rt, str):
            pitch = rt.max_pitch(device)
    return CopyEnginePlan(dst, src, nbytes, group, device, pitch)


_PLANS: OrderedDict = OrderedDict()
_PLANS_LOCK = threading.Lock()
MAX_CACHED_PLANS = 16


def plan_for(src_layout: KVLayout, src_ptrs, src_ids: np.ndarray, dst_layout: KVLayout, dst_ptrs,
             dst_ids: np.ndarray, device: int | None = None) -> CopyEnginePlan:
    """:func:`prepare`, remembered for the last :data:`MAX_CACHED_PLANS` (layouts, addresses, ids)."""
    key = (src_layout, tuple(int(p) for p in src_ptrs), dst_layout, tuple(int(p) for p in dst_ptrs), device,
           np.asarray(src_ids, dtype=np.int64).tobytes(), np.asarray(dst_ids, dtype=np.int64).tobytes())
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
            return plan
    plan = prepare(src_layout, src_ptrs, src_ids, dst_layout, dst_ptrs, dst_ids, device)
    with _PLANS_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > MAX_CACHED_PLANS:
            _PLANS.popitem(last=False)
    return plan
