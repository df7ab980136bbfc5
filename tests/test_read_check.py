"""One-sided READs checked by their initiator (xfer.transports.onesided.readcheck), on the usual
notice path (``XFER_NOTICE_EARLY`` off, the default for ``local``): a READ whose copy ended runs
the target's own check on the target's busy counts (its shared memory) and ends then, its notice
sent without waiting for the answer; several READs to one peer share one message. Refused READs
(a write hold live on their blocks, revoked blocks) send no notice: nothing is delivered. A target
whose counts cannot be mapped checks the notices itself, as before. Every case checks the bytes:
the read blocks equal the target's, every other block of the reader still poisoned."""

from __future__ import annotations

import time

import numpy as np
import pytest

from helpers import DIMS_TINY, assert_blocks_equal, assert_untouched, fill_random, local_pair, poison, slowed
from xfer.errors import BlocksBusyError, RevokedError
from xfer.transfer import TransferState

DIMS = {**DIMS_TINY, "num_blocks": 32}


@pytest.fixture
def pair(monkeypatch):
    from xfer.settings import reload

    monkeypatch.delenv("XFER_NOTICE_EARLY", raising=False)
    reload()
    for a, b, peer, (ta, la), (tb, lb) in local_pair("rc", seed=5, dims=DIMS):
        fill_random(tb, seed=9)  # the target's blocks random, the reader's poisoned
        poison(ta)
        assert not next(iter(a.transports.values())).notices_early
        yield a, b, peer, (ta, la), (tb, lb)


def _notes(b, n: int, timeout: float = 3.0) -> list:
    got, end = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < end:
        got += b.notifications()
        time.sleep(0.01)
    return got


def test_a_lone_read_ends_on_its_own_check_and_its_notice_is_delivered(pair):
    a, b, peer, (ta, la), (tb, lb) = pair
    t = a.read(peer, [4, 5, 6], [1, 2, 3], notify=b"one")
    assert t.wait() is TransferState.DONE
    tl = t.timeline()
    assert tl["copied"] <= tl["checked"] and "acked" not in tl
    assert_blocks_equal(lb, tb, [4, 5, 6], la, ta, [1, 2, 3])
    assert_untouched(la, ta, [1, 2, 3])
    notes = _notes(b, 1)
    assert [(n.payload, n.blocks.tolist()) for n in notes] == [(b"one", [4, 5, 6])]


def test_reads_back_to_back_end_on_their_own_checks_one_refused_and_not_delivered(pair):
    """Eight READs posted while the reader's copies are held; the target holds blocks of the third
    for a write meanwhile. That one is refused (BlocksBusyError), typed; the seven others end DONE
    with the target's bytes, and the target delivers exactly their seven notices."""
    a, b, peer, (ta, la), (tb, lb) = pair
    region = b._regions["kv"]
    slowed(a, 0.05)
    srcs = [[2 * i, 2 * i + 1] for i in range(8)]
    dsts = [[16 + 2 * i, 17 + 2 * i] for i in range(8)]
    ts = [a.read(peer, s, d, notify=f"r{i}".encode()) for i, (s, d) in enumerate(zip(srcs, dsts))]
    hold = b._grants.hold(region, np.array([5]), writes=True, peer="writer", tid="w1", owner="writer")
    try:
        with pytest.raises(BlocksBusyError):
            ts[2].wait()
        for i, t in enumerate(ts):
            if i != 2:
                assert t.wait() is TransferState.DONE
                assert "checked" in t.timeline() and "acked" not in t.timeline()
    finally:
        b._grants.end(hold)
    ok = [i for i in range(8) if i != 2]
    for i in ok:
        assert_blocks_equal(lb, tb, srcs[i], la, ta, dsts[i])
    assert_untouched(la, ta, [d for i in ok for d in dsts[i]] + dsts[2])
    notes = _notes(b, 7)
    time.sleep(0.1)
    notes += b.notifications()
    assert sorted(n.payload for n in notes) == sorted(f"r{i}".encode() for i in ok)


