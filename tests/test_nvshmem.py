"""NVSHMEM transport.

CPU: probe reasons, configuration checks, control-message validation, the store-side bootstrap and
teardown agreement, and the whole staged protocol (lanes, credits, deadlines, drains, recovery)
against a CPU stand-in of NVSHMEM (``nvshmem_helpers.FakeFabric``).

GPU (``-m gpu``; skipped without CUDA and nvshmem4py): real PEs in spawned processes: one PE
putting to itself through the full path, two PEs on one GPU (staged and direct paths, write and
read, byte-exact, a deadline expiry, a killed peer), two GPUs where there are several.
"""

import importlib.util
import threading
import time

import pytest
import torch

from helpers import assert_blocks_equal, assert_untouched, fill_random, poison, small_dims
import nvshmem_helpers
from nvshmem_helpers import FakeFabric, PeProcess, close_group
from xfer import Agent, AgentConfig, LayoutKind, TransferState, TransportKind, make_kv_cache
from xfer.config import NvshmemGroup
from xfer.errors import (FenceTimeoutError, InvalidArgumentError, LayoutMismatchError, NotRegisteredError,
                         TransferCancelledError, TransferTimeoutError, TransportError, TransportUnavailableError)
from xfer.store import open_store
from xfer.transports.nvshmem import bootstrap as bootstrap
from xfer.transports.nvshmem import lanes as nvshmem_lanes
from xfer.transports.nvshmem import runtime as nvshmem_runtime
from xfer.transports.nvshmem.signals import SelfSignals
from xfer.transports.nvshmem import proto as proto
from xfer.transports.base import TransportContext
from xfer.transports.nvshmem import NvshmemTransport
from xfer.transports.nvshmem.transport import check_group

NHD, HND = LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.VLLM_FLASH_ATTN_HND


def group(rank=0, size=2, **kw):
    return NvshmemGroup(store="tcp://127.0.0.1:1", name="g", rank=rank, size=size, staging_bytes=1 << 20, **kw)


