"""CUDA IPC transport. GPU tests: two processes on one GPU (and across GPUs where there are
several): every layout, push and pull, concurrency, the seed case at full size, a killed peer.
CPU tests: the handle bookkeeping that needs no GPU."""

import threading
import time

import pytest
import torch

from helpers import PeerProcess, assert_blocks_equal, assert_untouched, fill_random, small_dims
from xfer import Agent, AgentConfig, LayoutKind, TransferState, make_kv_cache
from xfer.errors import InvalidArgumentError, PeerDisconnectedError, TransferTimeoutError, TransportError
from xfer.transports.onesided.ipc import decode_share, encode_share

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def device_pairs():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return [(0, 0)] + ([(0, 1)] if n > 1 else [])


# ---- CPU: bookkeeping ---------------------------------------------------------------------
def test_share_descriptor_round_trip():
    share = (3, b"\x01" * 64, 1 << 30, 4096, b"rc-file", 16, b"\x02" * 64, True)
    d = encode_share(share, tensor_offset=512, uuid="GPU-1234")
    assert decode_share(d) == share and d["tensor_offset"] == 512 and d["uuid"] == "GPU-1234"
    with pytest.raises(TransportError, match="malformed CUDA IPC descriptor"):
        decode_share({"device": 0})


def test_copy_path_config_is_checked():
    assert AgentConfig().copy_path is None
    assert AgentConfig(copy_path="Copy_Engine_Batch").copy_path == "batch"
    assert AgentConfig(copy_path="2d").copy_path == "2d" and AgentConfig(copy_path="triton").copy_path == "kernel"
    for bad in ("dma", 3, ""):
        with pytest.raises(InvalidArgumentError, match="copy_path"):
            AgentConfig(copy_path=bad)


def test_memory_outside_torchs_allocator_is_refused_by_name():
    """An NVSHMEM symmetric heap (or any memory torch did not allocate) cannot be exported by CUDA
    IPC: the region is published as unshareable and the route names why, so selection moves on."""
    from types import SimpleNamespace

    from xfer.metadata import RegionRecord
    from xfer.transports.onesided.ipc import IpcTransport

    class Storage:
        def _share_cuda_(self):
            raise RuntimeError("invalid device pointer: 0x329c40a00\nmore")

    tensor = SimpleNamespace(untyped_storage=Storage)
    region = SimpleNamespace(device=torch.device("cuda", 0), tensors=[tensor], name="kv")
    export = IpcTransport.export_region(SimpleNamespace(), region)
    assert export == {"unshareable": "base tensor 0 cannot be exported by CUDA IPC: invalid device pointer: "
                                     "0x329c40a00"}
    tr = SimpleNamespace(kind=IpcTransport.kind, ctx=SimpleNamespace(host_id="h"))
    rec = RegionRecord(name="kv", layout=make_kv_cache("mla", **small_dims("mla"))[1], device="cuda:0",
                       exports={"ipc": export})
    peer = SimpleNamespace(metadata=SimpleNamespace(transports={"ipc": {"host_id": "h"}}, name="p", hostname="x"))
    why = IpcTransport.check_route(tr, region, peer, rec, None)
    assert why.startswith("peer region 'kv': base tensor 0 cannot be exported by CUDA IPC")


def test_peer_liveness_sees_a_killed_unreaped_process():
    """The check before every launch to a peer: a kill is seen at once, even before the process is
    reaped (a zombie), and a later check of a live peer polls its cached pidfd."""
    import subprocess

    from xfer import shm

    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert shm.pid_alive(proc.pid) and shm.pid_alive(proc.pid)
        assert proc.pid in shm._PIDFDS or not hasattr(shm.os, "pidfd_open")
        proc.kill()
        end = time.monotonic() + 5
        while shm.pid_alive(proc.pid) and time.monotonic() < end:
            time.sleep(0.01)
        assert not shm.pid_alive(proc.pid) and proc.pid not in shm._PIDFDS
    finally:
        proc.kill()
        proc.wait()
    assert not shm.pid_alive(proc.pid)


