"""xfer.kernels: the Triton kernel (interpreted on CPU, compiled on CUDA) against the torch
reference, the reference against a per-element oracle, and every error before any byte moves.

Data is random bytes (every bit pattern, NaNs included) and is compared as bytes; destinations
start as a poison pattern that must survive everywhere outside the destination blocks.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xfer.errors import BlockIdError, InvalidArgumentError, LayoutError, LayoutMismatchError, LengthMismatchError
from xfer.kernels import CopyPath, copy_blocks, gather, scatter, select_path, swap_in, swap_out
from xfer.kernels.reference import byte_views, copy_blocks_ref, gather_ref
from xfer.layout import LayoutKind, make_kv_cache
from xfer.settings import reload

POISON = 0xA5
MLA_KINDS = (LayoutKind.MLA, LayoutKind.MLA_FP8)
PLAIN = [k for k in LayoutKind if k not in MLA_KINDS]
# (block_size, heads, head_dim, dtype): head_dim 3 of bf16 makes 6-byte runs, 5 of fp8 5-byte runs
SHAPES = {"bf16-odd": (3, 2, 3, torch.bfloat16), "fp8-odd": (2, 3, 5, torch.float8_e4m3fn),
          "f32-aligned": (2, 2, 4, torch.float32)}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def raw(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a tensor's whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def cache(kind, *, blocks=5, shape="bf16-odd", layers=2, fill="random", device="cpu", seed=0, **kw):
    block_size, heads, head_dim, dtype = SHAPES[shape]
    if kind in MLA_KINDS:  # head_dim is the head size there
        heads, head_dim = 1, head_dim * 3
    ts, layout = make_kv_cache(kind, num_layers=layers, num_blocks=blocks, block_size=block_size,
                               num_heads=heads, head_dim=head_dim, dtype=dtype, device=device, **kw)
    gen = torch.Generator().manual_seed(seed)
    for t in ts:
        r = raw(t)
        if fill == "random":
            r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen))
        else:
            r.fill_(POISON)
    return ts, layout


def snapshot(ts):
    return [raw(t).clone() for t in ts]


def check_moved(src_layout, src, s_ids, dst_layout, dst, d_ids):
    """Destination blocks hold the source bytes; every other destination byte is still poison."""
    s_idx = torch.as_tensor(np.asarray(s_ids, dtype=np.int64), device=src[0].device)
    d_idx = torch.as_tensor(np.asarray(d_ids, dtype=np.int64), device=dst[0].device)
    for s, (sv, dv) in enumerate(zip(byte_views(src_layout, src), byte_views(dst_layout, dst))):
        assert torch.equal(dv[d_idx], sv[s_idx].to(dv.device)), f"slot {s}: moved bytes differ"
    marks = [torch.zeros_like(t) for t in dst]
    for mv in byte_views(dst_layout, marks):
        mv[d_idx] = 1
    for i, (t, m) in enumerate(zip(dst, marks)):
        outside = raw(t)[raw(m) == 0]
        assert bool((outside == POISON).all()), f"tensor {i}: bytes outside the destination blocks changed"


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reload()  # the kernels read their settings once (xfer.settings.current())


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reload()


# ---- the kernel through the interpreter --------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", list(LayoutKind), ids=lambda k: k.value)
def test_copy_blocks_every_kind(interpret, kind, shape):
    src, sl = cache(kind, shape=shape)
    dst, dl = cache(kind, shape=shape, blocks=7, fill="poison")
    assert select_path(src, dst)[0] is CopyPath.TRITON_INTERPRETER
    s_ids, d_ids = [4, 0, 4, 2], [1, 6, 3, 0]  # unsorted, a repeated source
    before = snapshot(src)
    assert copy_blocks(sl, src, s_ids, dl, dst, np.array(d_ids)) is None
    check_moved(sl, src, s_ids, dl, dst, d_ids)
    assert all(torch.equal(a, raw(b)) for a, b in zip(before, src)), "the source changed"


@pytest.mark.parametrize("kind", [LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.PACKED_KV], ids=lambda k: k.value)
def test_bound_copy_checks_once_and_moves_exact_bytes(interpret, kind):
    from xfer.kernels import BoundCopy
    src, sl = cache(kind)
    dst, dl = cache(kind, blocks=7, fill="poison")
    bound = BoundCopy(sl, src, dl, dst)
    assert bound.select_path()[0] is CopyPath.TRITON_INTERPRETER
    assert bound.copy([4, 0], [1, 6]) is None
    assert bound.copy(np.array([2], dtype=np.int64), np.array([3], dtype=np.int64), checked=True) is None
    check_moved(sl, src, [4, 0, 2], dl, dst, [1, 6, 3])
    for bad, err in ((([0, 1], [2, 2]), BlockIdError), (([0], [7]), BlockIdError),
                     (([0, 1], [2]), LengthMismatchError)):
        with pytest.raises(err):
            bound.copy(*bad)
    check_moved(sl, src, [4, 0, 2], dl, dst, [1, 6, 3])  # refused copies moved nothing
    with pytest.raises(LayoutMismatchError):
        BoundCopy(sl, src, cache(LayoutKind.MLA)[1], cache(LayoutKind.MLA)[0])
    assert bound.preload(3) is False  # no kernel module to load off the GPU


def test_bound_copy_takes_the_lean_stream_path_only_as_a_transport_asks(interpret, monkeypatch):
    """``BoundCopy.copy`` skips the per-call path decision only for what a transport's launch
    passes: checked ids, the kernel path already chosen, a stream, no record_stream. Every other
    call goes the full way (here: the host copy, bytes checked)."""
    from xfer.kernels import BoundCopy

    src, sl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD)
    dst, dl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD, blocks=7, fill="poison")
    bound = BoundCopy(sl, src, dl, dst)
    lean = []
    monkeypatch.setattr(BoundCopy, "_stream_copy", lambda self, s, d, stream, wait: lean.append((s, d, stream, wait)))
    ids = np.array([4], dtype=np.int64), np.array([1], dtype=np.int64)
    stream = object()
    bound.copy(*ids, stream=stream, wait_event="ev", path=CopyPath.TRITON, record_stream=False, checked=True)
    assert len(lean) == 1 and lean[0][2] is stream and lean[0][3] == "ev"
    assert np.array_equal(lean[0][0], [4]) and lean[0][0].dtype == np.int64
    bound.copy(*ids, stream=stream, path=CopyPath.TRITON, record_stream=False, checked=True)  # no wait event
    assert len(lean) == 2 and lean[1][3] is None
    bound.copy(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), stream=stream, path=CopyPath.TRITON,
               record_stream=False, checked=True)  # nothing to move: the full way (no launch)
    for kw in ({"checked": False, "path": CopyPath.TRITON, "record_stream": False},  # ids to check
               {"checked": True, "path": None, "record_stream": False},  # the path not chosen yet
               {"checked": True, "path": CopyPath.TRITON, "record_stream": True}):  # record_stream asked
        bound.copy([2], [3], stream=stream, **kw)
    bound.copy([0], [6], path=CopyPath.TRITON, record_stream=False, checked=True)  # no stream
    assert len(lean) == 2
    check_moved(sl, src, [2, 0], dl, dst, [3, 6])


def test_ids_ring_allocates_its_device_buffers_on_the_copy_stream(monkeypatch):
    """The ids buffers a repeat launch reuses are allocated on the copy's own stream. On the
    caller's current stream the allocator may return a block that kernels still queued there use,
    and the copy's stream does not wait for them: a TP prefill's forward and its layer copies then
    corrupted each other's bytes (wrong KV on the H200, an intermittent engine test failure)."""
    import contextlib
    import ctypes

    from xfer.kernels import copy as kc

    class Stream:
        cuda_stream = 7

    current, where, real_empty = [None], [], torch.empty

    @contextlib.contextmanager
    def stream_ctx(s):
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    def empty(*a, device=None, pin_memory=False, **kw):
        if device is not None:
            where.append(current[-1])
        return real_empty(*a, **kw)

    monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
    monkeypatch.setattr(torch, "empty", empty)
    ring, s = kc._IdsRing(torch.device("cpu")), Stream()
    def copy(dst, src, nbytes, kind, stream):  # host memory here: a plain copy
        ctypes.memmove(dst, src, nbytes)
        return 0

    memcpy = kc._put_memcpy(copy)

    ids, entry = ring.upload(np.arange(3), np.arange(3, 6), s, memcpy)
    assert where == [s], f"device buffer allocated under {where} (None: the caller's current stream)"
    assert ids.tolist() == [0, 1, 2, 3, 4, 5]

    # launches queued back to back each hold their buffer until their event completed: the ring
    # grows (no fresh per-call upload) up to MAX, every queued launch's ids intact, then says None
    held = [(ids, entry)]
    for k in range(1, kc._IdsRing.MAX):
        got = ring.upload(np.arange(k, k + 3), np.arange(k + 3, k + 6), s, memcpy)
        assert got is not None, f"ring full after {k} of {kc._IdsRing.MAX} buffers"
        held.append(got)
    assert len({e[1].data_ptr() for _, e in held}) == kc._IdsRing.MAX  # one buffer each
    assert all(v.tolist() == list(range(k, k + 6)) for k, (v, _) in enumerate(held))
    assert ring.upload(np.arange(3), np.arange(3, 6), s, memcpy) is None
    class Done:
        def query(self):
            return True
    kc.PairTables.release(held[5][1], Done())  # its launch ended: that buffer is reused, no new one
    again, entry = ring.upload(np.arange(2), np.arange(2, 4), s, memcpy)
    assert entry is held[5][1] and again.tolist() == [0, 1, 2, 3] and len(ring.entries) == kc._IdsRing.MAX


