"""The vLLM connector and the SGLang backend without the engines installed: fakes stand in for the
few base classes the adapters import (tests/dropin_harness.py), real tensors and real xfer agents
(``local`` transport, in process) move the KV, and decode blocks are checked byte for byte."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from dropin_harness import (fake_modules, fake_sglang, fake_vllm, run_sglang_failure, run_sglang_pd)
from xfer import LayoutKind, make_kv_cache
from xfer.store import open_store

pytestmark = pytest.mark.timeout(120)

BS, BLOCKS, LAYERS, HEAD = 4, 12, 2, 8


@pytest.fixture(scope="module")
def vmod():
    mods, role, status = fake_vllm()
    with fake_modules(mods, "xfer.engine.vllm_connector") as m:
        yield SimpleNamespace(m=m, Role=role, Status=status)


@pytest.fixture(scope="module")
def smod():
    mods, kvargs, kvpoll = fake_sglang()
    with fake_modules(mods, "xfer.engine.sglang_conn") as m:
        yield SimpleNamespace(m=m, KVArgs=kvargs, KVPoll=kvpoll)


@pytest.fixture
def store():
    s = open_store("tcp://127.0.0.1:0")
    yield s
    s.close()


def vconfig(role, engine, store_url, *, tp=1, rank=0, peer_tp=None, heads=2, mla=False, **extra):
    kv = SimpleNamespace(engine_id=engine, is_kv_producer=role in ("kv_producer", "kv_both"),
                         is_kv_consumer=role in ("kv_consumer", "kv_both"),
                         kv_connector_extra_config={"store": store_url, "tp_rank": rank, "peer_tp_size": peer_tp,
                                                    "transports": ["local"], "timeout_s": 5.0, "lease_s": 30.0,
                                                    **extra})
    return SimpleNamespace(kv_transfer_config=kv, cache_config=SimpleNamespace(block_size=BS),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                           model_config=SimpleNamespace(get_total_num_kv_heads=lambda: heads, use_mla=mla))


def caches(kind, heads, seed=None):
    """vLLM-style per-layer caches of ``kind`` as a dict of layer name -> tensor."""
    if kind == "packed":  # vLLM 0.33: one [B, H, N, 2*head] view per layer, NHD memory (LBNHC)
        ts = [torch.empty(BLOCKS, BS, heads, 2 * HEAD).permute(0, 2, 1, 3) for _ in range(LAYERS)]
    elif kind == "packed_hnd":  # the same view over HND memory (LBHNC)
        ts = [torch.empty(BLOCKS, heads, BS, 2 * HEAD) for _ in range(LAYERS)]
    elif kind == LayoutKind.MLA:  # vLLM 0.33 MLA: [B, 1, N, 576]
        ts = [torch.empty(BLOCKS, 1, BS, 576, dtype=torch.bfloat16) for _ in range(LAYERS)]
    else:
        ts, _ = make_kv_cache(kind, num_layers=LAYERS, num_blocks=BLOCKS, block_size=BS, num_heads=heads,
                              head_dim=576 if kind == LayoutKind.MLA else HEAD)
        if kind == LayoutKind.VLLM_FLASH_ATTN_HND:
            ts = [t.permute(0, 1, 3, 2, 4) for t in ts]  # logical (2, B, N, H, C) over HND memory
    g = torch.Generator().manual_seed(seed or 0)
    for t in ts:  # random KV on the source, a marker value on the destination
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype) if seed is not None else torch.full_like(t, 7.25))
    return {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(ts)}


def req(rid, prompt, params, status=None, vm=None):
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=params,
                           status=status if status is not None else vm.Status.FINISHED_LENGTH_CAPPED)


def blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def worker_step(conn, meta, finished=()):
    """vLLM 0.33's model runner order around one step (``_get_kv_connector_output``; no forward for
    these requests): sync loads start before the forward, async ones after it."""
    conn.bind_connector_metadata(meta)
    sync = any(load.sync for load in meta.loads)
    if sync:
        conn.start_load_kv(None)
    for name in conn._worker.layer_index:
        conn.wait_for_layer_load(name)
        conn.save_kv_layer(name, None, None)
    if not sync:
        conn.start_load_kv(None)
    conn.wait_for_save()
    res = conn.get_transfer_results(set(finished))
    done = (res.finished_sending or None, res.finished_recving or None)
    errors = conn.get_block_ids_with_load_errors()
    conn.clear_connector_metadata()
    return done, errors


def finished(sched, request, block_ids):
    """What vLLM 0.33's scheduler calls for a connector that declares SupportsHMA: one list per group."""
    return sched.request_finished_all_groups(request, (list(block_ids),))


