"""Harnesses that replay an engine's call order against the xfer drop-ins with real tensors.

Used with the real engines (tests/test_dropin_vllm.py, tests/test_dropin_sglang.py, opt-in) and
with fakes of their base classes (tests/test_dropin_fakes.py, always run): the fakes stand in for
the few names ``engine/vllm_connector.py`` and ``engine/sglang_conn.py`` import, so CI exercises
the adapters' logic without installing an engine.
"""

from __future__ import annotations

import socket
import sys
import time
import types
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import torch

POISON = 0x5A


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll_until(fn, want, limit_s=15.0, what="state"):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        got = fn()
        if got == want:
            return got
        time.sleep(0.005)
    raise AssertionError(f"{what} never became {want!r} (last {got!r})")


# ---- SGLang ----------------------------------------------------------------------------------------
class SglangRank:
    """One SGLang TP rank's token pool ``k[l], v[l]``: ``(pages*page, heads, dim)`` and aux rows."""

    def __init__(self, *, layers, pages, page, heads, dim, dtype=torch.bfloat16, aux_rows=4, aux_items=(8, 16),
                 seed=None, mla=False):
        n = pages * page
        self.page, self.mla = page, mla
        self.k = [torch.empty(n, heads, dim, dtype=dtype) for _ in range(layers)]
        self.v = [] if mla else [torch.empty(n, heads, dim, dtype=dtype) for _ in range(layers)]
        self.aux = [torch.empty(aux_rows, item, dtype=torch.uint8) for item in aux_items]
        for t in self.k + self.v + self.aux:
            t.view(torch.uint8).fill_(POISON)
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            for t in self.k + self.v + self.aux:
                t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8,
                                                        generator=g))

    def kv_args(self, KVArgs, *, rank, total_heads):
        a = KVArgs()
        bufs = self.k + self.v  # SGLang lists K buffers, then V buffers
        a.engine_rank, a.page_size, a.gpu_id = rank, self.page, 0
        a.kv_data_ptrs = [t.data_ptr() for t in bufs]
        a.kv_data_lens = [t.nbytes for t in bufs]
        a.kv_item_lens = [t[0].nbytes * self.page for t in bufs]
        a.kv_head_num, a.total_kv_head_num = self.k[0].shape[1], total_heads
        a.num_draft_entries = 0
        a.aux_data_ptrs = [t.data_ptr() for t in self.aux]
        a.aux_data_lens = [t.nbytes for t in self.aux]
        a.aux_item_lens = [t[0].nbytes for t in self.aux]
        return a

    def pages_bytes(self, layer_bufs, pages, heads=None):
        out = []
        for t in layer_bufs:
            x = t.view(-1, self.page, *t.shape[1:])[torch.as_tensor(pages)]
            if heads is not None:
                x = x[:, :, heads[0]:heads[1]]
            out.append(x.contiguous().view(torch.uint8).reshape(-1))
        return torch.cat(out)


def server_args(port, tp):
    return SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=port, tp_size=tp)


