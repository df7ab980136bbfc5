"""Across GPUs of one node (issue 33). CPU: the multi-GPU run's plan (pairs, what one GPU skips,
the budget), a part killed with its children at its cap, the table of results against the
ceilings, the NCCL baseline's schedule (gloo on host memory), the ipc transport's peer-to-peer
route decision and stream placement with torch.cuda's answers mocked, the engine's events on the
pool's GPU. GPU (two GPUs unless noted): ipc from a region on a GPU other than the current one,
the local transport between two GPUs of one process, the engine with prefill and decode on two
GPUs, the ceiling and the NCCL baseline on real devices."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import PeerProcess, assert_blocks_equal, assert_untouched, fill_random, poison, small_dims
from xfer import Agent, AgentConfig, LayoutKind, make_kv_cache
from xfer.bench import multigpu, multigpu_table, nccl_baseline
from xfer.bench.peer_copy import NO_MULTICAST, parse_pairs
from xfer.metadata import RegionRecord

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, this machine has {GPUS}")
gpu = pytest.mark.gpu
NONE_MISSING = {"nvshmem": None, "ucx": None, "engine": None}


# ---- CPU: the plan -----------------------------------------------------------------------------
def test_pairs_follow_the_gpu_count():
    assert multigpu.gpu_pairs(0) == [] and multigpu.gpu_pairs(1) == [(0, 0)] and multigpu.gpu_pairs(2) == [(0, 1)]
    assert multigpu.gpu_pairs(8) == [(0, k) for k in range(1, 8)]
    assert multigpu.gpu_pairs(4, "2:3,0:1") == [(2, 3), (0, 1)]
    with pytest.raises(ValueError, match="index 2 is not one of this machine's 2 GPUs"):
        multigpu.gpu_pairs(2, "0:2")
    with pytest.raises(ValueError, match="SRC:DST.*'0-1'"):
        parse_pairs("0-1")


def test_one_gpu_plan_says_what_it_skips_and_runs_the_two_process_variants():
    parts = {p.key: p for p in multigpu.plan(1, quick=True, have=NONE_MISSING)}
    assert "NCCL refuses two ranks on one GPU" in parts["nccl"].skip and parts["nccl"].cmd is None
    ipc = parts["ipc"].cmd
    assert ipc[ipc.index("--device") + 1] == "0" and ipc[ipc.index("--peer-device") + 1] == "0"
    assert ipc[ipc.index("--iters") + 1] == "5" and "--peer-ceiling" in ipc and "--pull-burst" in ipc
    assert ipc[ipc.index("--window") + 1] == "8" and "--burst-window" in parts["nvshmem"].cmd
    assert "cuda:0" in parts["engine"].cmd and parts["engine"].cmd[parts["engine"].cmd.index("--model") + 1] == "tiny"
    tests = parts["tests"].cmd
    assert "tests/test_multigpu.py" in tests and "tests/test_ipc.py" not in tests and parts["tests"].in_repo
    assert not [k for k in parts if k.startswith("extra")]


def test_multi_gpu_plan_measures_0_to_1_then_every_further_pair():
    parts = multigpu.plan(4, quick=False, have={"nvshmem": "nvshmem4py is not installed", "ucx": None,
                                                 "engine": None})
    by = {p.key: p for p in parts}
    assert [p.key for p in parts][-2:] == ["extra 0->2", "extra 0->3"]
    assert by["ceiling"].cmd[by["ceiling"].cmd.index("--pairs") + 1] == "0:1,0:2,0:3"
    assert by["nccl"].cmd[by["nccl"].cmd.index("--devices") + 1] == "0,1" and by["nccl"].skip is None
    assert by["nvshmem"].skip == "nvshmem4py is not installed"
    assert by["engine"].cmd[by["engine"].cmd.index("--decode-device") + 1] == "cuda:1"
    assert by["ucx"].cmd[by["ucx"].cmd.index("--peer-device") + 1] == "cuda:1"
    assert "tests/test_ipc.py" in by["tests"].cmd and multigpu.MULTI_GPU_TESTS in by["tests"].cmd
    assert multigpu.plan(4, quick=False, have=NONE_MISSING, parts=("ipc",))[0].key == "ipc"
    assert all(p.skip == "no CUDA GPU on this machine" for p in multigpu.plan(0, quick=True, have=NONE_MISSING))


def test_budget_skips_what_cannot_start_and_the_document_is_written_after_each_part(tmp_path):
    parts = [multigpu.Part("ceiling", "ceiling", ("x",), 60), multigpu.Part("nccl", "nccl", None, 60, skip="why"),
             multigpu.Part("ipc", "ipc", ("y",), 60)]
    seen = []

    def fake(part, timeout, folder):
        seen.append((part.key, timeout))
        on_disk = json.loads((folder / "multigpu.json").read_text()) if (folder / "multigpu.json").exists() else {}
        assert list(on_disk.get("parts", {})) == [k for k, _ in seen[:-1]] + (["nccl"] if len(seen) > 1 else [])
        time.sleep(0.3)
        return {"status": "ok", "wall_s": 0.3}

    doc = multigpu.run(parts, tmp_path, {"pairs": [[0, 1]]}, budget_s=20.2, execute=fake)
    assert seen == [("ceiling", pytest.approx(20.2, abs=0.1))]  # capped by the budget, not its 60 s
    assert doc["parts"]["nccl"] == {"status": "skipped", "reason": "why"}
    assert doc["parts"]["ipc"]["status"] == "skipped" and doc["parts"]["ipc"]["reason"].startswith("budget: 20 s left")
    assert json.loads((tmp_path / "multigpu.json").read_text())["parts"] == doc["parts"]


def test_a_part_runs_without_multicast_and_is_killed_with_its_children_at_its_cap(tmp_path):
    script = tmp_path / "part.py"
    script.write_text(textwrap.dedent("""
        import json, os, subprocess, sys, time
        json.dump({k: os.environ.get(k) for k in %r}, open("out.json", "w"))
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open("child.pid", "w").write(str(child.pid))
        time.sleep(60)
    """ % list(multigpu.NO_MULTICAST)))
    part = multigpu.Part("ipc", "ipc", (sys.executable, str(script)), 60, out="out.json")
    rec = multigpu._execute(part, 2.0, tmp_path)
    assert rec["status"] == "timeout" and rec["rc"] is None and rec["wall_s"] < 20
    assert rec["result"] == NO_MULTICAST
    child = int((tmp_path / "child.pid").read_text())
    end = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and time.monotonic() < end:
        time.sleep(0.05)
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z", "the part's child outlived its cap"


def test_a_failing_part_keeps_its_log_tail(tmp_path):
    part = multigpu.Part("ipc", "ipc", (sys.executable, "-c", "raise SystemExit('ipc bench: bytes differ')"), 60,
                         out="ipc.json")
    rec = multigpu._execute(part, 30, tmp_path)
    assert rec["status"] == "failed" and rec["rc"] == 1 and "ipc bench: bytes differ" in rec["log_tail"]


def test_without_a_gpu_the_run_says_what_it_skipped_and_exits_0(tmp_path):
    out = subprocess.run([sys.executable, "-m", "xfer.bench.multigpu", "--gpus", "0", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ipc            skipped: no CUDA GPU on this machine" in out.stdout
    doc = json.loads((tmp_path / "multigpu.json").read_text())
    assert {r["status"] for r in doc["parts"].values()} == {"skipped"} and doc["gpus"] == 0
    assert doc["env"] == NO_MULTICAST and "versions" in doc and doc["date"]
    bad = subprocess.run([sys.executable, "-m", "xfer.bench.multigpu", "--dry-run", "--parts", "ipc,nvlink"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown ['nvlink']" in bad.stderr


# ---- CPU: the table ----------------------------------------------------------------------------
def _ceiling_rows(push_lone, push_burst, pull_lone, pull_burst):
    return [{"direction": d, "mode": m, "gb_per_s": g, "ms": 1.0, "name": f"{d} {m}"}
            for d, m, g in (("push", "lone", push_lone), ("push", "burst", push_burst), ("pull", "lone", pull_lone),
                            ("pull", "burst", pull_burst))]


def _doc(ipc_ceiling=True):
    ok = lambda result: {"status": "ok", "wall_s": 1.0, "result": result}  # noqa: E731
    ipc_rows = [{"name": "xfer write, one request end to end", "gb_per_s": 300.0},
                {"name": "xfer write, 128 back to back (per request)", "gb_per_s": 360.0},
                {"name": "xfer read (pull), one request", "gb_per_s": 200.0},
                {"name": "xfer read (pull), 128 back to back (per request)", "gb_per_s": 390.0},
                {"name": "copy_blocks in one process (the kernel + its host call)", "gb_per_s": 1000.0}]
    ipc = {"rows": ipc_rows}
    if ipc_ceiling:
        ipc["peer_ceiling"] = {"rows": _ceiling_rows(350, 400, 350, 400)}
    return {"device": "NVIDIA H100 80GB HBM3", "gpus": 2, "pairs": [[0, 1]], "date": "2026-12-08T00:00:00+00:00",
            "parts": {
                "ceiling": ok({"pairs": [{"src": 0, "dst": 1, "rows": _ceiling_rows(370, 380, 360, 390)}]}),
                "nccl": ok({"rows": [{"case": c, "gb_per_s": g} for c, g in
                                     (("push lone", 250.0), ("push back to back", 370.0), ("pull lone", 240.0),
                                      ("pull back to back", 400.0))]}),
                "ipc": ok(ipc),
                "nvshmem": ok({"rows": [{"name": "direct: write, 8 back to back (per request)", "gb_per_s": 380.0},
                                        {"name": "staged: write, one request end to end", "gb_per_s": 100.0}]}),
                "engine": ok({"correct_by_variant": {"token message": {"equal": True}}, "variants": {"token message": {
                    "transfer_share_pct": 1.2, "added_ms": {"median": 1.5}, "ttft_no_transfer_ms": 120.0}}}),
                "tests": {"status": "ok", "wall_s": 9.0, "counts": {"passed": 12, "skipped": 1}},
                "p2p": ok({"local": 0, "peer": 1, "variants": [
                    {"allocation": "legacy", "variant": "as the ipc transport maps it", "error": "RuntimeError: CUDA "
                     "error: an illegal memory access was encountered"},
                    {"allocation": "legacy", "variant": "+ peer access enabled", "pull_ok": True, "push_ok": True,
                     "pull_gb_per_s": 350.0}]}),
                "ucx": {"status": "failed", "wall_s": 3.0, "log_tail": "...\nRuntimeError: no CUDA support"},
            }}


def test_table_ratios_use_the_same_process_ceiling_and_check_the_goals():
    doc = _doc()
    rows = {(r["section"], r["what"]): r for r in multigpu_table.summarize(doc)}
    lone = rows[("ipc", "ipc write (push), one request")]
    assert lone["ratio"] == pytest.approx(300 / 350) and lone["goal"] == 0.8 and lone["met"] is True
    assert "same process" in lone["ceiling"] and "cudaMemcpyPeerAsync 0->1, lone" in lone["ceiling"]
    burst = rows[("ipc", "ipc write (push), 128 back to back")]
    assert burst["ratio"] == pytest.approx(360 / 400) and burst["met"] is True
    pull = rows[("ipc", "ipc read (pull), one request")]
    assert pull["ratio"] == pytest.approx(200 / 350) and pull["met"] is False and "1->0" in pull["ceiling"]
    vs = rows[("ipc vs NCCL", "ipc write (push), one request")]
    assert vs["ratio"] == pytest.approx(300 / 250) and vs["met"] is True
    assert rows[("ipc vs NCCL", "ipc read (pull), 128 back to back")]["met"] is False  # 390 < NCCL's 400
    direct = rows[("nvshmem", "nvshmem direct, write, 8 back to back")]
    assert direct["ratio"] == pytest.approx(380 / 380) and direct["goal"] == 0.9 and "ceiling part" in direct["ceiling"]
    assert "1.20 %" in rows[("engine", "engine TTFT, token message")]["note"]
    assert ("ipc", "copy_blocks in one process (the kernel + its host call)") not in rows


def test_table_falls_back_to_the_ceiling_part_and_renders_the_readme_rows():
    doc = _doc(ipc_ceiling=False)
    lone = next(r for r in multigpu_table.summarize(doc) if r["what"] == "ipc write (push), one request")
    assert lone["ratio"] == pytest.approx(300 / 370) and "ceiling part, same call" in lone["ceiling"]
    readme = multigpu_table.readme_rows(doc, "2026-12-08-h100x2-multigpu.json")
    assert len(readme) == 6 and all(r.count(" | ") == 5 for r in readme)
    assert readme[0].startswith("| NVIDIA H100 80GB HBM3 x2, GPU 0 -> GPU 1 | ipc write (push), one request")
    assert "**0.81**" in readme[0] and readme[0].endswith("`2026-12-08-h100x2-multigpu.json` |")
    text = multigpu_table.markdown(doc, "f.json")
    assert "| tests | ok | 9.0 | 12 passed, 1 skipped |" in text
    assert "| ucx | failed | 3.0 | RuntimeError: no CUDA support |" in text
    assert "| legacy | + peer access enabled | ok | ok | 350 GB/s |  |" in text
    assert "| legacy | as the ipc transport maps it | - | - | - | RuntimeError: CUDA error: an illegal" in text


def test_table_of_a_one_gpu_smoke_run_names_the_device_copy():
    doc = _doc()
    doc["pairs"] = [[0, 0]]
    assert multigpu_table._machine(doc) == "NVIDIA H100 80GB HBM3, two processes on one GPU"
    assert "device copy (one GPU) 0->0" in multigpu_table.summarize(doc)[0]["ceiling"]
    assert multigpu_table.markdown({"pairs": []}, "x") == "no GPU: nothing was measured\n"


# ---- CPU: the NCCL baseline's schedule, on gloo and host memory ---------------------------------
def test_send_recv_baseline_schedule_verifies_both_directions_on_gloo():
    res = nccl_baseline.run((0, 0), 1 << 20, iters=3, burst=4, backend="gloo", device="cpu", timeout_s=60)
    assert "error" not in res, res.get("error")
    assert res["verified"] == {"push": True, "pull": True}
    assert [r["case"] for r in res["rows"]] == list(nccl_baseline.CASES)
    assert all(r["n"] == 3 and r["gb_per_s"] > 0 for r in res["rows"])
    assert "NCCL refuses" in nccl_baseline.run((1, 1), 1 << 20)["skipped"]


# ---- CPU: back to back without two unfenced writers of one block (the grants of issue 29) -------
def test_windowed_bursts_keep_one_request_in_flight_per_block_set():
    from xfer.bench.ipc_bench import windowed

    log, live = [], set()

    class T:
        def __init__(self, i):
            self.i = i

        def wait(self):
            live.discard(self.i)

    def post(i):
        assert not {j for j in live if j % 3 == i % 3}, f"request {i} shares a set with one in flight"
        live.add(i)
        log.append(i)
        return T(i)

    windowed(post, 10, 3)
    assert log == list(range(10)) and not live
    with pytest.raises(AssertionError, match="shares a set"):
        windowed(post, 4, 0)  # all at once: request 3 meets request 0 in set 0


def test_nvshmem_bench_back_to_back_over_disjoint_sets_on_the_fake(monkeypatch, tmp_path):
    """One PE on the CPU stand-in: with --burst-window 2 the direct path's 8 back-to-back writes go
    to two disjoint sets of decode blocks (all at once into one set, the targets refuse them)."""
    from nvshmem_helpers import FakeFabric

    from xfer.bench import nvshmem_bench

    FakeFabric().install(monkeypatch)
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1")
    res = nvshmem_bench.main(["--pes", "1", "--iters", "3", "--staging-mib", "1", "--burst-window", "2",
                              "--out", str(tmp_path / "r.json")],
                             dims=small_dims(LayoutKind.VLLM_FLASH_ATTN_NHD, blocks=16))
    names = [r["name"] for r in res["rows"]]
    assert "direct: write, 8 back to back (per request)" in names and len(names) == 7


# ---- CPU: the ipc transport's N-GPU decisions, torch.cuda's answers mocked ---------------------
def _ipc_route(monkeypatch, *, peer_uuid, mine, local_device="cuda", reach=lambda a, b: True):
    from xfer.transports.onesided import ipc

    monkeypatch.setattr(ipc, "_uuid", lambda i: f"GPU-{i}")
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", reach)
    tr = SimpleNamespace(kind=ipc.IpcTransport.kind, ctx=SimpleNamespace(host_id="h"),
                         _local_uuids={f"GPU-{i}": i for i in range(4)})
    dims = small_dims("mla")
    rec = RegionRecord(name="kv", layout=make_kv_cache("mla", **dims)[1], device="cuda:0",
                       exports={"ipc": {"uuid": peer_uuid, "bases": []}})
    region = SimpleNamespace(device=torch.device(local_device, mine) if local_device == "cuda" else torch.device("cpu"),
                             name="kv")
    peer = SimpleNamespace(metadata=SimpleNamespace(transports={"ipc": {"host_id": "h"}}, name="p", hostname="x"))
    return ipc.IpcTransport.check_route(tr, region, peer, rec, None)


def test_ipc_route_across_gpus_needs_peer_access_and_names_both(monkeypatch):
    asked = []
    assert _ipc_route(monkeypatch, peer_uuid="GPU-1", mine=0, reach=lambda a, b: asked.append((a, b)) or True) is None
    assert asked == [(0, 1)]  # this GPU's kernels reach the peer's: asked in that direction
    asked.clear()
    assert _ipc_route(monkeypatch, peer_uuid="GPU-2", mine=2, reach=lambda a, b: asked.append((a, b))) is None
    assert asked == []  # the same GPU: nothing to ask
    why = _ipc_route(monkeypatch, peer_uuid="GPU-3", mine=1, reach=lambda a, b: False)
    assert why == "GPU 1 (GPU-1) cannot reach GPU 3 (GPU-3) by peer-to-peer access (PCIe without P2P?)"


def test_ipc_route_to_a_gpu_this_process_cannot_see_says_so(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    why = _ipc_route(monkeypatch, peer_uuid="GPU-7f", mine=0)
    assert why == "peer GPU GPU-7f is not visible in this process (CUDA_VISIBLE_DEVICES=0,1)"
    assert "local region 'kv' is on cpu" in _ipc_route(monkeypatch, peer_uuid="GPU-1", mine=0, local_device="cpu")


def test_ipc_copies_run_on_a_stream_of_the_local_regions_gpu(monkeypatch):
    from xfer.transports.onesided import ipc

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: made.append(device) or f"stream on {device}")
    tr = SimpleNamespace(_streams={})
    job = lambda i: SimpleNamespace(local=SimpleNamespace(device=torch.device("cuda", i)))  # noqa: E731
    assert ipc.IpcTransport.stream(tr, job(1)) == "stream on 1"
    assert ipc.IpcTransport.stream(tr, job(3)) == "stream on 3"
    assert ipc.IpcTransport.stream(tr, job(1)) == "stream on 1" and made == [1, 3]  # one per GPU, kept


# ---- CPU: the engine's events on the pool's GPU (not the current device) ------------------------
class _FakeEvent:
    def __init__(self):
        self.stream = "never recorded"

    def record(self, stream=None):
        self.stream = stream


def _fake_cuda(monkeypatch):
    events = []

    def event():
        events.append(_FakeEvent())
        return events[-1]

    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"current stream of {device}")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: f"side stream on {device}")
    return events


def test_layer_streamer_records_on_the_pools_gpu(monkeypatch):
    from xfer.engine.streamer import LayerStreamer

    events = _fake_cuda(monkeypatch)
    posted = []
    poster = SimpleNamespace(put=lambda event, fn, *a: posted.append(event))
    s = LayerStreamer(None, "d", "r", [0], [1], num_layers=2, device=torch.device("cuda", 1), poster=poster)
    s.layer_done(0)
    assert posted == events and events[0].stream == "current stream of cuda:1"


def test_swap_waits_on_the_pools_gpu(monkeypatch):
    from xfer.engine import swap
    from xfer.engine.config import PRESETS, PoolSpec
    from xfer.engine.kv_pool import KVPool

    pool = KVPool(PRESETS["tiny"], PoolSpec(num_blocks=4, block_size=4, device="cpu"))
    pool.device = torch.device("cuda", 1)  # as a pool on GPU 1 is seen by the swapper
    events = _fake_cuda(monkeypatch)
    waited = []
    monkeypatch.setattr(swap, "swap_out", lambda *a, stream, wait_event: waited.append((stream, wait_event)))
    handle = swap.Swapper(pool, 4).swap_out("r", [1, 2])
    assert waited == [("side stream on cuda:1", events[0])] and events[0].stream == "current stream of cuda:1"
    assert handle.host_blocks and handle.direction == "out"


# ---- GPU: two GPUs --------------------------------------------------------------------------------
@gpu
@two_gpus
@pytest.mark.parametrize("devs", [(1, 0), (1, 1)], ids=["cuda1-cuda0", "cuda1-cuda1"])
def test_multigpu_ipc_from_a_gpu_other_than_the_current_one(devs):
    """The process's current device stays 0; the region is on GPU 1: the copy must run there."""
    mine, theirs = devs
    kind = LayoutKind.VLLM_FLASH_ATTN_NHD
    dims = small_dims(kind, layers=4, blocks=16, bs=16, heads=4, hd=64)
    peer = PeerProcess("decode", kind, dims, device=f"cuda:{theirs}", seed=None)
    try:
        assert torch.cuda.current_device() == 0
        tensors, layout = make_kv_cache(kind, device=f"cuda:{mine}", **dims)
        fill_random(tensors, seed=3)
        with Agent("prefill", AgentConfig(transport="ipc")) as agent:
            agent.register("kv", tensors, layout)
            name = agent.connect(peer.metadata)
            src, dst = [9, 1, 4, 2], [0, 15, 7, 3]
            agent.write(name, src, dst).wait()
            remote = peer.tensors()
            assert_blocks_equal(layout, tensors, src, peer.tensors_layout, remote, dst)
            assert_untouched(peer.tensors_layout, remote, dst)
            poison(tensors)
            agent.read(name, [0, 15], [2, 5]).wait()
            host = [t.cpu() for t in tensors]
            assert_blocks_equal(peer.tensors_layout, remote, [0, 15], layout, host, [2, 5])
            assert_untouched(layout, host, [2, 5])
    finally:
        peer.close()