@gpu
@needs_cuda
def test_gpu_bound_copy_preload_moves_nothing_then_copies(monkeypatch):
    """A preload runs a launch shape's kernel once, moving no byte; the copy after it is exact."""
    from xfer.kernels import BoundCopy
    from xfer.kernels import copy as kc
    # a process that ran other tests first has this geometry's kernel already: start from none
    monkeypatch.setattr(kc, "_COMPILED", {})
    src, sl = seed_cache(blocks=16)
    dst, dl = seed_cache(blocks=16, fill="poison")
    bound = BoundCopy(sl, src, dl, dst)
    n = 5
    stream = torch.cuda.Stream()
    assert bound.preload(n, stream) is True
    assert bound.preload(n, stream) is False  # once per process
    stream.synchronize()
    check_moved(sl, src, [], dl, dst, [])  # every destination byte still poisoned
    ev = bound.copy([9, 1, 3, 15, 0], [2, 4, 6, 8, 10], stream=stream)
    ev.synchronize()
    check_moved(sl, src, [9, 1, 3, 15, 0], dl, dst, [2, 4, 6, 8, 10])


@pytest.mark.parametrize("kind", list(LayoutKind), ids=lambda k: k.value)
def test_gather_scatter_round_trip(interpret, kind):
    src, layout = cache(kind, shape="fp8-odd", blocks=6)
    ids = [3, 1, 5]
    out = torch.full((len(ids) * layout.bytes_per_block,), POISON, dtype=torch.uint8)
    expect = torch.zeros_like(out)
    gather(layout, src, torch.tensor(ids), out)
    gather_ref(layout, src, ids, expect)
    assert torch.equal(out, expect)
    # staging is slot-major, each block in the layout's inner order: slot s, block k at (s*n + k)
    perm = [1 + "NHC".index(x) for x in layout.inner_order] + [4]
    for s, view in enumerate(byte_views(layout, src)):
        for k, b in enumerate(ids):
            at = (s * len(ids) + k) * layout.block_nbytes
            assert torch.equal(out[at:at + layout.block_nbytes], view[b:b + 1].permute(0, *perm).reshape(-1))
    staging = layout.staging(len(ids))
    dst, _ = cache(kind, shape="fp8-odd", blocks=6, fill="poison")
    scatter(out, layout, dst, [0, 4, 2], staging_layout=staging)
    check_moved(layout, src, ids, layout, dst, [0, 4, 2])


@pytest.mark.parametrize("a,b", [(a, b) for a, b in itertools.product(PLAIN, PLAIN) if a != b],
                         ids=lambda k: k.value)
def test_conversion_between_layouts(interpret, a, b):
    src, sl = cache(a, blocks=4)
    dst, dl = cache(b, blocks=6, fill="poison")
    copy_blocks(sl, src, [2, 0, 3], dl, dst, [5, 1, 0])
    check_moved(sl, src, [2, 0, 3], dl, dst, [5, 1, 0])


CONVERSIONS = [(LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.VLLM_FLASH_ATTN_HND),
               (LayoutKind.PACKED_KV, LayoutKind.VLLM_FLASH_ATTN_NHD),
               (LayoutKind.VLLM_FLASH_ATTN_HND, LayoutKind.PACKED_KV),
               (LayoutKind.DISTSERVE, LayoutKind.VLLM_FLASH_ATTN_NHD),
               (LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.DISTSERVE),
               (LayoutKind.VLLM_CROSS_LAYER, LayoutKind.VLLM_FLASHINFER),
               (LayoutKind.VLLM_FLASHINFER, LayoutKind.VLLM_CROSS_LAYER)]


@pytest.mark.parametrize("a,b", CONVERSIONS, ids=lambda k: k.value)
def test_staging_conversion(interpret, a, b):
    """Sender gathers in its order; receiver scatters the sender's staging into its own order."""
    src, sl = cache(a, shape="f32-aligned", blocks=4)
    dst, dl = cache(b, shape="f32-aligned", blocks=5, fill="poison")
    out = torch.empty(2 * sl.bytes_per_block // 8, dtype=torch.int64)
    gather(sl, src, [3, 1], out)
    scatter(out, dl, dst, [4, 0], staging_layout=sl.staging(2))
    check_moved(sl, src, [3, 1], dl, dst, [4, 0])


@pytest.mark.parametrize("tile_bytes", [16, 64, 512])
@pytest.mark.parametrize("b", [LayoutKind.VLLM_FLASHINFER, LayoutKind.PACKED_KV], ids=lambda k: k.value)
def test_tiling_chunks_and_tails(interpret, b, tile_bytes):
    """Runs longer than a tile split into masked chunks; rows spill over many programs."""
    from xfer.kernels import copy as kcopy
    from xfer.kernels.reference import slot_addresses, validate_copy
    src, sl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD, blocks=4)
    dst, dl = cache(b, blocks=4, fill="poison")
    _, s_ids, _, d_ids = validate_copy(sl, src, [1, 2, 3], dl, dst, [2, 3, 0])
    plan = kcopy.prepare(sl, slot_addresses(sl, src), s_ids, dl, slot_addresses(dl, dst), d_ids, torch.device("cpu"))
    assert plan.tiling(tile_bytes)[3] > 1  # several programs
    plan.launch(tile_bytes=tile_bytes)
    check_moved(sl, src, [1, 2, 3], dl, dst, [2, 3, 0])


def test_one_block_and_zero_blocks(interpret, monkeypatch):
    src, sl = cache(LayoutKind.VLLM_FLASH_ATTN_HND)
    dst, dl = cache(LayoutKind.DISTSERVE, fill="poison")
    copy_blocks(sl, src, [4], dl, dst, [0])
    check_moved(sl, src, [4], dl, dst, [0])
    from xfer.kernels import copy as kcopy

    def no_launch(*a, **k):
        raise AssertionError("zero blocks must not launch")
    monkeypatch.setattr(kcopy, "prepare", no_launch)
    before = snapshot(dst)
    assert copy_blocks(sl, src, [], dl, dst, np.zeros(0, dtype=np.int32)) is None
    gather(sl, src, [], torch.empty(0, dtype=torch.uint8))
    scatter(torch.empty(0), dl, dst, [])
    assert all(torch.equal(a, raw(b)) for a, b in zip(before, dst))
    with pytest.raises(InvalidArgumentError, match="empty"):
        gather(sl, src, [], torch.empty(4, dtype=torch.uint8))


def test_offsets_past_4_gib(interpret):
    """int64 address math: blocks 4.4 GiB into a cache (pages are touched only where copied).

    657-byte blocks make the word one byte, so word offsets pass 2**32 too.
    """
    last = 7_099_999
    kw = dict(num_layers=1, num_blocks=last + 1, block_size=1, num_heads=1, head_dim=657)
    try:
        src, sl = make_kv_cache(LayoutKind.MLA_FP8, **kw)
        dst, dl = make_kv_cache(LayoutKind.MLA_FP8, **kw)
    except RuntimeError as e:
        pytest.skip(f"cannot reserve 2 x 4.4 GiB of address space: {e}")
    assert src[0].nbytes > 2**32
    sv, dv = byte_views(sl, src)[0], byte_views(dl, dst)[0]
    gen = torch.Generator().manual_seed(1)
    for b in (1, 2, 3, last - 2, last - 1, last):
        sv[b] = torch.randint(0, 256, sv[b].shape, dtype=torch.uint8, generator=gen)
        dv[b] = POISON
    copy_blocks(sl, src, [last, 3], dl, dst, [2, last - 1])
    assert torch.equal(dv[2], sv[last]) and torch.equal(dv[last - 1], sv[3])
    assert all(bool((dv[b] == POISON).all()) for b in (1, 3, last - 2, last))


