"""A lone WRITE's or READ's notice sent at its copy's launch (XFER_NOTICE_EARLY; xfer.transports.onesided.mailbox).

The target checks the notice when it comes and answers it only once the initiator wrote its
landing slot: delivered after every byte landed, never before; a copy stopped short delivers
nothing and ends its grant; a slot never written is refused by the deadline with nothing
delivered; malformed landing fields are refused, typed, and the target serves on. A READ is
checked by its initiator against the target's busy counts (xfer.transports.onesided.readcheck):
it ends without waiting for the target's answer, refused when the target wrote, held for writing,
revoked or deregistered its blocks while it copied; a target whose counts cannot be mapped checks
the notice itself, as before. Each case checks the destination bytes (moved blocks the source's,
every other byte still poisoned)."""

from __future__ import annotations

import time

import pytest

from helpers import (DIMS_TINY as DIMS, assert_blocks_equal, assert_untouched, fill_random, local_pair, poison, queued,
                     slowed)
from xfer import Agent, AgentConfig, make_kv_cache, shared_empty
from xfer.errors import InvalidArgumentError, TransferCancelledError
from xfer.transfer import TransferState

@pytest.fixture
def pair(monkeypatch):
    from xfer.settings import reload

    monkeypatch.setenv("XFER_NOTICE_EARLY", "1")
    reload()
    yield from local_pair("early", seed=3)


def _held(a, post, delay=0.3, settle=0.15):
    """``post()`` with ``a``'s copies held ``delay`` s: the transfer, once its notice left and its
    copy has not begun."""
    slowed(a, delay)
    t = post()
    time.sleep(settle)  # the notice is at the target, the copy not begun
    assert "noticed" in dict(t.marks) and "launched" not in dict(t.marks)
    return t


def _delivered_after_the_copy(a, b, post, payload: bytes, peer_blocks: list[int], last: str = "acked"):
    """A held transfer's notice is at the target before its copy; the target delivers it only
    after the copy, naming its blocks and payload. ``last``: the transfer's last mark (acked: the
    target's answer; checked: a READ's own check)."""
    t = _held(a, post)
    assert b.notifications() == []
    assert t.wait() is TransferState.DONE
    tl = t.timeline()
    assert tl["noticed"] < tl["launched"] < tl["copied"] <= tl[last]
    assert ("checked" in tl) == (last == "checked") and ("acked" in tl) == (last == "acked")
    note = b.wait_notification(2)
    assert note.payload == payload and note.blocks.tolist() == peer_blocks


def _cancelled_before_the_copy(a, b, post) -> None:
    """A held transfer cancelled after its notice left: it ends CANCELLED, nothing is delivered."""
    t = _held(a, post, settle=0.1)
    t.cancel()
    with pytest.raises(TransferCancelledError):
        t.wait()
    time.sleep(0.2)
    assert b.notifications() == []


def test_the_notice_leaves_at_the_launch_and_is_delivered_only_after_the_bytes_landed(pair):
    a, b, peer, (ta, la), (tb, lb) = pair
    _delivered_after_the_copy(a, b, lambda: a.write(peer, [1, 2, 3], [4, 5, 6], notify=b"req-1"), b"req-1",
                              [4, 5, 6])
    assert_blocks_equal(la, ta, [1, 2, 3], lb, tb, [4, 5, 6])
    assert_untouched(lb, tb, [4, 5, 6])
    assert len(b._grants) == 0
    # a second write into the same blocks: the first's grant ended with its delivery
    assert a.write(peer, [7, 8, 9], [4, 5, 6]).wait() is TransferState.DONE
    assert_blocks_equal(la, ta, [7, 8, 9], lb, tb, [4, 5, 6])


def test_a_copy_stopped_before_it_ran_delivers_nothing_and_ends_its_grant(pair):
    a, b, peer, (ta, la), (tb, lb) = pair
    _cancelled_before_the_copy(a, b, lambda: a.write(peer, [1, 2, 3], [4, 5, 6], notify=b"gone"))
    assert len(b._grants) == 0
    assert_untouched(lb, tb, [])  # nothing landed
    assert a.write(peer, [1, 2, 3], [4, 5, 6]).wait() is TransferState.DONE  # the blocks are free again