# ---- probe, configuration ------------------------------------------------------------------------
def test_probe_names_every_missing_piece(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = NvshmemTransport.probe()
    assert reason.startswith("nvshmem: needs nvshmem4py") and "CUDA device" in reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "CUDA" not in NvshmemTransport.probe()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report on machines without a GPU")
def test_agent_reports_nvshmem_unavailable_with_the_reason():
    with Agent("x") as a:
        assert a.unavailable[TransportKind.NVSHMEM].startswith("nvshmem: needs")


def test_no_group_configured_is_unavailable(monkeypatch):
    import logging
    ctx = TransportContext(agent_name="a", agent_id="1", host_id="h", config=AgentConfig(), log=logging.getLogger())
    with pytest.raises(TransportUnavailableError, match="no NvshmemGroup configured"):
        NvshmemTransport(ctx)
    FakeFabric().install(monkeypatch)  # probe passes: the agent records the constructor's reason
    with Agent("x") as a:
        assert a.unavailable[TransportKind.NVSHMEM] == "nvshmem: no NvshmemGroup configured (AgentConfig.nvshmem is None)"


@pytest.mark.parametrize("field, value, match", [
    ("name", "a/b", "without '/'"), ("name", "", "non-empty"), ("store", "localhost:5", "URL"),
    ("device", -1, "CUDA index"), ("init_timeout_s", float("inf"), "init_timeout_s"),
])
def test_group_checks(field, value, match):
    kw = dict(store="tcp://127.0.0.1:1", name="g", rank=0, size=1)
    kw[field] = value
    with pytest.raises(InvalidArgumentError, match=match):
        check_group(NvshmemGroup(**kw))


def test_one_group_per_process(monkeypatch):
    class Dummy:
        outcome = "finalized: all PEs arrived"

        def __init__(self, group, host_id):
            self.group, self.teardown = group, "open"

        def close(self):
            self.teardown = Dummy.outcome

    monkeypatch.setattr(nvshmem_runtime, "Runtime", Dummy)
    monkeypatch.setattr(nvshmem_runtime, "_current", None)
    monkeypatch.setattr(nvshmem_runtime, "_spoiled", None)
    a = nvshmem_runtime.acquire(group(0), "h")
    assert nvshmem_runtime.acquire(group(0), "h") is a  # a second agent of the same PE shares it
    with pytest.raises(TransportUnavailableError, match="already is PE 0 of NVSHMEM group 'g'"):
        nvshmem_runtime.acquire(group(1), "h")
    nvshmem_runtime.release(a)
    assert a.teardown == "open"
    nvshmem_runtime.release(a)
    assert a.teardown.startswith("finalized") and nvshmem_runtime._current is None
    Dummy.outcome = "skipped: only 1 of 2 PEs arrived"  # NVSHMEM left initialised: no second setup
    nvshmem_runtime.release(nvshmem_runtime.acquire(group(0), "h"))
    with pytest.raises(TransportUnavailableError, match="cannot be set up again .* not finalized"):
        nvshmem_runtime.acquire(group(0), "h")


# ---- plan and messages ------------------------------------------------------------------------------
def test_staging_plan_offsets_do_not_overlap():
    p = proto.StagingPlan(size=3, staging_bytes=1 << 20)
    assert p.slot_bytes == 1 << 19 and p.chunk_cap == (1 << 19) // proto.DEPTH and p.area_bytes == 6 * p.slot_bytes
    starts = sorted(p.position(peer, role, seq) for peer in range(3) for role in (0, 1) for seq in range(proto.DEPTH))
    assert starts == [i * p.chunk_cap for i in range(6 * proto.DEPTH)]
    assert p.position(2, 1, 7) == p.position(2, 1, 7 + proto.DEPTH)


def test_chunk_plan():
    plan = proto.plan_chunks(10, bytes_per_block=100, chunk_cap=1000, chunk_bytes=350)
    assert (plan.per, plan.chunks, plan.bounds(3)) == (3, 4, (9, 10))
    with pytest.raises(InvalidArgumentError, match="raise NvshmemGroup.staging_bytes"):
        proto.plan_chunks(1, bytes_per_block=2000, chunk_cap=1000, chunk_bytes=10_000)


class _Region:
    def __init__(self, name, layout, device="cpu"):
        self.name, self.layout, self.device = name, layout, torch.device(device)


def _begin(sender_layout, **over):
    h = {"type": "nvshmem.begin", "from": "p", "group": "g", "session": "s", "pe": 1, "pid": 1, "host_id": "h",
         "transfer_id": "t1", "region": "kv", "blocks": [3, 1], "layout": sender_layout.to_dict(), "per_chunk": 1,
         "seq0": 5, "chunks": 2, "timeout": 3.0, "dead_upto": 0}
    h.update(over)
    return h


def test_begin_validation():
    _, layout = make_kv_cache(NHD, device="meta", **small_dims(NHD))
    _, hnd = make_kv_cache(HND, device="meta", **small_dims(HND))
    _, other = make_kv_cache(NHD, device="meta", **small_dims(NHD, layers=2))
    lookup = {"kv": _Region("kv", hnd)}.get
    cap = 1 << 20
    begin, region = proto.parse_begin(_begin(layout), pe=1, region_lookup=lookup, chunk_cap=cap)
    assert begin.ids.tolist() == [3, 1] and begin.plan.chunks == 2 and begin.sender_layout == layout
    assert proto.parse_member(_begin(layout), group="g", session="s", size=2) == 1
    cases = [
        (dict(region="nope"), NotRegisteredError, "no region 'nope'"),
        (dict(sender_layout=other), LayoutMismatchError, "num_layers"),
        (dict(layout={"x": 1}), InvalidArgumentError, "malformed"),
        (dict(blocks=[1, 1], chunks=2), InvalidArgumentError, "repeat id 1"),
        (dict(blocks=[99]), InvalidArgumentError, "contain id 99"),
        (dict(chunks=3), InvalidArgumentError, "make 2 chunks, the message says 3"),
        (dict(per_chunk=10 ** 6), InvalidArgumentError, "exceed this PE's staging chunk"),
        (dict(seq0=0), InvalidArgumentError, "seq0 must be >= 1"),
        (dict(timeout=-1), InvalidArgumentError, "timeout"),
        (dict(timeout=float("nan")), InvalidArgumentError, "timeout: ttl must be a finite number"),
        (dict(timeout=float("inf")), InvalidArgumentError, "timeout: ttl must be a finite number"),
        (dict(dead_upto="x"), InvalidArgumentError, "dead_upto"),
    ]
    for over, exc, match in cases:
        sender = over.pop("sender_layout", layout)
        with pytest.raises(exc, match=match):
            proto.parse_begin(_begin(sender, **over), pe=1, region_lookup=lookup, chunk_cap=cap)
    for over, match in [(dict(group="h"), "group 'h'"), (dict(session="old"), "session 'old'"), (dict(pe=2), "PE 2")]:
        with pytest.raises(InvalidArgumentError, match=match):
            proto.parse_member(_begin(layout, **over), group="g", session="s", size=2)


def test_read_and_abort_validation():
    _, layout = make_kv_cache(NHD, device="meta", **small_dims(NHD))
    lookup = {"kv": _Region("kv", layout)}.get
    h = {"type": "nvshmem.read", "from": "d", "group": "g", "session": "s", "pe": 0, "pid": 1, "host_id": "h",
         "transfer_id": "t", "region": "kv", "blocks": [2, 2, 5], "fingerprint": layout.fingerprint_hash(),
         "per_chunk": 2, "seq0": 1, "chunks": 2, "timeout": 1.0, "dead_upto": 0}
    req, _ = proto.parse_read(h, pe=0, region_lookup=lookup, chunk_cap=1 << 20)
    assert req.ids.tolist() == [2, 2, 5]  # a READ's source ids may repeat
    with pytest.raises(LayoutMismatchError, match="fingerprint"):
        proto.parse_read({**h, "fingerprint": "0" * 16}, pe=0, region_lookup=lookup, chunk_cap=1 << 20)
    assert proto.parse_abort({"role": "read", "upto": 9}) == (proto.ROLE_READ, 9)
    with pytest.raises(InvalidArgumentError, match="role"):
        proto.parse_abort({"role": "x", "upto": 1})


# ---- store-side bootstrap and teardown --------------------------------------------------------------
@pytest.fixture
def store():
    s = open_store("tcp://127.0.0.1:0")
    yield s
    s.close()


def test_uid_exchange_through_the_store(store):
    g0 = NvshmemGroup(store=store.endpoint, name="job1", rank=0, size=2, staging_bytes=1 << 20)
    g1 = NvshmemGroup(store=store.endpoint, name="job1", rank=1, size=2, staging_bytes=1 << 20)
    uid = bytes(range(128))
    got = []

    def rank1():
        session = bootstrap.fetch_session(store, g1, 10)
        got.append((session, bootstrap.fetch_uid(store, g1, session, 10)))
    t = threading.Thread(target=rank1)
    t.start()
    time.sleep(0.2)
    session = bootstrap.publish_session(store, g0)
    time.sleep(0.1)  # rank 1 has the session and waits for the id (rank 0 makes it after the GPU exchange)
    bootstrap.publish_uid(store, g0, session, uid)
    t.join(10)
    assert got == [(session, uid)]
    bad = NvshmemGroup(store=store.endpoint, name="job1", rank=1, size=3, staging_bytes=1 << 20)
    with pytest.raises(TransportUnavailableError, match="rank 0 has size 2, rank 1 was configured with size 3"):
        bootstrap.fetch_session(store, bad, 1)
    bad = NvshmemGroup(store=store.endpoint, name="job1", rank=1, size=2, staging_bytes=2 << 20)
    with pytest.raises(TransportUnavailableError, match="staging_bytes"):
        bootstrap.fetch_session(store, bad, 1)
    bootstrap.forget(store, g0, session)  # once the group formed: a later rank 1 waits for a new session
    with pytest.raises(TransportUnavailableError, match="did not publish the session .* within 0.2 s"):
        bootstrap.fetch_session(store, g1, 0.2)
    with pytest.raises(TransportUnavailableError, match="did not publish the unique id .* within 0.2 s"):
        bootstrap.fetch_uid(store, g1, session, 0.2)
    store.set("nvshmem/job3/uid", b"[1, 2]")
    with pytest.raises(TransportUnavailableError, match="malformed session record"):
        bootstrap.fetch_session(store, NvshmemGroup(store=store.endpoint, name="job3", rank=1, size=2), 1)
    store.set("nvshmem/job3/s1/uid", b"not base64!")
    with pytest.raises(TransportUnavailableError, match="malformed unique id"):
        bootstrap.fetch_uid(store, NvshmemGroup(store=store.endpoint, name="job3", rank=1, size=2), "s1", 1)


def test_gpu_exchange_decides_the_heap_the_same_on_every_pe(store):
    """Before init every PE says which GPU it uses; PEs sharing one get the static heap (NVSHMEM
    3.4's growing heap left a peer chunk unmapped there), unless the user chose."""
    gpus = [("h1", "GPU-a"), ("h1", "GPU-a"), ("h1", "GPU-b"), ("h2", "GPU-a")]
    out = [None] * 4

    def run(rank):
        g = NvshmemGroup(store=store.endpoint, name="gx", rank=rank, size=4)
        out[rank] = bootstrap.exchange_gpus(store, g, "s9", *gpus[rank], timeout=10)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    [t.start() for t in threads]
    [t.join(15) for t in threads]
    assert out == [dict(enumerate(gpus))] * 4
    bootstrap.forget(store, NvshmemGroup(store=store.endpoint, name="gx", rank=0, size=4), "s9")
    assert all(store.try_get(f"nvshmem/gx/s9/gpu/{r}") is None for r in range(4))  # nothing left behind
    shared = bootstrap.shared_gpus(out[0])
    assert shared == [[0, 1]]  # same uuid on another host is another GPU
    assert bootstrap.shared_gpus({0: ("h", "a"), 1: ("h", "b")}) == []
    setting, why = bootstrap.heap_choice(shared, {})
    assert setting == "1" and "static" in why and "ranks 0, 1" in why
    assert bootstrap.heap_choice([], {}) == (None, "NVSHMEM's default heap")
    setting, why = bootstrap.heap_choice(shared, {"NVSHMEM_DISABLE_CUDA_VMM": "0"})
    assert setting is None and "set by the user" in why and "unmapped" in why
    # a PE that never says: the others stop by the timeout, naming it
    g = NvshmemGroup(store=store.endpoint, name="gy", rank=0, size=2)
    start = time.monotonic()
    with pytest.raises(TransportUnavailableError, match="rank 1 did not say which GPU it uses within 0.3 s"):
        bootstrap.exchange_gpus(store, g, "s9", "h", "a", timeout=0.3)
    assert time.monotonic() - start < 3
    store.set("nvshmem/gz/s9/gpu/1", b"{not json")
    g = NvshmemGroup(store=store.endpoint, name="gz", rank=0, size=2)
    with pytest.raises(TransportUnavailableError, match="malformed GPU record of rank 1"):
        bootstrap.exchange_gpus(store, g, "s9", "h", "a", timeout=2)


def _agree(store, g, votes, timeout, delays=None):
    out = [None] * len(votes)

    def run(i):
        time.sleep((delays or [0] * len(votes))[i])
        out[i] = bootstrap.agree_to_finalize(store, g, "s1", vote=votes[i], timeout=timeout, poll=0.005)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(votes))]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    return out


