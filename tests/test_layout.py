"""KV layout model: constructors, fingerprints, block-id checks, and byte runs against a slow
reference that indexes the tensors directly."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xfer import KVLayout, LayoutKind, make_kv_cache
from xfer.errors import BlockIdError, LayoutError, LayoutMismatchError, LengthMismatchError
from xfer.layout import pair_runs

MLA_DIM = {LayoutKind.MLA: 576, LayoutKind.MLA_FP8: 656}


def dims(kind, layers=3, blocks=6, bs=4, heads=2, hd=8):
    return dict(num_layers=layers, num_blocks=blocks, block_size=bs, num_heads=heads, head_dim=MLA_DIM.get(kind, hd))


def random_fill(tensors, gen):
    for t in tensors:
        flat = t.view(-1).view(torch.uint8) if t.is_contiguous() else None
        assert flat is not None
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy()


@pytest.mark.parametrize("kind", list(LayoutKind))
def test_constructors_describe_their_tensors(kind):
    d = dims(kind)
    tensors, layout = make_kv_cache(kind, **d)
    assert layout.num_layers == 3 and layout.num_blocks == 6 and layout.block_size == 4
    mla = kind in MLA_DIM
    assert layout.num_kv == (1 if mla else 2)
    assert layout.num_heads == (1 if mla else 2) and layout.head_dim == d["head_dim"]
    assert layout.dtype == (torch.uint8 if kind is LayoutKind.MLA_FP8 else torch.bfloat16)
    assert layout.name == kind.value
    # every slot's view aliases its base tensor and the views of distinct slots never overlap
    views = layout.views(tensors)
    assert len(views) == layout.num_slots
    seen = set()
    for v in views:
        for b in range(layout.num_blocks):
            blk = v[b]
            addrs = {blk.data_ptr() + sum(i * s for i, s in zip(idx, blk.stride())) * blk.element_size()
                     for idx in np.ndindex(*blk.shape)}
            assert not (addrs & seen)
            seen |= addrs
    assert len(seen) == sum(t.numel() for t in tensors)  # the layout covers every element once
    assert KVLayout.from_dict(layout.to_dict()) == layout


def test_hnd_is_detected_from_strides():
    _, nhd = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, **dims(None))
    _, hnd = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_HND, **dims(None))
    assert nhd.inner_order == "NHC" and hnd.inner_order == "HNC"
    assert nhd.fingerprint() == hnd.fingerprint()  # same logical KV: exchangeable with conversion


def test_fingerprint_mismatch_names_the_field():
    _, a = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, **dims(None, bs=4))
    _, b = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, **dims(None, bs=8))
    with pytest.raises(LayoutMismatchError, match=r"block_size.*4.*8"):
        a.check_compatible(b)
    _, c = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, **dims(None), dtype=torch.float16)
    with pytest.raises(LayoutMismatchError, match=r"dtype.*bfloat16.*float16"):
        a.check_compatible(c)
    assert a.fingerprint_hash() != c.fingerprint_hash()


@pytest.mark.parametrize("bad,exc,pattern", [
    ([7], BlockIdError, "id 7"), ([-1], BlockIdError, "negative id -1"), ([[1]], BlockIdError, "1-D"),
    ([1.5], BlockIdError, "integers"),
])
def test_block_id_checks(bad, exc, pattern):
    _, layout = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, **dims(None))
    with pytest.raises(exc, match=pattern):
        layout.check_block_ids(bad)
    with pytest.raises(BlockIdError, match="repeat id 2"):
        layout.check_block_ids([2, 3, 2], unique=True)
    assert layout.check_block_ids([2, 3, 2]).tolist() == [2, 3, 2]  # repeats are fine as a source


@pytest.mark.parametrize("n", [1, 3, 512, 513, 3000])  # both sides of the short-list path (512 ids)
def test_block_id_checks_short_and_long(n):
    _, layout = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, num_layers=1, num_blocks=4096, block_size=2,
                              num_heads=1, head_dim=2)
    ids = np.random.default_rng(n).permutation(4096)[:n]
    out = layout.check_block_ids(ids, unique=True)
    assert out.dtype == np.int64 and out.tolist() == ids.tolist()
    assert layout.check_block_ids(ids.astype(np.int32)).dtype == np.int64
    for bad, pattern in ((4096, "id 4096; layout .* has 4096 blocks"), (-3, "negative id -3")):
        wrong = ids.copy()
        wrong[n // 2] = bad
        with pytest.raises(BlockIdError, match=pattern):
            layout.check_block_ids(wrong)
    if n > 1:
        twice = ids.copy()
        twice[-1] = twice[0]
        with pytest.raises(BlockIdError, match=f"repeat id {twice[0]}; each must appear once"):
            layout.check_block_ids(twice, unique=True)
        assert layout.check_block_ids(twice).tolist() == twice.tolist()  # a source may repeat


def test_from_tensors_rejects_inconsistent_input():
    t = torch.empty(2, 6, 4, 2, 8)
    with pytest.raises(LayoutError, match="dims"):
        KVLayout.from_tensors([t], "KBNHX")
    with pytest.raises(LayoutError, match="5 dims"):
        KVLayout.from_tensors([t], "KBNH")
    with pytest.raises(LayoutError, match="tensor 1 has shape"):
        KVLayout.from_tensors([t, torch.empty(2, 5, 4, 2, 8)], "KBNHC")
    with pytest.raises(LayoutError, match="block_size"):
        KVLayout.from_tensors([torch.empty(10, 2, 8)] * 2, "THC", block_size=4)
    _, layout = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, **dims(None))
    with pytest.raises(LayoutError, match="base tensor 0 holds"):
        layout.check_tensors([torch.empty(3, dtype=torch.bfloat16)] * 3)
    with pytest.raises(LayoutError, match="dtype"):
        layout.check_tensors([torch.empty(2, 6, 4, 2, 8)] * 3)


def slow_reference(src_layout, src_tensors, src_ids, dst_layout, dst_tensors, dst_ids):
    """Element by element through the logical indices: the oracle for byte runs."""
    for sv, dv in zip(src_layout.views(src_tensors), dst_layout.views(dst_tensors)):
        for i, j in zip(src_ids, dst_ids):
            for n in range(sv.shape[1]):
                for h in range(sv.shape[2]):
                    dv[j, n, h] = sv[i, n, h]


def apply_runs(runs, src_tensors, dst_tensors):
    srcb = [t.view(-1).view(torch.uint8) for t in src_tensors]
    dstb = [t.view(-1).view(torch.uint8) for t in dst_tensors]
    for st_, so, dt_, do, n in zip(runs.src_tensor, runs.src_offset, runs.dst_tensor, runs.dst_offset, runs.nbytes):
        dstb[dt_][do:do + n] = srcb[st_][so:so + n]


# kinds sharing one fingerprint, so any pair converts
CONVERTIBLE = [k for k in LayoutKind if k not in MLA_DIM]


@settings(max_examples=60, deadline=None)
@given(src_kind=st.sampled_from(CONVERTIBLE), dst_kind=st.sampled_from(CONVERTIBLE),
       layers=st.integers(1, 3), bs=st.integers(1, 4), heads=st.integers(1, 3), hd=st.integers(1, 5),
       data=st.data())
def test_pair_runs_match_slow_reference(src_kind, dst_kind, layers, bs, heads, hd, data):
    d = dict(num_layers=layers, block_size=bs, num_heads=heads, head_dim=hd)
    src_t, src_l = make_kv_cache(src_kind, num_blocks=5, **d)
    dst_t, dst_l = make_kv_cache(dst_kind, num_blocks=6, **d)
    n = data.draw(st.integers(0, 5))
    src_ids = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    dst_ids = data.draw(st.permutations(range(6)))[:n]
    gen = torch.Generator().manual_seed(n)
    random_fill(src_t, gen)
    expect = [t.clone().fill_(3) for t in dst_t]
    got = [t.clone().fill_(3) for t in dst_t]
    slow_reference(src_l, src_t, src_ids, dst_l, expect, dst_ids)
    runs = pair_runs(src_l, src_ids, dst_l, dst_ids)
    apply_runs(runs, src_t, got)
    for e, g in zip(expect, got):
        assert np.array_equal(as_bytes(e), as_bytes(g))
    assert runs.nbytes.sum() == n * src_l.bytes_per_block


@pytest.mark.parametrize("kind", list(LayoutKind))
def test_runs_merge_contiguous_blocks(kind):
    _, layout = make_kv_cache(kind, **dims(kind))
    per_block = layout.runs([2])
    merged = layout.runs([2, 3, 4])
    assert merged.nbytes.sum() == 3 * layout.bytes_per_block
    # consecutive ids never need more runs than a single id needs: block-major layouts collapse
    assert len(merged) <= 3 * len(per_block)
    if kind in (LayoutKind.VLLM_CROSS_LAYER, LayoutKind.DISTSERVE):
        assert len(merged) == layout.num_tensors  # one run per base tensor
    if kind is LayoutKind.PACKED_KV:
        assert len(per_block) == layout.num_layers  # K and V interleave into one run per layer


def test_pair_runs_validate_before_computing():
    _, a = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, **dims(None))
    with pytest.raises(LengthMismatchError, match="2 source block ids but 1"):
        pair_runs(a, [0, 1], a, [0])
    with pytest.raises(BlockIdError, match="destination block ids repeat id 0"):
        pair_runs(a, [0, 1], a, [0, 0])


def test_seed_case_slices():
    """64 layers x K/V x 128 blocks: 16,384 slices, merged where blocks are adjacent."""
    tensors, layout = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, num_layers=64, num_blocks=256,
                                    block_size=1, num_heads=1, head_dim=8, device="meta")
    ids = np.arange(0, 256, 2)  # every other block: nothing merges
    runs = layout.runs(ids)
    assert len(runs) == 64 * 2 * 128
    assert len(layout.runs(np.arange(128))) == 64 * 2  # consecutive blocks merge per slot


def test_fingerprint_hash_is_made_once_and_names_the_fingerprint():
    """Requests and notices name a layout by its fingerprint hash on every transfer: it is made
    once per layout object, equals a fresh hash of the fingerprint, survives pickling, and differs
    for a layout that differs in a fingerprint field."""
    import dataclasses
    import hashlib
    import json
    import pickle

    from xfer.layout import LayoutKind, make_kv_cache

    _, layout = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, num_layers=2, num_blocks=4, block_size=16,
                              num_heads=2, head_dim=8)
    expect = hashlib.sha256(json.dumps(layout.fingerprint(), sort_keys=True).encode()).hexdigest()[:16]
    assert layout.fingerprint_hash() == expect and layout.fingerprint_hash() is layout.fingerprint_hash()
    again = pickle.loads(pickle.dumps(layout))
    assert again == layout and again.fingerprint_hash() == expect
    import torch
    other = dataclasses.replace(layout, dtype=torch.float16 if layout.dtype != torch.float16 else torch.bfloat16)
    assert other.fingerprint_hash() != expect