def _reading(pair):
    """The pair with the reader's (a's) cache poisoned and the target's (b's) random."""
    a, b, peer, (ta, la), (tb, lb) = pair
    fill_random(tb, seed=5)
    poison(ta)
    return pair


def test_a_lone_reads_notice_leaves_at_the_launch_and_is_checked_after_its_copy(pair):
    """A READ's notice names its blocks and the copy's start: it leaves before the (held) copy, is
    delivered only after the initiator wrote its slot, and the initiator's blocks hold the peer's."""
    a, b, peer, (ta, la), (tb, lb) = _reading(pair)
    _delivered_after_the_copy(a, b, lambda: a.read(peer, [4, 5, 6], [1, 2, 3], notify=b"pulled"), b"pulled",
                              [4, 5, 6], last="checked")
    assert_blocks_equal(lb, tb, [4, 5, 6], la, ta, [1, 2, 3])
    assert_untouched(la, ta, [1, 2, 3])


def _tables(a):
    return next(iter(a.transports.values()))


def test_a_lone_read_ends_on_its_own_check_before_the_target_answers(pair):
    """The target's delivery of a READ's notice is held (its control loop busy): the READ still ends
    DONE once its copy ended and its own check passed, with the bytes; the target delivers the
    notice once it is free, and the landing slot is given back once its answer is taken."""
    import threading

    a, b, peer, (ta, la), (tb, lb) = _reading(pair)
    gate, inside = threading.Event(), threading.Event()
    real = b._inbox.notice

    def held_notice(header, entry, payload):
        inside.set()
        assert gate.wait(10)
        return real(header, entry, payload)
    b._inbox.notice = held_notice
    try:
        t = a.read(peer, [4, 5, 6], [1, 2, 3], notify=b"early")
        assert t.wait(timeout=3) is TransferState.DONE
        assert inside.wait(2) and b.notifications() == []  # the target has not delivered it yet
        tl = t.timeline()
        assert "checked" in tl and "acked" not in tl
        assert_blocks_equal(lb, tb, [4, 5, 6], la, ta, [1, 2, 3])
        assert_untouched(la, ta, [1, 2, 3])
    finally:
        gate.set()
    note = b.wait_notification(2)
    assert note.payload == b"early" and note.blocks.tolist() == [4, 5, 6]
    tr = _tables(a)
    end = time.monotonic() + 2
    while tr._unacked and time.monotonic() < end:  # the answer is taken by the next sweep
        time.sleep(0.01)
        tr._sweep()
    assert not tr._unacked and len(tr._box._free) == 1024
    assert a.read(peer, [7], [8]).wait() is TransferState.DONE
    assert_blocks_equal(lb, tb, [7], la, ta, [8])


@pytest.mark.parametrize("change", ["held", "written", "deregistered"])
def test_a_read_whose_source_changes_during_its_copy_is_refused_by_its_own_check(pair, change):
    """While a held READ's copy waits: the target holds some of its blocks for a write (held), or
    holds and ends such a hold (written: a write landed), or deregisters the region. The READ's own
    check refuses it (BlocksBusyError, RevokedError), nothing is delivered, the target serves on."""
    from xfer.errors import BlocksBusyError, RevokedError

    a, b, peer, (ta, la), (tb, lb) = _reading(pair)
    assert a.read(peer, [9], [10]).wait() is TransferState.DONE  # the peer's region mapped here
    assert b.wait_notification(2).blocks.tolist() == [9]
    t = _held(a, lambda: a.read(peer, [4, 5, 6], [1, 2, 3], notify=b"mixed"), delay=0.4)
    region = b._regions["kv"]
    if change == "deregistered":
        b.deregister("kv")
    else:
        import numpy as np

        hold = b._grants.hold(region, np.array([5]), writes=True, peer="writer", tid="w1", owner="writer")
        if change == "written":
            b._grants.end(hold)
    with pytest.raises(RevokedError if change == "deregistered" else BlocksBusyError):
        t.wait()
    assert "checked" in t.timeline() and t.poll() is TransferState.FAILED
    time.sleep(0.2)
    assert b.notifications() == []
    if change == "held":
        b._grants.end(hold)
    if change != "deregistered":
        assert a.read(peer, [7], [8]).wait() is TransferState.DONE  # the target serves on
        assert_blocks_equal(lb, tb, [7], la, ta, [8])
    assert_untouched(la, ta, [1, 2, 3, 8, 10] if change != "deregistered" else [1, 2, 3, 10])