def test_peer_liveness_checked_from_several_threads_at_once():
    """Launches to one peer check it from several threads (the poster's inline launch, the worker,
    a copy's own thread): each check polls the cached pidfd with a poll object of its own (one
    object polled by two threads at once raises RuntimeError, which failed the transfer)."""
    import subprocess
    import threading

    from xfer import shm

    proc = subprocess.Popen(["sleep", "30"])
    errors, stop = [], time.monotonic() + 1.0

    def check():
        try:
            while time.monotonic() < stop:
                for _ in range(200):
                    assert shm.pid_alive(proc.pid)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    try:
        assert shm.pid_alive(proc.pid)  # (cached from here)
        threads = [threading.Thread(target=check) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        proc.kill()
        proc.wait()
    assert errors == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report on machines without a GPU")
def test_without_cuda_ipc_is_unavailable_and_says_why():
    with Agent("x") as a:
        assert "no CUDA device" in a.unavailable[next(k for k in a.unavailable if k.value == "ipc")]
        tensors, layout = make_kv_cache(LayoutKind.MLA, **small_dims("mla"))
        a.register("kv", tensors, layout)
        with Agent("y", AgentConfig(transport="ipc")) as b:
            b.register("kv", *make_kv_cache(LayoutKind.MLA, **small_dims("mla")))
            peer = b.connect(a.metadata())
            with pytest.raises(Exception, match="pinned transport 'ipc' cannot serve .* no CUDA device"):
                b.write(peer, [0], [0])


# ---- GPU ------------------------------------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("devs", device_pairs())
@pytest.mark.parametrize("kind", list(LayoutKind))
def test_push_and_pull_every_layout(kind, devs):
    mine, theirs = devs
    dims = small_dims(kind, layers=4, blocks=16, bs=16, heads=4, hd=64)
    peer = PeerProcess("decode", kind, dims, device=f"cuda:{theirs}", seed=None)
    try:
        tensors, layout = make_kv_cache(kind, device=f"cuda:{mine}", **dims)
        fill_random(tensors, seed=2)
        with Agent("prefill", AgentConfig(transport="ipc")) as agent:
            agent.register("kv", tensors, layout)
            name = agent.connect(peer.metadata)
            assert agent.route(name).kind.value == "ipc"
            src, dst = [9, 1, 4, 4], [0, 15, 7, 3]
            agent.write(name, src, dst, notify=b"push").wait()
            assert peer.call("notification", 10)[:4] == ("ok", "prefill", "write", dst)
            remote = peer.tensors()
            assert_blocks_equal(layout, tensors, src, peer.tensors_layout, remote, dst)
            assert_untouched(peer.tensors_layout, remote, dst)
            # pull back what we pushed, into blocks we poison first
            for t in tensors:
                t.view(-1).view(torch.uint8)[:] = 0xA5
            agent.read(name, [0, 15], [2, 5]).wait()
            assert_blocks_equal(peer.tensors_layout, remote, [0, 15], layout, [t.cpu() for t in tensors], [2, 5])
            assert_untouched(layout, [t.cpu() for t in tensors], [2, 5])
    finally:
        peer.close()


@gpu
@needs_cuda
def test_write_orders_after_the_callers_stream():
    """KV still being written on the caller's stream when write() is called: the copy waits for it
    (after="stream", the default), or for an explicit event."""
    kind = LayoutKind.VLLM_FLASH_ATTN_NHD
    dims = small_dims(kind, layers=4, blocks=16, bs=16, heads=4, hd=64)
    peer = PeerProcess("decode", kind, dims, device="cuda:0", seed=None)
    try:
        tensors, layout = make_kv_cache(kind, device="cuda:0", **dims)
        for t in tensors:
            t.zero_()
        torch.cuda.synchronize()
        with Agent("prefill", AgentConfig(transport="ipc")) as agent:
            agent.register("kv", tensors, layout)
            name = agent.connect(peer.metadata)
            for i, mode in enumerate(["stream", "event"]):
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the fill
                for t in tensors:
                    t.view(-1).view(torch.uint8).fill_(17 + i)
                after = "stream"
                if mode == "event":
                    after = torch.cuda.Event()
                    after.record()
                agent.write(name, [3], [5 + i], after=after).wait()  # no synchronize by the caller
                remote = peer.tensors()
                assert_blocks_equal(layout, [t.cpu() for t in tensors], [3], peer.tensors_layout, remote, [5 + i])
    finally:
        peer.close()


@gpu
@needs_cuda
def test_ipc_write_granted_ahead_lands_exactly_and_asks_nothing():
    """A WRITE under a grant its target issued ahead (xfer.ahead) launches at once: no grant asked,
    the bytes exact, every other block still poisoned, the notice delivered, the token spent."""
    kind = LayoutKind.VLLM_FLASH_ATTN_NHD
    dims = small_dims(kind, layers=4, blocks=16, bs=16, heads=4, hd=64)
    peer = PeerProcess("decode", kind, dims, device="cuda:0", seed=None)
    try:
        tensors, layout = make_kv_cache(kind, device="cuda:0", **dims)
        fill_random(tensors, seed=5)
        with Agent("prefill", AgentConfig(transport="ipc")) as agent:
            agent.register("kv", tensors, layout)
            name = agent.connect(peer.metadata)
            peer.call("connect", agent.metadata())
            src, dst = [1, 4, 6], [9, 2, 12]
            token = peer.call("grant", (agent.name, dst))
            t = agent.write(name, src, dst, grant=token)
            t.wait()
            assert "asked" not in t.timeline() and "launched" in t.timeline(), t.timeline()
            remote = peer.tensors()
            assert_blocks_equal(layout, [x.cpu() for x in tensors], src, peer.tensors_layout, remote, dst)
            assert_untouched(peer.tensors_layout, remote, dst)
            assert peer.call("notification", 10)[:4] == ("ok", "prefill", "write", dst)
            with pytest.raises(InvalidArgumentError):
                agent.write(name, src, dst, grant=token)  # spent
    finally:
        peer.close()


@gpu
@needs_cuda
def test_seed_case_full_size_and_concurrency():
    kind = LayoutKind.VLLM_FLASH_ATTN_NHD
    dims = dict(num_layers=64, num_blocks=256, block_size=16, num_heads=8, head_dim=128)  # 32 KiB slices
    peer = PeerProcess("decode", kind, dims, device="cuda:0")
    try:
        tensors, layout = make_kv_cache(kind, device="cuda:0", **dims)
        fill_random(tensors, seed=3)
        from xfer.bench.target import block_digests
        with Agent("prefill") as agent:
            agent.register("kv", tensors, layout)
            name = agent.connect(peer.metadata)
            src, dst = list(range(0, 256, 2)), list(range(128, 256))
            agent.write(name, src, dst).wait()
            digests, clean = peer.call("digests", dst, timeout=120)
            assert clean and digests == block_digests(layout, tensors, src)
            # eight concurrent single-block transfers from threads
            errors = []

            def one(i):
                try:
                    agent.write(name, [i], [i]).wait()
                except Exception as exc:  # asserted below
                    errors.append(exc)
            threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            assert not errors
            digests, _ = peer.call("digests", list(range(8)), timeout=120)
            assert digests == block_digests(layout, tensors, list(range(8)))
    finally:
        peer.close()


@gpu
@needs_cuda
def test_killed_peer_ends_with_typed_error_by_deadline():
    kind = LayoutKind.VLLM_FLASH_ATTN_HND
    dims = dict(num_layers=32, num_blocks=64, block_size=16, num_heads=8, head_dim=128)
    peer = PeerProcess("decode", kind, dims, device="cuda:0")
    try:
        tensors, layout = make_kv_cache(kind, device="cuda:0", **dims)
        fill_random(tensors, seed=4)
        with Agent("prefill", AgentConfig(chunk_bytes=1)) as agent:
            agent.register("kv", tensors, layout)
            name = agent.connect(peer.metadata)
            peer.stop_signal()
            t = agent.write(name, list(range(64)), list(range(64)), timeout=10)
            time.sleep(0.2)
            peer.kill()
            start = time.monotonic()
            with pytest.raises((PeerDisconnectedError, TransferTimeoutError)):
                t.wait()
            assert time.monotonic() - start < 10
            assert t.poll() is not TransferState.DONE
    finally:
        peer.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("copy_path", ["batch", "2d", "kernel"])
@pytest.mark.parametrize("kind", [LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.VLLM_FLASH_ATTN_HND, LayoutKind.DISTSERVE],
                         ids=lambda k: k.value)
def test_push_and_pull_by_copy_engine(kind, copy_path):
    """Two processes on one GPU; the initiator moves the peer's blocks by the copy engines, and the
    transfer says which path it took."""
    from xfer.kernels import copy_engine as ce
    if copy_path != "kernel" and ce.available(copy_path):
        pytest.skip(ce.available(copy_path))
    dims = small_dims(kind, layers=4, blocks=16, bs=16, heads=4, hd=64)
    peer = PeerProcess("decode", LayoutKind.VLLM_FLASH_ATTN_NHD, dims, device="cuda:0", seed=None)
    try:
        tensors, layout = make_kv_cache(kind, device="cuda:0", **dims)
        fill_random(tensors, seed=5)
        torch.cuda.synchronize()  # the ipc stream does not wait for the default stream
        with Agent("prefill", AgentConfig(transport="ipc", copy_path=copy_path)) as agent:
            agent.register("kv", tensors, layout)
            name = agent.connect(peer.metadata)
            src, dst = [0, 2, 4, 6, 9, 9], [1, 3, 5, 7, 15, 0]
            t = agent.write(name, src, dst, notify=b"ce")
            t.wait()
            expect = {"batch": "copy_engine_batch", "2d": "copy_engine_2d", "kernel": "triton"}[copy_path]
            assert t.copy_path == expect and t.path.startswith(f"ipc (copy: {expect}; {copy_path} requested")
            assert peer.call("notification", 10)[:4] == ("ok", "prefill", "write", dst)
            remote = peer.tensors()
            assert_blocks_equal(layout, tensors, src, peer.tensors_layout, remote, dst)
            assert_untouched(peer.tensors_layout, remote, dst)
            for t_ in tensors:
                t_.view(-1).view(torch.uint8)[:] = 0xA5
            torch.cuda.synchronize()
            r = agent.read(name, [15, 1, 3], [2, 5, 6])
            r.wait()
            assert r.copy_path == expect
            local = [t_.cpu() for t_ in tensors]
            assert_blocks_equal(peer.tensors_layout, remote, [15, 1, 3], layout, local, [2, 5, 6])
            assert_untouched(layout, local, [2, 5, 6])
    finally:
        peer.close()


@gpu
@needs_cuda
def test_auto_copy_path_is_reported(monkeypatch):
    from xfer.kernels import set_copy_table
    monkeypatch.delenv("XFER_COPY_PATH", raising=False)
    monkeypatch.delenv("XFER_COPY_TABLE", raising=False)
    set_copy_table(None)
    kind = LayoutKind.VLLM_FLASH_ATTN_NHD
    dims = small_dims(kind, layers=2, blocks=8, bs=16, heads=8, hd=128)
    peer = PeerProcess("decode", kind, dims, device="cuda:0", seed=None)
    try:
        tensors, layout = make_kv_cache(kind, device="cuda:0", **dims)
        fill_random(tensors, seed=6)
        torch.cuda.synchronize()
        with Agent("prefill", AgentConfig(transport="ipc")) as agent:
            agent.register("kv", tensors, layout)
            name = agent.connect(peer.metadata)
            t = agent.write(name, [1, 2], [3, 4])
            t.wait()
            assert t.copy_path == "triton" and "auto (default table): 32768-byte slices d2d -> kernel" in t.path
    finally:
        peer.close()


# ---- GPU: the fence (issue 29) ---------------------------------------------------------------
FENCE_DIMS = dict(num_layers=64, num_blocks=256, block_size=16, num_heads=8, head_dim=128)  # 32 KiB slices


def _watch_device(tensors, seconds=2.0):
    """Bytes of ``tensors`` (CUDA) that change over ``seconds`` (0: nothing landed after the end)."""
    torch.cuda.synchronize()
    ref = [t.clone() for t in tensors]
    changed, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.2)
        torch.cuda.synchronize()
        changed = max(changed, sum(int((a != b).sum()) for a, b in zip(ref, tensors)))
    return changed