def run_sglang_pd(mod, KVArgs, KVPoll, *, p_tp=1, d_tp=1, total_heads=2, layers=3, page=4, dim=8, mla=False,
                  chunks=2):
    """Prefill ranks -> decode ranks through the SGLang backend classes in ``mod``; checks every byte."""
    port = free_port()
    addr = f"127.0.0.1:{port}"
    server = mod.XferKVBootstrapServer("127.0.0.1", port)
    heads_p = 1 if mla else max(1, total_heads // p_tp)
    heads_d = 1 if mla else max(1, total_heads // d_tp)
    P = [SglangRank(layers=layers, pages=12, page=page, heads=heads_p, dim=dim, seed=10 + r, mla=mla)
         for r in range(p_tp)]
    D = [SglangRank(layers=layers, pages=16, page=page, heads=heads_d, dim=dim, mla=mla) for _ in range(d_tp)]
    mgrs = []
    try:
        pm = [mod.XferKVManager(P[r].kv_args(KVArgs, rank=r, total_heads=total_heads), "prefill",
                                server_args(port, p_tp), is_mla_backend=mla) for r in range(p_tp)]
        mgrs += pm
        dm = [mod.XferKVManager(D[r].kv_args(KVArgs, rank=r, total_heads=total_heads), "decode",
                                server_args(port, d_tp), is_mla_backend=mla) for r in range(d_tp)]
        mgrs += dm
        room, p_pages, d_pages, p_aux, d_aux = 4242, [7, 2, 9, 4, 0], [3, 11, 5, 14, 8], 1, 3
        receivers = [mod.XferKVReceiver(m, addr, room) for m in dm]
        senders = [mod.XferKVSender(m, addr, room) for m in pm]
        for s in senders:
            s.init(len(p_pages), p_aux)
            assert s.poll() == KVPoll.Bootstrapping
        for r in receivers:
            r.init(0)  # returns at once: the bootstrap look-up runs on the manager's Background
            poll_until(r.poll, KVPoll.WaitingForInput, what="receiver bootstrap")
            r.send_metadata(np.asarray(d_pages, dtype=np.int32), d_aux)
        for s in senders:
            poll_until(s.poll, KVPoll.WaitingForInput, what="sender")
            step = -(-len(p_pages) // chunks)
            for i in range(0, len(p_pages), step):  # SGLang sends chunk by chunk (chunked prefill)
                s.send(np.asarray(p_pages[i:i + step], dtype=np.int32))
        for s in senders:
            poll_until(s.poll, KVPoll.Success, what="sender")
        for r in receivers:
            poll_until(r.poll, KVPoll.Success, what="receiver")
        # byte for byte: every decode rank's heads come from the prefill ranks holding them
        for d, rank_d in enumerate(D):
            for layer in range(layers):
                for kv in ("k",) if mla else ("k", "v"):
                    got = rank_d.pages_bytes([getattr(rank_d, kv)[layer]], d_pages)
                    if mla:
                        want = P[d % p_tp].pages_bytes([getattr(P[d % p_tp], kv)[layer]], p_pages)
                    else:
                        parts = []
                        d0 = d * heads_d
                        for h in range(d0, d0 + heads_d):
                            src = min(h // heads_p, p_tp - 1)
                            local = h - src * heads_p
                            parts.append(getattr(P[src], kv)[layer].view(-1, page, heads_p, dim)[
                                torch.as_tensor(p_pages)][:, :, local:local + 1])
                        want = torch.cat(parts, dim=2).contiguous().view(torch.uint8).reshape(-1)
                    assert torch.equal(got, want), f"decode rank {d} layer {layer} {kv}"
                    rest = sorted(set(range(16)) - set(d_pages))
                    assert (rank_d.pages_bytes([getattr(rank_d, kv)[layer]], rest) == POISON).all()
            for i, aux in enumerate(rank_d.aux):
                src0 = d % p_tp if mla else min(d * heads_d // heads_p, p_tp - 1)
                assert torch.equal(aux[d_aux], P[src0].aux[i][p_aux]), "aux row"
                assert (aux[[0, 1, 2]] == POISON).all()
    finally:
        for m in mgrs:
            m.close()
        server.close()


def run_sglang_failure(mod, KVArgs, KVPoll):
    """The prefill side aborts: the decode side ends Failed with a typed error, nobody hangs."""
    port = free_port()
    addr = f"127.0.0.1:{port}"
    server = mod.XferKVBootstrapServer("127.0.0.1", port)
    P = SglangRank(layers=2, pages=8, page=4, heads=2, dim=8, seed=1)
    D = SglangRank(layers=2, pages=8, page=4, heads=2, dim=8)
    pm = mod.XferKVManager(P.kv_args(KVArgs, rank=0, total_heads=2), "prefill", server_args(port, 1))
    dm = mod.XferKVManager(D.kv_args(KVArgs, rank=0, total_heads=2), "decode", server_args(port, 1))
    try:
        r = mod.XferKVReceiver(dm, addr, 7)
        r.init(0)
        poll_until(r.poll, KVPoll.WaitingForInput, what="receiver bootstrap")
        r.send_metadata(np.asarray([1, 2], dtype=np.int32), 0)
        s = mod.XferKVSender(pm, addr, 7)
        s.init(2, 0)
        poll_until(s.poll, KVPoll.WaitingForInput, what="sender")
        s.abort()
        assert s.poll() == KVPoll.Failed
        poll_until(r.poll, KVPoll.Failed, what="receiver")
        try:
            r.failure_exception()
        except mod.XferTransferError as exc:
            assert "7" in str(exc)
        else:
            raise AssertionError("failure_exception did not raise")
        assert (D.pages_bytes(D.k, [1, 2]) == POISON).all()  # nothing was written
    finally:
        pm.close()
        dm.close()
        server.close()


def _pair(mod, KVArgs, port, *, seed=1):
    """A prefill and a decode manager (TP 1, 2 heads) on a bootstrap server at ``port``."""
    P = SglangRank(layers=2, pages=8, page=4, heads=2, dim=8, seed=seed)
    D = SglangRank(layers=2, pages=8, page=4, heads=2, dim=8)
    pm = mod.XferKVManager(P.kv_args(KVArgs, rank=0, total_heads=2), "prefill", server_args(port, 1))
    dm = mod.XferKVManager(D.kv_args(KVArgs, rank=0, total_heads=2), "decode", server_args(port, 1))
    return P, D, pm, dm


def run_sglang_abort(mod, KVArgs, KVPoll):
    """Case 8: a decode abort reaches the prefill: its sender ends Failed within 1 s and writes
    nothing into the aborted room's pages, even when SGLang hands it the KV afterwards."""
    port = free_port()
    addr = f"127.0.0.1:{port}"
    server = mod.XferKVBootstrapServer("127.0.0.1", port)
    P, D, pm, dm = _pair(mod, KVArgs, port)
    try:
        r = mod.XferKVReceiver(dm, addr, 11)
        r.init(0)
        poll_until(r.poll, KVPoll.WaitingForInput, what="receiver bootstrap")
        r.send_metadata(np.asarray([1, 2], dtype=np.int32), 0)
        s = mod.XferKVSender(pm, addr, 11)
        s.init(2, 0)
        poll_until(s.poll, KVPoll.WaitingForInput, what="sender")
        t0 = time.monotonic()
        r.abort()
        assert r.poll() == KVPoll.Failed and r.abort_notified
        poll_until(s.poll, KVPoll.Failed, limit_s=5, what="sender after the decode's abort")
        assert time.monotonic() - t0 < 1.0, time.monotonic() - t0
        s.send(np.asarray([5, 6], dtype=np.int32))  # a forward that was in flight hands the KV over anyway
        assert s.poll() == KVPoll.Failed
        time.sleep(0.3)
        assert (D.pages_bytes(D.k + D.v, [1, 2]) == POISON).all()  # not one byte landed
        assert (D.aux[0] == POISON).all()
    finally:
        pm.close()
        dm.close()
        server.close()


def run_sglang_unknown_prefill(mod, KVArgs, KVPoll, *, timeout_s, step=None):
    """Case 9: a bootstrap address nobody serves fails the request by about ``timeout_s``; no call
    into the backend waits (``step()``, default ``receiver.poll``, is what the scheduler loop runs).
    Returns (seconds to Failed, the longest call)."""
    D = SglangRank(layers=2, pages=8, page=4, heads=2, dim=8)
    dm = mod.XferKVManager(D.kv_args(KVArgs, rank=0, total_heads=2), "decode", server_args(free_port(), 1))
    try:
        r = mod.XferKVReceiver(dm, f"127.0.0.1:{free_port()}", 3)
        t0 = time.monotonic()
        r.init(0)
        worst = time.monotonic() - t0
        while r.poll() != KVPoll.Failed:
            c0 = time.monotonic()
            (step or r.poll)()
            worst = max(worst, time.monotonic() - c0)
            assert time.monotonic() - t0 < timeout_s + 10, "the request never failed"
            time.sleep(0.01)
        with pytest_raises(mod.XferTransferError, "127.0.0.1"):
            r.failure_exception()
        return time.monotonic() - t0, worst
    finally:
        dm.close()


def run_sglang_dead_prefill(mod, KVArgs, KVPoll, *, timeout_s):
    """Case 9: the prefill dies after the decode asked for the KV: the room fails within about
    ``timeout_s`` (the liveness probe), not after SGLang's 300 s waiting timeout."""
    port = free_port()
    addr = f"127.0.0.1:{port}"
    server = mod.XferKVBootstrapServer("127.0.0.1", port)
    P, D, pm, dm = _pair(mod, KVArgs, port)
    try:
        r = mod.XferKVReceiver(dm, addr, 5)
        r.init(0)
        poll_until(r.poll, KVPoll.WaitingForInput, what="receiver bootstrap")
        r.send_metadata(np.asarray([1, 2], dtype=np.int32), 0)
        assert r.poll() == KVPoll.Transferring
        time.sleep(0.2)
        pm.close()  # the prefill rank is gone: its agent's port refuses
        t0 = time.monotonic()
        poll_until(r.poll, KVPoll.Failed, limit_s=timeout_s + 5, what="receiver of a dead prefill")
        return time.monotonic() - t0
    finally:
        pm.close()
        dm.close()
        server.close()


def run_sglang_frozen_prefill(mod, KVArgs, KVPoll, *, timeout_s):
    """Case 9: a prefill instance in its own process (bootstrap server + prefill manager) is frozen
    with SIGSTOP after the decode asked it for a room: the room fails within about ``timeout_s``
    (the liveness probe gets no answer) and no poll waits. Returns (seconds to Failed, longest poll)."""
    import os
    import select
    import signal
    import subprocess

    port = free_port()
    addr = f"127.0.0.1:{port}"
    env = dict(os.environ, XFER_SGLANG_TIMEOUT_S=str(timeout_s), XFER_SGLANG_TRANSPORTS="local")
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "sglang-prefill", str(port)],
                             stdout=subprocess.PIPE, text=True, env=env)
    D = SglangRank(layers=2, pages=8, page=4, heads=2, dim=8)
    dm = None
    try:
        assert select.select([child.stdout], [], [], 60)[0] and child.stdout.readline().strip() == "ready"
        dm = mod.XferKVManager(D.kv_args(KVArgs, rank=0, total_heads=2), "decode", server_args(port, 1))
        r = mod.XferKVReceiver(dm, addr, 13)
        r.init(0)
        poll_until(r.poll, KVPoll.WaitingForInput, what="receiver bootstrap")
        r.send_metadata(np.asarray([1, 2], dtype=np.int32), 0)
        time.sleep(0.5)
        assert r.poll() == KVPoll.Transferring
        os.kill(child.pid, signal.SIGSTOP)
        t0, worst = time.monotonic(), 0.0
        while True:
            c0 = time.monotonic()
            state = r.poll()
            worst = max(worst, time.monotonic() - c0)
            if state == KVPoll.Failed:
                break
            assert time.monotonic() - t0 < timeout_s + 10, "the room never failed"
            time.sleep(0.005)
        return time.monotonic() - t0, worst
    finally:
        child.kill()  # SIGKILL ends a stopped process too
        child.wait()
        if dm is not None:
            dm.close()


def _sglang_prefill_main(port: int) -> None:
    """Child process: SGLang's classes (or the fakes), a bootstrap server and one prefill rank."""
    import importlib
    try:
        import sglang.srt.disaggregation.base.conn as conn  # noqa: F401
    except ImportError:
        mods, _, _ = fake_sglang()
        sys.modules.update(mods)
    mod = importlib.import_module("xfer.engine.sglang_conn")
    KVArgs = sys.modules["sglang.srt.disaggregation.base.conn"].KVArgs
    server = mod.XferKVBootstrapServer("127.0.0.1", port)
    P = SglangRank(layers=2, pages=8, page=4, heads=2, dim=8, seed=1)
    pm = mod.XferKVManager(P.kv_args(KVArgs, rank=0, total_heads=2), "prefill", server_args(port, 1))
    print("ready", flush=True)
    try:
        while True:  # the prefill's scheduler loop, idle: it drains what decode ranks send
            pm.pump()
            time.sleep(0.01)
    finally:
        pm.close()
        server.close()


def pytest_raises(exc, text):
    import pytest
    return pytest.raises(exc, match=text)


# ---- fakes of the engines' base classes --------------------------------------------------------------
def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


_DEPENDENTS = {"xfer.engine.sglang_conn": ("xfer.engine.sglang_rooms",)}  # modules that import the faked ones too


@contextmanager
def fake_modules(modules: dict, reload: str):
    """Temporarily install ``modules`` in sys.modules (shadowing real ones) and import ``reload`` fresh."""
    import importlib
    fresh = [reload, *_DEPENDENTS.get(reload, ())]
    saved = {k: sys.modules.get(k) for k in [*modules, *fresh]}
    try:
        sys.modules.update(modules)
        for name in fresh:
            sys.modules.pop(name, None)
        yield importlib.import_module(reload)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def fake_sglang():
    class KVPoll:
        Failed, Bootstrapping, WaitingForInput, Transferring, Success = range(5)

    class KVArgs:
        pass

    class _Base:
        def __init__(self, *a, **k):
            pass

    class KVTransferMetric:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    conn = _module("sglang.srt.disaggregation.base.conn", KVPoll=KVPoll, KVArgs=KVArgs, KVTransferMetric=KVTransferMetric,
                   BaseKVManager=type("BaseKVManager", (_Base,), {}), BaseKVSender=type("BaseKVSender", (_Base,), {}),
                   BaseKVReceiver=type("BaseKVReceiver", (_Base,), {}),
                   BaseKVBootstrapServer=type("BaseKVBootstrapServer", (_Base,), {}))
    names = ["sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.disaggregation.base"]
    mods = {n: _module(n) for n in names}
    mods[conn.__name__] = conn
    return mods, KVArgs, KVPoll


def fake_vllm():
    import enum

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:
        pass

    class SupportsHMA:
        pass

    class KVConnectorBase_V1:
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._vllm_config, self._role, self._kv_cache_config = vllm_config, role, kv_cache_config
            self._connector_metadata = None

        def bind_connector_metadata(self, m):
            self._connector_metadata = m

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def _get_connector_metadata(self):
            return self._connector_metadata

        def get_transfer_results(self, finished_req_ids):  # vLLM 0.33's default: get_finished's two sets
            sending, recving = self.get_finished(finished_req_ids)
            return types.SimpleNamespace(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                         failed_recving=set())

    class RequestStatus(enum.IntEnum):
        RUNNING = 5
        FINISHED_STOPPED = 7
        FINISHED_LENGTH_CAPPED = 8
        FINISHED_ABORTED = 9

    base = _module("vllm.distributed.kv_transfer.kv_connector.v1.base", KVConnectorBase_V1=KVConnectorBase_V1,
                   KVConnectorMetadata=KVConnectorMetadata, KVConnectorRole=KVConnectorRole, SupportsHMA=SupportsHMA)
    req = _module("vllm.v1.request", RequestStatus=RequestStatus)
    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
             "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.v1"]
    mods = {n: _module(n) for n in names}
    mods[base.__name__], mods[req.__name__] = base, req
    return mods, KVConnectorRole, RequestStatus


if __name__ == "__main__":
    if sys.argv[1] == "sglang-prefill":
        _sglang_prefill_main(int(sys.argv[2]))