@pytest.mark.parametrize("bad", ["other-pid", "wrong-size", "not-a-name", "missing"])
def test_a_read_from_a_target_whose_busy_counts_cannot_be_mapped_is_checked_by_the_target(pair, bad):
    """The target's published busy segment names another process's segment, one of another size,
    no segment, or is absent: the READ's notice is checked on the target's side, as before (the
    READ ends once the target answered), and the bytes land."""
    import os

    a, b, peer, (ta, la), (tb, lb) = _reading(pair)
    export = a._peers[peer].metadata.regions["kv"].exports["local"]
    assert export.get("busy")
    other = f"/dev/shm/xfer-1-{os.getpid()}"  # a segment of the right size, named for another process (pid 1)
    with open(other, "wb") as f:
        f.truncate(3 * 8 * lb.num_blocks)
    export["busy"] = {"other-pid": os.path.basename(other), "wrong-size": _tables(a)._box.name, "not-a-name": "../x",
                      "missing": None}[bad]
    try:
        t = a.read(peer, [4, 5, 6], [1, 2, 3], notify=b"checked-there")
        assert t.wait() is TransferState.DONE
    finally:
        os.unlink(other)
    tl = t.timeline()
    assert "acked" in tl and "checked" not in tl
    assert b.wait_notification(2).payload == b"checked-there"
    assert_blocks_equal(lb, tb, [4, 5, 6], la, ta, [1, 2, 3])
    assert_untouched(la, ta, [1, 2, 3])


def test_a_read_from_another_process_checks_that_process_busy_counts(pair):
    """The target in another process (its cache and busy counts in its shared memory): a lone READ
    ends DONE on its own check, with the target's bytes, and the target delivers its notice; a READ
    whose source the target revokes while its copy waits is refused by its own check (RevokedError),
    and nothing of it is delivered."""
    from helpers import PeerProcess
    from xfer.errors import RevokedError

    a, _, _, (ta, la), _ = pair
    poison(ta)
    b = PeerProcess("early-far", "vllm_flash_attn_nhd", DIMS, seed=11,
                    config=AgentConfig(enable=("local",), default_timeout_s=5))
    try:
        peer = a.connect(b.metadata)
        t = a.read(peer, [4, 5, 6], [1, 2, 3], notify=b"far")
        assert t.wait() is TransferState.DONE
        assert "checked" in t.timeline() and "acked" not in t.timeline()
        assert_blocks_equal(la, b.tensors(), [4, 5, 6], la, ta, [1, 2, 3])
        assert_untouched(la, ta, [1, 2, 3])
        got = b.call("notification", 2)
        assert got[0] == "ok" and got[3] == [4, 5, 6] and got[4] == b"far"
        t = _held(a, lambda: a.read(peer, [7, 8], [9, 10], notify=b"revoked"), delay=0.4)
        assert b.call("revoke", [8]) == 0  # (a READ holds nothing: only the counts say it)
        with pytest.raises(RevokedError):
            t.wait()
        assert "checked" in t.timeline()
        time.sleep(0.2)
        assert b.call("drain") == []
    finally:
        b.close()