# ---- errors, raised before any byte moves -------------------------------------------------------
@pytest.mark.parametrize("s_ids,d_ids,err,match", [
    ([0, 1], [2, 2], BlockIdError, "repeat id 2"),
    ([0, 5], [1, 2], BlockIdError, "id 5"),
    ([-1, 0], [1, 2], BlockIdError, "negative id -1"),
    ([0, 1], [1, 7], BlockIdError, "id 7"),
    ([0.0, 1.0], [1, 2], BlockIdError, "integers"),
    ([[0, 1]], [[1, 2]], BlockIdError, "1-D"),
    ([0, 1, 2], [3, 4], LengthMismatchError, "3 source block ids but 2"),
])
def test_bad_block_ids(interpret, s_ids, d_ids, err, match):
    src, sl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD)
    dst, dl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD, fill="poison")
    before = snapshot(dst)
    with pytest.raises(err, match=match):
        copy_blocks(sl, src, s_ids, dl, dst, d_ids)
    assert all(torch.equal(a, raw(b)) for a, b in zip(before, dst))


def test_bad_layouts_tensors_and_buffers(interpret):
    src, sl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD)
    other, ol = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, num_layers=2, num_blocks=5, block_size=3,
                              num_heads=2, head_dim=4)
    with pytest.raises(LayoutMismatchError, match="head_dim"):
        copy_blocks(sl, src, [0], ol, other, [0])
    mla, ml = cache(LayoutKind.MLA)
    with pytest.raises(LayoutMismatchError, match="num_kv"):
        copy_blocks(sl, src, [0], ml, mla, [0])
    with pytest.raises(LayoutError, match="base tensors"):
        copy_blocks(sl, src, [0], sl, src[:1], [1])
    with pytest.raises(LayoutError, match="dtype"):
        copy_blocks(sl, src, [0], sl, [t.view(torch.float16) for t in src], [1])
    n = 2 * sl.bytes_per_block
    for bad, match in [(torch.empty(n - 1, dtype=torch.uint8), "exactly"), (torch.empty(n + 2, dtype=torch.uint8),
                       "exactly"), (torch.empty(2, n // 2, dtype=torch.uint8), "1-D"),
                       (torch.empty(2 * n, dtype=torch.uint8)[::2], "contiguous"),
                       (torch.empty(n + 1, dtype=torch.uint8)[1:], "multiple")]:
        with pytest.raises(InvalidArgumentError, match=match):
            gather(sl, src, [0, 1], bad)
    with pytest.raises(InvalidArgumentError, match="overlap: block 2"):
        copy_blocks(sl, src, [1, 2], sl, src, [2, 3])
    with pytest.raises(InvalidArgumentError, match="pinned"):
        swap_out(sl, src, [0], sl, src, [1])


@pytest.mark.parametrize("op, ids, err, match", [
    ("gather", [0, 5], BlockIdError, "id 5"),
    ("gather", [-1], BlockIdError, "negative id -1"),
    ("gather", [[0, 1]], BlockIdError, "1-D"),
    ("scatter", [1, 1], BlockIdError, "repeat id 1"),
    ("scatter", [0, 9], BlockIdError, "id 9"),
    ("scatter-as", [0, 1, 2], BlockIdError, "id 2"),  # the sender's staging layout holds 2 blocks
    ("scatter-other", [0, 1], LayoutMismatchError, "head_dim"),
])
def test_gather_scatter_refuse_bad_ids_and_staging_before_any_byte_moves(interpret, op, ids, err, match):
    """gather/scatter check their ids once (not again through check_ids): a bad id, a repeated
    destination, a sender's staging layout too small or of another shape is refused, typed, and
    neither the cache nor the staging buffer changed."""
    src, sl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD)
    dst, dl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD, fill="poison")
    n = len(ids) if op != "gather" or np.ndim(ids) == 1 else 2
    buf = torch.full((max(n, 1) * sl.bytes_per_block,), POISON, dtype=torch.uint8)
    before, staged = snapshot(dst), buf.clone()
    with pytest.raises(err, match=match):
        if op == "gather":
            gather(sl, src, ids, buf)
        elif op == "scatter":
            scatter(buf, dl, dst, ids)
        elif op == "scatter-as":
            scatter(buf, dl, dst, ids, staging_layout=sl.staging(2))
        else:
            _, ol = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, num_layers=2, num_blocks=5, block_size=3,
                                  num_heads=2, head_dim=4)
            scatter(torch.empty(2 * ol.bytes_per_block, dtype=torch.uint8), dl, dst, ids,
                    staging_layout=ol.staging(2))
    assert all(torch.equal(a, raw(b)) for a, b in zip(before, dst)) and torch.equal(buf, staged)


def test_remembered_tensor_checks_notice_changes(interpret):
    """A cache's tensor checks are remembered per tensor objects; a changed tensor is checked again."""
    src, sl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD, layers=4)
    dst, dl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD, layers=4, fill="poison")
    copy_blocks(sl, src, [0], dl, dst, [1])
    dst[1].set_(torch.empty(4, dtype=dst[1].dtype))  # same object, storage now too small
    with pytest.raises(LayoutError, match="holds 8 bytes"):
        copy_blocks(sl, src, [0], dl, dst, [2])


def test_disjoint_blocks_within_one_cache(interpret):
    ts, layout = cache(LayoutKind.VLLM_CROSS_LAYER)
    before = [v.clone() for v in byte_views(layout, ts)]
    copy_blocks(layout, ts, [1, 4], layout, ts, [3, 0])
    for b, a in zip(before, byte_views(layout, ts)):
        expect = b.clone()
        expect[[3, 0]] = b[[1, 4]]
        assert torch.equal(a, expect)


# ---- reference, paths, imports ------------------------------------------------------------------
def oracle_copy(sl, src, s_ids, dl, dst, d_ids):
    """One element at a time, straight from the layout's address formula."""
    isz = sl.itemsize
    s_raw = [raw(t).numpy()[t.storage_offset() * isz:] for t in src]
    d_raw = [raw(t).numpy()[t.storage_offset() * isz:] for t in dst]
    snap = [r.copy() for r in s_raw]
    for s, (a, b) in itertools.product(range(sl.num_slots), zip(s_ids, d_ids)):
        for n, h, c in itertools.product(range(sl.block_size), range(sl.num_heads), range(sl.head_dim)):
            so = (sl.slot_offset[s] + a * sl.block_stride + n * sl.token_stride + h * sl.head_stride
                  + c * sl.dim_stride) * isz
            do = (dl.slot_offset[s] + b * dl.block_stride + n * dl.token_stride + h * dl.head_stride
                  + c * dl.dim_stride) * isz
            d_raw[dl.slot_tensor[s]][do:do + isz] = snap[sl.slot_tensor[s]][so:so + isz]


@st.composite
def copy_cases(draw):
    a, b = draw(st.sampled_from(PLAIN)), draw(st.sampled_from(PLAIN))
    dims = dict(num_layers=draw(st.integers(1, 2)), block_size=draw(st.integers(1, 3)),
                num_heads=draw(st.integers(1, 2)), head_dim=draw(st.integers(1, 4)),
                dtype=draw(st.sampled_from([torch.bfloat16, torch.float8_e5m2, torch.float32])))
    nb_s, nb_d = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    n = draw(st.integers(0, nb_d))
    s_ids = draw(st.lists(st.integers(0, nb_s - 1), min_size=n, max_size=n))
    d_ids = draw(st.permutations(range(nb_d)))[:n]
    return a, b, dims, nb_s, nb_d, s_ids, d_ids, draw(st.integers(0, 2**31))