def step_until(conn, meta, *, want, limit_s=10.0, finished=()):
    sending, recving, errors = set(), set(), set()
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        (s, r), e = worker_step(conn, meta, finished)
        meta = type(meta)()
        sending |= s or set()
        recving |= r or set()
        errors |= e
        if want(sending, recving):
            return sending, recving, errors
        time.sleep(0.01)
    raise AssertionError(f"no progress: sending={sending} recving={recving} errors={errors}")


def same_blocks(src, src_ids, dst, dst_ids):
    for name in src:
        a = src[name][torch.as_tensor(src_ids)] if src[name].dim() != 5 or src[name].shape[0] != 2 else \
            src[name][:, torch.as_tensor(src_ids)]
        b = dst[name][torch.as_tensor(dst_ids)] if dst[name].dim() != 5 or dst[name].shape[0] != 2 else \
            dst[name][:, torch.as_tensor(dst_ids)]
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), name


def pd(vm, store, kind, *, mla=False, heads=2, load_async=True):
    P = {r: vm.m.XferConnector(vconfig("kv_producer", "pre", store.endpoint, mla=mla, heads=heads), r)
         for r in (vm.Role.SCHEDULER, vm.Role.WORKER)}
    D = {r: vm.m.XferConnector(vconfig("kv_consumer", "dec", store.endpoint, mla=mla, heads=heads,
                                       load_async=load_async), r) for r in (vm.Role.SCHEDULER, vm.Role.WORKER)}
    return P, D


@pytest.mark.parametrize("kind", ["packed", "packed_hnd", LayoutKind.MLA])  # vLLM 0.33's per-layer views
def test_vllm_prefill_to_decode(vmod, store, kind):
    mla = kind == LayoutKind.MLA
    heads = 1 if mla else 2
    P, D = pd(vmod, store, kind, mla=mla, heads=heads)
    try:
        pk, dk = caches(kind, heads, seed=3), caches(kind, heads)
        P[vmod.Role.WORKER].register_kv_caches(pk)
        D[vmod.Role.WORKER].register_kv_caches(dk)
        prompt, p_ids = list(range(10)), [5, 1, 8]  # 10 tokens: 3 blocks of 4
        delay, params = finished(P[vmod.Role.SCHEDULER], req("p1", prompt, {"do_remote_decode": True},
                                                                    vm=vmod), p_ids)
        assert delay and params["remote_block_ids"] == p_ids
        hold = P[vmod.Role.SCHEDULER].build_connector_meta(None)
        assert [h.req_id for h in hold.holds] == ["p1"]
        worker_step(P[vmod.Role.WORKER], hold, finished={"p1"})
        d_req = req("d1", prompt, dict(params), status=vmod.Status.RUNNING, vm=vmod)
        n, is_async = D[vmod.Role.SCHEDULER].get_num_new_matched_tokens(d_req, 0)
        assert (n, is_async) == (10, True)
        D[vmod.Role.SCHEDULER].update_state_after_alloc(d_req, blocks([2, 9, 0]), n)
        assert D[vmod.Role.SCHEDULER].get_num_new_matched_tokens(d_req, 0) == (0, False)  # loads once
        meta = D[vmod.Role.SCHEDULER].build_connector_meta(None)
        _, recving, errors = step_until(D[vmod.Role.WORKER], meta, want=lambda s, r: "d1" in r)
        assert not errors
        same_blocks(pk, p_ids, dk, [2, 9, 0])
        untouched = [b for b in range(BLOCKS) if b not in (2, 9, 0)]
        for t in dk.values():
            sel = t[:, torch.as_tensor(untouched)] if t.dim() == 5 and t.shape[0] == 2 else t[torch.as_tensor(untouched)]
            assert (sel == 7.25).all(), "a block outside the load changed"
        sending, _, _ = step_until(P[vmod.Role.WORKER], type(meta)(), want=lambda s, r: "p1" in s, finished={"p1"})
        assert sending == {"p1"}
    finally:
        for c in (*P.values(), *D.values()):
            c.shutdown()


