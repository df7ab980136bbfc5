"""Torch reference of the block-copy ops: their meaning, their checks, and the CPU path.

Every op here is per slot ``dst_view[dst_ids] = src_view[src_ids]`` over byte views built from
``KVLayout.views()``, so any dtype (fp8, uint8, NaN bit patterns) moves bit for bit. It runs on
CPU and CUDA tensors alike and is the oracle the Triton kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from xfer.errors import InvalidArgumentError, LengthMismatchError
from xfer.layout import KVLayout

__all__ = ["copy_blocks_ref", "gather_ref", "scatter_ref", "apply_copy_ref", "validate_copy", "check_ids",
           "check_overlap", "tensor_spans", "staging_tensor", "empty_staging", "byte_views", "slot_addresses"]


def validate_copy(src_layout: KVLayout, src_tensors: Sequence[torch.Tensor], src_ids,
                  dst_layout: KVLayout, dst_tensors: Sequence[torch.Tensor], dst_ids,
                  ) -> tuple[list[torch.Tensor], np.ndarray, list[torch.Tensor], np.ndarray]:
    """Every check of a block copy, before any byte moves; returns (src tensors, src ids, dst tensors, dst ids).

    Source ids may repeat; destination ids must be unique. Raises :class:`LayoutMismatchError`,
    :class:`BlockIdError`, :class:`LengthMismatchError`, :class:`LayoutError` or
    :class:`InvalidArgumentError` (source and destination blocks overlapping in memory).
    """
    s_ids, d_ids = check_ids(src_layout, src_ids, dst_layout, dst_ids)
    src, dst = src_layout.check_tensors(src_tensors), dst_layout.check_tensors(dst_tensors)
    check_overlap(src_layout, src, s_ids, dst_layout, dst, d_ids)
    return src, s_ids, dst, d_ids


def check_ids(src_layout: KVLayout, src_ids, dst_layout: KVLayout, dst_ids) -> tuple[np.ndarray, np.ndarray]:
    """Layout compatibility, id ranges, unique destination ids, equal lengths; returns int64 id arrays."""
    src_layout.check_compatible(dst_layout, what="destination")
    s_ids = src_layout.check_block_ids(src_ids, what="source block ids")
    d_ids = dst_layout.check_block_ids(dst_ids, what="destination block ids", unique=True)
    if s_ids.size != d_ids.size:
        raise LengthMismatchError(f"{s_ids.size} source block ids but {d_ids.size} destination block ids")
    return s_ids, d_ids


def check_overlap(src_layout: KVLayout, src: Sequence[torch.Tensor], s_ids: np.ndarray,
                  dst_layout: KVLayout, dst: Sequence[torch.Tensor], d_ids: np.ndarray, *,
                  spans: tuple | None = None, touching: bool | None = None) -> None:
    """Raise when the copy would write bytes it also reads (one kernel reads and writes in no fixed
    order); only disjoint blocks of one cache (same layout, same tensors) may share memory.

    ``spans``: the two sides' :func:`tensor_spans`, when the caller has them already;
    ``touching``: whether those spans overlap, when the caller knows it (:func:`sides_touch`).
    """
    if not s_ids.size:
        return
    if touching is None:
        a, b = spans if spans is not None else (tensor_spans(src_layout, src), tensor_spans(dst_layout, dst))
        touching = _spans_overlap(a, b)
    if not touching:
        return
    same = src_layout == dst_layout and [t.data_ptr() for t in src] == [t.data_ptr() for t in dst]
    common = np.intersect1d(s_ids, d_ids)
    if not same or common.size:
        what = f"block {int(common[0])} is both read and written" if common.size else "the two layouts share memory"
        raise InvalidArgumentError(f"source and destination overlap: {what}; copy through a staging buffer")


def tensor_spans(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges [lo, hi) the layout may touch in each base tensor (unified addresses are unique)."""
    lo = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    return lo, lo + np.asarray(layout.tensor_numel, dtype=np.int64) * layout.itemsize