def _make_pair(case):
    a, b, dims, nb_s, nb_d, s_ids, d_ids, seed = case
    src, sl = make_kv_cache(a, num_blocks=nb_s, **dims)
    dst, dl = make_kv_cache(b, num_blocks=nb_d, **dims)
    gen = torch.Generator().manual_seed(seed)
    for t in src:
        raw(t).copy_(torch.randint(0, 256, raw(t).shape, dtype=torch.uint8, generator=gen))
    for t in dst:
        raw(t).fill_(POISON)
    return src, sl, dst, dl, s_ids, d_ids


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(copy_cases())
def test_reference_matches_element_oracle(case):
    src, sl, dst, dl, s_ids, d_ids = _make_pair(case)
    expect = [t.clone() for t in dst]
    oracle_copy(sl, src, s_ids, dl, expect, d_ids)
    copy_blocks_ref(sl, src, s_ids, dl, dst, d_ids)
    assert all(torch.equal(raw(x), raw(y)) for x, y in zip(dst, expect))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(copy_cases())
def test_kernel_matches_reference(interpret, case):
    src, sl, dst, dl, s_ids, d_ids = _make_pair(case)
    expect = [t.clone() for t in dst]
    copy_blocks_ref(sl, src, s_ids, dl, expect, d_ids)
    copy_blocks(sl, src, s_ids, dl, dst, d_ids)
    assert all(torch.equal(raw(x), raw(y)) for x, y in zip(dst, expect))


def test_cpu_torch_path(torch_path):
    src, sl = cache(LayoutKind.PACKED_KV)
    dst, dl = cache(LayoutKind.VLLM_FLASH_ATTN_HND, fill="poison")
    assert select_path(src, dst)[0] is CopyPath.TORCH_REFERENCE
    assert copy_blocks(sl, src, [2, 2], dl, dst, [4, 1]) is None
    check_moved(sl, src, [2, 2], dl, dst, [4, 1])


def test_import_is_light():
    code = "import sys, xfer.kernels; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- copy engines without a GPU: plans, 2-D decomposition, launch through a host-memory runtime -----
class HostRuntime:
    """Stands in for libcudart: every call moves host bytes with memmove, exactly as the CUDA call
    would move device bytes, and checks the arguments the real one checks."""

    def __init__(self, version=13000, fail_at=None):
        from xfer.kernels import copy_engine as ce
        self.version, self.batch_has_fail_idx = version, version < 13000
        self.attrs = ce.MemcpyAttributes(ce.SRC_ACCESS_ORDER_STREAM, ce._MemLocation(0, 0), ce._MemLocation(0, 0), 0)
        self.attr_idx = np.zeros(1, dtype=np.uint64)
        self.calls = {"batch": [], "memcpy": 0, "memcpy2d": 0}
        self.fail_at = fail_at
        self.batch_missing = None

    def _array(self, addr, count):
        import ctypes
        return np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(addr)).copy()

    def batch(self, dsts, srcs, sizes, count, attrs, idx, num_attrs, *rest):
        import ctypes
        assert len(rest) == (2 if self.batch_has_fail_idx else 1)
        stream = rest[-1]
        assert stream not in (0, 1), "the batch API refuses the legacy stream"
        a = ctypes.cast(attrs, ctypes.POINTER(type(self.attrs))).contents
        assert (a.srcAccessOrder, a.flags, num_attrs) == (1, 0, 1) and self._array(idx, 1)[0] == 0
        self.calls["batch"].append(count)
        if self.fail_at is not None:
            if self.batch_has_fail_idx:
                ctypes.cast(rest[0], ctypes.POINTER(ctypes.c_size_t)).contents.value = self.fail_at
            return 1  # cudaErrorInvalidValue
        for d, s, n in zip(self._array(dsts, count), self._array(srcs, count), self._array(sizes, count)):
            ctypes.memmove(int(d), int(s), int(n))
        return 0

    def memcpy(self, d, s, n, kind, stream):
        import ctypes
        assert kind == 4
        self.calls["memcpy"] += 1
        ctypes.memmove(d, s, n)
        return 0

    def memcpy2d(self, d, dp, s, sp, w, h, kind, stream):
        import ctypes
        assert kind == 4 and dp >= w and sp >= w and h > 1
        self.calls["memcpy2d"] += 1
        for r in range(h):
            ctypes.memmove(d + r * dp, s + r * sp, w)
        return 0

    def error(self, what, rc, detail=""):
        from xfer.errors import TransportError
        return TransportError(f"{what} failed: {rc}{detail}")

    def max_pitch(self, device):
        return (1 << 31) - 1


@pytest.fixture
def host_runtime(monkeypatch):
    from xfer.kernels import copy_engine as ce
    rt = HostRuntime()
    monkeypatch.setattr(ce, "_RUNTIME", [rt])
    return rt


def engine_plan(sl, src, s_ids, dl, dst, d_ids):
    from xfer.kernels import copy_engine as ce
    return ce.prepare(sl, [t.data_ptr() for t in src], s_ids, dl, [t.data_ptr() for t in dst], d_ids)


def brute_force_bytes(sl, s_ptrs, s_ids, dl, d_ptrs, d_ids):
    """Every (source byte address, destination byte address) of a block copy, sorted, from the layout formula."""
    isz = sl.itemsize
    out = []
    for s, (a, b) in itertools.product(range(sl.num_slots), zip(s_ids, d_ids)):
        for n, h, c in itertools.product(range(sl.block_size), range(sl.num_heads), range(sl.head_dim)):
            so = s_ptrs[sl.slot_tensor[s]] + (sl.slot_offset[s] + a * sl.block_stride + n * sl.token_stride
                                               + h * sl.head_stride + c * sl.dim_stride) * isz
            do = d_ptrs[dl.slot_tensor[s]] + (dl.slot_offset[s] + b * dl.block_stride + n * dl.token_stride
                                               + h * dl.head_stride + c * dl.dim_stride) * isz
            out += [(so + k, do + k) for k in range(isz)]
    return sorted(out)


def run_bytes(dst, src, nbytes):
    return sorted((int(s) + k, int(d) + k) for d, s, n in zip(dst, src, nbytes) for k in range(int(n)))


ENGINE_PAIRS = [(LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.VLLM_FLASH_ATTN_NHD), *CONVERSIONS,
                (LayoutKind.SGLANG, LayoutKind.PACKED_KV), (LayoutKind.MLA_FP8, LayoutKind.MLA_FP8)]


@pytest.mark.parametrize("a,b", ENGINE_PAIRS, ids=lambda k: k.value)
@pytest.mark.parametrize("ids", ["strided", "random", "consecutive"])
def test_copy_engine_runs_and_2d_match_brute_force(a, b, ids):
    from xfer.kernels import copy_engine as ce
    dims = dict(num_layers=2, num_blocks=9, block_size=3, num_heads=2, head_dim=4, device="meta")
    _, sl = make_kv_cache(a, **dims)
    _, dl = make_kv_cache(b, **dims)
    rng = np.random.default_rng(7)
    s_ids, d_ids = {"strided": ([0, 2, 4, 6], [1, 3, 5, 7]), "consecutive": ([2, 3, 4], [5, 6, 7]),
                    "random": (rng.integers(0, 9, 5).tolist(), rng.permutation(9)[:5].tolist())}[ids]
    # base tensors far apart, at addresses unrelated to each other
    s_ptrs = [(1 << 40) + i * (1 << 24) + 64 * (i % 3) for i in range(sl.num_tensors)]
    d_ptrs = [(3 << 40) + i * (1 << 25) + 128 * (i % 5) for i in range(dl.num_tensors)]
    plan = ce.prepare(sl, s_ptrs, s_ids, dl, d_ptrs, d_ids)
    expect = brute_force_bytes(sl, s_ptrs, s_ids, dl, d_ptrs, d_ids)
    assert run_bytes(plan.dst, plan.src, plan.nbytes) == expect
    ops = plan.ops_2d()
    assert run_bytes(*ce.expand_2d(ops)) == expect
    h = ops["height"]
    tall = h > 1
    assert (h >= 1).all() and (ops["spitch"][tall] >= ops["width"][tall]).all()
    assert (ops["dpitch"][tall] >= ops["width"][tall]).all() and ops["height"].sum() == len(plan)
    # no operation spans two base tensors on either side
    for side, ptrs, layout in (("src", s_ptrs, sl), ("dst", d_ptrs, dl)):
        lo = np.asarray(ptrs)
        hi = lo + np.asarray(layout.tensor_numel) * layout.itemsize
        first = ops[side]
        last = first + (h - 1) * ops[f"{side[0]}pitch"] + ops["width"]
        owner = np.searchsorted(lo, first, side="right") - 1
        assert (first >= lo[owner]).all() and (last <= hi[owner]).all()
    if ids == "strided" and a == b == LayoutKind.VLLM_FLASH_ATTN_NHD:
        assert h.size == sl.num_slots and (h == 4).all()  # one 2-D copy per (layer, K/V)
    assert ops["height"].size <= len(plan)


