"""Engine pieces in one process: block manager, per-layer / per-head region layouts, and the paged
transformers Cache against single-process HF generation (Llama and Qwen2, several layouts)."""

import pytest
import torch

pytest.importorskip("transformers", reason="the engine needs transformers: pip install -e '.[engine]'")

from xfer import LayoutKind  # noqa: E402
from xfer.engine.block_manager import BlockManager, OutOfBlocksError, blocks_for  # noqa: E402
from xfer.engine.config import PRESETS, ModelSpec, PoolSpec  # noqa: E402
from xfer.engine.kv_pool import KVPool, head_layout, layer_layout  # noqa: E402
from xfer.engine.model import build_model, hf_generate, next_token_logits  # noqa: E402
from xfer.engine.paged_cache import PagedCache  # noqa: E402
from xfer.errors import InvalidArgumentError  # noqa: E402

from helpers import one_torch_thread  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _one_thread(request):
    one_torch_thread(request)


LLAMA, QWEN2 = PRESETS["tiny"], PRESETS["tiny-qwen2"]


@pytest.fixture(scope="module")
def models():
    return {spec.family.value: (spec, build_model(spec)) for spec in (LLAMA, QWEN2)}


def prompt(n, seed=0, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def paged_generate(model, spec, pool_spec, tokens, max_new):
    """Greedy generation on a PagedCache whose block table grows block by block."""
    pool = KVPool(spec, pool_spec)
    bm = BlockManager(pool_spec.num_blocks, pool_spec.block_size)
    table = bm.allocate(blocks_for(len(tokens), pool_spec.block_size))
    bm.allocate(1)  # keep the table non-contiguous in the pool
    cache = PagedCache(pool, [table])
    out = [int(next_token_logits(model, torch.tensor([tokens]), cache).argmax())]
    length = len(tokens)
    while len(out) < max_new:
        bm.append(table, length)
        out.append(int(next_token_logits(model, torch.tensor([[out[-1]]]), cache).argmax()))
        length += 1
    return out, table


# ---- block manager ------------------------------------------------------------------------
def test_block_manager_check_then_act():
    bm = BlockManager(4, block_size=16)
    assert bm.can_allocate(4) and not bm.can_allocate(5)
    a = bm.allocate(3)
    assert bm.num_free == 1 and not bm.can_allocate(2)
    with pytest.raises(OutOfBlocksError, match="asked for 2 blocks, 1 of 4 are free"):
        bm.allocate(2)
    bm.share(a[:1])
    bm.free(a)
    assert bm.num_free == 3 and bm.ref_counts[a[0]] == 1  # still held by the sharer
    bm.free(a[:1])
    assert bm.num_free == 4
    with pytest.raises(InvalidArgumentError, match="not allocated"):
        bm.free(a[:1])


def test_block_manager_append_grows_at_block_boundaries():
    bm = BlockManager(3, block_size=4)
    table = bm.allocate(1)
    assert bm.blocks_to_append(table, 3) == 0 and bm.blocks_to_append(table, 4) == 1
    assert bm.append(table, 3) == [] and len(bm.append(table, 4)) == 1 and len(table) == 2
    assert bm.can_append(table, 8) and not bm.can_append(table, 8, new_tokens=5)


# ---- region layouts -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", [LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.VLLM_FLASH_ATTN_HND,
                                  LayoutKind.DISTSERVE, LayoutKind.VLLM_CROSS_LAYER])
def test_layer_and_head_layouts_address_the_pool(kind):
    spec = ModelSpec(num_layers=3, num_kv_heads=4, num_heads=4)
    pool = KVPool(spec, PoolSpec(num_blocks=5, block_size=4, layout=kind))
    for t in pool.tensors:
        t.copy_(torch.randn(t.shape))
    for layer in range(3):
        layout, used = layer_layout(pool.layout, layer)
        views = layout.views([pool.tensors[i] for i in used])
        for kv in range(2):
            assert torch.equal(views[kv], pool.views[2 * layer + kv])
        sub = head_layout(layout, (1, 3)).views([pool.tensors[i] for i in used])
        assert torch.equal(sub[1], pool.views[2 * layer + 1][:, :, 1:3])
    with pytest.raises(InvalidArgumentError):
        head_layout(pool.layout, (2, 5))


# ---- paged cache == HF --------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_paged_cache_generation_equals_hf(models, family, n):
    spec, model = models[family]
    tokens = prompt(n, seed=n)
    ref = hf_generate(model, tokens, 12)
    out, _ = paged_generate(model, spec, PoolSpec(num_blocks=16, block_size=8), tokens, 12)
    assert out == ref


