"""The drop-ins never stall the engine (issue 31), shown without the engines installed: the vLLM
connector over fakes of vLLM's base classes, driven in vLLM 0.33's call order and cache shapes
(tests/test_dropin_fakes.py has the byte-for-byte loads). The same cases against vLLM's own
scheduler and a frozen prefill process are in tests/test_dropin_vllm.py (opt-in)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from dropin_harness import fake_modules, fake_vllm
from test_dropin_fakes import BLOCKS, blocks, caches, finished, req, same_blocks, vconfig, worker_step
from xfer.errors import InvalidArgumentError
from xfer.store import open_store

pytestmark = pytest.mark.timeout(120)

FAST_S = 0.5  # an engine-thread call that returns within this did not wait on the network (timeouts: 2-5 s)


@pytest.fixture(scope="module")
def vmod():
    mods, role, status = fake_vllm()
    with fake_modules(mods, "xfer.engine.vllm_connector") as m:
        yield SimpleNamespace(m=m, Role=role, Status=status)


@pytest.fixture
def store():
    s = open_store("tcp://127.0.0.1:0")
    yield s
    s.close()


def pair(vm, store_url, engine, role, **extra):
    cfg = vconfig(role, engine, store_url, **extra)
    return vm.m.XferConnector(cfg, vm.Role.SCHEDULER), vm.m.XferConnector(cfg, vm.Role.WORKER)


def timed_steps(conn, meta, *, until, limit_s, finished=()):
    """Engine steps until ``until(sending, recving, errors)``; (elapsed, the longest step, sending, recving, errors)."""
    sending, recving, errors, worst = set(), set(), set(), 0.0
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        s0 = time.monotonic()
        (s, r), e = worker_step(conn, meta, finished)
        worst = max(worst, time.monotonic() - s0)
        meta, finished = type(meta)(), ()
        sending |= s or set()
        recving |= r or set()
        errors |= e
        if until(sending, recving, errors):
            return time.monotonic() - t0, worst, sending, recving, errors
        time.sleep(0.005)
    raise AssertionError(f"no progress in {limit_s} s: sending={sending} recving={recving} errors={errors}")


def remote_params(engine, key="p", block_ids=(1, 2), store_url=None):
    return {"do_remote_prefill": True, "remote_engine_id": engine, "remote_request_id": key,
            "remote_block_ids": list(block_ids), "remote_tp_size": 1, "remote_store": store_url,
            "lease_expires": time.time() + 30}


def plan_load(sched, rid, params, local_ids):
    d_req = req(rid, list(range(8)), dict(params), status=0, vm=None)
    n, _ = sched.get_num_new_matched_tokens(d_req, 0)
    sched.update_state_after_alloc(d_req, blocks(local_ids), n)
    return sched.build_connector_meta(None)


def hold(vm, ps, pw, rid="p", block_ids=(0, 1)):
    """The prefill finished ``rid``: its blocks are held for a reader (one engine step)."""
    _, params = finished(ps, req(rid, list(range(8)), {"do_remote_decode": True}, vm=vm), list(block_ids))
    worker_step(pw, ps.build_connector_meta(None), finished={rid})
    return params


def test_unknown_prefill_engine_never_blocks_the_engine_thread(vmod, store):
    """Case 2: a load from an engine nobody published waits timeout_s on a Background thread; every
    engine step returns at once, and the load ends by its deadline with its blocks reported."""
    ds, dw = pair(vmod, store.endpoint, "dec-u", "kv_consumer", timeout_s=2.0)
    try:
        dw.register_kv_caches(caches("packed", 2))
        meta = plan_load(ds, "d", remote_params("nobody"), [5, 6])
        elapsed, worst, _, recving, errors = timed_steps(dw, meta, until=lambda s, r, e: "d" in r, limit_s=10)
        print(f"unknown engine: longest engine step {worst * 1000:.1f} ms, load ended after {elapsed:.2f} s")
        assert worst < FAST_S, f"an engine step took {worst:.2f} s: it waited on the peer lookup"
        assert 1.5 < elapsed < 2.0 + 2.0, elapsed  # ended by its deadline (timeout_s=2), not before
        assert errors == {5, 6}  # vLLM recomputes them
    finally:
        ds.shutdown()
        dw.shutdown()


def test_abort_before_scheduling_releases_the_prefill_blocks_at_once(vmod, store):
    """Case 3: a decode request aborted before it was scheduled tells the prefill, which frees its
    blocks within 1 s (not when the 30 s lease ends)."""
    ps, pw = pair(vmod, store.endpoint, "pre-a", "kv_producer")
    ds, dw = pair(vmod, store.endpoint, "dec-a", "kv_consumer")
    try:
        pw.register_kv_caches(caches("packed", 2, seed=1))
        dw.register_kv_caches(caches("packed", 2))
        params = hold(vmod, ps, pw)
        d_req = req("d", list(range(8)), dict(params), status=vmod.Status.FINISHED_ABORTED, vm=vmod)
        assert ds.get_num_new_matched_tokens(d_req, 0)[0] > 0
        assert finished(ds, d_req, []) == (False, None)  # aborted while waiting: vLLM frees it at once
        t0 = time.monotonic()
        worker_step(dw, ds.build_connector_meta(None))  # the step after the abort carries the release
        elapsed, _, sending, _, _ = timed_steps(pw, type(ds.build_connector_meta(None))(),
                                                until=lambda s, r, e: "p" in s, limit_s=5)
        assert sending == {"p"} and time.monotonic() - t0 < 1.0, time.monotonic() - t0
    finally:
        for c in (ps, pw, ds, dw):
            c.shutdown()


def test_abort_while_loading_ends_the_load_and_releases_the_prefill(vmod, store):
    """Case 3: vLLM finishes a request whose load runs (finished_req_ids): its reads stop, it is
    reported received (vLLM then frees its blocks) and the prefill frees its blocks within 1 s;
    an abort while the prefill lookup is stuck ends the load at once too, not at timeout_s."""
    ps, pw = pair(vmod, store.endpoint, "pre-w", "kv_producer")
    ds, dw = pair(vmod, store.endpoint, "dec-w", "kv_consumer", timeout_s=5.0)
    try:
        pw.register_kv_caches(caches("packed", 2, seed=2))
        dw.register_kv_caches(caches("packed", 2))
        params = hold(vmod, ps, pw)
        t0 = time.monotonic()
        meta = plan_load(ds, "d", params, [3, 4])
        _, _, _, recving, errors = timed_steps(dw, meta, finished={"d"}, until=lambda s, r, e: "d" in r, limit_s=5)
        assert not errors  # an aborted load's blocks are not reported for recompute: the request is gone
        _, _, sending, _, _ = timed_steps(pw, type(meta)(), until=lambda s, r, e: "p" in s, limit_s=5)
        assert sending == {"p"} and time.monotonic() - t0 < 1.0, time.monotonic() - t0

        meta = plan_load(ds, "d2", remote_params("nobody", key="q"), [7])  # its lookup waits 5 s
        worker_step(dw, meta)
        t0 = time.monotonic()
        elapsed, worst, _, recving, _ = timed_steps(dw, type(meta)(), finished={"d2"},
                                                    until=lambda s, r, e: "d2" in r, limit_s=10)
        assert elapsed < 1.0 and worst < FAST_S, (elapsed, worst)
    finally:
        for c in (ps, pw, ds, dw):
            c.shutdown()


def test_remote_store_named_by_the_prefill_is_used(vmod, store):
    """Case 4: the decode instance finds the prefill in the store the prefill returned
    (``remote_store``), not only in its own."""
    with open_store("tcp://127.0.0.1:0") as own:
        ps, pw = pair(vmod, store.endpoint, "pre-s", "kv_producer")
        ds, dw = pair(vmod, own.endpoint, "dec-s", "kv_consumer")
        try:
            pk, dk = caches("packed", 2, seed=4), caches("packed", 2)
            pw.register_kv_caches(pk)
            dw.register_kv_caches(dk)
            params = hold(vmod, ps, pw, block_ids=[6, 2])
            assert params["remote_store"] == store.endpoint
            meta = plan_load(ds, "d", params, [9, 1])
            _, _, _, recving, errors = timed_steps(dw, meta, until=lambda s, r, e: "d" in r, limit_s=10)
            assert not errors
            same_blocks(pk, [6, 2], dk, [9, 1])
            untouched = [b for b in range(BLOCKS) if b not in (9, 1)]
            for t in dk.values():
                assert (t[torch.as_tensor(untouched)] == 7.25).all()
        finally:
            for c in (ps, pw, ds, dw):
                c.shutdown()


def test_extra_config_is_strict(vmod, store):
    """Case 4: unknown keys raise with the list of known keys; "false" is false."""
    with pytest.raises(InvalidArgumentError, match=r"unknown keys \['timeout'\].*known keys.*timeout_s"):
        vmod.m.XferConnector(vconfig("kv_consumer", "x", store.endpoint, timeout=5), vmod.Role.SCHEDULER)
    for text, want in (("false", False), ("False", False), ("0", False), ("true", True), ("yes", True)):
        c = vmod.m.XferConnector(vconfig("kv_consumer", "x", store.endpoint, load_async=text, host_store=text),
                                 vmod.Role.SCHEDULER)
        assert c.settings.load_async is want and c.settings.host_store is want, text
    c = vmod.m.XferConnector(vconfig("kv_consumer", "x", store.endpoint, timeout_s="2.5", lease_s=60),
                             vmod.Role.SCHEDULER)
    assert c.settings.timeout_s == 2.5 and c.settings.lease_s == 60.0
    for key, bad in (("load_async", "maybe"), ("host_store", 2), ("timeout_s", True), ("timeout_s", "nan"),
                     ("lease_s", -1), ("transports", 5), ("layout", "paged"), ("store", "http://x:1")):
        with pytest.raises(InvalidArgumentError, match=key):
            vmod.m.XferConnector(vconfig("kv_consumer", "x", store.endpoint, **{key: bad}), vmod.Role.SCHEDULER)


# ---- SGLang (fakes of its base classes; SGLang's own queues: tests/test_dropin_sglang.py) ------------
@pytest.fixture(scope="module")
def smod():
    from dropin_harness import fake_sglang
    mods, kvargs, kvpoll = fake_sglang()
    with fake_modules(mods, "xfer.engine.sglang_conn") as m:
        yield SimpleNamespace(m=m, KVArgs=kvargs, KVPoll=kvpoll)


def test_sglang_decode_abort_reaches_the_prefill(smod, monkeypatch):
    from dropin_harness import run_sglang_abort
    monkeypatch.setattr(smod.m, "_TRANSPORTS", ("local",))
    run_sglang_abort(smod.m, smod.KVArgs, smod.KVPoll)


def test_sglang_unknown_prefill_fails_by_the_deadline_without_blocking(smod, monkeypatch):
    from dropin_harness import run_sglang_unknown_prefill
    monkeypatch.setattr(smod.m, "_TRANSPORTS", ("local",))
    monkeypatch.setattr(smod.m, "TIMEOUT_S", 1.0)
    elapsed, worst = run_sglang_unknown_prefill(smod.m, smod.KVArgs, smod.KVPoll, timeout_s=1.0)
    print(f"sglang unknown prefill: failed after {elapsed:.2f} s, longest call {worst * 1000:.1f} ms")
    assert worst < 0.1 and elapsed < 1.0 + 3.0, (elapsed, worst)


def test_sglang_dead_prefill_fails_a_waiting_room(smod, monkeypatch):
    from dropin_harness import run_sglang_dead_prefill
    monkeypatch.setattr(smod.m, "_TRANSPORTS", ("local",))
    monkeypatch.setattr(smod.m, "TIMEOUT_S", 2.0)
    elapsed = run_sglang_dead_prefill(smod.m, smod.KVArgs, smod.KVPoll, timeout_s=2.0)
    assert elapsed < 2.0 + 2.0, elapsed


def test_sglang_frozen_prefill_fails_a_waiting_room_without_blocking(smod, monkeypatch):
    """Case 9: the prefill process is frozen (SIGSTOP) while a decode room waits on it."""
    from dropin_harness import run_sglang_frozen_prefill
    monkeypatch.setattr(smod.m, "_TRANSPORTS", ("local",))
    monkeypatch.setattr(smod.m, "TIMEOUT_S", 2.0)
    elapsed, worst = run_sglang_frozen_prefill(smod.m, smod.KVArgs, smod.KVPoll, timeout_s=2.0)
    print(f"sglang frozen prefill: room failed after {elapsed:.2f} s, longest poll {worst * 1000:.1f} ms")
    assert worst < 0.1 and elapsed < 2.0 + 3.0, (elapsed, worst)
