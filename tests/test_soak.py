"""Load under faults, CI-sized: one agent drives mixed-size concurrent transfers into three peer
processes for a few seconds while one peer is killed mid-round and replaced. Every transfer must
end by its deadline (no hang); every DONE transfer's blocks must verify byte for byte on the peer;
a peer must be notified of exactly the transfers reported DONE (nothing half-written reported
complete). ``XFER_SOAK_SECONDS`` and ``XFER_SOAK_CONCURRENCY`` make it the opt-in long run
(e.g. 60 s with 1000 transfers in flight)."""

import os
import random
import resource
import threading
import time

import numpy as np
import pytest

from helpers import PeerProcess, fill_random
from xfer import Agent, AgentConfig, LayoutKind, TransferState, make_kv_cache
from xfer.bench.target import block_digests
from xfer.errors import XferError

KIND = LayoutKind.VLLM_FLASH_ATTN_NHD
DIMS = dict(num_layers=8, num_blocks=1536, block_size=2, num_heads=1, head_dim=16)
SECONDS = float(os.environ.get("XFER_SOAK_SECONDS", "8"))
# transfers in flight at once across the three peers (the opt-in long run: 1000 and 60 s)
CONCURRENCY = int(os.environ.get("XFER_SOAK_CONCURRENCY", "120"))
DEADLINE = 5.0


def post_round(agent, rng, peer_names, per_peer):
    """Up to ``per_peer`` transfers per peer, each to a disjoint random range of blocks."""
    posted = []
    for name in peer_names:
        cuts = sorted(rng.sample(range(1, DIMS["num_blocks"]), per_peer))
        starts = [0] + cuts
        for lo, hi in zip(starts, cuts + [DIMS["num_blocks"]]):
            n = rng.randint(1, min(8, hi - lo))
            dst = list(range(lo, lo + n))
            src = [rng.randrange(DIMS["num_blocks"]) for _ in range(n)]
            posted.append((name, src, dst, agent.write(name, src, dst, timeout=DEADLINE)))
    return posted


@pytest.mark.timeout(300)
def test_soak_mixed_transfers_with_a_peer_killed_and_replaced():
    rng = random.Random(1)
    tensors, layout = make_kv_cache(KIND, **DIMS)
    fill_random(tensors, seed=21)
    peers = {f"d{i}": PeerProcess(f"d{i}", KIND, DIMS) for i in range(3)}
    stats = dict(tried=0, done=0, failed=0, faults=0, hangs=0, corrupt=0, reported_not_done=0, rounds=0)
    rss0 = None
    agent = Agent("soak", AgentConfig(default_timeout_s=DEADLINE, enable=("local",)))
    try:
        agent.register("kv", tensors, layout)
        for p in peers.values():
            agent.connect(p.metadata)
        end = time.monotonic() + SECONDS
        kill_round = 3
        while time.monotonic() < end or stats["rounds"] <= kill_round:
            killed = None
            if stats["rounds"] == kill_round:  # kill d1 while this round's transfers are in flight
                killed = "d1"
                threading.Timer(0.002, peers[killed].kill).start()
                stats["faults"] += 1
            posted = post_round(agent, rng, list(peers), max(1, CONCURRENCY // len(peers)))
            stats["tried"] += len(posted)
            t_end = time.monotonic() + DEADLINE + 2.0
            for _, _, _, t in posted:
                try:
                    t.wait(timeout=max(0.0, t_end - time.monotonic()))
                except XferError:
                    pass
                if not t.poll().terminal:
                    stats["hangs"] += 1
            for name, p in peers.items():
                if name == killed:
                    continue
                notified = {tid for tid, *_ in p.call("drain")}
                mine = [(src, dst, t) for n, src, dst, t in posted if n == name]
                done = {t.id for _, _, t in mine if t.poll() is TransferState.DONE}
                stats["reported_not_done"] += len(notified - done)
                for src, dst, t in mine:
                    if t.poll() is TransferState.DONE:
                        digests, _ = p.call("digests", dst)
                        stats["corrupt"] += digests != block_digests(layout, tensors, src)
            stats["done"] += sum(t.poll() is TransferState.DONE for *_, t in posted)
            stats["failed"] += sum(t.poll() is not TransferState.DONE for *_, t in posted)
            if killed:  # a replacement process under the same name; the agent reconnects
                peers[killed].close()
                peers[killed] = PeerProcess(killed, KIND, DIMS)
                agent.connect(peers[killed].metadata)
            stats["rounds"] += 1
            if stats["rounds"] == 2:
                rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        print(f"soak: {stats}, peak RSS growth after warm-up {growth_mib:.1f} MiB")
        assert stats["hangs"] == 0 and stats["corrupt"] == 0 and stats["reported_not_done"] == 0
        assert stats["done"] > stats["tried"] // 2 and stats["faults"] == 1
        assert growth_mib < 200
    finally:
        agent.close()
        for p in peers.values():
            p.close()