def test_copy_engine_2d_pitch_limit_and_groups():
    from xfer.kernels import copy_engine as ce
    s = np.array([1000, 1100, 1200, 1300, 5000, 5100], dtype=np.int64)
    d = np.array([9000, 9300, 9600, 9900, 20000, 20300], dtype=np.int64)
    w = np.full(6, 64, dtype=np.int64)
    ops = ce.coalesce_2d(d, s, w)
    assert ops["height"].tolist() == [4, 2] and ops["spitch"].tolist() == [100, 100]
    assert ops["dpitch"].tolist() == [300, 300]
    assert ce.coalesce_2d(d, s, w, max_pitch=200)["height"].tolist() == [1] * 6  # dst pitch 300 > 200
    grouped = ce.coalesce_2d(d, s, w, group=[0, 0, 1, 1, 1, 1])
    assert grouped["height"].tolist() == [2, 2, 2]  # no operation crosses from group 0 into group 1
    assert run_bytes(*ce.expand_2d(grouped)) == run_bytes(d, s, w)
    # pitch below the width (rows would overlap) and repeated sources never chain
    assert ce.coalesce_2d([0, 32], [100, 132], [64, 64])["height"].tolist() == [1, 1]
    assert ce.coalesce_2d([0, 64, 128], [500, 500, 500], [64, 64, 64])["height"].tolist() == [1, 1, 1]
    # two step patterns touching: every run still covered exactly once
    s2 = np.array([0, 100, 200, 250, 300, 350], dtype=np.int64) + 10_000
    d2 = np.array([0, 100, 200, 250, 300, 350], dtype=np.int64) + 90_000
    ops2 = ce.coalesce_2d(d2, s2, np.full(6, 40))
    assert run_bytes(*ce.expand_2d(ops2)) == run_bytes(d2, s2, np.full(6, 40))
    assert ce.coalesce_2d([], [], [])["height"].size == 0


@pytest.mark.parametrize("version", [13000, 12080])
@pytest.mark.parametrize("mode", ["batch", "2d", "runs"])
def test_copy_engine_launch_moves_bytes(monkeypatch, version, mode):
    """Plan + launch through a runtime that memmoves host bytes: every mode, both batch signatures."""
    from xfer.kernels import copy_engine as ce
    rt = HostRuntime(version)
    monkeypatch.setattr(ce, "_RUNTIME", [rt])
    monkeypatch.setattr(ce, "MAX_BATCH", 7)  # several chunks
    src, sl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD, blocks=9, layers=3)
    dst, dl = cache(LayoutKind.VLLM_FLASH_ATTN_HND, blocks=9, layers=3, fill="poison")
    s_ids, d_ids = [8, 0, 2, 4, 6, 6], [1, 3, 5, 7, 0, 2]
    plan = engine_plan(sl, src, s_ids, dl, dst, d_ids)
    plan.launch(mode, stream=0x1234)
    check_moved(sl, src, s_ids, dl, dst, d_ids)
    if mode == "batch":
        assert rt.calls["batch"] == [min(7, len(plan) - i) for i in range(0, len(plan), 7)]
        assert plan.num_calls("batch") == len(rt.calls["batch"])
    elif mode == "2d":
        assert rt.calls["memcpy2d"] > 0 and rt.calls["memcpy"] + rt.calls["memcpy2d"] == plan.num_calls("2d")
        assert plan.num_calls("2d") < len(plan)
    else:
        assert rt.calls["memcpy"] == len(plan)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(copy_cases(), st.sampled_from(["batch", "2d", "runs"]))
def test_copy_engine_matches_reference(case, mode):
    from xfer.kernels import copy_engine as ce
    saved = ce._RUNTIME[:]
    ce._RUNTIME[:] = [HostRuntime()]
    try:
        src, sl, dst, dl, s_ids, d_ids = _make_pair(case)
        expect = [t.clone() for t in dst]
        copy_blocks_ref(sl, src, s_ids, dl, expect, d_ids)
        engine_plan(sl, src, s_ids, dl, dst, d_ids).launch(mode, stream=0x10)
        assert all(torch.equal(raw(x), raw(y)) for x, y in zip(dst, expect))
    finally:
        ce._RUNTIME[:] = saved


def test_copy_engine_errors_before_bytes_move(host_runtime):
    from xfer.errors import TransportError, TransportUnavailableError
    from xfer.kernels import copy_engine as ce
    src, sl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD)
    dst, dl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD, fill="poison")
    ptrs = lambda ts: [t.data_ptr() for t in ts]  # noqa: E731
    with pytest.raises(BlockIdError, match="repeat id 2"):
        ce.prepare(sl, ptrs(src), [0, 1], dl, ptrs(dst), [2, 2])
    with pytest.raises(LengthMismatchError):
        ce.prepare(sl, ptrs(src), [0, 1], dl, ptrs(dst), [2])
    with pytest.raises(LayoutMismatchError):
        ce.prepare(sl, ptrs(src), [0], cache(LayoutKind.MLA)[1], ptrs(cache(LayoutKind.MLA)[0]), [0])
    with pytest.raises(InvalidArgumentError, match="base pointers"):
        ce.prepare(sl, ptrs(src)[:1], [0], dl, ptrs(dst), [1])
    with pytest.raises(InvalidArgumentError, match="non-null"):
        ce.prepare(sl, [0] * len(src), [0], dl, ptrs(dst), [1])
    with pytest.raises(InvalidArgumentError, match="positive sizes"):
        ce.CopyEnginePlan([64], [128], [0])
    plan = engine_plan(sl, src, [0, 1], dl, dst, [2, 3])
    with pytest.raises(InvalidArgumentError, match="mode"):
        plan.launch("dma", stream=0x10)
    with pytest.raises(InvalidArgumentError, match="legacy default stream"):
        plan.launch("batch", stream=0)
    host_runtime.fail_at = 1
    with pytest.raises(TransportError, match="cudaMemcpyBatchAsync failed"):
        plan.launch("batch", stream=0x10)
    assert all(bool((raw(t) == POISON).all()) for t in dst)
    host_runtime.batch = None
    host_runtime.batch_missing = "cudaMemcpyBatchAsync needs CUDA runtime >= 12.8"
    with pytest.raises(TransportUnavailableError, match="12.8"):
        plan.launch("batch", stream=0x10)


def test_copy_engine_without_cuda_is_unavailable_and_says_why():
    from xfer.errors import TransportUnavailableError
    from xfer.kernels import copy_engine as ce
    if torch.cuda.is_available():
        pytest.skip("checks the report on machines without a GPU")
    assert "no CUDA device" in ce.available("batch") and not ce.runtime_info()["available"]
    with pytest.raises(TransportUnavailableError, match="no CUDA device"):
        ce.CopyEnginePlan([64], [128], [8]).launch("runs", stream=0x10)


def test_copy_engine_plan_cache(host_runtime):
    from xfer.kernels import copy_engine as ce
    src, sl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD)
    dst, dl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD, fill="poison")
    args = (sl, [t.data_ptr() for t in src], np.array([0, 1]), dl, [t.data_ptr() for t in dst])
    p1 = ce.plan_for(*args, np.array([2, 3]))
    assert ce.plan_for(*args, np.array([2, 3])) is p1 and ce.plan_for(*args, np.array([3, 2])) is not p1


# ---- choosing the path ------------------------------------------------------------------------------
@pytest.fixture
def engines(monkeypatch):
    """Pretend both copy-engine modes are available (the choice logic is what is tested)."""
    from xfer.kernels import _dispatch
    from xfer.kernels import copy_engine as ce
    state = {"batch": None, "2d": None}
    monkeypatch.setattr(ce, "available", lambda mode: state[mode])
    monkeypatch.delenv("XFER_COPY_PATH", raising=False)
    monkeypatch.delenv("XFER_COPY_TABLE", raising=False)
    _dispatch.set_copy_table(None)
    yield state
    _dispatch.set_copy_table(None)


CUDA, PINNED = ("cuda", False), ("cpu", True)