@pytest.mark.parametrize("kind", [LayoutKind.VLLM_FLASH_ATTN_HND, LayoutKind.DISTSERVE, LayoutKind.VLLM_FLASHINFER])
def test_paged_cache_any_layout(models, kind):
    spec, model = models["llama"]
    tokens = prompt(21, seed=5)
    out, _ = paged_generate(model, spec, PoolSpec(num_blocks=8, block_size=4, layout=kind), tokens, 8)
    assert out == hf_generate(model, tokens, 8)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_rows_of_different_lengths_equal_hf(models, family):
    """One forward per step for rows of different lengths (per-row positions, padding mask) == HF per row."""
    spec, model = models[family]
    prompts = [prompt(n, seed=n) for n in (1, 6, 17, 33)]
    pool = KVPool(spec, PoolSpec(num_blocks=32, block_size=8))
    bm = BlockManager(32, 8)
    tables = [bm.allocate(blocks_for(len(p), 8)) for p in prompts]
    out = [[int(next_token_logits(model, torch.tensor([p]), PagedCache(pool, [t])).argmax())]
           for p, t in zip(prompts, tables)]
    lengths = [len(p) for p in prompts]
    for _ in range(9):
        for t, n in zip(tables, lengths):
            bm.append(t, n)
        cache = PagedCache(pool, tables, lengths)
        inputs = cache.model_inputs(1)
        assert inputs["attention_mask"].shape == (4, 1, 1, max(lengths) + 1)
        logits = next_token_logits(model, torch.tensor([[o[-1]] for o in out]), cache, **inputs)
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(t)
        lengths = [n + 1 for n in lengths]
        assert cache.lengths == lengths
    for p, o in zip(prompts, out):
        assert o == hf_generate(model, p, 10)
    assert PagedCache(pool, tables[:2], [5, 5]).model_inputs(1) == {}  # one length: HF's own mask path


def test_paged_cache_holds_the_keys_hf_computes(models):
    spec, model = models["qwen2"]
    tokens = prompt(19, seed=2)
    pool = KVPool(spec, PoolSpec(num_blocks=8, block_size=4))
    cache = PagedCache(pool, [[5, 1, 7, 3, 0]])
    next_token_logits(model, torch.tensor([tokens]), cache)
    ref = model(torch.tensor([tokens]), use_cache=True)
    ref_cache = getattr(ref, "cache", None) or ref.past_key_values
    for layer in range(spec.num_layers):
        k, v = pool.read(layer, pool.table_tensor(cache.tables[0], len(tokens)), len(tokens))
        assert torch.equal(k, ref_cache.layers[layer].keys[0]) and torch.equal(v, ref_cache.layers[layer].values[0])
    assert cache.get_seq_length() == len(tokens)


def test_paged_cache_refuses_a_short_table(models):
    spec, model = models["llama"]
    cache = PagedCache(KVPool(spec, PoolSpec(num_blocks=4, block_size=4)), [[0]])
    with pytest.raises(InvalidArgumentError, match="cannot hold 9 tokens"):
        next_token_logits(model, torch.tensor([prompt(9)]), cache)


def test_partial_head_cache_serves_prefill_only(models):
    spec, model = models["llama"]
    pool = KVPool(spec, PoolSpec(num_blocks=4, block_size=4), heads=(1, 2))
    cache = PagedCache(pool, [[0, 1, 2]], heads=(1, 2))
    tokens = prompt(6)
    next_token_logits(model, torch.tensor([tokens]), cache)
    full = KVPool(spec, PoolSpec(num_blocks=4, block_size=4))
    next_token_logits(model, torch.tensor([tokens]), PagedCache(full, [[0, 1, 2]]))
    table = pool.table_tensor([0, 1], 6)
    assert torch.equal(pool.read(0, table, 6)[0], full.read(0, table, 6)[0][1:2])
    with pytest.raises(InvalidArgumentError, match="needs all 2"):
        next_token_logits(model, torch.tensor([[1]]), cache)


def test_poster_runs_in_order_flushes_and_keeps_the_first_error():
    from xfer.engine.streamer import Poster

    poster, seen = Poster(), []
    try:
        for i in range(5):
            poster.put(None, seen.append, i)
        poster.put(None, lambda: 1 / 0)
        poster.put(None, seen.append, 5)
        assert poster.flush(5.0) and seen == list(range(6))
        assert isinstance(poster.error, ZeroDivisionError)
    finally:
        poster.close()


def test_the_checkout_root_never_shadows_hugging_faces_kernels_package():
    """Run from the repository root (``python -c``, ``python -m``, the Router's forkserver), the
    folder ``kernels/`` (xfer.kernels) must not answer ``import kernels``: transformers imports
    Hugging Face's package of that name when it is installed."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import importlib.util, xfer.engine; s = importlib.util.find_spec('kernels'); "
            "print(s.origin if s else None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() != os.path.join(root, "kernels", "__init__.py"), out.stdout
