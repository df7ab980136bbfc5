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


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


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