def test_a_read_whose_source_is_revoked_during_its_copy_is_refused_by_its_own_check(pair):
    a, b, peer, (ta, la), (tb, lb) = pair
    assert a.read(peer, [9], [10]).wait() is TransferState.DONE
    _notes(b, 1)
    slowed(a, 0.3)
    t = a.read(peer, [4, 5, 6], [1, 2, 3], notify=b"gone")
    time.sleep(0.1)
    assert b.revoke([6], region="kv", timeout=2) == 0  # (a READ holds nothing: only the counts say it)
    with pytest.raises(RevokedError):
        t.wait()
    assert "checked" in t.timeline()
    time.sleep(0.2)
    assert b.notifications() == []
    assert_untouched(la, ta, [1, 2, 3, 10])  # (the refused READ's blocks hold what it read: reported failed)


def test_a_target_whose_counts_cannot_be_mapped_checks_the_notice_itself(pair):
    a, b, peer, (ta, la), (tb, lb) = pair
    a._peers[peer].metadata.regions["kv"].exports["local"].pop("busy")
    t = a.read(peer, [4, 5], [1, 2], notify=b"there")
    assert t.wait() is TransferState.DONE
    tl = t.timeline()
    assert "acked" in tl and "checked" not in tl
    assert [n.payload for n in _notes(b, 1)] == [b"there"]
    assert_blocks_equal(lb, tb, [4, 5], la, ta, [1, 2])
    assert_untouched(la, ta, [1, 2])


def test_many_lone_reads_leave_no_unread_answers_behind(pair, caplog):
    """150 lone READs one after another: each one's notice answer is taken while a later copy
    runs, so the answers waiting stay few (unread, they would stop the target's server reading
    that connection: its later requests would time out), every notice is delivered, nothing is
    logged as undelivered, and the bytes of the last read are the target's."""
    import logging

    from xfer.transports.onesided.transport import _UNANSWERED_MAX

    a, b, peer, (ta, la), (tb, lb) = pair
    tr = next(iter(a.transports.values()))
    most, delivered = 0, 0
    with caplog.at_level(logging.WARNING, logger="xfer"):
        for i in range(150):
            assert a.read(peer, [i % 8], [16 + i % 8], notify=b"n").wait() is TransferState.DONE
            most = max(most, len(tr._unacked))
            delivered += len(b.notifications())
    delivered += len(_notes(b, 150 - delivered))
    assert most < _UNANSWERED_MAX and delivered == 150
    assert not [r for r in caplog.records if "not delivered" in r.getMessage()]
    assert_blocks_equal(lb, tb, list(range(8)), la, ta, list(range(16, 24)))
    assert_untouched(la, ta, list(range(16, 24)))


def test_a_read_launches_without_waiting_for_an_earlier_notices_answer(pair):
    """The worker looks at earlier READs' notice answers at each launch and never waits for them
    (``ControlClient.poll_reply``): with the target's answer to the first READ's notice held for
    1.5 s, three more READs, each posted once the one before ended, all end DONE well before that
    answer comes (a look that waited would hold every later launch behind it); the bytes are the
    target's, the other blocks still poisoned, and every notice is delivered."""
    import threading

    a, b, peer, (ta, la), (tb, lb) = pair
    real, held = b._server._handler, threading.Event()

    def handler(header, payload):
        if str(header.get("type", "")).startswith("notify") and not held.is_set():
            held.set()
            time.sleep(1.5)  # the first notice's answer (the target's server loop held meanwhile)
        return real(header, payload)

    b._server._handler = handler
    assert a.read(peer, [4], [1], notify=b"r0").wait() is TransferState.DONE
    assert held.wait(3), "the first READ's notice never reached the target"
    t0 = time.monotonic()
    for i, (s, d) in enumerate(((5, 2), (6, 3), (7, 4))):
        assert a.read(peer, [s], [d], notify=b"r%d" % (i + 1)).wait() is TransferState.DONE
    took = time.monotonic() - t0
    assert took < 1.0, f"three reads took {took:.2f} s behind a held notice answer"
    assert_blocks_equal(lb, tb, [4, 5, 6, 7], la, ta, [1, 2, 3, 4])
    assert_untouched(la, ta, [1, 2, 3, 4])
    assert sorted(n.payload for n in _notes(b, 4, timeout=5.0)) == [b"r0", b"r1", b"r2", b"r3"]