@gpu
@needs_cuda
@pytest.mark.parametrize("copy_path", ["kernel", "batch"])
def test_ipc_cancel_mid_read_then_refill_lands_nothing_after(copy_path):
    """A READ of the seed case cancelled right after it was posted: it reads CANCELLED (or DONE)
    only once its copy ended (the queued kernels cannot be stopped: the stop waits for them); the
    destination refilled then never changes for 2 s."""
    kind = LayoutKind.VLLM_FLASH_ATTN_NHD
    peer = PeerProcess("prefill", kind, FENCE_DIMS, seed=5, device="cuda:0")
    try:
        tensors, layout = make_kv_cache(kind, device="cuda:0", **FENCE_DIMS)
        with Agent("decode", AgentConfig(copy_path=copy_path)) as agent:
            agent.register("kv", tensors, layout)
            name = agent.connect(peer.metadata)
            agent.read(name, [0], [0]).wait()  # mapped once
            for _ in range(5):
                t = agent.read(name, list(range(128)), list(range(128, 256)), timeout=10)
                t.cancel()
                try:
                    t.wait()
                except Exception:  # CANCELLED: asserted below
                    pass
                assert t.poll() in (TransferState.CANCELLED, TransferState.DONE)
                for x in tensors:
                    x.view(-1).view(torch.uint8).fill_(0x11)
                assert _watch_device(tensors) == 0, "bytes landed after the READ ended"
    finally:
        peer.close()


