"""Prefill and decode instances in one process, moving KV through their agents (the local
transport): layer-wise streaming with per-request and per-layer waits, prefill heads split over two
ranks and joined on decode, leases, back-pressure, and swap under decode memory pressure. Every
case checks the tokens against single-process HF generation."""

import time

import pytest
import torch

pytest.importorskip("transformers", reason="the engine needs transformers: pip install -e '.[engine]'")

from xfer.engine.config import PRESETS, PoolSpec, WaitMode  # noqa: E402
from xfer.engine.decode import DecodeInstance  # noqa: E402
from xfer.engine.model import build_model, hf_generate  # noqa: E402
from xfer.engine.prefill import PrefillInstance  # noqa: E402
from xfer.engine.protocol import Request, TokenNote, decode  # noqa: E402
from xfer.errors import XferError  # noqa: E402

from helpers import one_torch_thread  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _one_thread(request):
    one_torch_thread(request)


SPEC = PRESETS["tiny"]
POOL = PoolSpec(num_blocks=32, block_size=8)


@pytest.fixture(scope="module")
def model():
    return build_model(SPEC)


@pytest.fixture
def make(model):
    made = []

    def _make(cls, name, pool=POOL, **kw):
        inst = cls(name, SPEC, pool, torch_model=model, **kw)
        made.append(inst)
        return inst

    yield _make
    for inst in made:
        inst.close()


def requests(lengths, max_new=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Request(f"r{i}", torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist(), max_new)
            for i, n in enumerate(lengths)]


def drive(decode, prefills, reqs, *, heads=None, release=True):
    """Admit, prefill (each rank its head share), then decode until every request finished."""
    for r in reqs:
        decode.waiting.append(r)
    deadline = time.monotonic() + 60
    while decode.busy:
        for req, blocks in decode.admit_waiting():
            for rank, p in enumerate(prefills):
                p.prefill(req.id, req.prompt, decode.name, blocks, peer_heads=heads[rank] if heads else None)
                if release:
                    p.release(req.id)
        decode.poll(0.01)
        decode.step()
        assert time.monotonic() < deadline, f"stuck: {decode!r}"
    return {s.id: s for s in decode.finished}


def check(model, reqs, done):
    for r in reqs:
        assert done[r.id].tokens == hf_generate(model, r.prompt, r.max_new_tokens), r.id


@pytest.mark.parametrize("wait", list(WaitMode))
def test_layerwise_stream_then_decode_equals_hf(model, make, wait):
    p, d = make(PrefillInstance, "p"), make(DecodeInstance, "d", wait=wait)
    p.agent.connect(d.agent.metadata())
    reqs = requests([1, 8, 9, 30])
    done = drive(d, [p], reqs)
    check(model, reqs, done)
    assert d.blocks.num_free == POOL.num_blocks and p.blocks.num_free == POOL.num_blocks
    assert all(s.times["ready"] >= s.times["forward"] for s in done.values())
    assert max(d.batch_sizes) == 4  # all four decoded in one forward


def test_continuous_batching_requests_join_and_leave(model, make):
    """Decode batches whatever runs: requests of different lengths and budgets leave as they finish and
    queued ones join between steps, each still equal to its own single-process HF generation."""
    d = make(DecodeInstance, "d", pool=PoolSpec(num_blocks=14, block_size=8))
    p = make(PrefillInstance, "p")
    p.agent.connect(d.agent.metadata())
    reqs = requests([3, 12, 30, 7, 19, 40], seed=4)
    for r, n in zip(reqs, [4, 12, 8, 10, 6, 9]):
        r.max_new_tokens = n
    done = drive(d, [p], reqs)
    check(model, reqs, done)
    batches = list(d.recent_batches)
    assert max(map(len, batches)) >= 3
    late = [r.id for r in reqs if done[r.id].times["admit"] > min(s.times["done"] for s in done.values())]
    assert late, "some request should have waited for blocks"
    assert any(set(late) & set(b) and set(b) - set(late) for b in batches)  # a late one decoded beside an early one
    assert d.blocks.num_free == 14


@pytest.mark.parametrize("hold_last", [False, True])
def test_each_layer_is_its_own_transfer(model, make, hold_last):
    p, d = make(PrefillInstance, "p"), make(DecodeInstance, "d")
    p.hold_last = hold_last
    p.agent.connect(d.agent.metadata())
    (req,) = requests([20])
    blocks = d.admit(req)
    p.prefill(req.id, req.prompt, "d", blocks)
    notes = d.agent.notifications()
    layers = [n for n in notes if n.blocks.size]
    assert [n.region for n in layers] == [f"kv.{i}" for i in range(SPEC.num_layers)]
    assert all(n.blocks.tolist() == blocks[:3] for n in layers)
    (tok,) = [n for n in notes if isinstance(decode(n.payload), TokenNote)]
    token = decode(tok.payload)
    assert token.layer == (SPEC.num_layers - 1 if hold_last else -1)
    assert tok.blocks.size == (3 if hold_last else 0) and (tok.op.value == "message") != hold_last
    for n in notes:
        d._take(decode(n.payload))
    while d.busy:
        d.step()
    assert d.finished[0].tokens == hf_generate(model, req.prompt, req.max_new_tokens)