def test_teardown_agreement(store):
    g = NvshmemGroup(store=store.endpoint, name="a", rank=0, size=3)
    assert all(go for go, _ in _agree(store, g, [True] * 3, timeout=5))
    # one PE never comes: every present PE aborts, within the timeout
    g = NvshmemGroup(store=store.endpoint, name="b", rank=0, size=3)
    start = time.monotonic()
    res = _agree(store, g, [True, True], timeout=0.5)
    assert [go for go, _ in res] == [False, False] and "only 2 of 3" in " ".join(w for _, w in res)
    assert time.monotonic() - start < 5
    # a PE that arrives after the verdict follows it
    assert bootstrap.agree_to_finalize(store, g, "s1", vote=True, timeout=5)[0] is False
    # a PE that cannot tear down settles abort at once for everyone
    g = NvshmemGroup(store=store.endpoint, name="c", rank=0, size=2)
    start = time.monotonic()
    res = _agree(store, g, [True, False], timeout=10, delays=[0.3, 0])
    assert [go for go, _ in res] == [False, False] and time.monotonic() - start < 5


# ---- the staged protocol on the CPU stand-in ----------------------------------------------------------
def pair(monkeypatch, kinds=(NHD, HND), *, chunk_bytes=None, dims=None, symmetric=False, size=2):
    """Two agents on fake PEs 0 and 1; prefill's KV random, decode's poisoned."""
    fabric = FakeFabric().install(monkeypatch)
    agents, caches = [], []
    for rank, (name, kind) in enumerate(zip(("prefill", "decode"), kinds, strict=True)):
        d = dims or small_dims(kind, blocks=16)
        bpb = make_kv_cache(kind, device="meta", **d)[1].bytes_per_block
        cfg = AgentConfig(transport="nvshmem", nvshmem=group(rank, size), chunk_bytes=chunk_bytes or bpb)
        a = Agent(name, cfg)
        assert TransportKind.NVSHMEM in a.transports, a.unavailable
        empty = a.transports[TransportKind.NVSHMEM].symmetric_empty if symmetric else torch.empty
        tensors, layout = make_kv_cache(kind, empty=empty, **d)
        (fill_random(tensors, seed=rank + 1) if rank == 0 else poison(tensors))
        a.register("kv", tensors, layout)
        agents.append(a)
        caches.append((tensors, layout))
    agents[0].connect(agents[1].metadata())
    agents[1].connect(agents[0].metadata())
    return fabric, agents, caches


def close_all(agents):
    for a in agents:
        a.close()


def test_write_and_read_byte_exact_across_physical_orders(monkeypatch):
    fabric, (p, d), ((pt, pl), (dt, dl)) = pair(monkeypatch)  # one block per chunk: 16 chunks > DEPTH, AHEAD
    try:
        assert p.route("decode").kind is TransportKind.NVSHMEM
        src, dst = list(range(15, -1, -1)), [(3 * i) % 16 for i in range(16)][:12] + [1, 4, 7, 10]
        src, dst = src[:12], dst[:12]
        t = p.write("decode", src, dst, notify=b"req-1", timeout=20)
        t.wait()
        n = d.wait_notification(5)
        assert (n.peer, n.op.value, n.blocks.tolist(), n.payload) == ("prefill", "write", dst, b"req-1")
        assert_blocks_equal(pl, pt, src, dl, dt, dst)
        assert_untouched(dl, dt, dst)
        # read back into poisoned prefill blocks (repeated source ids allowed)
        poison(pt)
        d_src, p_dst = [dst[0], dst[0], dst[5]], [2, 9, 14]
        p.read("decode", d_src, p_dst, notify=b"pull", timeout=20).wait()
        n = d.wait_notification(5)
        assert (n.peer, n.op.value, n.blocks.tolist(), n.payload) == ("prefill", "read", d_src, b"pull")
        assert_blocks_equal(dl, dt, d_src, pl, pt, p_dst)
        assert_untouched(pl, pt, p_dst)
        assert p.transports[TransportKind.NVSHMEM].stats == {"staged_write": 1, "staged_read": 1}
        assert d.transports[TransportKind.NVSHMEM].stats == {"received_write": 1, "served_read": 1}
        # each item had its chunks' copy kernel run once before its first wait (one block a chunk)
        assert fabric.pes[0].preloaded == [("gather", 1), ("scatter", 1)]
        assert fabric.pes[1].preloaded == [("scatter", 1), ("gather", 1)]
    finally:
        close_all([p, d])