def test_vllm_sync_load_waits_layer_by_layer(vmod, store):
    P, D = pd(vmod, store, "packed", load_async=False)
    try:
        pk, dk = caches("packed", 2, seed=4), caches("packed", 2)
        P[vmod.Role.WORKER].register_kv_caches(pk)
        D[vmod.Role.WORKER].register_kv_caches(dk)
        _, params = finished(P[vmod.Role.SCHEDULER], req("p", list(range(9)), {"do_remote_decode": True},
                                                                vm=vmod), [3, 4, 6])
        worker_step(P[vmod.Role.WORKER], P[vmod.Role.SCHEDULER].build_connector_meta(None), finished={"p"})
        d_req = req("d", list(range(9)), dict(params), status=vmod.Status.RUNNING, vm=vmod)
        assert D[vmod.Role.SCHEDULER].get_num_new_matched_tokens(d_req, 0) == (8, False)  # the forward computes the last
        D[vmod.Role.SCHEDULER].update_state_after_alloc(d_req, blocks([0, 1, 2]), 8)
        w = D[vmod.Role.WORKER]
        w.bind_connector_metadata(D[vmod.Role.SCHEDULER].build_connector_meta(None))
        w.start_load_kv(None)  # sync loads start before the forward
        names = list(dk)
        w.wait_for_layer_load(names[0])  # layer 0 has landed when this returns
        group = w._worker.loading["d"].group
        assert all(t.poll().name == "DONE" for t in group.by_layer[0])
        w.wait_for_layer_load(names[1])
        s_r = w.get_finished(set())
        assert s_r == (None, None)  # a sync load is not reported as an async receive
        assert w.get_block_ids_with_load_errors() == set()
        same_blocks(pk, [3, 4], dk, [0, 1])  # two full blocks (the third holds the recomputed token too)
    finally:
        for c in (*P.values(), *D.values()):
            c.shutdown()


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_vllm_tp_mismatch(vmod, store, p_tp, d_tp):
    total = 2
    Pw = [vmod.m.XferConnector(vconfig("kv_producer", "pre", store.endpoint, tp=p_tp, rank=r, peer_tp=d_tp,
                                       heads=total), vmod.Role.WORKER) for r in range(p_tp)]
    Ps = vmod.m.XferConnector(vconfig("kv_producer", "pre", store.endpoint, tp=p_tp, peer_tp=d_tp, heads=total),
                              vmod.Role.SCHEDULER)
    Dw = [vmod.m.XferConnector(vconfig("kv_consumer", "dec", store.endpoint, tp=d_tp, rank=r, peer_tp=p_tp,
                                       heads=total), vmod.Role.WORKER) for r in range(d_tp)]
    Ds = vmod.m.XferConnector(vconfig("kv_consumer", "dec", store.endpoint, tp=d_tp, peer_tp=p_tp, heads=total),
                              vmod.Role.SCHEDULER)
    try:
        pk = [caches("packed", total // p_tp, seed=20 + r) for r in range(p_tp)]
        dk = [caches("packed", total // d_tp) for _ in range(d_tp)]
        for w, k in zip(Pw, pk):
            w.register_kv_caches(k)
        for w, k in zip(Dw, dk):
            w.register_kv_caches(k)
        _, params = finished(Ps, req("p", list(range(8)), {"do_remote_decode": True}, vm=vmod), [4, 7])
        hold = Ps.build_connector_meta(None)
        for w in Pw:
            worker_step(w, hold, finished={"p"})
        d_req = req("d", list(range(8)), dict(params), status=vmod.Status.RUNNING, vm=vmod)
        n, _ = Ds.get_num_new_matched_tokens(d_req, 0)
        Ds.update_state_after_alloc(d_req, blocks([1, 10]), n)
        meta = Ds.build_connector_meta(None)
        for w in Dw:
            step_until(w, meta, want=lambda s, r: "d" in r)
        for name in pk[0]:  # whole-model heads on both sides, concatenated over ranks: [B, H, N, 2C]
            src = torch.cat([k[name][torch.as_tensor([4, 7])] for k in pk], dim=1)
            dst = torch.cat([k[name][torch.as_tensor([1, 10])] for k in dk], dim=1)
            assert torch.equal(src, dst), name
        for w in Pw:  # every prefill rank is released by the decode ranks that read it
            step_until(w, type(meta)(), want=lambda s, r: "p" in s, finished={"p"})
    finally:
        for c in (*Pw, *Dw, Ps, Ds):
            c.shutdown()


def test_vllm_failed_load_reports_blocks(vmod, store):
    P, D = pd(vmod, store, "packed")
    try:
        P[vmod.Role.WORKER].register_kv_caches(caches("packed", 2, seed=1))
        dk = caches("packed", 2)
        D[vmod.Role.WORKER].register_kv_caches(dk)
        _, params = finished(P[vmod.Role.SCHEDULER], req("p", list(range(8)), {"do_remote_decode": True},
                                                                vm=vmod), [0, 1])
        P[vmod.Role.WORKER].shutdown()  # prefill gone before the read
        d_req = req("d", list(range(8)), dict(params), status=vmod.Status.RUNNING, vm=vmod)
        D[vmod.Role.SCHEDULER].update_state_after_alloc(
            d_req, blocks([5, 6]), D[vmod.Role.SCHEDULER].get_num_new_matched_tokens(d_req, 0)[0])
        _, recving, errors = step_until(D[vmod.Role.WORKER], D[vmod.Role.SCHEDULER].build_connector_meta(None),
                                        want=lambda s, r: "d" in r)
        assert errors == {5, 6}  # reported in the same pass as the finished receive
    finally:
        for c in (*P.values(), *D.values()):
            c.shutdown()


def test_vllm_lease_frees_unread_blocks(vmod, store):
    cfg = vconfig("kv_producer", "pre-l", store.endpoint, timeout_s=0.3, lease_s=0.6)
    s, w = vmod.m.XferConnector(cfg, vmod.Role.SCHEDULER), vmod.m.XferConnector(cfg, vmod.Role.WORKER)
    try:
        w.register_kv_caches(caches("packed", 2))
        finished(s, req("p", list(range(8)), {"do_remote_decode": True}, vm=vmod), [0, 1])
        (sending, _), _ = worker_step(w, s.build_connector_meta(None), finished={"p"})
        assert not sending
        sending, _, _ = step_until(w, type(s.build_connector_meta(None))(), want=lambda a, b: "p" in a, limit_s=5)
        assert sending == {"p"}
    finally:
        s.shutdown()
        w.shutdown()


def test_vllm_request_finished_edge_cases(vmod, store):
    s = vmod.m.XferConnector(vconfig("kv_producer", "pre-e", store.endpoint), vmod.Role.SCHEDULER)
    assert finished(s, req("a", [1, 2], {"do_remote_decode": True}, vmod.Status.FINISHED_ABORTED, vmod),
                    [1]) == (False, None)
    assert finished(s, req("b", [1, 2], None, vm=vmod), [1]) == (False, None)
    assert finished(s, req("c", [1, 2], {"do_remote_decode": True}, vm=vmod), []) == (False, None)
    assert s.build_connector_meta(None).holds == []
    # a prefill whose only sampled token is end-of-sequence (FINISHED_STOPPED) hands off too, as NIXL does
    delay, params = finished(s, req("e", [1, 2], {"do_remote_decode": True}, vmod.Status.FINISHED_STOPPED, vmod), [4])
    assert delay and params["remote_block_ids"] == [4]
    assert [h.req_id for h in s.build_connector_meta(None).holds] == ["e"]
    with pytest.raises(ValueError, match="one KV cache group"):
        s.request_finished_all_groups(req("d", [1], {}, vm=vmod), ([1], [2]))
    with pytest.raises(ValueError, match="lease_s"):
        vmod.m.XferConnector(vconfig("kv_producer", "x", store.endpoint, lease_s=1.0, timeout_s=5.0),
                             vmod.Role.SCHEDULER)


def test_vllm_layout_detection(vmod):
    lay = vmod.m.vllm_layer_layout
    assert lay(torch.empty(2, 6, 4, 2, 8), mla=False).name == "vllm_flash_attn_nhd"
    assert lay(torch.empty(2, 6, 2, 4, 8).permute(0, 1, 3, 2, 4), mla=False).name == "vllm_flash_attn_hnd"
    assert lay(torch.empty(6, 2, 4, 2, 8), mla=False).name == "vllm_flashinfer"
    assert lay(torch.empty(6, 2, 4, 16), mla=False).name == "packed_kv"
    assert lay(torch.empty(6, 1, 4, 576, dtype=torch.bfloat16), mla=True).name == "mla"
    assert lay(torch.empty(6, 4, 656, dtype=torch.uint8), mla=True).name == "mla_fp8"
    with pytest.raises(ValueError, match="layout"):
        lay(torch.empty(6, 4), mla=False)


# ---- SGLang ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1)])
def test_sglang_prefill_to_decode(smod, p_tp, d_tp, monkeypatch):
    monkeypatch.setattr(smod.m, "_TRANSPORTS", ("local",))
    run_sglang_pd(smod.m, smod.KVArgs, smod.KVPoll, p_tp=p_tp, d_tp=d_tp)


def test_sglang_failure(smod, monkeypatch):
    monkeypatch.setattr(smod.m, "_TRANSPORTS", ("local",))
    run_sglang_failure(smod.m, smod.KVArgs, smod.KVPoll)


def test_sglang_hook_patches_closed_backend_list(smod):
    import enum
    from types import ModuleType

    class TransferBackend(enum.Enum):
        MOONCAKE = "mooncake"
        NIXL = "nixl"

    class KVClassType(enum.Enum):
        KVARGS = "kvargs"
        MANAGER = "manager"
        SENDER = "sender"
        RECEIVER = "receiver"
        BOOTSTRAP_SERVER = "bootstrap_server"

    def get_kv_class(backend, class_type):
        return f"native-{backend.value}-{class_type.value}"

    utils = ModuleType("fake_utils")
    utils.TransferBackend, utils.KVClassType, utils.get_kv_class = TransferBackend, KVClassType, get_kv_class
    from xfer.engine.sglang_plugin import install
    install("mooncake", module=utils)
    assert utils.get_kv_class(TransferBackend.MOONCAKE, KVClassType.MANAGER) is smod.m.XferKVManager
    assert utils.get_kv_class(TransferBackend.MOONCAKE, KVClassType.BOOTSTRAP_SERVER) is smod.m.XferKVBootstrapServer
    assert utils.get_kv_class(TransferBackend.MOONCAKE, KVClassType.KVARGS) == "native-mooncake-kvargs"
    assert utils.get_kv_class(TransferBackend.NIXL, KVClassType.SENDER) == "native-nixl-sender"
    patched = utils.get_kv_class
    install("mooncake", module=utils)  # idempotent
    assert utils.get_kv_class is patched


def test_sglang_hook_reaches_spawned_processes(tmp_path):
    """A process started with the launcher's environment (XFER_SGLANG_REPLACE + the hook dir on
    PYTHONPATH) patches SGLang's get_kv_class the moment SGLang's utils are imported."""
    import os
    import subprocess
    import sys

    from xfer.engine.sglang_plugin import hook_dir

    pkg = tmp_path / "sglang" / "srt" / "disaggregation"
    (pkg / "base").mkdir(parents=True)
    for d in (tmp_path / "sglang", tmp_path / "sglang" / "srt", pkg, pkg / "base"):
        (d / "__init__.py").write_text("")
    (pkg / "base" / "conn.py").write_text(
        "class KVPoll:\n    Failed, Bootstrapping, WaitingForInput, Transferring, Success = range(5)\n"
        "class BaseKVManager: pass\nclass BaseKVSender: pass\nclass BaseKVReceiver: pass\n"
        "class BaseKVBootstrapServer: pass\n")
    (pkg / "utils.py").write_text(
        "import enum\nclass TransferBackend(enum.Enum):\n    MOONCAKE = 'mooncake'\n"
        "class KVClassType(enum.Enum):\n    KVARGS = 'kvargs'\n    MANAGER = 'manager'\n"
        "def get_kv_class(b, t):\n    return 'native'\n")
    code = ("from sglang.srt.disaggregation.utils import get_kv_class, TransferBackend as B, KVClassType as K\n"
            "print(get_kv_class(B.MOONCAKE, K.MANAGER).__name__, get_kv_class(B.MOONCAKE, K.KVARGS))")
    env = {**os.environ, "XFER_SGLANG_REPLACE": "mooncake",
           "PYTHONPATH": os.pathsep.join([hook_dir(), str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["XferKVManager", "native"], out.stderr[-2000:]