@gpu
@needs_cuda
def test_ipc_cancel_mid_write_then_a_second_writer_keeps_the_second_writers_bytes():
    """A WRITE cancelled right after posting, then another agent writes the same destination
    blocks: the second writer's bytes are what the peer holds, for 2 s, and only its notice came."""
    from xfer.bench.target import block_digests

    kind = LayoutKind.VLLM_FLASH_ATTN_NHD
    peer = PeerProcess("decode", kind, FENCE_DIMS, device="cuda:0")
    try:
        a_t, layout = make_kv_cache(kind, device="cuda:0", **FENCE_DIMS)
        c_t, _ = make_kv_cache(kind, device="cuda:0", **FENCE_DIMS)
        fill_random(a_t, seed=6)
        fill_random(c_t, seed=7)
        with Agent("prefill-a") as a, Agent("prefill-c") as c:
            a.register("kv", a_t, layout)
            c.register("kv", c_t, layout)
            na, nc = a.connect(peer.metadata), c.connect(peer.metadata)
            src, dst = list(range(128)), list(range(128, 256))
            t = a.write(na, src, dst, timeout=10, notify=b"first")
            t.cancel()
            try:
                t.wait()
            except Exception:  # CANCELLED, or DONE: both fine, the second writer comes after
                pass
            assert c.write(nc, src, dst, timeout=10, notify=b"second").wait() is TransferState.DONE
            want = block_digests(layout, c_t, src)
            for _ in range(3):
                assert peer.call("digests", dst, timeout=120)[0] == want
                time.sleep(1.0)
            notes = [n[0] for n in peer.call("drain")]
            assert len(notes) == (2 if t.poll() is TransferState.DONE else 1)
    finally:
        peer.close()