def test_concurrent_transfers_both_ways(monkeypatch):
    fabric, (p, d), ((pt, pl), (dt, dl)) = pair(monkeypatch, kinds=(NHD, NHD), chunk_bytes=1)
    try:
        fill_random(dt, seed=9)  # decode's blocks 8..15 travel to prefill (read by prefill, written by decode)
        errors = []

        def run(fn):
            try:
                fn()
            except Exception as exc:  # asserted below
                errors.append(exc)
        jobs = [lambda i=i: p.write("decode", [i], [i], timeout=20).wait() for i in range(8)]
        jobs += [lambda i=i: p.read("decode", [8 + i], [8 + i], timeout=20).wait() for i in range(4)]
        jobs += [lambda i=i: d.write("prefill", [12 + i], [12 + i], timeout=20).wait() for i in range(4)]
        threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        assert not errors, errors
        assert_blocks_equal(pl, pt, range(8), dl, dt, range(8))
        assert_blocks_equal(dl, dt, range(8, 16), pl, pt, range(8, 16))
    finally:
        close_all([p, d])


def test_deadline_expiry_discards_then_the_lane_recovers(monkeypatch):
    fabric, (p, d), ((pt, pl), (dt, dl)) = pair(monkeypatch)
    try:
        fabric.pes[1].pause()  # decode's GPU is stuck: nothing is scattered, no credit comes back
        t = p.write("decode", list(range(12)), list(range(12)), timeout=0.5)
        with pytest.raises(TransferTimeoutError):
            t.wait()
        assert t.poll() is TransferState.TIMED_OUT
        time.sleep(1.0)
        fabric.pes[1].resume()  # decode drains within DRAIN_TIMEOUT_S
        with pytest.raises(TransferTimeoutError):
            d.wait_notification(1.0)  # the expired write is never delivered
        poison(dt)
        p.write("decode", [5, 6, 7], [0, 1, 2], notify=b"after", timeout=10).wait()
        n = d.wait_notification(5)
        assert (n.blocks.tolist(), n.payload) == ([0, 1, 2], b"after")
        assert_blocks_equal(pl, pt, [5, 6, 7], dl, dt, [0, 1, 2])
        assert_untouched(dl, dt, [0, 1, 2])
        # the same for a read whose holder is stuck
        fabric.pes[1].pause()
        t = p.read("decode", [0, 1, 2], [3, 4, 5], timeout=0.5)
        with pytest.raises(TransferTimeoutError):
            t.wait()
        time.sleep(0.5)
        fabric.pes[1].resume()
        poison(pt)
        p.read("decode", [0, 1, 2], [9, 10, 11], timeout=10).wait()
        assert_blocks_equal(dl, dt, [0, 1, 2], pl, pt, [9, 10, 11])
        assert_untouched(pl, pt, [9, 10, 11])
    finally:
        close_all([p, d])


def test_cancel_and_a_lane_that_cannot_drain(monkeypatch):
    monkeypatch.setattr(nvshmem_lanes, "DRAIN_TIMEOUT_S", 0.5)
    fabric, (p, d), ((pt, pl), (dt, dl)) = pair(monkeypatch)
    try:
        fabric.pes[1].pause()
        t = p.write("decode", list(range(12)), list(range(12)), timeout=1.0)
        time.sleep(0.3)
        assert t.cancel()
        # the write's own lane drains (its sender side), but the stop is fenced only once it did:
        # CANCELLED; a lane that cannot drain fences nothing (the transfer would stay STOPPING)
        with pytest.raises((TransferCancelledError, FenceTimeoutError)):
            t.wait()
        assert t.poll() in (TransferState.CANCELLED, TransferState.STOPPING)
        time.sleep(1.5)  # decode's receive lane cannot drain while its GPU stays stuck: broken
        t = p.write("decode", [1], [1], timeout=5)
        with pytest.raises(TransportError, match="is broken: its stream did not drain"):
            t.wait()
        assert "broken" in (d.transports[TransportKind.NVSHMEM].rt.lanes.broken(0) or "")
    finally:
        fabric.pes[1].resume()
        close_all([p, d])


def test_receiver_refusals_reach_the_sender_typed(monkeypatch):
    fabric, (p, d), _ = pair(monkeypatch)
    try:
        d.deregister("kv")
        with pytest.raises(NotRegisteredError, match="no region 'kv'"):
            p.write("decode", [0], [0], timeout=5).wait()
        with pytest.raises(NotRegisteredError, match="no region 'kv'"):
            p.read("decode", [0], [0], timeout=5).wait()
    finally:
        close_all([p, d])


def test_stale_sequence_numbers_are_refused(monkeypatch):
    fabric, (p, d), _ = pair(monkeypatch)
    try:
        p.write("decode", [0], [0], timeout=5).wait()
        lane = fabric.pes[1].lanes.recv(0, proto.ROLE_WRITE)
        with pytest.raises(TransportError, match="not after the last admitted"):
            lane.admit(object(), 1, 1)
    finally:
        close_all([p, d])


def test_direct_path_between_symmetric_pools(monkeypatch):
    fabric, (p, d), ((pt, pl), (dt, dl)) = pair(monkeypatch, kinds=(NHD, NHD), symmetric=True)
    try:
        p.write("decode", [4, 2], [0, 9], notify=b"direct", timeout=10).wait()
        assert d.wait_notification(5).payload == b"direct"
        assert_blocks_equal(pl, pt, [4, 2], dl, dt, [0, 9])
        assert_untouched(dl, dt, [0, 9])
        poison(pt)
        p.read("decode", [0], [3], timeout=10).wait()
        assert_blocks_equal(dl, dt, [0], pl, pt, [3])
        assert p.transports[TransportKind.NVSHMEM].stats == {"direct_write": 1, "direct_read": 1}
    finally:
        close_all([p, d])