@pytest.mark.parametrize("wait", list(WaitMode))
def test_prefill_heads_split_over_two_ranks_join_on_decode(model, make, wait):
    """Two ranks in one process: each runs the full forward but holds and sends only its kv-heads
    (real TP, a sharded model per rank process: test_engine_router)."""
    shards = [(0, 1), (1, 2)]
    ranks = [make(PrefillInstance, f"p{r}", heads=h, rank=r) for r, h in enumerate(shards)]
    d = make(DecodeInstance, "d", shards=shards, wait=wait)
    for p in ranks:
        p.agent.connect(d.agent.metadata())
        assert p.pool.num_heads == 1
    reqs = requests([5, 17, 24], seed=1)
    done = drive(d, ranks, reqs, heads=shards)
    check(model, reqs, done)


def test_lease_holds_blocks_until_release_or_expiry(make):
    p = make(PrefillInstance, "p", pool=PoolSpec(num_blocks=4, block_size=8), lease_s=0.2)
    d = make(DecodeInstance, "d")
    p.agent.connect(d.agent.metadata())
    a, b = requests([24, 16])
    p.prefill(a.id, a.prompt, "d", d.admit(a))
    assert p.blocks.num_free == 1 and not p.can_prefill(len(b.prompt))  # a's lease pins 3 blocks
    assert p.release(a.id) and not p.release(a.id) and p.can_prefill(len(b.prompt))
    p.prefill(b.id, b.prompt, "d", d.admit(b))
    assert not p.can_prefill(24)
    time.sleep(0.25)
    assert p.can_prefill(24) and p.expired == 1  # the lease ran out: blocks back without a confirmation


def test_decode_admits_only_what_fits(model, make):
    d = make(DecodeInstance, "d", pool=PoolSpec(num_blocks=8, block_size=8))
    p = make(PrefillInstance, "p")
    p.agent.connect(d.agent.metadata())
    reqs = requests([20, 20, 4], max_new=6)  # without swap each reserves blocks for all its tokens: 4 + 4 + 2
    d.waiting.extend(reqs)
    first = d.admit_waiting()
    assert [r.id for r, _ in first] == ["r0", "r1"] and not d.can_admit(reqs[2]) and d.blocks.num_free == 0
    for req, blocks in first:
        p.prefill(req.id, req.prompt, "d", blocks)
    done = drive(d, [p], [])  # r2 waits in the queue until a finished request freed its blocks
    check(model, reqs, done)
    assert done["r2"].times["admit"] >= min(done["r0"].times["done"], done["r1"].times["done"])


def test_swap_under_decode_memory_pressure_keeps_tokens(model, make):
    # 9 blocks of 4 tokens: three 10-token prompts fit, their 12 new tokens do not -> swap out and back
    d = make(DecodeInstance, "d", pool=PoolSpec(num_blocks=9, block_size=4), swap_blocks=32)
    p = make(PrefillInstance, "p", pool=PoolSpec(num_blocks=32, block_size=4))
    p.agent.connect(d.agent.metadata())
    reqs = requests([10, 10, 10], max_new=12, seed=3)
    done = drive(d, [p], reqs)
    check(model, reqs, done)
    assert sum(s.swaps for s in done.values()) >= 1 and d.swapper.count >= 2
    assert d.blocks.num_free == 9 and d.swapper.blocks.num_free == 32


def test_abort_frees_and_reports(make):
    d = make(DecodeInstance, "d")
    (req,) = requests([12])
    d.admit(req)
    assert d.abort(req.id, "TransferTimeoutError: gone") and not d.abort(req.id, "again")
    assert d.finished[-1].times["error"].startswith("TransferTimeoutError") and d.blocks.num_free == 32


def test_prefill_to_a_closed_decode_fails_typed(make):
    p, d = make(PrefillInstance, "p", transfer_timeout_s=2.0), make(DecodeInstance, "d")
    p.agent.connect(d.agent.metadata())
    (req,) = requests([12])
    blocks = d.admit(req)
    d.agent.close()
    with pytest.raises(XferError):
        p.prefill(req.id, req.prompt, "d", blocks)
    assert req.id in p.leases  # held until the lease runs out
