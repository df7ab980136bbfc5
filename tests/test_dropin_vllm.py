"""XferConnector inside real vLLM (opt-in: needs vLLM installed, see README.md, "Running the engine tests").

vLLM's own v1 ``Scheduler`` (on CPU) drives the connector's scheduler side for a prefill -> decode
request; the worker side is driven in vLLM's call order (``_get_kv_connector_output``) on the KV
tensors vLLM's own ``allocate_kv_cache`` lays out, and the decode blocks are checked byte for byte.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny model is a local config.json: never ask the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed (opt-in engine tests: see the README section Running the engine tests)")

from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from vllm_harness import (BLOCKS, EOS, POISON, Engine, PrefillProcess, block_bytes, make_config,  # noqa: E402
                          prefill, request, write_tiny_model)
from xfer.errors import InvalidArgumentError  # noqa: E402
from xfer.store import open_store  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def store():
    s = open_store("tcp://127.0.0.1:0")
    yield s
    s.close()


def run_decode(d: Engine, prompt, params, rid="dreq-1", limit_s=20.0):
    d.sched.add_request(request(rid, prompt, dict(params), max_tokens=3))
    seen_invalid, loaded = set(), None
    end = time.monotonic() + limit_s
    while time.monotonic() < end:  # the engine loop: steps until the load landed and the request runs
        out, kvo, _ = d.step()
        seen_invalid |= kvo.invalid_block_ids
        for r in out.scheduled_new_reqs:
            if r.req_id == rid:
                loaded = r
        if loaded is not None:
            return loaded, seen_invalid
    raise AssertionError(f"decode request {rid} was never scheduled after its load")


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC])
@pytest.mark.parametrize("load_async", [True, False])
def test_prefill_to_decode_with_vllm_scheduler(tiny_model, store, layout, load_async):
    p = Engine(make_config(tiny_model, "kv_producer", "prefill-a", store.endpoint), layout)
    d = Engine(make_config(tiny_model, "kv_consumer", "decode-a", store.endpoint, load_async=load_async), layout)
    try:
        prompt = list(range(1, 19))  # 18 tokens: 5 blocks of 4, the last partial
        p_blocks, params = prefill(p, prompt)
        assert params["remote_block_ids"] == p_blocks
        loaded, invalid = run_decode(d, prompt, params)
        assert not invalid
        d_blocks = d.sched.kv_cache_manager.get_block_ids("dreq-1")[0][:len(p_blocks)]
        # async: vLLM recomputes only the last prompt token; sync: the forward computes it
        assert loaded.num_computed_tokens == len(prompt) - 1
        for name in p.kv:
            assert torch.equal(block_bytes(p.kv[name], p_blocks), block_bytes(d.kv[name], d_blocks)), name
            rest = sorted(set(range(BLOCKS)) - set(d_blocks))
            assert (block_bytes(d.kv[name], rest) == POISON).all(), f"{name}: a block outside the load changed"
        # the decode side released the prefill blocks: the prefill scheduler frees them
        free_before = p.sched.kv_cache_manager.block_pool.get_num_free_blocks()
        end = time.monotonic() + 10
        while time.monotonic() < end:
            _, kvo, _ = p.step()
            if kvo.finished_sending:
                assert kvo.finished_sending == {"req-1"}
                break
            time.sleep(0.01)
        else:
            raise AssertionError("prefill never reported finished_sending")
        assert p.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before + len(p_blocks)
        assert "req-1" not in p.sched.requests
    finally:
        p.close()
        d.close()


def test_mla_layout(tiny_model, store):
    p = Engine(make_config(tiny_model, "kv_producer", "prefill-m", store.endpoint, use_mla=True, total_kv_heads=1),
               mla=True)
    d = Engine(make_config(tiny_model, "kv_consumer", "decode-m", store.endpoint, use_mla=True, total_kv_heads=1),
               mla=True)
    try:
        assert p.worker._worker.link.layouts[0].name == "mla"
        prompt = list(range(3, 13))
        p_blocks, params = prefill(p, prompt, seed=3)
        run_decode(d, prompt, params)
        d_blocks = d.sched.kv_cache_manager.get_block_ids("dreq-1")[0][:len(p_blocks)]
        for name in p.kv:
            assert torch.equal(block_bytes(p.kv[name], p_blocks), block_bytes(d.kv[name], d_blocks))
    finally:
        p.close()
        d.close()


def test_failed_load_reports_blocks_and_vllm_recomputes(tiny_model, store):
    p = Engine(make_config(tiny_model, "kv_producer", "prefill-f", store.endpoint))
    d = Engine(make_config(tiny_model, "kv_consumer", "decode-f", store.endpoint, policy="recompute"))
    try:
        prompt = list(range(5, 17))
        _, params = prefill(p, prompt, seed=5)
        p.close()  # the prefill instance dies before the decode side reads
        loaded, invalid = run_decode(d, prompt, params)
        d_blocks = d.sched.kv_cache_manager.get_block_ids("dreq-1")[0]
        assert invalid and invalid <= set(d_blocks)
        assert loaded.num_computed_tokens == 0  # vLLM recomputes the prompt (kv_load_failure_policy=recompute)
    finally:
        p.close()
        d.close()


def test_lease_frees_unread_prefill_blocks(tiny_model, store):
    p = Engine(make_config(tiny_model, "kv_producer", "prefill-l", store.endpoint, lease_s=6.0, timeout_s=5.0))
    try:
        free0 = p.sched.kv_cache_manager.block_pool.get_num_free_blocks()
        p_blocks, _ = prefill(p, list(range(2, 14)))
        assert p.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0 - len(p_blocks)
        end = time.monotonic() + 15
        while time.monotonic() < end:  # nobody reads: the lease ends and the blocks free
            _, kvo, _ = p.step()
            if kvo.finished_sending:
                break
            time.sleep(0.2)
        assert kvo.finished_sending == {"req-1"}
        assert p.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    finally:
        p.close()


def test_aborted_prefill_holds_nothing(tiny_model, store):
    p = Engine(make_config(tiny_model, "kv_producer", "prefill-x", store.endpoint))
    try:
        p.sched.add_request(request("r", list(range(1, 9)), {"do_remote_decode": True}, max_tokens=1))
        p.sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
        _, _, outs = p.step()
        assert all(o.kv_transfer_params is None for o in outs)
        assert "r" not in p.sched.requests
    finally:
        p.close()


# ---- issue 31: nothing stalls the engine; aborts free blocks at once; strict config; EOS-only ----------
def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", ["unknown", "frozen", "frozen_after_connect"])
def test_frozen_or_unknown_prefill_does_not_stall_other_requests(tiny_model, case):
    """A prefill instance in its own process hosts the store (the documented set-up). While one
    decode request's prefill is frozen (SIGSTOP) or unknown, another request on the same decode
    instance gets a token every engine step; the stuck request's load ends by timeout_s and vLLM
    recomputes it."""
    import gc
    import signal

    port, timeout_s = free_port(), 2.0
    p = PrefillProcess(tiny_model, "pre-z", port, timeout_s=timeout_s, lease_s=30.0)
    d = Engine(make_config(tiny_model, "kv_consumer", "dec-z", f"tcp://127.0.0.1:{port}", timeout_s=timeout_s))
    frozen = False
    try:
        if case == "frozen_after_connect":  # a first load connects this decode instance to the prefill
            first = p.call(op="prefill", rid="warm", start=1, n=10)
            run_decode(d, list(range(1, 11)), first["params"], rid="dwarm")
        others = iter(range(10**6))  # a chain of short local requests: one always runs, within the cache
        other = f"other-{next(others)}"
        d.sched.add_request(request(other, list(range(50, 58)), None, max_tokens=16))
        for _ in range(3):
            d.step()
        gc.collect()
        gc.freeze()  # as vLLM's EngineCore does after start-up (freeze_gc_heap): no full-heap GC pauses
        if case == "unknown":
            params = {"do_remote_prefill": True, "remote_engine_id": "nobody", "remote_request_id": "x",
                      "remote_block_ids": [1, 2, 3], "remote_tp_size": 1, "lease_expires": time.time() + 30}
        else:
            params = p.call(op="prefill", rid="r2", start=3, n=10)["params"]
            os.kill(p.pid, signal.SIGSTOP)
            frozen = True
        d.sched.add_request(request("r2", list(range(3, 13)), dict(params), max_tokens=2))
        worst, worst_at, steps, loaded, invalid = 0.0, 0.0, 0, None, set()
        start = time.monotonic()
        end = start + timeout_s + 1.5
        while time.monotonic() < end or loaded is None:
            t0 = time.monotonic()
            out, kvo, outs = d.step()
            dt = time.monotonic() - t0
            assert any(o.request_id == other and o.new_token_ids for o in outs), f"step {steps}: no token"
            if dt > worst:
                worst, worst_at = dt, t0 - start
            steps += 1
            if other not in d.sched.requests:  # finished: the next one runs from the next step
                other = f"other-{next(others)}"
                d.sched.add_request(request(other, list(range(50, 58)), None, max_tokens=16))
            invalid |= kvo.invalid_block_ids
            loaded = loaded or next((r for r in out.scheduled_new_reqs if r.req_id == "r2"), None)
            assert time.monotonic() < end + 10, "r2 never came back for recompute"
            time.sleep(0.002)
        print(f"{case}: {steps} steps, longest {worst * 1000:.1f} ms ({worst_at:.2f} s in); r2 recomputed from token "
              f"{loaded.num_computed_tokens}")
        assert worst < timeout_s / 4, f"an engine step took {worst:.2f} s (timeout_s={timeout_s})"
        assert invalid and loaded.num_computed_tokens == 0  # the failed load is recomputed
    finally:
        gc.unfreeze()
        if frozen:
            os.kill(p.pid, signal.SIGCONT)
        p.stop()
        d.close()


def test_abort_before_scheduling_frees_prefill_blocks_at_once(tiny_model, store):
    """vLLM aborts a decode request before scheduling it: the prefill frees its blocks within 1 s."""
    p = Engine(make_config(tiny_model, "kv_producer", "prefill-ab", store.endpoint))
    d = Engine(make_config(tiny_model, "kv_consumer", "decode-ab", store.endpoint))
    try:
        free0 = p.free_blocks()
        prompt = list(range(4, 16))
        p_blocks, params = prefill(p, prompt, seed=6)
        assert p.free_blocks() == free0 - len(p_blocks)
        d.sched.add_request(request("d-ab", prompt, dict(params), max_tokens=3))
        d.sched.finish_requests("d-ab", RequestStatus.FINISHED_ABORTED)
        t0 = time.monotonic()
        while p.free_blocks() != free0:
            assert time.monotonic() - t0 < 1.0, "the prefill still holds the aborted request's blocks"
            d.step()
            p.step()
            time.sleep(0.005)
        assert "req-1" not in p.sched.requests
    finally:
        p.close()
        d.close()


def test_abort_while_loading_frees_blocks_at_once(tiny_model, store):
    """vLLM aborts a decode request whose load runs (WAITING_FOR_REMOTE_KVS): its blocks come back
    once the load ended, and the prefill frees its blocks, both within 1 s of the abort."""
    p = Engine(make_config(tiny_model, "kv_producer", "prefill-aw", store.endpoint))
    d = Engine(make_config(tiny_model, "kv_consumer", "decode-aw", store.endpoint))
    try:
        p_free0, d_free0 = p.free_blocks(), d.free_blocks()
        prompt = list(range(7, 19))
        _, params = prefill(p, prompt, seed=8)
        d.sched.add_request(request("d-aw", prompt, dict(params), max_tokens=3))
        d.step()  # scheduled: blocks allocated, the load started
        assert d.sched.requests["d-aw"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert d.free_blocks() < d_free0
        d.sched.finish_requests("d-aw", RequestStatus.FINISHED_ABORTED)
        t0 = time.monotonic()
        while p.free_blocks() != p_free0 or d.free_blocks() != d_free0 or "d-aw" in d.sched.requests:
            assert time.monotonic() - t0 < 1.0, (p.free_blocks(), p_free0, d.free_blocks(), d_free0)
            d.step()
            p.step()
            time.sleep(0.005)
    finally:
        p.close()
        d.close()


def test_prefill_ending_on_eos_hands_off(tiny_model, store):
    """A prefill whose only sampled token is end-of-sequence (FINISHED_STOPPED) hands off, as NIXL does."""
    p = Engine(make_config(tiny_model, "kv_producer", "prefill-eos", store.endpoint))
    d = Engine(make_config(tiny_model, "kv_consumer", "decode-eos", store.endpoint))
    try:
        prompt = list(range(9, 21))
        p_blocks, params = prefill(p, prompt, seed=9, token=EOS)
        loaded, invalid = run_decode(d, prompt, params, rid="d-eos")
        assert not invalid and loaded.num_computed_tokens == len(prompt) - 1
        d_blocks = d.sched.kv_cache_manager.get_block_ids("d-eos")[0][:len(p_blocks)]
        for name in p.kv:
            assert torch.equal(block_bytes(p.kv[name], p_blocks), block_bytes(d.kv[name], d_blocks)), name
    finally:
        p.close()
        d.close()


def test_unknown_extra_config_key_fails_at_startup(tiny_model, store):
    with pytest.raises(InvalidArgumentError, match=r"unknown keys \['timeout'\].*timeout_s"):
        Engine(make_config(tiny_model, "kv_consumer", "decode-typo", store.endpoint, timeout=5))
    e = Engine(make_config(tiny_model, "kv_consumer", "decode-str", store.endpoint, load_async="false"))
    try:
        assert e.worker.settings.load_async is False
    finally:
        e.close()