def test_empty_transfer_notifies(monkeypatch):
    fabric, (p, d), _ = pair(monkeypatch)
    try:
        p.write("decode", [], [], notify=b"nothing", timeout=5).wait()
        n = d.wait_notification(5)
        assert n.blocks.size == 0 and n.payload == b"nothing"
    finally:
        close_all([p, d])


def test_self_put_two_agents_one_pe(monkeypatch):
    """Two agents of one process share PE 0; a write between them is a put to the PE itself."""
    fabric = FakeFabric().install(monkeypatch)
    dims = small_dims(NHD, blocks=8)
    agents, caches = [], []
    for name, seed in (("a", 1), ("b", None)):
        a = Agent(name, AgentConfig(transport="nvshmem", nvshmem=group(0, 1), chunk_bytes=1))
        tensors, layout = make_kv_cache(NHD, **dims)
        fill_random(tensors, 3) if seed else poison(tensors)
        a.register("kv", tensors, layout)
        agents.append(a)
        caches.append((tensors, layout))
    try:
        a, b = agents
        a.connect(b.metadata())
        a.write("b", [1, 2, 3], [7, 6, 5], timeout=10).wait()
        assert b.wait_notification(5).blocks.tolist() == [7, 6, 5]
        (at, al), (bt, bl) = caches
        assert_blocks_equal(al, at, [1, 2, 3], bl, bt, [7, 6, 5])
        assert_untouched(bl, bt, [7, 6, 5])
        assert len(fabric.pes) == 1
    finally:
        close_all(agents)


# ---- GPU: real NVSHMEM PEs in spawned processes --------------------------------------------------------
gpu = pytest.mark.gpu
needs_nvshmem = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("nvshmem") is None,
                                   reason="needs a CUDA GPU and nvshmem4py")
GPU_DIMS = dict(num_layers=4, num_blocks=32, block_size=16, num_heads=4, head_dim=64)  # 8 KiB slices, 64 KiB a block
GPU_CONFIG = dict(chunk_bytes=128 << 10)  # 2 blocks a chunk: 16 chunks for 32 blocks (> DEPTH, AHEAD)


def device_sets():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return [(0, 0)] + ([(0, 1)] if n > 1 else [])


def start_group(store, name, devices, config_kw=GPU_CONFIG, **group_kw):
    """One PE process per entry of ``devices`` (a CUDA index each), initialised together."""
    size = len(devices)
    pes = [PeProcess(f"pe{r}", dict(store=store.endpoint, name=name, rank=r, size=size, device=dev,
                                    staging_bytes=8 << 20, init_timeout_s=60.0, **group_kw), config_kw)
           for r, dev in enumerate(devices)]
    try:
        collective(pes, "init", timeout=90)
    except BaseException:
        for pe in pes:
            pe.kill()
        raise
    return pes


def collective(pes, cmd, args=None, timeout=180):
    """Send ``cmd`` to every PE before waiting for any (NVSHMEM collectives need all of them); every
    reply is read before the first failure is raised, so later commands get their own replies."""
    for i, pe in enumerate(pes):
        pe.send(cmd, (args or [None] * len(pes))[i], limit=timeout - 10)
    out, errors = [], []
    for pe in pes:
        try:
            out.append(pe.reply(cmd, timeout=timeout))
        except AssertionError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    if cmd == "init":
        print("NVSHMEM: " + "; ".join(f"PE {i['pe']}/{i['size']} on {i['device']}, {i['status']}" for i in out))
    return out


def fetch(pe, region, layout, agent=None):
    return [torch.from_numpy(b).view(layout.dtype) for b in pe.call("bytes", {"region": region,
                                                                              **({"agent": agent} if agent else {})})]


def transfer(pe, op, peer, src, dst, **kw):
    res = pe.call("transfer", {"op": op, "peer": peer, "src": list(src), "dst": list(dst), **kw})
    if res["state"] != "DONE":  # printed now: a later hang (closing a stuck lane) would lose the report
        print(f"{pe.name}: {op} -> {res['state']}: " + "\n".join(f"  {k}: {v}" for k, v in res.items()), flush=True)
    return res


def connect(a, b, a_agent=None, b_agent=None):
    md = b.call("metadata", {"agent": b_agent} if b_agent else None)
    return a.call("connect", {"metadata": md, **({"agent": a_agent} if a_agent else {})})


def one_pe_self_put():
    """Group of size 1; two agents of the process share PE 0, so a write between them puts to the PE itself."""
    with open_store("tcp://127.0.0.1:0") as store:
        (pe,) = start_group(store, "solo", [0])
        try:
            pe.call("init", {"agent": "b"})
            layout = make_kv_cache(NHD, device="meta", **GPU_DIMS)[1]
            pe.call("region", {"region": "kv", "kind": NHD.value, "dims": GPU_DIMS, "memory": "torch", "seed": 11})
            pe.call("region", {"agent": "b", "region": "kv", "kind": NHD.value, "dims": GPU_DIMS, "memory": "torch"})
            connect(pe, pe, b_agent="b")
            src, dst = list(range(31, 1, -1)), list(range(30))
            res = transfer(pe, "write", "b", src, dst, notify=b"self", timeout=10)
            assert res["state"] == "DONE", res
            assert pe.call("wait_notification", {"agent": "b", "timeout": 10})[3] == dst
            mine, theirs = fetch(pe, "kv", layout), fetch(pe, "kv", layout, agent="b")
            assert_blocks_equal(layout, mine, src, layout, theirs, dst)
            assert_untouched(layout, theirs, dst)
            pe.call("poison", {"region": "kv"})
            res = transfer(pe, "read", "b", [0, 1, 2], [7, 8, 9], timeout=30)
            assert res["state"] == "DONE", res
            mine = fetch(pe, "kv", layout)
            assert_blocks_equal(layout, theirs, [0, 1, 2], layout, mine, [7, 8, 9])
            assert_untouched(layout, mine, [7, 8, 9])
            assert pe.call("stats") == {"staged_write": 1, "staged_read": 1}
            closed = pe.call("close")
            assert [t.split(":")[0] for t in closed["teardown"]] == ["finalized"], closed
        finally:
            pe.close()


def test_pe_process_harness_on_the_fake(monkeypatch):
    """The GPU tests' process harness, run once on the CPU stand-in (one PE, so one process)."""
    monkeypatch.setenv("XFER_TEST_FAKE_NVSHMEM", "1")
    one_pe_self_put()