@gpu
@two_gpus
@pytest.mark.parametrize("devs", [(0, 1), (1, 0)], ids=["cuda0-cuda1", "cuda1-cuda0"])
def test_multigpu_local_transport_between_two_gpus_of_one_process(devs):
    kind = LayoutKind.VLLM_FLASH_ATTN_NHD
    dims = small_dims(kind, layers=3, blocks=8, bs=16, heads=2, hd=64)
    a, la = make_kv_cache(kind, device=f"cuda:{devs[0]}", **dims)
    b, lb = make_kv_cache(kind, device=f"cuda:{devs[1]}", **dims)
    fill_random(a, seed=4)
    poison(b)
    with Agent("x") as x, Agent("y") as y:
        x.register("kv", a, la)
        y.register("kv", b, lb)
        name = x.connect(y.metadata())
        assert x.route(name).kind.value == "local"
        x.write(name, [1, 6], [3, 0]).wait()
        host = [t.cpu() for t in b]
        assert_blocks_equal(la, [t.cpu() for t in a], [1, 6], lb, host, [3, 0])
        assert_untouched(lb, host, [3, 0])


@gpu
@two_gpus
@pytest.mark.parametrize("devices", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")], ids=["prefill0-decode1",
                                                                                      "prefill1-decode0"])