def test_a_read_whose_source_is_revoked_during_its_copy_is_refused_after_it(pair):
    """The target revokes and rewrites the READ's source blocks after the notice came and before the
    copy ran: the notice, checked once the slot says the copy ended, is refused (RevokedError), the
    READ never ends DONE, nothing is delivered, and the target serves on."""
    from xfer.errors import RevokedError

    a, b, peer, (ta, la), (tb, lb) = _reading(pair)
    t = _held(a, lambda: a.read(peer, [4, 5, 6], [1, 2, 3], notify=b"mixed"), delay=0.4)
    assert b.revoke([5], region="kv", timeout=2) >= 0
    with pytest.raises(RevokedError):
        t.wait()
    assert t.poll() is TransferState.FAILED
    assert b.notifications() == []
    assert a.read(peer, [7], [8]).wait() is TransferState.DONE  # the target serves on
    assert_blocks_equal(lb, tb, [7], la, ta, [8])
    assert_untouched(la, ta, [1, 2, 3, 8])  # (the refused READ's blocks hold what it read: reported failed)


def test_a_read_stopped_before_its_copy_ran_delivers_nothing(pair):
    a, b, peer, (ta, la), (tb, lb) = _reading(pair)
    _cancelled_before_the_copy(a, b, lambda: a.read(peer, [4, 5, 6], [1, 2, 3], notify=b"gone"))
    assert_untouched(la, ta, [])  # nothing landed
    assert a.read(peer, [4], [1]).wait() is TransferState.DONE
    assert_blocks_equal(lb, tb, [4], la, ta, [1])


def test_a_write_revoked_while_its_notice_waits_ends_revoked(pair):
    """The target revokes the blocks of a write whose notice waits for its slot: the revoke returns
    once the copy ended and the notice was refused; the write ends RevokedError (the notice's own
    refusal, not a second notice's "no such grant"), and nothing is delivered."""
    from xfer.errors import RevokedError

    a, b, peer, (ta, la), (tb, lb) = pair
    t = _held(a, lambda: a.write(peer, [1, 2, 3], [4, 5, 6], notify=b"revoked"), delay=0.4)
    assert b.revoke([5], region="kv", timeout=3) == 1
    with pytest.raises(RevokedError):
        t.wait()
    assert b.notifications() == [] and len(b._grants) == 0
    assert a.write(peer, [7], [8]).wait() is TransferState.DONE  # the target serves on
    assert_blocks_equal(la, ta, [7], lb, tb, [8])


def _dying_initiator(md: bytes, conn) -> None:
    """A child process: writes into the target with XFER_NOTICE_EARLY, its copy held back, says
    when its notice left, then waits to be killed."""
    import os

    os.environ["XFER_NOTICE_EARLY"] = "1"
    ta, la = make_kv_cache("vllm_flash_attn_nhd", empty=shared_empty, **DIMS)
    fill_random(ta, seed=4)
    a = Agent("early-dying", AgentConfig(enable=("local",), default_timeout_s=30))
    a.register("kv", ta, la)
    peer = a.connect(md)
    slowed(a, 60.0)
    t = a.write(peer, [1, 2, 3], [4, 5, 6], notify=b"never")
    end = time.monotonic() + 20
    while "noticed" not in dict(t.marks) and time.monotonic() < end:
        time.sleep(0.01)
    conn.send("noticed" in dict(t.marks))
    time.sleep(60)


def test_an_initiator_killed_mid_copy_never_has_its_notice_delivered_and_the_target_serves_on(pair):
    """kill -9 of the initiator after its notice left and before its copy ran: nothing is delivered,
    the target's control loop serves another peer meanwhile and after, and the blocks, never
    written, can be revoked (the dead initiator's hold is reaped) and written again."""
    import multiprocessing as mp
    import os
    import signal

    a, b, peer, (ta, la), (tb, lb) = pair
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_dying_initiator, args=(b.metadata(), child), daemon=True)
    proc.start()
    try:
        assert parent.poll(60) and parent.recv() is True
        start = time.monotonic()
        assert a.write(peer, [9], [10]).wait() is TransferState.DONE  # another peer, served meanwhile
        assert time.monotonic() - start < 2.0
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        time.sleep(0.3)
        notes = b.notifications()
        assert [n.payload for n in notes] == [b""] and notes[0].peer == "early-a"
        assert b.revoke([4, 5, 6], region="kv", timeout=5) >= 0  # returns: the dead one's hold is gone
        assert_untouched(lb, tb, [10])
        assert a.write(peer, [1, 2, 3], [4, 5, 6]).wait() is TransferState.DONE
        assert_blocks_equal(la, ta, [1, 2, 3, 9], lb, tb, [4, 5, 6, 10])
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


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