@gpu
@needs_nvshmem
def test_gpu_one_pe_puts_to_itself():
    one_pe_self_put()


@gpu
@needs_nvshmem
@pytest.mark.parametrize("devices", device_sets(), ids=lambda d: f"cuda{d[0]}-cuda{d[1]}")
def test_gpu_two_pes_staged_write_and_read(devices):
    """Two PEs (processes), on one GPU or two: put-with-signal pipeline, NHD source into an HND cache."""
    with open_store("tcp://127.0.0.1:0") as store:
        p, d = start_group(store, f"staged-{devices[1]}", list(devices))
        try:
            layout_p = make_kv_cache(NHD, device="meta", **GPU_DIMS)[1]
            layout_d = make_kv_cache(HND, device="meta", **GPU_DIMS)[1]
            p.call("region", {"region": "kv", "kind": NHD.value, "dims": GPU_DIMS, "memory": "torch", "seed": 5})
            d.call("region", {"region": "kv", "kind": HND.value, "dims": GPU_DIMS, "memory": "torch"})
            connect(p, d)
            connect(d, p)
            src, dst = list(range(0, 32, 2)) + list(range(1, 32, 2))[:10], list(range(31, 5, -1))
            res = transfer(p, "write", "pe1", src, dst, notify=b"w", timeout=30)
            assert res["state"] == "DONE", res
            note = d.call("wait_notification", {"timeout": 10})
            assert (note[0], note[2], note[3], note[4]) == ("pe0", "write", dst, b"w")
            assert_blocks_equal(layout_p, fetch(p, "kv", layout_p), src, layout_d, fetch(d, "kv", layout_d), dst)
            assert_untouched(layout_d, fetch(d, "kv", layout_d), dst)
            p.call("poison", {"region": "kv"})
            res = transfer(p, "read", "pe1", [6, 6, 31], [0, 1, 2], notify=b"r", timeout=30)
            assert res["state"] == "DONE", res
            assert d.call("wait_notification", {"timeout": 10})[2:] == ("read", [6, 6, 31], b"r")
            mine = fetch(p, "kv", layout_p)
            assert_blocks_equal(layout_d, fetch(d, "kv", layout_d), [6, 6, 31], layout_p, mine, [0, 1, 2])
            assert_untouched(layout_p, mine, [0, 1, 2])
            # the decode side writes back too (its own lanes), then many small transfers back to back
            res = transfer(d, "write", "pe0", [6], [20], timeout=30)
            assert res["state"] == "DONE", res
            for i in range(20):
                res = transfer(p, "write", "pe1", [i], [i], timeout=30)
                assert res["state"] == "DONE", (i, res)
            assert p.call("stats") == {"staged_write": 21, "staged_read": 1, "received_write": 1}
            closed = close_group([p, d])
            assert all(c["teardown"][0].startswith("finalized") for c in closed), closed
        finally:
            close_group([p, d])


@gpu
@needs_nvshmem
@pytest.mark.parametrize("devices", device_sets(), ids=lambda d: f"cuda{d[0]}-cuda{d[1]}")
def test_gpu_two_pes_direct_between_symmetric_pools(devices):
    """KV pools on the symmetric heap (collective allocation): copy_blocks straight into the peer."""
    with open_store("tcp://127.0.0.1:0") as store:
        p, d = start_group(store, f"direct-{devices[1]}", list(devices))
        try:
            layout = make_kv_cache(NHD, device="meta", **GPU_DIMS)[1]
            args = [{"region": "kv", "kind": NHD.value, "dims": GPU_DIMS, "memory": "symmetric", "seed": 9},
                    {"region": "kv", "kind": NHD.value, "dims": GPU_DIMS, "memory": "symmetric"}]
            assert collective([p, d], "region", args) == [{"symmetric": True}] * 2
            connect(p, d)
            res = transfer(p, "write", "pe1", [3, 4, 5], [10, 0, 31], notify=b"direct", timeout=30)
            assert res["state"] == "DONE", res
            assert d.call("wait_notification", {"timeout": 10})[4] == b"direct"
            theirs = fetch(d, "kv", layout)
            assert_blocks_equal(layout, fetch(p, "kv", layout), [3, 4, 5], layout, theirs, [10, 0, 31])
            assert_untouched(layout, theirs, [10, 0, 31])
            connect(d, p)  # a write under a grant the target issued ahead (xfer.ahead): no grant asked
            token = d.call("grant", {"peer": "pe0", "blocks": [20, 21]})
            res = transfer(p, "write", "pe1", [6, 7], [20, 21], timeout=30, grant=token)
            assert res["state"] == "DONE", res
            theirs = fetch(d, "kv", layout)
            assert_blocks_equal(layout, fetch(p, "kv", layout), [3, 4, 5, 6, 7], layout, theirs, [10, 0, 31, 20, 21])
            assert_untouched(layout, theirs, [10, 0, 31, 20, 21])
            p.call("poison", {"region": "kv"})
            res = transfer(p, "read", "pe1", [10], [1], timeout=30)
            assert res["state"] == "DONE", res
            assert_blocks_equal(layout, theirs, [10], layout, fetch(p, "kv", layout), [1])
            assert p.call("stats") == {"direct_write": 2, "direct_read": 1}
            closed = close_group([p, d])
            assert all(c["teardown"][0].startswith("finalized") for c in closed), closed
        finally:
            close_group([p, d])


@gpu
@needs_nvshmem
def test_gpu_deadline_expiry_then_exact_transfers():
    """Transfers given deadlines too short to finish end TIMED_OUT (or DONE), never deliver unlanded
    bytes, and the lanes stay usable: the next transfers are byte-exact."""
    with open_store("tcp://127.0.0.1:0") as store:
        p, d = start_group(store, "expiry", [0, 0])
        try:
            layout = make_kv_cache(NHD, device="meta", **GPU_DIMS)[1]
            p.call("region", {"region": "kv", "kind": NHD.value, "dims": GPU_DIMS, "memory": "torch", "seed": 4})
            d.call("region", {"region": "kv", "kind": NHD.value, "dims": GPU_DIMS, "memory": "torch"})
            connect(p, d)
            states = []
            for timeout in (1e-4, 3e-4, 1e-3, 3e-3, 1e-2):
                res = transfer(p, "write", "pe1", range(32), range(32), timeout=timeout)
                assert res["state"] in ("TIMED_OUT", "DONE"), res
                states.append(res["state"])
                res = transfer(p, "read", "pe1", range(16), range(16, 32), timeout=timeout)
                assert res["state"] in ("TIMED_OUT", "DONE"), res
                states.append(res["state"])
            print(f"short deadlines ended: {states}")
            assert "TIMED_OUT" in states
            time.sleep(2)  # let both sides finish draining
            d.call("notifications")
            # synchronizes the decode PE's device: a lane stream still blocked on a signal wait would
            # hang it; the short limit makes that PE print its threads' stacks before the test's timeout
            d.call("poison", {"region": "kv"}, timeout=30)
            src, dst = list(range(8, 24)), list(range(16))
            res = transfer(p, "write", "pe1", src, dst, notify=b"ok", timeout=30)
            assert res["state"] == "DONE", res
            note = d.call("wait_notification", {"timeout": 10})
            assert (note[3], note[4]) == (dst, b"ok")
            theirs = fetch(d, "kv", layout)
            assert_blocks_equal(layout, fetch(p, "kv", layout), src, layout, theirs, dst)
            assert_untouched(layout, theirs, dst)
        finally:
            close_group([p, d])


