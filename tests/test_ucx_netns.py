"""The UCX transport between two hosts: network namespaces A and B joined by a veth pair
(ci/netns.sh), one agent process in each (one kernel, so the same host id; each pinned to UCX over
TCP on its end of the veth: UCX_TLS=tcp, UCX_NET_DEVICES). The seed workload and many
concurrent small requests byte-exact, the link cut mid-transfer, kill -9 of the peer mid-transfer."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("ucxx", reason="the UCX transport needs ucxx: pip install -e '.[ucx]'")

from ucx_helpers import CHUNK_DELAY, NetnsPair, UcxPeer, assert_peer_blocks, expected_blocks, netns_skip_reason  # noqa: E402
from xfer import LayoutKind  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]
_reason = netns_skip_reason()
if _reason:
    pytestmark.append(pytest.mark.skip(reason=_reason))

KIND = LayoutKind.VLLM_FLASH_ATTN_NHD
SEED = dict(num_layers=64, num_blocks=256, block_size=4, num_heads=1, head_dim=16)
SLOW = dict(num_layers=8, num_blocks=512, block_size=16, num_heads=2, head_dim=64)
SLOW_ENV = {"XFER_UCX_CHUNK_BYTES": "8K", "XFER_UCX_DEPTH": "1", CHUNK_DELAY: "0.002"}  # >= 8 s a transfer
SLOW_RATE = "40mbit"  # A's side of the veth shaped (tc): a slow WAN link


@pytest.fixture
def hosts():
    pair = NetnsPair()
    peers = []

    def start(side, name, dims, seed=None, env=None):
        peer = UcxPeer(name, KIND, dims, seed=seed, netns=pair[f"ns_{side}"], device=pair[f"dev_{side}"],
                       bind=pair[f"addr_{side}"], env=env)
        peers.append(peer)
        return peer

    yield pair, start
    for p in peers:
        p.close()
    pair.close()


def test_seed_and_many_small_requests_across_the_veth(hosts):
    pair, start = hosts
    a, b = start("a", "prefill", SEED, seed=7), start("b", "decode", SEED)
    assert a.call("connect", b.metadata) == "decode"
    src, dst = list(range(0, 256, 2)), list(range(128, 256))[::-1]
    a.call("post", [("write", "decode", src, dst, 30, b"seed")])
    (res,) = a.call("wait", timeout=60)
    assert res[0] == "ok", res
    assert b.call("notification", 5) == ("ok", "prefill", "write", dst, b"seed")
    assert_peer_blocks(b, dst, expected_blocks(KIND, SEED, 7, src))
    untouched = b.tensors()
    from helpers import assert_untouched

    assert_untouched(b.layout, untouched, dst)
    # 48 concurrent small requests into the blocks the seed write left alone
    rng = np.random.default_rng(1)
    free = rng.permutation(np.arange(0, 128))
    plan = [(rng.integers(0, 256, 2).tolist(), free[2 * k:2 * k + 2].tolist()) for k in range(48)]
    a.call("post", [("write", "decode", s, d, 30, f"r{k}".encode()) for k, (s, d) in enumerate(plan)])
    results = a.call("wait", timeout=60)
    assert all(r[0] == "ok" for r in results), [r for r in results if r[0] != "ok"][:3]
    notes = b.call("notifications")
    end = time.monotonic() + 5
    while len(notes) < 48 and time.monotonic() < end:
        notes += b.call("notifications")
    assert sorted(n[3] for n in notes) == sorted(f"r{k}".encode() for k in range(48))
    for s, d in plan:
        assert_peer_blocks(b, d, expected_blocks(KIND, SEED, 7, s))


def _wait_running(a) -> None:
    end = time.monotonic() + 5
    while a.call("states") != ["RUNNING"] and time.monotonic() < end:
        time.sleep(0.01)
    time.sleep(0.3)
    assert a.call("states") == ["RUNNING"], "the transfer ended before the fault: make it longer"


def test_link_cut_then_peer_killed_mid_transfer(hosts):
    """The veth link taken down mid-transfer: typed error by the deadline, nothing delivered; the
    link back up: the agents move blocks again; then kill -9 of the peer mid-transfer: noticed
    at once, not at the deadline."""
    pair, start = hosts
    a, b = start("a", "prefill", SLOW, seed=3), start("b", "decode", SLOW, env=SLOW_ENV)
    a.call("connect", b.metadata)
    pair.rate(SLOW_RATE)  # 32 MiB at 5 MB/s: still running whenever the faults below come, on any machine
    a.call("post", [("write", "decode", list(range(512)), list(range(512)), 3.0, b"cut")])
    _wait_running(a)
    pair.link("down")
    start_t = time.monotonic()
    try:
        (res,) = a.call("wait", timeout=10)
        waited = time.monotonic() - start_t
    finally:
        pair.link("up")
    assert res[0] == "error" and res[1] in ("TransferTimeoutError", "PeerDisconnectedError"), res
    assert waited < 3.0 + 1.0  # by its deadline
    time.sleep(0.5)
    assert b.call("notifications") == []  # the partial transfer was never reported
    # the link is back: the same agents move blocks again (reconnecting if UCX dropped the endpoint)
    a.call("post", [("write", "decode", [5, 6], [7, 8], 15, b"again")])
    assert a.call("wait", timeout=30)[0][0] == "ok"
    assert b.call("notification", 5)[4] == b"again"
    assert_peer_blocks(b, [7, 8], expected_blocks(KIND, SLOW, 3, [5, 6]))
    # kill -9 of the peer host's agent mid-transfer
    a.call("post", [("write", "decode", list(range(512)), list(range(512)), 30, b"x")])
    _wait_running(a)
    b.kill()
    start_t = time.monotonic()
    (res,) = a.call("wait", timeout=40)
    assert res[:2] == ("error", "PeerDisconnectedError"), res
    assert time.monotonic() - start_t < 5.0  # noticed, not waited out to the 30 s deadline