def test_multigpu_engine_prefill_and_decode_on_two_gpus_equal_hf(devices):
    """Each worker process's current device is 0: prefill on GPU 1 checks that its layer events
    are recorded on the forward's GPU (they were on GPU 0's stream, ordering nothing)."""
    pytest.importorskip("transformers")
    from xfer.engine.config import ModelSpec, PoolSpec
    from xfer.engine.model import build_model, hf_generate
    from xfer.engine.protocol import Request
    from xfer.engine.router import Router

    spec = ModelSpec(vocab_size=1024, hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4,
                     intermediate_size=512, dtype="float32", init_std=0.2)
    g = torch.Generator().manual_seed(7)
    reqs = [Request(f"g{i}", torch.randint(0, spec.vocab_size, (n,), generator=g).tolist(), 12)
            for i, n in enumerate([5, 100, 300])]
    with Router(spec, num_prefill=1, num_decode=1, prefill_pool=PoolSpec(num_blocks=64, block_size=16,
                device=devices[0]), decode_pool=PoolSpec(num_blocks=64, block_size=16, device=devices[1]),
                start_timeout_s=240) as router:
        results = router.run(reqs, timeout=90)
    model = build_model(spec, "cuda:0")
    for r, x in zip(reqs, results, strict=True):
        assert x["tokens"] == hf_generate(model, r.prompt, 12), r.id


@gpu
@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_multigpu_peer_copy_ceiling_is_verified_and_timed():
    """Runs on one GPU too (0 -> 0: the device copy), as the one-GPU smoke run does."""
    from xfer.bench.peer_copy import peer_ceiling

    b = 1 if GPUS > 1 else 0
    res = peer_ceiling(0, b, 64 << 20, iters=3)
    assert "error" not in res, res
    assert {(r["direction"], r["mode"]) for r in res["rows"]} == {("push", "lone"), ("push", "burst"),
                                                                  ("pull", "lone"), ("pull", "burst"),
                                                                  ("local", "lone")}
    assert all(r["gb_per_s"] > 0 for r in res["rows"]) and all(r["verified"] for r in res["rows"][:4])
    if b:
        assert set(res["peer_access"].values()) <= {"enabled", "already enabled"}, res["peer_access"]


@gpu
@two_gpus
def test_multigpu_nccl_send_recv_baseline_is_verified():
    res = nccl_baseline.run((0, 1), 16 << 20, iters=3, burst=2, timeout_s=120)
    assert "error" not in res, res.get("error")
    assert res["verified"] == {"push": True, "pull": True} and len(res["rows"]) == 4