def sides_touch(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    """Whether any byte range of spans ``a`` meets one of ``b`` (fixed for two fixed sides)."""
    return _spans_overlap(a, b)


def _spans_overlap(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    if a[0].min() >= b[1].max() or b[0].min() >= a[1].max():
        return False  # the common case: the two sides' address ranges are apart
    order = np.argsort(b[0])
    b_lo, reach = b[0][order], np.maximum.accumulate(b[1][order])  # furthest end among spans so far
    k = np.searchsorted(b_lo, a[1], side="left")  # b spans [0, k) start before each a span ends
    return bool(np.any((k > 0) & (reach[np.maximum(k - 1, 0)] > a[0])))


def staging_tensor(buf: torch.Tensor, staging: KVLayout, *, what: str = "staging buffer") -> torch.Tensor:
    """Reinterpret ``buf`` (1-D, contiguous, any dtype) as the single base tensor of ``staging``.

    Its size must be exactly the staging layout's bytes; raises :class:`InvalidArgumentError` otherwise.
    """
    if not isinstance(buf, torch.Tensor):
        raise InvalidArgumentError(f"{what} must be a torch.Tensor, got {type(buf).__name__}")
    if staging.num_tensors != 1:
        raise InvalidArgumentError(f"a staging layout has one base tensor, {staging.name} has {staging.num_tensors}")
    need = staging.tensor_numel[0] * staging.itemsize
    if buf.dim() != 1 or not buf.is_contiguous():
        raise InvalidArgumentError(f"{what} must be 1-D and contiguous, got shape {tuple(buf.shape)} "
                                   f"stride {buf.stride()}")
    if buf.numel() * buf.element_size() != need:
        raise InvalidArgumentError(f"{what} holds {buf.numel() * buf.element_size()} bytes, "
                                   f"{staging.num_blocks} blocks of this layout need exactly {need}")
    if buf.data_ptr() % staging.itemsize:
        raise InvalidArgumentError(f"{what} starts at address {buf.data_ptr():#x}, not a multiple of the "
                                   f"{staging.itemsize}-byte {staging.dtype}")
    return buf.view(torch.uint8).view(staging.dtype)


def empty_staging(buf: torch.Tensor, *, what: str = "staging buffer") -> None:
    """Check the staging buffer of a copy of zero blocks (no staging layout exists for zero blocks)."""
    if not isinstance(buf, torch.Tensor) or buf.dim() != 1 or buf.numel():
        raise InvalidArgumentError(f"{what} for 0 blocks must be an empty 1-D tensor, got "
                                   f"{tuple(buf.shape) if isinstance(buf, torch.Tensor) else type(buf).__name__}")


def slot_addresses(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """int64 ``[num_slots]``: byte address of block 0 of every slot (base ``data_ptr`` + offset)."""
    ptrs = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    return ptrs[np.asarray(layout.slot_tensor, dtype=np.int64)] + \
        np.asarray(layout.slot_offset, dtype=np.int64) * layout.itemsize


def byte_views(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-slot uint8 views ``[num_blocks, block_size, num_heads, head_dim, itemsize]`` (no copy)."""
    isz = layout.itemsize
    raws: dict[int, torch.Tensor] = {}
    out = []
    for v in layout.views(tensors):
        storage = v.untyped_storage()
        raw = raws.get(storage.data_ptr())
        if raw is None:
            raw = raws[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=v.device).set_(storage)
        size = tuple(v.shape) + (isz,)
        stride = tuple(s * isz for s in v.stride()) + (1,)
        out.append(raw.as_strided(size, stride, v.storage_offset() * isz))
    return out


def copy_blocks_ref(src_layout: KVLayout, src_tensors: Sequence[torch.Tensor], src_ids,
                    dst_layout: KVLayout, dst_tensors: Sequence[torch.Tensor], dst_ids) -> None:
    """Copy blocks ``src_ids`` of the source onto ``dst_ids`` of the destination, every slot; synchronous.

    Tensors as in :func:`xfer.kernels.copy_blocks`; the two sides may sit on different devices.
    """
    src, s_ids, dst, d_ids = validate_copy(src_layout, src_tensors, src_ids, dst_layout, dst_tensors, dst_ids)
    apply_copy_ref(src_layout, src, s_ids, dst_layout, dst, d_ids)


def apply_copy_ref(src_layout: KVLayout, src: list[torch.Tensor], s_ids: np.ndarray,
                   dst_layout: KVLayout, dst: list[torch.Tensor], d_ids: np.ndarray, *, views=None) -> None:
    """:func:`copy_blocks_ref` on arguments :func:`validate_copy` already returned.

    ``views``: what :func:`host_run_views` returned for these very tensors (a caller that copies
    between the same two caches again and again keeps it: building 2 x 128 views costs ~1 ms)."""
    if not s_ids.size:
        return
    if views is not None:
        _copy_numpy(views[0], s_ids, views[1], d_ids)
        return
    src_views, dst_views = run_views(src_layout, src, dst_layout, dst)
    if src[0].device.type == "cpu" and dst[0].device.type == "cpu":
        _copy_numpy([v.numpy() for v in src_views], s_ids, [v.numpy() for v in dst_views], d_ids)
        return
    s_idx = torch.from_numpy(s_ids).to(src[0].device)
    d_idx = torch.from_numpy(d_ids).to(dst[0].device)
    for sv, dv in zip(src_views, dst_views):
        dv[d_idx] = sv[s_idx].to(dv.device)


def host_run_views(src_layout: KVLayout, src: Sequence[torch.Tensor], dst_layout: KVLayout,
                   dst: Sequence[torch.Tensor]) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """:func:`run_views` of two host sides as numpy arrays, for :func:`apply_copy_ref`'s ``views``
    (None when a side is not on the host)."""
    if src[0].device.type != "cpu" or dst[0].device.type != "cpu":
        return None
    s_views, d_views = run_views(src_layout, src, dst_layout, dst)
    return [v.numpy() for v in s_views], [v.numpy() for v in d_views]


def _copy_numpy(src_views, s_ids: np.ndarray, dst_views, d_ids: np.ndarray) -> None:
    """Host copies through numpy's fancy indexing (numpy views of :func:`run_views`): memcpy per
    run, several times faster than torch's CPU index_select/index_copy_ here. Single pass when
    one side is a run of ids."""
    n = int(s_ids.size)
    d_run = int(d_ids[0]) if _is_run(d_ids) else None  # gather into staging: ids k..k+n-1
    s_run = int(s_ids[0]) if _is_run(s_ids) else None  # scatter from staging
    for s, d in zip(src_views, dst_views):
        if d_run is not None and d[d_run:d_run + n].flags.c_contiguous:
            np.take(s, s_ids, axis=0, out=d[d_run:d_run + n])
        elif s_run is not None:
            d[d_ids] = s[s_run:s_run + n]
        else:
            d[d_ids] = s[s_ids]


def _is_run(ids: np.ndarray) -> bool:
    """True when ``ids`` are consecutive ascending (k, k+1, ...)."""
    return bool(ids.size) and int(ids[-1]) - int(ids[0]) == ids.size - 1 and bool(np.all(np.diff(ids) == 1))


def run_views(src_layout: KVLayout, src: Sequence[torch.Tensor], dst_layout: KVLayout,
              dst: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-slot views ``[num_blocks, *outer, run_words]`` of both sides, iterating the same
    logical elements in the same order; the last dim is the run contiguous on both sides, in the
    widest integer word that every address, stride and run length allows (so an indexed copy
    moves whole runs, 8 bytes an element where it can)."""
    run, outer = src_layout.joint_runs(dst_layout)
    isz = src_layout.itemsize
    s_views, d_views = src_layout.views(src), dst_layout.views(dst)
    byte_offsets = [run * isz]
    for layout, vs in ((src_layout, s_views), (dst_layout, d_views)):
        byte_offsets += [layout.block_stride * isz, *(d[1] * isz for d in outer), *(d[2] * isz for d in outer)]
        byte_offsets += [v.data_ptr() for v in vs] + [v.untyped_storage().data_ptr() for v in vs]
    word = next(w for w in (8, 4, 2, 1) if all(b % w == 0 for b in byte_offsets))
    wdtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]

    def views(layout, vs, which):
        raws: dict[int, torch.Tensor] = {}
        out = []
        for v in vs:
            storage = v.untyped_storage()
            raw = raws.get(storage.data_ptr())
            if raw is None:
                raw = raws[storage.data_ptr()] = torch.empty(0, dtype=wdtype, device=v.device).set_(
                    storage, 0, (storage.nbytes() // word,))
            size = (layout.num_blocks, *(d[0] for d in outer), run * isz // word)
            stride = (layout.block_stride * isz // word, *(d[which] * isz // word for d in outer), 1)
            out.append(raw.as_strided(size, stride, v.storage_offset() * isz // word))
        return out

    return views(src_layout, s_views, 1), views(dst_layout, d_views, 2)


def gather_ref(layout: KVLayout, tensors: Sequence[torch.Tensor], block_ids, out: torch.Tensor) -> None:
    """Gather blocks into the 1-D staging buffer ``out`` laid out as ``layout.staging(len(block_ids))``."""
    n = len(layout.check_block_ids(block_ids))
    if n == 0:
        return empty_staging(out, what="out")
    staging = layout.staging(n)
    copy_blocks_ref(layout, tensors, block_ids, staging, [staging_tensor(out, staging, what="out")], np.arange(n))


def scatter_ref(staging: torch.Tensor, layout: KVLayout, tensors: Sequence[torch.Tensor], block_ids, *,
                staging_layout: KVLayout | None = None) -> None:
    """Scatter a 1-D staging buffer (``staging_layout``, default ``layout.staging(n)``) onto blocks."""
    n = len(layout.check_block_ids(block_ids, unique=True))
    if n == 0:
        return empty_staging(staging, what="staging")
    staging_layout = layout.staging(n) if staging_layout is None else staging_layout
    buf = staging_tensor(staging, staging_layout, what="staging")
    copy_blocks_ref(staging_layout, [buf], np.arange(n), layout, tensors, block_ids)