def test_a_target_that_cannot_map_the_slot_gets_the_usual_notice_and_no_more_landing_ones(pair, monkeypatch):
    """Where the target cannot read the initiator's slots (no common /dev/shm between containers),
    the write still completes by the usual notice after its copy, and later writes to that peer
    send the usual notice only."""
    from xfer.errors import TransportError

    a, b, peer, (ta, la), (tb, lb) = pair

    def no_view(name, pid):
        raise TransportError("cannot open peer shared segment: no such file")
    monkeypatch.setattr(b._inbox._boxes, "view", no_view)
    t = a.write(peer, [1, 2, 3], [4, 5, 6], notify=b"fallback")
    assert t.wait() is TransferState.DONE and "noticed" in dict(t.marks)
    assert b.wait_notification(2).payload == b"fallback"
    t2 = a.write(peer, [7], [8])
    assert t2.wait() is TransferState.DONE and "noticed" not in dict(t2.marks)
    assert_blocks_equal(la, ta, [1, 2, 3, 7], lb, tb, [4, 5, 6, 8])
    assert_untouched(lb, tb, [4, 5, 6, 8])
    assert len(b._grants) == 0


@pytest.mark.parametrize("op", ["write", "read"])
def test_transfers_after_a_lone_one_are_not_held_behind_its_landing_notice(pair, op):
    """Launches that return at once (as ipc's): a lone transfer's notice waits at the target for its
    slot, while the transfers posted after it finish their copies first and the completer waits on
    their (usual) notices before it writes that slot. Landing notices go on a connection of their
    own, so neither waits on the other: every transfer ends well before its deadline with its bytes."""
    a, b, peer, (ta, la), (tb, lb) = pair if op == "write" else _reading(pair)
    queued(a)
    start, noticed = time.monotonic(), 0
    for r in range(20):
        src = [(r + k) % 8 for k in range(8)]
        if op == "write":
            ts = [a.write(peer, [s], [8 + k], timeout=3) for k, s in enumerate(src)]
        else:
            ts = [a.read(peer, [s], [8 + k], timeout=3) for k, s in enumerate(src)]
        assert [t.wait() for t in ts] == [TransferState.DONE] * 8
        if op == "write":
            assert_blocks_equal(la, ta, src, lb, tb, list(range(8, 16)))
        else:
            assert_blocks_equal(lb, tb, src, la, ta, list(range(8, 16)))
        noticed += sum("noticed" in dict(t.marks) for t in ts)
    assert time.monotonic() - start < 5.0
    assert 0 < noticed < 160  # landing notices and usual ones, mixed
    if op == "write":
        assert_untouched(lb, tb, list(range(8, 16)))
    else:
        assert_untouched(la, ta, list(range(8, 16)))
    assert len(b._grants) == 0


def test_a_closed_landing_connection_is_opened_again_after_the_next_write(pair):
    """The landing connection closed (idle, or broken): the next lone WRITE sends the usual notice
    after its copy, and the completer opens the connection again for the one after it."""
    from xfer.errors import PeerDisconnectedError

    a, b, peer, (ta, la), (tb, lb) = pair
    lane = a._clients[peer].lane()
    assert lane.is_open
    with lane._lock:
        lane._reset(PeerDisconnectedError("closed as idle"))
    t1 = a.write(peer, [1], [2])
    assert t1.wait() is TransferState.DONE and "noticed" not in dict(t1.marks)
    end = time.monotonic() + 2
    while not (lane.is_open and not lane._lock.locked()) and time.monotonic() < end:  # its handshake done
        time.sleep(0.01)
    t2 = a.write(peer, [3], [4])
    assert t2.wait() is TransferState.DONE and "noticed" in dict(t2.marks)
    assert_blocks_equal(la, ta, [1, 3], lb, tb, [2, 4])
    assert_untouched(lb, tb, [2, 4])