@gpu
@needs_cuda
def test_ipc_a_frozen_target_resumed_after_the_deadline_gets_no_byte_and_no_notice():
    """The target is stopped (SIGSTOP) before the WRITE: the grant never comes, the WRITE ends
    TIMED_OUT with nothing copied; resumed, the target refuses the late grant request (its age):
    its blocks stay poisoned and no notice is delivered."""
    kind = LayoutKind.VLLM_FLASH_ATTN_NHD
    peer = PeerProcess("decode", kind, FENCE_DIMS, device="cuda:0")
    try:
        tensors, layout = make_kv_cache(kind, device="cuda:0", **FENCE_DIMS)
        fill_random(tensors, seed=8)
        with Agent("prefill") as agent:
            agent.register("kv", tensors, layout)
            name = agent.connect(peer.metadata)
            agent.write(name, [0], [0]).wait()
            peer.call("drain")
            peer.stop_signal()
            try:
                t = agent.write(name, list(range(1, 129)), list(range(1, 129)), timeout=1.0)
                with pytest.raises(TransferTimeoutError):
                    t.wait()
            finally:
                import os
                import signal as _signal
                os.kill(peer.proc.pid, _signal.SIGCONT)
            time.sleep(1.0)
            _, untouched = peer.call("digests", [0], timeout=120)  # every block but 0 still poisoned
            assert untouched and peer.call("drain") == []
    finally:
        peer.close()