def test_auto_table_default(engines):
    from xfer.kernels._dispatch import _choose, set_copy_table
    # the default (measured on the H200): the kernel in every direction and size
    for a, b in ((CUDA, CUDA), (CUDA, PINNED), (PINNED, CUDA)):
        for size in (None, 512, 4096, 32768):
            path, why = _choose(a, b, size, None)
            assert path is CopyPath.TRITON and "default table" in why
    assert _choose(CUDA, CUDA, 512, "auto")[0] is CopyPath.TRITON
    # a calibrated table that prefers the copy engine for large host<->device slices
    set_copy_table({"d2h": [[0, "kernel"], [4096, "batch"]], "h2d": [[0, "kernel"], [4096, "batch"]]})
    try:
        assert _choose(CUDA, PINNED, 512, None)[0] is CopyPath.TRITON  # small slices to host: the kernel
        path, why = _choose(CUDA, PINNED, 4096, None)
        assert path is CopyPath.COPY_ENGINE_BATCH and "d2h" in why and "set_copy_table" in why
        assert _choose(PINNED, CUDA, 32768, None)[0] is CopyPath.COPY_ENGINE_BATCH
        assert _choose(PINNED, CUDA, None, None)[0] is CopyPath.TRITON  # size unknown: the first row
        _fallbacks(engines)
    finally:
        set_copy_table(None)


def _fallbacks(engines):
    from xfer.kernels._dispatch import _choose
    engines["batch"] = "cudaMemcpyBatchAsync needs CUDA runtime >= 12.8"
    path, why = _choose(PINNED, CUDA, 32768, None)
    assert path is CopyPath.COPY_ENGINE_2D and "12.8" in why
    engines["2d"] = "copy engine unavailable: no libcudart"
    path, why = _choose(PINNED, CUDA, 32768, None)
    assert path is CopyPath.TRITON and "copy engine unavailable" in why


def test_path_requests_and_env_override(engines, monkeypatch):
    from xfer.errors import TransportUnavailableError
    from xfer.kernels._dispatch import _choose
    for req, expect in [("kernel", CopyPath.TRITON), ("batch", CopyPath.COPY_ENGINE_BATCH),
                        ("2d", CopyPath.COPY_ENGINE_2D), ("copy_engine_2d", CopyPath.COPY_ENGINE_2D),
                        (CopyPath.COPY_ENGINE_BATCH, CopyPath.COPY_ENGINE_BATCH),
                        (" Batch ", CopyPath.COPY_ENGINE_BATCH)]:
        assert _choose(CUDA, CUDA, 512, req)[0] is expect
    monkeypatch.setenv("XFER_COPY_PATH", "2d")
    reload()
    path, why = _choose(CUDA, CUDA, 512, None)
    assert path is CopyPath.COPY_ENGINE_2D and "XFER_COPY_PATH" in why
    assert _choose(CUDA, CUDA, 512, "kernel")[0] is CopyPath.TRITON  # an argument beats the environment
    monkeypatch.setenv("XFER_COPY_PATH", "dma")
    reload()
    with pytest.raises(InvalidArgumentError, match="XFER_COPY_PATH.*kernel, batch, 2d, auto"):
        _choose(CUDA, CUDA, 512, None)
    with pytest.raises(InvalidArgumentError, match="chosen from the tensors"):
        _choose(CUDA, CUDA, 512, CopyPath.TORCH_REFERENCE)
    engines["batch"] = "cudaMemcpyBatchAsync needs CUDA runtime >= 12.8"
    with pytest.raises(TransportUnavailableError, match="'batch' .*12.8"):
        _choose(CUDA, CUDA, 512, "batch")
    # no CUDA side: the request does not apply, the CPU path runs
    monkeypatch.setenv("XFER_COPY_PATH", "batch")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reload()
    src, sl = cache(LayoutKind.PACKED_KV)
    dst, dl = cache(LayoutKind.VLLM_FLASH_ATTN_HND, fill="poison")
    assert select_path(src, dst, src_layout=sl, dst_layout=dl)[0] is CopyPath.TORCH_REFERENCE
    assert copy_blocks(sl, src, [2, 0], dl, dst, [4, 1], path="2d") is None
    check_moved(sl, src, [2, 0], dl, dst, [4, 1])


def test_copy_table_set_file_and_errors(engines, monkeypatch, tmp_path):
    import json
    from xfer.kernels import copy_table, set_copy_table
    from xfer.kernels._dispatch import DEFAULT_COPY_TABLE, _choose
    assert copy_table() == (DEFAULT_COPY_TABLE, "default table")
    set_copy_table({"d2d": [[0, "kernel"], [16384, "batch"]]}, source="calibration")
    table, source = copy_table()
    assert source == "calibration" and table["d2d"] == ((0, "kernel"), (16384, "batch"))
    assert table["h2d"] == DEFAULT_COPY_TABLE["h2d"]  # omitted directions keep the default
    assert _choose(CUDA, CUDA, 16384, None)[0] is CopyPath.COPY_ENGINE_BATCH
    assert _choose(CUDA, CUDA, 16383, None)[0] is CopyPath.TRITON
    for bad, match in [({"p2p": [[0, "kernel"]]}, "direction"), ({"d2d": [[512, "kernel"]]}, "start at 0"),
                       ({"d2d": [[0, "kernel"], [0, "2d"]]}, "grow"), ({"d2d": [[0, "dma"]]}, "path 'dma'"),
                       ({"d2d": [["x", "kernel"]]}, "pairs"), ([1, 2], "map directions")]:
        with pytest.raises(InvalidArgumentError, match=match):
            set_copy_table(bad)
    set_copy_table(None)
    f = tmp_path / "table.json"
    f.write_text(json.dumps({"device": "H200", "table": {"h2d": [[0, "2d"]]}}))
    monkeypatch.setenv("XFER_COPY_TABLE", str(f))
    reload()
    assert copy_table()[0]["h2d"] == ((0, "2d"),) and _choose(PINNED, CUDA, 512, None)[0] is CopyPath.COPY_ENGINE_2D
    set_copy_table(None)
    f.write_text("{")
    with pytest.raises(InvalidArgumentError, match="XFER_COPY_TABLE"):
        copy_table()


def test_calibration_table_from_measurements(engines):
    """The calibration's table: a copy engine only where it beats the kernel by the margin; usable as is."""
    from xfer.bench.copy_calibrate import derive_table
    from xfer.kernels import set_copy_table
    from xfer.kernels._dispatch import _choose
    rows = lambda **ms: [{"path": p, "ms": v} for p, v in ms.items()]  # noqa: E731
    cases = [{"scenario": "d2d", "slice_bytes": 512, "rows": rows(kernel=1.0, batch=5.0, runs=0.1)},
             {"scenario": "d2d", "slice_bytes": 32768, "rows": rows(kernel=1.0, batch=0.97)},  # inside the margin
             {"scenario": "d2h", "slice_bytes": 512, "rows": rows(kernel=1.0, batch=2.0)},
             {"scenario": "d2h", "slice_bytes": 4096, "rows": rows(kernel=1.0, batch=0.9, **{"2d": 0.8})},
             {"scenario": "d2h", "slice_bytes": 32768, "rows": rows(kernel=1.0, batch=0.5, **{"2d": 0.8})},
             {"scenario": "h2d", "slice_bytes": 512, "rows": [{"path": "kernel", "skipped": "x"}]},
             {"scenario": "ipc_push", "slice_bytes": 32768, "rows": rows(kernel=1.0, batch=0.5)}]
    table = derive_table(cases)
    assert table == {"d2d": [[0, "kernel"]], "d2h": [[0, "kernel"], [4096, "2d"], [32768, "batch"]]}
    set_copy_table(table, source="calibration")
    assert _choose(CUDA, PINNED, 8192, None)[0] is CopyPath.COPY_ENGINE_2D
    assert _choose(CUDA, PINNED, 65536, None)[0] is CopyPath.COPY_ENGINE_BATCH
    assert _choose(PINNED, CUDA, 65536, None)[0] is CopyPath.TRITON  # h2d: still the default (the kernel)


# ---- CUDA ---------------------------------------------------------------------------------------
def seed_cache(kind=LayoutKind.VLLM_FLASH_ATTN_NHD, blocks=256, fill="random", **kw):
    ts, layout = make_kv_cache(kind, num_layers=64, num_blocks=blocks, block_size=16, num_heads=8,
                               head_dim=128, device="cuda", **kw)
    for t in ts:
        if fill == "random":
            raw(t).random_(0, 256)
        else:
            raw(t).fill_(POISON)
    return ts, layout


