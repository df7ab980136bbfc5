"""xfer's SGLang transfer backend with SGLang's real base classes (opt-in: needs SGLang installed,
see README.md, "Running the engine tests"). The harness replays SGLang's call order: bootstrap server, managers
(prefill registers to bootstrap), receiver ``init`` / ``send_metadata``, sender ``init`` / chunked
``send``, both polled to ``KVPoll.Success``; decode pages and aux rows are checked byte for byte."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed (opt-in engine tests: see the README section Running the engine tests)")
conn = pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="SGLang's disaggregation base is missing")

from dropin_harness import run_sglang_failure, run_sglang_pd  # noqa: E402

sglang_conn = pytest.importorskip("xfer.engine.sglang_conn")
pytestmark = pytest.mark.timeout(120)


def test_classes_implement_sglang_bases():
    assert issubclass(sglang_conn.XferKVManager, conn.BaseKVManager)
    assert issubclass(sglang_conn.XferKVSender, conn.BaseKVSender)
    assert issubclass(sglang_conn.XferKVReceiver, conn.BaseKVReceiver)
    assert issubclass(sglang_conn.XferKVBootstrapServer, conn.BaseKVBootstrapServer)
    for cls in (sglang_conn.XferKVManager, sglang_conn.XferKVSender, sglang_conn.XferKVReceiver):
        assert not getattr(cls, "__abstractmethods__", None), f"{cls.__name__} leaves {cls.__abstractmethods__}"


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2)])
def test_prefill_to_decode(p_tp, d_tp):
    run_sglang_pd(sglang_conn, conn.KVArgs, conn.KVPoll, p_tp=p_tp, d_tp=d_tp, total_heads=2)


def test_mla():
    run_sglang_pd(sglang_conn, conn.KVArgs, conn.KVPoll, mla=True, total_heads=1, dim=576)


def test_failure_is_reported():
    run_sglang_failure(sglang_conn, conn.KVArgs, conn.KVPoll)


def test_hook_replaces_backend_in_sglang():
    import os
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import sglang_queues; sglang_queues._stub_torchvision();"
            "import xfer.engine.sglang_plugin as p, xfer.engine.sglang_conn as c; p.install_import_hook('mooncake');"
            "from sglang.srt.disaggregation.utils import get_kv_class, TransferBackend as T, KVClassType as K;"
            "assert get_kv_class(T.MOONCAKE, K.MANAGER) is c.XferKVManager;"
            "assert get_kv_class(T.NIXL, K.MANAGER).__name__ != 'XferKVManager'; print('hooked')")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__))],
                         capture_output=True, text=True, timeout=120)
    assert "hooked" in out.stdout, out.stderr[-2000:]


# ---- issue 31: SGLang's own decode queue code; aborts; a dead or unknown prefill ------------------------
FAST_S = 0.1  # a scheduler-loop call that returns within this did not wait on the network


@pytest.fixture(scope="module")
def queues():
    from dropin_harness import free_port
    from sglang_queues import gloo_group, import_decode
    try:
        decode, utils = import_decode()
    except ImportError as exc:
        pytest.skip(f"SGLang's decode queue does not import here: {exc}")
    return decode, utils, gloo_group(free_port())


def test_decode_prealloc_queue_drives_the_backend(queues, monkeypatch):
    """Case 7: SGLang's DecodePreallocQueue.add / _resolve_pending_reqs / _update_handshake_waiters
    and the transfer queue's poll_and_all_reduce, unchanged, bootstrap a request through xfer (the
    first from the pending path, the second from the cached fast path); every call returns at once
    and the KV lands byte for byte."""
    import time

    import numpy as np

    from dropin_harness import POISON, SglangRank, free_port, poll_until, server_args
    from sglang_queues import prealloc_queue, request, scheduler_step

    decode, utils, group = queues
    port = free_port()
    addr = f"127.0.0.1:{port}"
    server = sglang_conn.XferKVBootstrapServer("127.0.0.1", port)
    P = SglangRank(layers=2, pages=8, page=4, heads=2, dim=8, seed=7)
    D = SglangRank(layers=2, pages=8, page=4, heads=2, dim=8)
    pm = sglang_conn.XferKVManager(P.kv_args(conn.KVArgs, rank=0, total_heads=2), "prefill", server_args(port, 1))
    dm = sglang_conn.XferKVManager(D.kv_args(conn.KVArgs, rank=0, total_heads=2), "decode", server_args(port, 1))
    try:
        q = prealloc_queue(decode, dm, group, monkeypatch)
        q.add(request("r1", addr, 21))  # on the old backend: AttributeError prefill_info_table
        (dreq,) = q.queue
        assert isinstance(dreq.kv_receiver, sglang_conn.XferKVReceiver) and q.pending_reqs == [dreq]
        worst, t0 = 0.0, time.monotonic()
        while not dreq.waiting_for_input:
            c0 = time.monotonic()
            scheduler_step(q)
            worst = max(worst, time.monotonic() - c0)
            assert dreq.req.finished_reason is None, dreq.req.finished_reason
            assert time.monotonic() - t0 < 10, "the handshake never finished"
            time.sleep(0.01)
        assert worst < FAST_S, f"a scheduler-loop call took {worst:.3f} s"
        q.add(request("r2", addr, 22))  # cached: initialised at once, not pending
        assert q.pending_reqs == [] and len(q.queue) == 2
        dreq.kv_receiver.send_metadata(np.asarray([3, 6], dtype=np.int32), 2)
        s = sglang_conn.XferKVSender(pm, addr, 21)
        s.init(2, 1)
        poll_until(lambda: utils.poll_and_all_reduce([s], group)[0], conn.KVPoll.WaitingForInput, what="sender")
        s.send(np.asarray([5, 0], dtype=np.int32))
        poll_until(lambda: utils.poll_and_all_reduce([s], group)[0], conn.KVPoll.Success, what="sender")
        poll_until(lambda: utils.poll_and_all_reduce([dreq.kv_receiver], group)[0], conn.KVPoll.Success,
                   what="receiver")
        assert torch.equal(D.pages_bytes(D.k + D.v, [3, 6]), P.pages_bytes(P.k + P.v, [5, 0]))
        assert (D.pages_bytes(D.k + D.v, [0, 1, 2, 4, 5, 7]) == POISON).all()
        assert torch.equal(D.aux[0][2], P.aux[0][1])
    finally:
        pm.close()
        dm.close()
        server.close()


def test_unknown_prefill_fails_through_the_queue_without_blocking(queues, monkeypatch):
    """Case 9: a request whose bootstrap address nobody serves is failed by SGLang's handshake
    waiter (prepare_abort, our error) within TIMEOUT_S plus SGLang's 1 s retry; no call of the
    scheduler loop waits on it."""
    import time

    from dropin_harness import SglangRank, free_port, server_args
    from sglang_queues import prealloc_queue, request, scheduler_step

    decode, _, group = queues
    monkeypatch.setattr(sglang_conn, "TIMEOUT_S", 1.0)
    D = SglangRank(layers=2, pages=8, page=4, heads=2, dim=8)
    dm = sglang_conn.XferKVManager(D.kv_args(conn.KVArgs, rank=0, total_heads=2), "decode",
                                   server_args(free_port(), 1))
    try:
        q = prealloc_queue(decode, dm, group, monkeypatch)
        addr = f"127.0.0.1:{free_port()}"
        q.add(request("r", addr, 9))
        (dreq,) = q.queue
        worst, t0 = 0.0, time.monotonic()
        while dreq.req.finished_reason is None:
            c0 = time.monotonic()
            scheduler_step(q)
            worst = max(worst, time.monotonic() - c0)
            assert time.monotonic() - t0 < 15, "the request was never failed"
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
        print(f"unknown prefill through SGLang's queue: failed after {elapsed:.2f} s, longest call "
              f"{worst * 1000:.1f} ms")
        assert worst < FAST_S and elapsed < 1.0 + 1.0 + 3.0, (worst, elapsed)
        assert addr in str(dreq.req.finished_reason.message)
    finally:
        dm.close()


def test_decode_abort_reaches_the_prefill():
    from dropin_harness import run_sglang_abort
    run_sglang_abort(sglang_conn, conn.KVArgs, conn.KVPoll)


def test_dead_prefill_fails_a_waiting_room(monkeypatch):
    from dropin_harness import run_sglang_dead_prefill
    monkeypatch.setattr(sglang_conn, "TIMEOUT_S", 2.0)
    assert run_sglang_dead_prefill(sglang_conn, conn.KVArgs, conn.KVPoll, timeout_s=2.0) < 4.0


def test_frozen_prefill_process_fails_a_waiting_room(monkeypatch):
    from dropin_harness import run_sglang_frozen_prefill
    monkeypatch.setattr(sglang_conn, "TIMEOUT_S", 2.0)
    elapsed, worst = run_sglang_frozen_prefill(sglang_conn, conn.KVArgs, conn.KVPoll, timeout_s=2.0)
    assert worst < 0.1 and elapsed < 5.0, (elapsed, worst)
