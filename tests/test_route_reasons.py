"""No silent slow path (issue 27, item 7).

``route()``'s printed form names each transport preferred over the chosen one and why it was
refused; two agents of one host that end up on ``ucx`` log one warning naming the route, the
refusals and the fix (``xfer.shared_empty`` / ``make_kv_cache``), once per peer, never when the
fast path serves them or the peers are on different hosts; regions that can never exchange blocks
(dtype, block geometry) are refused at ``connect()``, or at the latest by ``route()``, before any
byte moves.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import pytest
import torch

from helpers import (PeerProcess, assert_blocks_equal, assert_untouched, fill_random, poison,
                     small_dims)
from xfer import Agent, AgentConfig, LayoutKind, Op, TransportKind, make_kv_cache, shared_empty
from xfer import metadata as md_codec
from xfer.engine.kv_pool import head_layout
from xfer.errors import LayoutMismatchError, PeerNotConnectedError
from xfer.transports import PREFERENCE
from xfer.transports.base import Selection

KIND = LayoutKind.VLLM_FLASH_ATTN_NHD
DIMS = small_dims(KIND)
FIRST = f"first of {[k.value for k in PREFERENCE]} able to serve this pair"
needs_ucx = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                               reason="the ucx route needs ucxx: pip install -e '.[ucx]'")


def slow_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "xfer.agent" and "slow route" in r.getMessage()]


def cache(empty=torch.zeros, fill=None, **changes):
    dims = dict(DIMS, **{k: v for k, v in changes.items() if k != "dtype"})
    tensors, layout = make_kv_cache(KIND, empty=empty, dtype=changes.get("dtype", torch.bfloat16), **dims)
    if fill is None:
        poison(tensors)
    else:
        fill_random(tensors, seed=fill)
    return tensors, layout


def forged(agent: Agent, **changes) -> bytes:
    """``agent``'s metadata as if it ran elsewhere: another pid (another process of this host), or
    another host (``host_id``/``hostname``, also in each transport's info)."""
    md = md_codec.decode(agent.metadata())
    if "host_id" in changes:
        changes["transports"] = {k: dict(v, host_id=changes["host_id"]) if "host_id" in v else v
                                 for k, v in md.transports.items()}
    return md_codec.encode(dataclasses.replace(md, **changes))


# ---- the printed route -----------------------------------------------------------------------------
def test_selection_prints_the_choice_and_each_refusal_on_one_line():
    rejected = {"local": "peer region 'kv' of 'd' is not in shared memory (allocate it with xfer.shared_empty)",
                "ipc": "no CUDA device in this process", "nvshmem": "needs nvshmem4py"}
    sel = Selection(kind=TransportKind.UCX, reason=FIRST, rejected=rejected)
    assert str(sel) == ("ucx (local refused: peer region 'kv' of 'd' is not in shared memory (allocate it with "
                        "xfer.shared_empty); ipc refused: no CUDA device in this process; nvshmem refused: "
                        "needs nvshmem4py)")
    assert repr(sel) == f"Selection({sel})" and "\n" not in repr(sel)
    assert str(Selection(kind=TransportKind.LOCAL, reason=FIRST)) == f"local ({FIRST})"
    assert str(Selection(kind=TransportKind.UCX, reason="pinned by config")) == "ucx (pinned by config)"


@needs_ucx
def test_plain_caches_of_one_host_route_to_ucx_say_why_and_warn_once(caplog):
    """Two processes of one host with torch.zeros caches: ucx, each refusal in the printed route,
    ONE warning line (route, reasons, fix) over routes of both ops and several transfers."""
    caplog.set_level(logging.INFO, logger="xfer")
    tensors, layout = cache(fill=3)
    peer_proc = PeerProcess("plain", KIND, DIMS, empty=torch.zeros, config=AgentConfig(default_timeout_s=20))
    try:
        with Agent("prefill", AgentConfig(default_timeout_s=20)) as agent:
            agent.register("kv", tensors, layout)
            peer = agent.connect(peer_proc.metadata)
            sel = agent.route(peer)
            assert sel.kind is TransportKind.UCX
            assert list(sel.rejected) == ["local", "ipc", "nvshmem"]
            assert "not in shared memory" in sel.rejected["local"]
            for kind, reason in sel.rejected.items():
                assert f"{kind} refused: {reason}" in str(sel) and f"{kind} refused: {reason}" in repr(sel)
                assert not reason.startswith(f"{kind}:")  # the transport's name is said once
            assert str(sel).startswith("ucx (local refused: peer region 'kv' of 'plain' is not in shared memory")
            for i in range(3):
                assert agent.write(peer, [i, 5], [i + 2, 7]).wait().name == "DONE"
            agent.route(peer, Op.READ)
            agent.read(peer, [7], [6]).wait()  # block 5 back, through the peer's block 7
            warned = slow_warnings(caplog)
            assert len(warned) == 1, warned
            line = warned[0]
            assert "\n" not in line
            assert "prefill:kv -> plain:kv goes over ucx" in line and "both agents are on host" in line
            assert "local refused: peer region 'kv' of 'plain' is not in shared memory" in line
            assert "xfer.shared_empty" in line and "make_kv_cache(..., empty=xfer.shared_empty)" in line
            remote = [torch.from_numpy(b).view(layout.dtype) for b in peer_proc.call("bytes")]
            assert_blocks_equal(layout, tensors, [0, 1, 2, 5], layout, remote, [2, 3, 4, 7])
            assert_untouched(layout, remote, [2, 3, 4, 7])
            assert_blocks_equal(layout, tensors, [5], layout, tensors, [6])
    finally:
        peer_proc.close()


def test_shared_memory_pair_takes_local_and_logs_no_warning(caplog):
    caplog.set_level(logging.INFO, logger="xfer")
    tensors, layout = cache(empty=shared_empty, fill=5)
    decode = PeerProcess("decode", KIND, DIMS)
    try:
        with Agent("prefill", AgentConfig(default_timeout_s=20)) as agent:
            agent.register("kv", tensors, layout)
            peer = agent.connect(decode.metadata)
            sel = agent.route(peer)
            assert str(sel) == f"local ({FIRST})" and sel.rejected == {}
            agent.write(peer, [1], [2]).wait()
            agent.route(peer, Op.READ)
            assert slow_warnings(caplog) == []
    finally:
        decode.close()


@needs_ucx
def test_a_peer_on_another_host_takes_ucx_without_a_warning(caplog):
    caplog.set_level(logging.INFO, logger="xfer")
    with Agent("a") as a, Agent("b") as b:
        a.register("kv", *cache(fill=1))
        b.register("kv", *cache())
        peer = a.connect(forged(b, host_id="elsewhere/boot", hostname="elsewhere"))
        sel = a.route(peer)
        assert sel.kind is TransportKind.UCX
        assert "local refused: peer 'b' is on host 'elsewhere', another host" in str(sel)
        assert slow_warnings(caplog) == []


@needs_ucx
@pytest.mark.parametrize("config", [AgentConfig(transport="ucx"), AgentConfig(enable=("ucx",))],
                         ids=["pinned", "enabled-only"])
def test_a_config_that_chose_ucx_is_not_warned(caplog, config):
    caplog.set_level(logging.INFO, logger="xfer")
    with Agent("a", config) as a, Agent("b") as b:
        a.register("kv", *cache(fill=1))
        b.register("kv", *cache())
        peer = a.connect(forged(b, pid=1))  # another process of this host
        assert a.route(peer).kind is TransportKind.UCX
        assert slow_warnings(caplog) == []


@needs_ucx
def test_the_warning_is_once_per_peer_not_per_region(caplog):
    """An engine registers one region per layer: one warning for the peer, not one per region."""
    caplog.set_level(logging.INFO, logger="xfer")
    with Agent("a") as a, Agent("b") as b:
        for name in ("L0", "L1", "L2"):
            a.register(name, *cache(fill=1))
            b.register(name, *cache())
        peer = a.connect(forged(b, pid=1))
        for name in ("L0", "L1", "L2"):
            for op in (Op.WRITE, Op.READ):
                assert a.route(peer, op, region=name).kind is TransportKind.UCX
        assert len(slow_warnings(caplog)) == 1


# ---- layouts that can never exchange blocks ---------------------------------------------------------
@pytest.mark.parametrize("change, pattern", [
    (dict(dtype=torch.float16), r"dtype: local vllm_flash_attn_nhd has 'bfloat16', peer vllm_flash_attn_nhd has "
                                r"'float16'"),
    (dict(bs=8), r"block_size: local vllm_flash_attn_nhd has 4, peer vllm_flash_attn_nhd has 8"),
    (dict(hd=16), r"head_dim: local vllm_flash_attn_nhd has 8, peer vllm_flash_attn_nhd has 16"),
])
def test_connect_refuses_a_peer_whose_regions_can_never_serve_ours(change, pattern):
    dtype = change.pop("dtype", torch.bfloat16)
    with Agent("a") as a, Agent("b") as b:
        ta, la = cache(fill=1)
        a.register("kv", ta, la)
        tb, lb = make_kv_cache(KIND, dtype=dtype, **small_dims(KIND, **change))
        poison(tb)
        b.register("kv", tb, lb)
        with pytest.raises(LayoutMismatchError, match="no region of peer 'b' can exchange blocks with a region "
                                                      "of 'a': a:kv -> b:kv: layouts differ in " + pattern):
            a.connect(b.metadata())
        assert a.peers == []  # left unconnected: nothing can be posted to it
        with pytest.raises(PeerNotConnectedError):
            a.write("b", [0], [0])
        assert_untouched(lb, tb, [])
        assert b.notifications() == []


def test_one_matching_region_is_enough_to_connect_and_route_names_the_bad_pair():
    """A peer may register several regions (KV and an aux region of another dtype): connect
    passes when one pair can exchange blocks; route() and write() refuse the pair that cannot."""
    with Agent("a") as a, Agent("b") as b:
        ta, la = cache(fill=1)
        a.register("kv", ta, la)
        tb, lb = cache()
        b.register("kv", tb, lb)
        t16, l16 = cache(dtype=torch.float16)
        b.register("kv16", t16, l16)
        peer = a.connect(b.metadata())
        with pytest.raises(LayoutMismatchError, match=r"a:kv -> b:kv16: layouts differ in dtype: .*'bfloat16'.*"
                                                      r"'float16'"):
            a.route(peer, peer_region="kv16")
        with pytest.raises(LayoutMismatchError, match="dtype"):
            a.write(peer, [0], [0], peer_region="kv16")
        with pytest.raises(LayoutMismatchError, match="dtype"):
            a.read(peer, [0], [0], peer_region="kv16")
        assert_untouched(l16, t16, [])
        a.write(peer, [1], [2], peer_region="kv").wait()
        assert_blocks_equal(la, ta, [1], lb, tb, [2])


def test_heads_alone_differ_connect_passes_route_raises_and_a_head_view_serves():
    """A TP rank's share of the heads is registered as a view, possibly after connecting
    (xfer.engine's ensure_heads): a heads-only mismatch passes connect, route() refuses it."""
    with Agent("a") as a, Agent("b") as b:
        ta, la = cache(fill=1)  # 2 heads
        a.register("kv", ta, la)
        tb, lb = make_kv_cache(KIND, **small_dims(KIND, heads=1))
        poison(tb)
        b.register("kv", tb, lb)
        peer = a.connect(b.metadata())
        with pytest.raises(LayoutMismatchError, match="num_heads: local vllm_flash_attn_nhd has 2, peer"):
            a.route(peer)
        a.register("kv.h1", ta, head_layout(la, (1, 2)))  # head 1 of this agent's 2
        assert a.route(peer, region="kv.h1", peer_region="kv").kind is TransportKind.LOCAL
        a.write(peer, [3], [4], region="kv.h1", peer_region="kv").wait()
        assert_blocks_equal(head_layout(la, (1, 2)), ta, [3], lb, tb, [4])


def test_nothing_registered_yet_on_either_side_connects():
    with Agent("a") as a, Agent("b") as b:
        assert a.connect(b.metadata()) == "b"  # neither registered
        b.register("kv", *cache(dtype=torch.float16))
        assert a.connect(b.metadata()) == "b"  # a registered nothing yet
        a.register("kv", *cache(fill=1))  # registered after connecting: route() judges the pair
        with pytest.raises(LayoutMismatchError, match="a:kv -> b:kv: layouts differ in dtype"):
            a.route("b")
        with pytest.raises(LayoutMismatchError, match="no region of peer 'b'"):
            a.connect(b.metadata())  # re-connecting judges the regions as they are now
        assert a.peers == ["b"]  # the refused re-connect left the earlier connection as it was