@gpu
@needs_nvshmem
def test_gpu_a_stopped_transfer_lands_nothing_after_it_ended():
    """Issue 29's fence on NVSHMEM: READs and WRITEs whose deadline expires mid-flight end TIMED_OUT
    only once their lane drained; the destination then does not change for 2 s (a READ's own blocks;
    a WRITE's blocks on the peer), and the peer is notified of none of them."""
    with open_store("tcp://127.0.0.1:0") as store:
        p, d = start_group(store, "fence", [0, 0])
        try:
            layout = make_kv_cache(NHD, device="meta", **GPU_DIMS)[1]
            p.call("region", {"region": "kv", "kind": NHD.value, "dims": GPU_DIMS, "memory": "torch", "seed": 4})
            d.call("region", {"region": "kv", "kind": NHD.value, "dims": GPU_DIMS, "memory": "torch", "seed": 5})
            connect(p, d)
            stopped = 0
            for timeout in (1e-4, 3e-4, 1e-3, 3e-3):
                for op, where in (("read", p), ("write", d)):
                    res = transfer(p, op, "pe1", range(32), range(32), timeout=timeout)
                    assert res["state"] in ("TIMED_OUT", "DONE"), res
                    if res["state"] == "DONE":
                        continue
                    stopped += 1
                    before = fetch(where, "kv", layout)
                    time.sleep(2.0)
                    after = fetch(where, "kv", layout)
                    diff = [int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in zip(before, after)]
                    assert not any(diff), f"{sum(diff)} bytes landed after the {op} ended ({res})"
            notes = d.call("notifications")
            print(f"stopped mid-flight: {stopped}; notices: {len(notes)}")
            assert len(notes) <= 8 - stopped  # only the DONE ones were notified
        finally:
            close_group([p, d])


@gpu
@needs_nvshmem
@pytest.mark.parametrize("victim", ["receiver", "sender"])
def test_gpu_killed_peer(victim):
    """A PE killed (SIGKILL): the survivor's transfers end with a typed error by their deadline and its
    agent closes in bounded time (the teardown agreement skips the collective free/finalize)."""
    with open_store("tcp://127.0.0.1:0") as store:
        p, d = start_group(store, f"killed-{victim}", [0, 0])
        try:
            p.call("region", {"region": "kv", "kind": NHD.value, "dims": GPU_DIMS, "memory": "torch", "seed": 4})
            d.call("region", {"region": "kv", "kind": NHD.value, "dims": GPU_DIMS, "memory": "torch"})
            connect(p, d)
            assert transfer(p, "write", "pe1", [0], [0], timeout=30)["state"] == "DONE"
            survivor = p if victim == "receiver" else d
            (d if victim == "receiver" else p).kill()
            if victim == "receiver":
                start = time.monotonic()
                res = transfer(p, "write", "pe1", range(32), range(32), timeout=10)
                assert res["state"] in ("FAILED", "TIMED_OUT"), res
                assert res["error"] in ("PeerDisconnectedError", "TransferTimeoutError"), res
                assert time.monotonic() - start < 15
            closed = survivor.call("close", timeout=30)
            print(f"survivor closed in {closed['close_s']:.1f} s: {closed['teardown']}")
            assert closed["close_s"] < nvshmem_runtime.CLOSE_TIMEOUT_S + 10
            assert closed["teardown"][0].startswith("skipped"), closed
        finally:
            d.kill()
            p.kill()


@gpu
@needs_nvshmem
def test_gpu_register_existing_pool_on_the_symmetric_heap():
    """register_external_tensor on a torch allocation: either it works (direct path) or the error says
    what NVSHMEM needs; prints which, for the record."""
    with open_store("tcp://127.0.0.1:0") as store:
        p, d = start_group(store, "registered", [0, 0])
        try:
            args = [{"region": "kv", "kind": NHD.value, "dims": GPU_DIMS, "memory": "registered", "seed": 2},
                    {"region": "kv", "kind": NHD.value, "dims": GPU_DIMS, "memory": "registered"}]
            try:
                out = collective([p, d], "region", args, timeout=60)
            except AssertionError as exc:
                print(f"register_external_tensor of a torch allocation: refused:\n{exc}")
                assert "register_external_tensor failed" in str(exc)
                return
            print(f"register_external_tensor of a torch allocation: accepted ({out})")
            layout = make_kv_cache(NHD, device="meta", **GPU_DIMS)[1]
            connect(p, d)
            assert transfer(p, "write", "pe1", [1, 2], [3, 4], timeout=30)["state"] == "DONE"
            assert_blocks_equal(layout, fetch(p, "kv", layout), [1, 2], layout, fetch(d, "kv", layout), [3, 4])
            print(f"stats: {p.call('stats')}")
        finally:
            close_group([p, d])


@pytest.mark.parametrize("body", ["staged", "direct", "registered", "expiry", "fence"])
def test_gpu_test_bodies_dry_run_on_the_fake(body, monkeypatch):
    """The GPU tests' own steps and checks, with PEs as threads of this process on the CPU stand-in
    (so that a GPU run fails only on what the GPU does differently)."""
    FakeFabric().install(monkeypatch)
    quiet = type("NoFaultHandler", (), {"enable": staticmethod(lambda: None),
                                        "dump_traceback_later": staticmethod(lambda *a, **k: None),
                                        "cancel_dump_traceback_later": staticmethod(lambda: None)})
    monkeypatch.setattr(nvshmem_helpers, "faulthandler", quiet)  # one per process: threads would fight over it
    monkeypatch.setitem(globals(), "PeProcess", nvshmem_helpers.PeThread)
    fn = {"staged": test_gpu_two_pes_staged_write_and_read, "direct": test_gpu_two_pes_direct_between_symmetric_pools,
          "registered": test_gpu_register_existing_pool_on_the_symmetric_heap,
          "expiry": test_gpu_deadline_expiry_then_exact_transfers,
          "fence": test_gpu_a_stopped_transfer_lands_nothing_after_it_ended}[body]
    fn(*([(0, 0)] if body in ("staged", "direct") else []))


