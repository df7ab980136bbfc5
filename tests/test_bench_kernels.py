"""pytest-benchmark of the block-copy kernels on the seed case (CUDA only).

    python -m pytest tests/test_bench_kernels.py --benchmark-columns=median,ops

64 layers x K/V x 128 of 256 blocks x 32 KiB slices (512 MiB a call). Each benchmark checks the
bytes against the torch reference first; ``extra_info`` carries GB/s and the ratio to the
contiguous device copy of the same bytes, measured in the same session.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xfer.kernels import copy_blocks, gather, scatter
from xfer.kernels.reference import byte_views, gather_ref
from xfer.layout import LayoutKind, make_kv_cache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MOVED = 128


def cache(kind: LayoutKind):
    ts, layout = make_kv_cache(kind, num_layers=64, num_blocks=256, block_size=16, num_heads=8, head_dim=128,
                               device="cuda")
    for t in ts:
        t.view(torch.uint8).random_(0, 256)
    return ts, layout


@pytest.fixture(scope="module")
def seed():
    torch.manual_seed(0)
    src, sl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD)
    s_ids = torch.randperm(256)[:MOVED].numpy()
    d_ids = torch.randperm(256)[:MOVED].numpy()
    staging = torch.empty(MOVED * sl.bytes_per_block, dtype=torch.uint8, device="cuda")
    return src, sl, s_ids, d_ids, staging


@pytest.fixture(scope="module")
def ceiling_ms(seed):
    import triton.testing
    a = torch.empty_like(seed[4]).random_(0, 256)
    b = torch.empty_like(a)
    return triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")


def run(benchmark, fn, nbytes, ceiling_ms):
    def timed():
        fn()
        torch.cuda.synchronize()
    timed()  # warm-up: compile and first touch
    benchmark.pedantic(timed, rounds=30, warmup_rounds=3)
    median_ms = benchmark.stats.stats.median * 1e3
    benchmark.extra_info.update(GBps=nbytes / median_ms / 1e6, of_contiguous_copy=ceiling_ms / median_ms,
                                contiguous_copy_ms=ceiling_ms)


def test_gather(benchmark, seed, ceiling_ms):
    src, sl, s_ids, _, staging = seed
    expect = torch.empty_like(staging)
    gather(sl, src, s_ids, staging)
    gather_ref(sl, src, s_ids, expect)
    assert torch.equal(staging, expect)
    run(benchmark, lambda: gather(sl, src, s_ids, staging), staging.numel(), ceiling_ms)


@pytest.mark.parametrize("kind", [LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.VLLM_FLASH_ATTN_HND],
                         ids=lambda k: k.value)
def test_scatter(benchmark, seed, ceiling_ms, kind):
    src, sl, s_ids, d_ids, staging = seed
    dst, dl = cache(kind)
    gather(sl, src, s_ids, staging)
    scatter(staging, dl, dst, d_ids, staging_layout=sl.staging(MOVED))
    torch.cuda.synchronize()
    d_idx, s_idx = torch.as_tensor(d_ids, device="cuda"), torch.as_tensor(s_ids, device="cuda")
    assert all(torch.equal(dv[d_idx], sv[s_idx]) for sv, dv in zip(byte_views(sl, src), byte_views(dl, dst)))
    run(benchmark, lambda: scatter(staging, dl, dst, d_ids, staging_layout=sl.staging(MOVED)), staging.numel(),
        ceiling_ms)


def test_copy_blocks(benchmark, seed, ceiling_ms):
    src, sl, s_ids, d_ids, staging = seed
    dst, dl = cache(LayoutKind.VLLM_FLASH_ATTN_NHD)
    copy_blocks(sl, src, s_ids, dl, dst, d_ids).synchronize()
    d_idx, s_idx = torch.as_tensor(d_ids, device="cuda"), torch.as_tensor(s_ids, device="cuda")
    assert all(torch.equal(dv[d_idx], sv[s_idx]) for sv, dv in zip(byte_views(sl, src), byte_views(dl, dst)))
    run(benchmark, lambda: copy_blocks(sl, src, s_ids, dl, dst, np.asarray(d_ids)), staging.numel(), ceiling_ms)
