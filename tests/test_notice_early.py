"""A lone WRITE's notice sent at its copy's launch (XFER_NOTICE_EARLY; xfer.transports.onesided.mailbox).

The target checks the notice when it comes and answers it only once the initiator wrote its
landing slot: delivered after every byte landed, never before; a copy stopped short delivers
nothing and ends its grant; a slot never written is refused by the deadline with nothing
delivered; malformed landing fields are refused, typed, and the target serves on. Each case checks
the destination bytes (moved blocks the source's, every other byte still poisoned)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from helpers import assert_blocks_equal, assert_untouched, fill_random, poison
from xfer import Agent, AgentConfig, make_kv_cache, shared_empty
from xfer.errors import InvalidArgumentError, TransferCancelledError, TransferTimeoutError
from xfer.transfer import TransferState

DIMS = dict(num_layers=2, num_blocks=16, block_size=4, num_heads=1, head_dim=16)


@pytest.fixture
def pair(monkeypatch):
    from xfer.settings import reload

    monkeypatch.setenv("XFER_NOTICE_EARLY", "1")
    reload()
    ta, la = make_kv_cache("vllm_flash_attn_nhd", empty=shared_empty, **DIMS)
    tb, lb = make_kv_cache("vllm_flash_attn_nhd", empty=shared_empty, **DIMS)
    fill_random(ta, seed=3)
    poison(tb)
    a = Agent("early-a", AgentConfig(enable=("local",), default_timeout_s=5))
    b = Agent("early-b", AgentConfig(enable=("local",), default_timeout_s=5))
    a.register("kv", ta, la)
    b.register("kv", tb, lb)
    peer = a.connect(b.metadata())
    yield a, b, peer, (ta, la), (tb, lb)
    a.close()
    b.close()


def slowed(agent, delay: float, before=None):
    """The agent's host copies start ``delay`` seconds late (``before()`` runs first)."""
    tr = next(iter(agent.transports.values()))
    real = tr._launch

    def launch(job, prep=None):
        if before is not None:
            before(job)
        time.sleep(delay)
        return real(job, prep)
    tr._launch = launch
    return tr


def test_the_notice_leaves_at_the_launch_and_is_delivered_only_after_the_bytes_landed(pair):
    a, b, peer, (ta, la), (tb, lb) = pair
    slowed(a, 0.3)
    t = a.write(peer, [1, 2, 3], [4, 5, 6], notify=b"req-1")
    time.sleep(0.15)  # the notice is at the target, the copy not begun
    assert "noticed" in dict(t.marks) and "launched" not in dict(t.marks)
    assert b.notifications() == []
    assert t.wait() is TransferState.DONE
    tl = t.timeline()
    assert tl["noticed"] < tl["launched"] < tl["copied"] <= tl["acked"]
    note = b.wait_notification(2)
    assert note.payload == b"req-1" and note.blocks.tolist() == [4, 5, 6]
    assert_blocks_equal(la, ta, [1, 2, 3], lb, tb, [4, 5, 6])
    assert_untouched(lb, tb, [4, 5, 6])
    assert len(b._grants) == 0
    # a second write into the same blocks: the first's grant ended with its delivery
    assert a.write(peer, [7, 8, 9], [4, 5, 6]).wait() is TransferState.DONE
    assert_blocks_equal(la, ta, [7, 8, 9], lb, tb, [4, 5, 6])


def test_a_copy_stopped_before_it_ran_delivers_nothing_and_ends_its_grant(pair):
    a, b, peer, (ta, la), (tb, lb) = pair
    slowed(a, 0.3)
    t = a.write(peer, [1, 2, 3], [4, 5, 6], notify=b"gone")
    time.sleep(0.1)
    t.cancel()
    with pytest.raises(TransferCancelledError):
        t.wait()
    assert "noticed" in dict(t.marks)
    time.sleep(0.2)
    assert b.notifications() == [] and len(b._grants) == 0
    assert_untouched(lb, tb, [])  # nothing landed
    assert a.write(peer, [1, 2, 3], [4, 5, 6]).wait() is TransferState.DONE  # the blocks are free again


def test_a_slot_never_written_is_refused_by_the_deadline_and_the_target_serves_on(pair):
    a, b, peer, (ta, la), (tb, lb) = pair
    tr = next(iter(a.transports.values()))
    tr._box.land = lambda slot, seq, landed=True: None  # the initiator never reports its landing
    c = Agent("early-c", AgentConfig(enable=("local",)))
    try:
        other = c.connect(b.metadata())
        t = a.write(peer, [1, 2, 3], [4, 5, 6], notify=b"never", timeout=1.0)
        time.sleep(0.2)
        start = time.monotonic()
        c.send(other, b"meanwhile")  # the target's control loop is not held by the waiting notice
        assert time.monotonic() - start < 0.5
        assert b.wait_notification(2, peer="early-c").payload == b"meanwhile"
        with pytest.raises(TransferTimeoutError):
            t.wait()
        assert t.finished - t.created < 1.0 + 1.5  # by its deadline and the grace
        assert b.notifications() == []
        end = time.monotonic() + 5  # the initiator ends the grant once its copy ended (retried)
        while len(b._grants) and time.monotonic() < end:
            time.sleep(0.05)
        assert len(b._grants) == 0
    finally:
        c.close()


@pytest.mark.parametrize("landing, match", [
    ({"box": "xfer-1-1", "slot": 0, "seq": 1}, "sender's"),  # another process's segment
    ({"box": "/etc/passwd", "slot": 0, "seq": 1}, "sender's"),
    ({"box": "BOX", "slot": 99999, "seq": 1}, "malformed"),
    ({"box": "BOX", "slot": 0, "seq": True}, "malformed"),
    ({"box": "BOX", "slot": -1, "seq": 1}, "malformed"),
    ("not a dict", "landing slot"),
])
def test_malformed_landing_fields_are_refused_typed_and_nothing_is_delivered(pair, landing, match):
    import os

    from xfer.transports.completion import raise_remote

    a, b, peer, (ta, la), (tb, lb) = pair
    tr = next(iter(a.transports.values()))
    if isinstance(landing, dict) and landing["box"] == "BOX":
        landing = {**landing, "box": tr._box.name}
    header = {"type": "notify", "from": "early-a", "pid": os.getpid(), "host": a._host_id, "transfer_id": "x",
              "op": "write", "region": "kv", "ttl": 5.0, "sent": time.monotonic(), "grant": 1, "landing": landing}
    reply, _ = a._clients[peer].request(header, b"", deadline=time.monotonic() + 5)
    with pytest.raises(InvalidArgumentError, match=match):
        raise_remote(reply, peer)
    assert b.notifications() == []
    assert a.write(peer, [1, 2], [3, 4]).wait() is TransferState.DONE  # the target serves on
    assert_blocks_equal(la, ta, [1, 2], lb, tb, [3, 4])