def test_probe_steps_pass_on_the_fake(monkeypatch):
    """The GPU probe (xfer.bench.nvshmem_probe) run on the CPU stand-in: every step passes there."""
    from xfer.bench import nvshmem_probe

    FakeFabric().install(monkeypatch)
    with open_store("tcp://127.0.0.1:0") as store:
        lines = nvshmem_probe.pe_main(0, 1, 0, store.endpoint, limit=5.0)
    body = [line for line in lines[1:] if "words" not in line and "teardown" not in line]
    assert len(body) == 12 and all(line.endswith(": ok") or ": ok " in line for line in body), lines


def test_self_signals_order_a_self_put_by_events():
    """A self put's waits block the lane thread until the setter posted the value's event; a floor
    (own initialisation or drain) releases without one; ``check`` stops a wait; old events age out."""
    sig = SelfSignals()
    key = ("data", 0)
    got = {}

    def waiter():
        got["event"] = sig.wait(key, 3)
        got["at"] = time.monotonic()

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    assert t.is_alive()  # nothing posted yet: the waiter is held on the host
    sig.post(key, 2, "e2")
    time.sleep(0.02)
    assert t.is_alive()  # 2 < 3
    posted = time.monotonic()
    sig.post(key, 3, "e3")
    t.join(2)
    assert got["event"] == "e3" and got["at"] >= posted
    assert sig.wait(key, 2) == "e2"  # an earlier value still orders after its own event
    sig.floor(key, 10)  # a drain: everything up to 10 is released, no event to order after
    assert sig.wait(key, 9) is None
    with pytest.raises(TransferTimeoutError):  # the item's check stops a wait that cannot come
        sig.wait(("credit", 0), 1, check=lambda: (_ for _ in ()).throw(TransferTimeoutError("deadline")))
    for v in range(11, 11 + SelfSignals.KEEP + 5):
        sig.post(key, v, f"e{v}")
    assert sig.wait(key, 11) is None  # dropped long ago: completed
    assert sig.wait(key, 11 + SelfSignals.KEEP + 4) == f"e{11 + SelfSignals.KEEP + 4}"


@pytest.mark.parametrize("chunk_mib", [None, 0.002])
def test_bench_one_pe_dry_run_on_the_fake(chunk_mib, monkeypatch, tmp_path, capsys):
    """xfer.bench.nvshmem_bench --pes 1 on the CPU stand-in, with a small cache: both agents share the
    one PE, both paths are verified byte-exact and timed, the JSON records the mode."""
    import json

    from xfer.bench import nvshmem_bench

    FakeFabric().install(monkeypatch)
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1")  # setdefault must not leak a value into later tests
    out = tmp_path / "r.json"
    argv = ["--pes", "1", "--iters", "3", "--staging-mib", "1", "--out", str(out)]
    res = nvshmem_bench.main(argv + (["--chunk-mib", str(chunk_mib)] if chunk_mib else []),
                             dims=small_dims(NHD, blocks=16))
    assert json.loads(out.read_text())["mode"] == {"pes": 1, "status": "FAKE", "agents": "both on PE 0 (self put)"}
    assert res["paths"]["staged"]["counted_as"] == {"staged_write": 1}
    assert res["paths"]["direct"]["counted_as"] == {"direct_write": 1}
    assert res["paths"]["staged"]["chunks"] == (1 if chunk_mib is None else 4)
    assert [r["name"].split(":")[0] for r in res["rows"]] == ["contiguous device copy (ceiling)"] + \
        ["staged"] * 3 + ["direct"] * 3
    assert all(t.startswith("finalized") or t == "open" for t in res["teardown"].values()), res["teardown"]
    assert "both agents share PE 0" in capsys.readouterr().out


def test_bench_two_pe_failure_reports_the_receiver_on_the_fake(monkeypatch, capsys):
    """The 2-PE bench's verifying write into a stuck decode PE (fake PE 1 paused; its command loop on
    a thread): the in-flight snapshot and the failure report carry the decode PE's words and lanes,
    and a decode side whose report itself hangs is cut off by the bound, not waited for."""
    from xfer.bench import nvshmem_bench

    fabric = FakeFabric().install(monkeypatch)
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1")
    monkeypatch.setattr(nvshmem_bench, "DESCRIBE_S", 0.5)
    run_paths = nvshmem_bench._run_paths

    def stuck(*a, **k):
        fabric.pes[1].pause()  # decode's GPU is stuck: nothing is scattered, no credit comes back
        calls = []
        real = fabric.pes[1].describe

        def describe():  # the bench's second report of the decode PE hangs (a stuck device copy)
            if not threading.current_thread().name.startswith("xfer-"):  # not the lanes' own logs
                calls.append(1)
                if len(calls) > 1:
                    time.sleep(30)
            return real()
        fabric.pes[1].describe = describe
        try:
            return run_paths(*a, **k)
        finally:
            fabric.pes[1].describe = real
            fabric.pes[1].resume()

    monkeypatch.setattr(nvshmem_bench, "_run_paths", stuck)
    start = time.monotonic()
    with pytest.raises(SystemExit, match="staged path: the verifying write failed") as err:
        nvshmem_bench.main(["--iters", "3", "--staging-mib", "1", "--verify-s", "2", "--snapshot-s", "0.5",
                            "--chunk-mib", "0.002"], dims=small_dims(NHD, blocks=16), decode_thread=True)
    assert time.monotonic() - start < 10, time.monotonic() - start
    out = capsys.readouterr().out
    assert "still RUNNING after 0.5 s" in out and "decode (receiver): PE 1/2 (fake): data words" in out, out
    assert "decode (receiver) lanes: Lanes(Lane(pe1<-pe0/write" in out, out
    assert "decode (receiver): host call blocked > 0.5 s" in str(err.value), err.value
    assert "prefill (sender): PE 0/2 (fake)" in str(err.value)