@gpu
@needs_cuda
@pytest.mark.parametrize("dst_kind", [LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.VLLM_FLASH_ATTN_HND])
def test_gpu_seed_case(dst_kind):
    """64 layers x K/V x 128 of 256 blocks x 32 KiB slices, one launch; NHD -> NHD and -> HND."""
    src, sl = seed_cache()
    dst, dl = seed_cache(dst_kind, fill="poison")
    s_ids = torch.randperm(256)[:128].tolist()
    d_ids = torch.randperm(256)[:128].tolist()
    ev = copy_blocks(sl, src, s_ids, dl, dst, d_ids)
    assert isinstance(ev, torch.cuda.Event)
    ev.synchronize()
    check_moved(sl, src, s_ids, dl, dst, d_ids)
    out = torch.empty(128 * sl.bytes_per_block, dtype=torch.uint8, device="cuda")
    expect = torch.empty_like(out)
    gather(sl, src, s_ids, out)
    gather_ref(sl, src, s_ids, expect)
    assert torch.equal(out, expect)
    dst2, _ = seed_cache(dst_kind, fill="poison")
    scatter(out, dl, dst2, d_ids, staging_layout=sl.staging(128))
    torch.cuda.synchronize()
    check_moved(sl, src, s_ids, dl, dst2, d_ids)


@gpu
@needs_cuda
def test_gpu_gather_scatter_reuse_a_staging_buffers_tables_only_while_it_is_the_same():
    """A CUDA staging buffer reused across gathers/scatters keeps its checks and device tables
    (the lean path); other ids into it, another buffer at another address, the same buffer after
    it was dropped and its address handed to a new one: every call's bytes are exact."""
    import gc
    from xfer.kernels import sides as d
    src, sl = seed_cache(blocks=32)
    n = 6
    out = torch.full((n * sl.bytes_per_block,), POISON, dtype=torch.uint8, device="cuda")
    expect = torch.empty_like(out)
    for ids in ([1, 5, 9, 30, 2, 7], [0, 31, 3, 4, 8, 16], [1, 5, 9, 30, 2, 7]):
        gather(sl, src, ids, out)
        gather_ref(sl, src, ids, expect)
        assert torch.equal(out, expect), ids
    assert d._RECENT_STAGING.get(out, sl.staging(n)) is not None
    dst, dl = seed_cache(blocks=32, fill="poison")
    scatter(out, dl, dst, [3, 2, 11, 12, 20, 0])
    torch.cuda.synchronize()
    check_moved(sl, src, [1, 5, 9, 30, 2, 7], dl, dst, [3, 2, 11, 12, 20, 0])
    ptr = out.data_ptr()
    del out
    gc.collect()
    again = torch.full((n * sl.bytes_per_block,), POISON, dtype=torch.uint8, device="cuda")  # likely at ptr
    assert d._RECENT_STAGING.get(again, sl.staging(n)) is None, (again.data_ptr() == ptr)
    gather(sl, src, [4, 4, 6, 8, 10, 12], again)  # a source block may repeat
    gather_ref(sl, src, [4, 4, 6, 8, 10, 12], expect)
    assert torch.equal(again, expect)


@gpu
@needs_cuda
def test_gpu_offsets_past_4_gib():
    per_block = 4 * 2 * 16 * 8 * 128 * 2  # cross-layer: a block spans 4 layers x K/V x 32 KiB
    blocks = (5 << 30) // per_block
    if torch.cuda.mem_get_info()[0] < 2 * blocks * per_block + (1 << 30):
        pytest.skip("needs 11 GiB of free GPU memory")
    kw = dict(num_layers=4, num_blocks=blocks, block_size=16, num_heads=8, head_dim=128, device="cuda")
    src, sl = make_kv_cache(LayoutKind.VLLM_CROSS_LAYER, **kw)
    dst, dl = make_kv_cache(LayoutKind.VLLM_CROSS_LAYER, **kw)
    raw(src[0]).random_(0, 256)
    raw(dst[0]).fill_(POISON)
    s_ids, d_ids = [blocks - 1, 3, blocks - 7], [5, blocks - 2, blocks - 1]
    copy_blocks(sl, src, s_ids, dl, dst, d_ids).synchronize()
    check_moved(sl, src, s_ids, dl, dst, d_ids)


@gpu
@needs_cuda
def test_gpu_swap_pinned_host_and_streams():
    dev, dl = seed_cache(blocks=64)

    def pinned(*shape, **kw):
        return torch.empty(*shape, **kw, pin_memory=True)
    host, hl = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_HND, num_layers=64, num_blocks=32, block_size=16,
                             num_heads=8, head_dim=128, empty=pinned)
    for t in host:
        raw(t).fill_(POISON)
    side = torch.cuda.Stream()
    ready = torch.cuda.Event()
    ready.record()
    ev = swap_out(dl, dev, [9, 40, 2], hl, host, [31, 0, 7], stream=side, wait_event=ready)
    ev.synchronize()
    check_moved(dl, dev, [9, 40, 2], hl, host, [31, 0, 7])
    back, _ = seed_cache(blocks=64, fill="poison")
    swap_in(dl, back, [63, 1, 5], hl, host, [31, 0, 7]).synchronize()
    check_moved(dl, dev, [9, 40, 2], dl, back, [63, 1, 5])
    with pytest.raises(InvalidArgumentError, match="pinned"):
        copy_blocks(dl, dev, [0], hl, [torch.empty_like(t, device="cpu") for t in host], [0])


@pytest.mark.parametrize("idle, device", [(True, None), (False, None), (True, 1), (False, 1)])
def test_order_after_stream_decides_by_the_query(monkeypatch, idle, device):
    """The ordering ``after="stream"`` adds (``order_after_stream``), by what the query of the
    region device's current stream says, without a GPU: the stream and the event are stand-ins."""
    from xfer.kernels import _dispatch as d

    class Stream:
        def query(self):
            return idle

    class Event:
        made = []

        def __init__(self):
            Event.made.append(self)

        def record(self, stream):
            self.on = stream

    asked, stream = [], Stream()
    monkeypatch.setattr(d, "_current_stream", lambda index=None: asked.append(index) or stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    got = d.order_after_stream(torch.device("cuda", device) if device is not None else torch.device("cuda"))
    assert asked == [3 if device is None else device]  # that device's current stream
    if idle:
        assert got is None and not Event.made
    else:
        assert Event.made == [got] and got.on is stream


@gpu
@needs_cuda
def test_gpu_order_after_stream_only_where_work_is_queued():
    """``order_after_stream`` (what ``after="stream"`` orders a transfer's copy after): None on an
    idle current stream; an event that ends after the queued work on a busy one (the default stream
    or a side stream made current); the query's "not ready" left as no error for torch's next launch."""
    from xfer.kernels import _dispatch as d
    from xfer.kernels import order_after_stream

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    assert order_after_stream(dev) is None
    assert order_after_stream(torch.device("cuda")) is None
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            assert d._current_stream().cuda_stream == stream.cuda_stream  # (kept by its raw handle)
            torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time queued
            event = order_after_stream(dev)
            assert event is not None and not event.query()
            x = torch.ones(4, device=dev) * 3  # a launch right after a "not ready" query: no stale error
            event.synchronize()
            torch.cuda.synchronize()
            assert x.sum().item() == 12
            assert order_after_stream(dev) is None


# ---- CUDA: the copy engines ---------------------------------------------------------------------
def engine_or_skip(path):
    from xfer.kernels import copy_engine as ce
    reason = ce.available({"batch": "batch", "2d": "2d"}.get(path, "runs"))
    if reason:
        pytest.skip(reason)


def small_gpu_cache(kind=LayoutKind.VLLM_FLASH_ATTN_NHD, *, layers=8, blocks=32, fill="random", empty=torch.empty,
                    device="cuda"):
    ts, layout = make_kv_cache(kind, num_layers=layers, num_blocks=blocks, block_size=16, num_heads=8,
                               head_dim=128, device=device, empty=empty)
    for t in ts:
        if fill == "random":
            r = raw(t)
            r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, device=r.device))
        else:
            raw(t).fill_(POISON)
    return ts, layout


@gpu
@needs_cuda
def test_gpu_copy_engine_runtime_is_torchs():
    from xfer.kernels import copy_engine as ce
    info = ce.runtime_info()
    assert info["available"], info
    assert info["library"] in ce._loaded_cudart(), "not the libcudart torch loaded"
    major = int(torch.version.cuda.split(".")[0])
    assert info["version"] // 1000 == major, (info, torch.version.cuda)
    if info["version"] >= 12080:
        assert info["batch"], info
        assert info["batch_signature"] == ("13.x (no failIdx)" if major >= 13 else "12.8 (with failIdx)")


