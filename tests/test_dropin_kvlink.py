"""The engine-neutral core of the drop-in KV layers (engine/kvlink.py): TP head plans, leases,
load errors, per-layer transfer groups between two links, raw-pointer tensors."""

from __future__ import annotations

import time

import pytest
import torch

from helpers import POISON, assert_blocks_equal, assert_untouched, fill_random, poison
from xfer import LayoutKind, make_kv_cache
from xfer.errors import InvalidArgumentError
from xfer.transfer import Op
from xfer.engine.kvlink import (KVLink, LeaseTable, LinkConfig, LoadErrors, TransferGroup, head_plan, rank_heads,
                                readers_of, region_name, tensor_from_ptr)

pytestmark = pytest.mark.timeout(60)


def test_rank_heads_split_and_replicate():
    assert [rank_heads(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # replicated
    with pytest.raises(InvalidArgumentError, match="do not split"):
        rank_heads(6, 4, 0)
    with pytest.raises(InvalidArgumentError, match="rank 4"):
        rank_heads(8, 4, 4)


@pytest.mark.parametrize("total,src_tp,dst_tp", [(8, 1, 1), (8, 2, 1), (8, 1, 4), (8, 4, 2), (2, 4, 1), (2, 1, 4),
                                                 (4, 2, 8)])
def test_head_plan_covers_each_destination_head_once(total, src_tp, dst_tp):
    for d in range(dst_tp):
        plan = head_plan(total, src_tp, dst_tp, d)
        covered = [h for _, (a, b) in plan for h in range(a, b)]
        assert covered == list(range(*rank_heads(total, dst_tp, d)))
        for src, (a, b) in plan:
            s0, s1 = rank_heads(total, src_tp, src)
            assert s0 <= a < b <= s1
    readers = {s: readers_of(total, src_tp, dst_tp, s) for s in range(src_tp)}
    for d in range(dst_tp):
        for s, _ in head_plan(total, src_tp, dst_tp, d):
            assert d in readers[s]


def test_lease_table_release_and_expiry():
    leases = LeaseTable()
    leases.hold("a", [1, 2], ttl=60, readers=2)
    leases.hold("b", [3], ttl=0.01)
    assert not leases.release("a") and "a" in leases
    assert leases.release("a") and "a" not in leases
    assert not leases.release("zzz")
    time.sleep(0.02)
    assert leases.expired() == ["b"] and len(leases) == 0


def test_load_errors_are_taken_once():
    errors = LoadErrors()
    errors.add([3, 4])
    errors.add([4, 9])
    assert errors.take() == {3, 4, 9}
    assert errors.take() == set()


def test_link_config_validates():
    with pytest.raises(InvalidArgumentError, match="name"):
        LinkConfig(name="a/b")
    with pytest.raises(InvalidArgumentError, match="store_url"):
        LinkConfig(name="a", store_url="http://x")
    with pytest.raises(InvalidArgumentError, match="timeout_s"):
        LinkConfig(name="a", timeout_s=0)


def test_tensor_from_ptr_aliases_memory():
    t = torch.arange(16, dtype=torch.uint8)
    view = tensor_from_ptr(t.data_ptr(), 16)
    view[3] = 200
    assert t[3] == 200 and view.dtype == torch.uint8 and view.numel() == 16


def _layers(kind, seed=None, heads=2):
    ts, layout = make_kv_cache(kind, num_layers=3, num_blocks=8, block_size=4, num_heads=heads, head_dim=8)
    fill_random(ts, seed) if seed is not None else poison(ts)
    from xfer.engine.kv_pool import layer_layout
    per = [layer_layout(layout, i) for i in range(3)]
    return ts, layout, [[ts[j] for j in used] for _, used in per], [lay for lay, _ in per]


@pytest.mark.parametrize("op", [Op.WRITE, Op.READ])
def test_two_links_move_layer_by_layer(op):
    src_ts, src_layout, src_t, src_l = _layers(LayoutKind.VLLM_FLASH_ATTN_NHD, seed=1)
    dst_ts, dst_layout, dst_t, dst_l = _layers(LayoutKind.VLLM_FLASH_ATTN_HND)
    with KVLink(LinkConfig("src", enable=("local",))) as a, KVLink(LinkConfig("dst", enable=("local",))) as b:
        a.register_layers(src_t, src_l)
        b.register_layers(dst_t, dst_l)
        mover, other = (a, b) if op is Op.WRITE else (b, a)
        peer = mover.connect(other.agent.metadata())
        local_ids, peer_ids = ([2, 5, 7], [0, 3, 6]) if op is Op.WRITE else ([0, 3, 6], [2, 5, 7])
        group = TransferGroup("req", 3)
        for layer in range(3):
            group.add(layer, mover.post(op, peer, layer, local_ids, peer_ids, note={"k": "req", "l": layer}))
            assert group.wait_layer(layer)
        assert group.poll() is True and group.wait()
        assert_blocks_equal(src_layout, src_ts, [2, 5, 7], dst_layout, dst_ts, [0, 3, 6])
        assert_untouched(dst_layout, dst_ts, [0, 3, 6])
        end = time.monotonic() + 5
        notes = []
        while len(notes) < 3 and time.monotonic() < end:
            notes += other.messages()
            time.sleep(0.005)
        assert sorted(m["l"] for _, _, m in notes) == [0, 1, 2] and all(o is op for _, o, _ in notes)


def test_head_regions_move_part_of_the_heads():
    # source rank holds heads (2, 4) of 4; the destination holds all 4 and receives them in its h2-4 region
    src_ts, src_layout, src_t, src_l = _layers(LayoutKind.VLLM_FLASH_ATTN_NHD, seed=2, heads=2)
    dst_ts, dst_layout, dst_t, dst_l = _layers(LayoutKind.VLLM_FLASH_ATTN_NHD, heads=4)
    with KVLink(LinkConfig("s", enable=("local",))) as a, KVLink(LinkConfig("d", enable=("local",))) as b:
        a.register_layers(src_t, src_l, own_heads=(2, 4))
        b.register_layers(dst_t, dst_l, own_heads=(0, 4))
        assert b.ensure_heads((2, 4)) == region_name(0, (2, 4))
        assert a.ensure_heads((2, 4)) == region_name(0)  # all of a's heads: its full region
        peer = a.connect(b.agent.metadata())
        group = TransferGroup("r", 3)
        for layer in range(3):
            group.add(layer, a.post(Op.WRITE, peer, layer, [1], [4], heads=(2, 4), peer_heads=(0, 4)))
        assert group.wait()
        src_v, dst_v = src_layout.views(src_ts), dst_layout.views(dst_ts)
        for s in range(6):
            assert torch.equal(src_v[s][1].view(torch.uint8), dst_v[s][4][:, 2:4].contiguous().view(torch.uint8))
            assert (dst_v[s][4][:, 0:2].contiguous().view(torch.uint8) == POISON).all()
        with pytest.raises(InvalidArgumentError, match="not inside"):
            a.ensure_heads((0, 2))


def test_group_reports_failure_without_raising():
    src_ts, _, src_t, src_l = _layers(LayoutKind.VLLM_FLASH_ATTN_NHD, seed=3)
    _, _, dst_t, dst_l = _layers(LayoutKind.VLLM_FLASH_ATTN_NHD)
    a, b = KVLink(LinkConfig("fa", enable=("local",))), KVLink(LinkConfig("fb", enable=("local",)))
    try:
        a.register_layers(src_t, src_l)
        b.register_layers(dst_t, dst_l)
        peer = a.connect(b.agent.metadata())
        b.close()  # the peer goes away
        group = TransferGroup("x", 3)
        group.add(0, a.post(Op.WRITE, peer, 0, [0], [0], timeout=2.0))
        assert group.wait() is False and group.errors
        assert group.poll() is False  # the outcome is stable
    finally:
        a.close()
        b.close()


def test_background_runs_calls_off_the_caller_and_close_cancels_the_queue():
    import threading

    from xfer.engine.background import Background

    bg = Background("t", max_workers=2)
    gate = threading.Event()
    stuck = [bg.submit(gate.wait, 5) for _ in range(2)]  # both threads wait on a "frozen peer"
    t0 = time.monotonic()
    queued = bg.submit(lambda x: x * 2, 21)
    assert time.monotonic() - t0 < 0.05 and not queued.done()  # submit never waits
    gate.set()
    assert queued.result(2) == 42 and all(f.result(2) for f in stuck)
    failing = bg.submit(lambda: 1 / 0)
    assert isinstance(failing.exception(2), ZeroDivisionError)
    gate.clear()
    busy = [bg.submit(gate.wait, 5) for _ in range(2)]
    end = time.monotonic() + 2
    while not all(f.running() for f in busy) and time.monotonic() < end:
        time.sleep(0.005)
    pending = bg.submit(int)
    bg.close()
    assert pending.cancelled() and bg.submit(int).exception() is not None
    gate.set()
    assert all(f.result(2) for f in busy)
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("t-"))
