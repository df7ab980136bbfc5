"""A burst's posts take the pipeline's due turns (XFER_POST_TURNS; OneSidedTransport._help).

An engine thread that posts a burst and runs Python between posts keeps the GIL: the worker,
whose grant replies came, would launch the granted copies only when that thread lets the GIL go.
Here the interpreter's forced switch is set to 1 s while the burst is posted (each post followed
by 1 ms of pure Python, as an engine's work between requests), so the worker does nothing until the
last post: without post turns nothing launches before it; with them the posting thread launches
the granted copies itself, in posting order, while it posts. Every transfer's bytes are checked at
the target (a process of its own: its control server answers while this process posts), and
every byte outside them is still poisoned."""

from __future__ import annotations

import sys
import time

import pytest

from helpers import PeerProcess, fill_random, queued
from xfer import Agent, AgentConfig, LayoutKind, TransferState, make_kv_cache, shared_empty

DIMS = dict(num_layers=4, num_blocks=128, block_size=4, num_heads=1, head_dim=16)
KIND = LayoutKind.VLLM_FLASH_ATTN_NHD
N = 24  # writes in the burst


@pytest.fixture
def burst_pair(monkeypatch, request):
    from xfer.settings import reload

    monkeypatch.setenv("XFER_POST_TURNS", request.param)
    reload()
    target = PeerProcess("turns-b", KIND, DIMS)
    tensors, layout = make_kv_cache(KIND, empty=shared_empty, **DIMS)
    fill_random(tensors, seed=11)
    a = Agent("turns-a", AgentConfig(enable=("local",), default_timeout_s=20))
    try:
        a.register("kv", tensors, layout)
        peer = a.connect(target.metadata)
        yield a, peer, target, tensors, layout, request.param != "0"
    finally:
        a.close()
        target.close()
        monkeypatch.delenv("XFER_POST_TURNS")
        reload()


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _burst(a, peer, src, dst) -> tuple[list, float]:
    """Post the burst with the GIL's forced switch at 1 s; (the transfers, when the last post returned)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # the worker gets the GIL only when this thread lets it go
    try:
        ts = []
        for s, d in zip(src, dst):
            ts.append(a.write(peer, s, d, timeout=20))
            _busy(0.001)
        return ts, time.monotonic()
    finally:
        sys.setswitchinterval(old)


# "1": on (these copies launch as stream copies do: queued); "0": off (the default)
@pytest.mark.parametrize("burst_pair", ["1", "0"], indirect=True, ids=["turns", "no-turns"])
def test_a_burst_launches_its_copies_while_it_is_posted_in_posting_order(burst_pair):
    from xfer.bench.target import block_digests

    a, peer, target, tensors, layout, on = burst_pair
    queued(a)  # copies launch as stream copies do: the launch returns at once
    assert a.write(peer, [0], [127]).wait() is TransferState.DONE  # connections open, caches warm
    src = [[(5 * i) % 48, (5 * i + 1) % 48] for i in range(N)]
    dst = [[64 + 2 * i, 65 + 2 * i] for i in range(N)]
    ts, posted = _burst(a, peer, src, dst)
    assert [t.wait() for t in ts] == [TransferState.DONE] * N
    launched = [dict(t.marks)["launched"] for t in ts]
    assert launched == sorted(launched)  # in posting order
    early = sum(at < posted for at in launched)
    if on:  # (how many depends on the target's replies on a loaded 2-core machine: at least the first)
        assert early >= 1, f"no copy launched while the burst was posted ({1e3 * (launched[0] - posted):.1f} ms after)"
    else:  # the case the turns are for: the worker starved until the posting ended
        assert early == 0, f"{early} copies launched before the last post"
    # every destination block holds its source's bytes; every other byte is still poisoned
    theirs, untouched = target.call("digests", [d for ds in dst for d in ds] + [127])
    assert theirs == block_digests(layout, tensors, [s for ss in src for s in ss] + [0])
    assert untouched


@pytest.mark.parametrize("burst_pair", ["1"], indirect=True, ids=["turns"])
def test_a_refused_grant_in_a_burst_ends_that_write_alone(burst_pair):
    """A WRITE of the burst whose grant the target refuses (another peer holds its block) ends with
    the refusal and nothing of it lands; the others land, launched in the posting thread's turns."""
    from xfer.bench.target import block_digests
    from xfer.errors import BlocksBusyError

    a, peer, target, tensors, layout, _ = burst_pair
    queued(a)
    assert a.write(peer, [0], [127]).wait() is TransferState.DONE
    other = Agent("turns-c", AgentConfig(enable=("local",), default_timeout_s=20))
    try:
        t2, l2 = make_kv_cache(KIND, empty=shared_empty, **DIMS)
        other.register("kv", t2, l2)
        name = target.call("connect", other.metadata())
        assert isinstance(target.call("grant", (name, [100])), str)  # block 100 held for the other peer
        src = [[i] for i in range(12)]
        dst = [[64 + i] for i in range(12)]
        dst[5] = [100]
        ts, _ = _burst(a, peer, src, dst)
        with pytest.raises(BlocksBusyError):
            ts[5].wait()
        ok = [i for i in range(12) if i != 5]
        assert [ts[i].wait() for i in ok] == [TransferState.DONE] * 11
        theirs, untouched = target.call("digests", [dst[i][0] for i in ok] + [127])
        assert theirs == block_digests(layout, tensors, [src[i][0] for i in ok] + [0])
        assert untouched  # every other block, 100 included, still poisoned
    finally:
        other.close()