@gpu
@needs_cuda
@pytest.mark.parametrize("path", ["batch", "2d"])
@pytest.mark.parametrize("dst_kind", [LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.VLLM_FLASH_ATTN_HND],
                         ids=lambda k: k.value)
@pytest.mark.parametrize("ids", ["random", "strided"])
def test_gpu_copy_engine_device_to_device(path, dst_kind, ids):
    """Every copy-engine path byte-exact, untouched blocks still poison; on the default stream
    (batch detours through a side stream) and on a side stream after an event."""
    engine_or_skip(path)
    src, sl = small_gpu_cache()
    dst, dl = small_gpu_cache(dst_kind, fill="poison")
    if ids == "strided":  # uniform strides: 2-D copies of many rows
        s_ids, d_ids = list(range(0, 32, 2)), list(range(1, 32, 2))
    else:
        s_ids, d_ids = torch.randperm(32)[:12].tolist(), torch.randperm(32)[:12].tolist()
    before = snapshot(src)
    ev = copy_blocks(sl, src, s_ids, dl, dst, d_ids, path=path)
    assert ev.path is {"batch": CopyPath.COPY_ENGINE_BATCH, "2d": CopyPath.COPY_ENGINE_2D}[path]
    ev.synchronize()
    check_moved(sl, src, s_ids, dl, dst, d_ids)
    assert all(torch.equal(a, raw(b)) for a, b in zip(before, src)), "the source changed"
    dst2, _ = small_gpu_cache(dst_kind, fill="poison")
    side, ready = torch.cuda.Stream(), torch.cuda.Event()
    ready.record()
    copy_blocks(sl, src, s_ids, dl, dst2, d_ids, path=path, stream=side, wait_event=ready).synchronize()
    check_moved(sl, src, s_ids, dl, dst2, d_ids)


@gpu
@needs_cuda
@pytest.mark.parametrize("path", ["batch", "2d", "auto", "kernel"])
def test_gpu_copy_engine_pinned_host(path, monkeypatch):
    """swap_out / swap_in by every path; gather into a pinned staging buffer and scatter back."""
    if path in ("batch", "2d"):
        engine_or_skip(path)
    monkeypatch.delenv("XFER_COPY_PATH", raising=False)
    dev, dl = small_gpu_cache(blocks=32)

    def pinned(*shape, **kw):
        return torch.empty(*shape, **{**kw, "device": "cpu"}, pin_memory=True)
    host, hl = small_gpu_cache(LayoutKind.VLLM_FLASH_ATTN_HND, blocks=16, fill="poison", empty=pinned, device="cpu")
    ev = swap_out(dl, dev, [9, 30, 2, 3], hl, host, [15, 0, 7, 8], path=path)
    if path == "kernel":
        assert ev.path is CopyPath.TRITON
    elif path != "auto":
        assert ev.path.value == f"copy_engine_{path}"
    ev.synchronize()
    check_moved(dl, dev, [9, 30, 2, 3], hl, host, [15, 0, 7, 8])
    back, _ = small_gpu_cache(blocks=32, fill="poison")
    swap_in(dl, back, [31, 1, 5, 6], hl, host, [15, 0, 7, 8], path=path).synchronize()
    check_moved(dl, dev, [9, 30, 2, 3], dl, back, [31, 1, 5, 6])
    out = torch.full((3 * dl.bytes_per_block,), POISON, dtype=torch.uint8, pin_memory=True)
    expect = torch.empty(3 * dl.bytes_per_block, dtype=torch.uint8, device="cuda")
    gather(dl, dev, [4, 0, 4], out, path=path).synchronize()
    gather_ref(dl, dev, [4, 0, 4], expect)
    assert torch.equal(out.cuda(), expect)


@gpu
@needs_cuda
def test_gpu_copy_engine_seed_case_and_chunks(monkeypatch):
    """64 layers x K/V x 128 of 256 blocks x 32 KiB by the batch call, in several chunks."""
    engine_or_skip("batch")
    from xfer.kernels import copy_engine as ce
    monkeypatch.setattr(ce, "MAX_BATCH", 3000)
    src, sl = seed_cache()
    dst, dl = seed_cache(fill="poison")
    s_ids, d_ids = list(range(0, 256, 2)), list(range(255, 127, -1))
    ev = copy_blocks(sl, src, s_ids, dl, dst, d_ids, path="batch")
    assert len(ev.keep[2]) == 128 * sl.num_slots and ev.keep[2].num_calls("batch") == 6
    ev.synchronize()
    check_moved(sl, src, s_ids, dl, dst, d_ids)


@gpu
@needs_cuda
def test_gpu_copy_engine_error_is_cleared_for_torch():
    """A refused runtime call raises TransportError and leaves no sticky error for torch's next launch."""
    engine_or_skip("2d")
    from xfer.errors import TransportError
    from xfer.kernels import copy_engine as ce
    rt = ce._runtime()
    a = torch.zeros(64, dtype=torch.uint8, device="cuda")
    b = torch.ones(64, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    rc = rt.memcpy2d(a.data_ptr(), 8, b.data_ptr(), 8, 16, 2, ce.MEMCPY_DEFAULT, s.cuda_stream)  # pitch < width
    assert rc != 0
    with pytest.raises(TransportError, match="cudaMemcpy2DAsync failed"):
        raise rt.error("cudaMemcpy2DAsync", rc)
    c = a + 1  # would raise if the runtime's last error were still set
    torch.cuda.synchronize()
    assert bool((c == 1).all()) and bool((a == 0).all())


@gpu
@needs_cuda
def test_gpu_copy_calibrate_quick(tmp_path):
    """The calibration helper runs, checks every path's bytes, and writes a table the dispatcher takes."""
    import json
    from xfer.bench import copy_calibrate
    from xfer.kernels import set_copy_table
    out = tmp_path / "table.json"
    res = copy_calibrate.main(["--quick", "--sizes", "512,32768", "--iters", "3", "--budget-s", "0.05",
                               "--out", str(out)])
    rows = [r for c in res["cases"] for r in c["rows"]]
    assert all(r.get("verified", True) for r in rows) and not [r for r in rows if "error" in r]
    assert {c["scenario"] for c in res["cases"]} == {"d2d", "d2h", "h2d"}
    set_copy_table(json.loads(out.read_text())["table"], source=str(out))
    set_copy_table(None)


def test_functional_copies_reuse_a_sides_checks_only_for_the_same_tensor_objects(torch_path):
    """copy_blocks remembers a cache's checked side by the identity of its tensor objects (never by
    ``id()``, which a new tensor may reuse): the same objects hit; equal-looking new objects, or
    the same objects in another order, are checked afresh; the memory keeps the newest 32; bytes
    move right either way."""
    from xfer.kernels import sides as d

    src, sl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD, layers=3)  # one tensor a layer
    dst, dl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD, layers=3, fill="poison")
    assert len(src) > 2  # a cache: remembered (per-call staging buffers are not)
    first = d._side(sl, src).info
    assert d._side(sl, src).info is first and d._side(sl, tuple(src)).info is first
    assert d._side(sl, [src[1], src[0], src[2]]).info is not first
    views = [src[0], *(t.view(t.shape) for t in src[1:])]  # new objects over the same bytes: not the same
    assert d._side(sl, views).info is not first
    clones = [t.clone() for t in src]
    assert d._side(sl, clones).info is not first
    for _ in range(d._RECENT.cap):
        d._side(sl, [t.clone() for t in src])
    assert len(d._RECENT) == d._RECENT.cap and d._side(sl, src).info is not first  # pushed out, checked anew
    copy_blocks(sl, src, [3, 1], dl, dst, [0, 2])
    check_moved(sl, src, [3, 1], dl, dst, [0, 2])


def test_functional_copies_keep_no_cache_alive(torch_path):
    """The memory of checked sides refers to the caches weakly: a cache the caller dropped after
    copy_blocks is freed at once (on a GPU its memory goes back), and its record matches nothing."""
    import gc
    import weakref
    from xfer.kernels import sides as d

    src, sl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD, layers=3)
    dst, dl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD, layers=3, fill="poison")
    copy_blocks(sl, src, [3, 1], dl, dst, [0, 2])
    check_moved(sl, src, [3, 1], dl, dst, [0, 2])
    assert d._side(sl, src).cached and d._side(dl, dst).cached  # both remembered
    gone = [weakref.ref(t) for t in (*src, *dst)]
    del src, dst
    gc.collect()
    assert all(r() is None for r in gone), "a copy's side cache kept a dropped KV cache alive"
