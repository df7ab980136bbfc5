"""The one-sided transports' completion line (xfer.transports.onesided.line): a caller blocked in
``wait()`` on a lone transfer finishes it in its own thread (no hand-off to the completer and back);
transfers that queue behind one another still go to the completer, their notices together and in
launch order; a wait with a timeout of its own, a second waiter, a refusal before the launch and a
deadline reached while the caller finishes it all end as before. Each case checks the destination
bytes (moved blocks the source's, every other byte still poisoned)."""

from __future__ import annotations

import threading
import time

import pytest

from helpers import assert_blocks_equal, assert_untouched, local_pair, slowed
from xfer.errors import NotRegisteredError, TransferTimeoutError
from xfer.transfer import TransferState

@pytest.fixture
def pair():
    yield from local_pair("line", seed=5)


def finishers(agent) -> list[tuple[str, str]]:
    """(transfer id, thread name) of each job the agent's one-sided transport finished, in order."""
    tr = next(iter(agent.transports.values()))
    real, seen = tr._finish_item, []

    def finish(job, event, batch=False):
        seen.append((job.transfer.id, threading.current_thread().name))
        return real(job, event, batch)
    tr._finish_item = finish
    return seen


def test_a_lone_transfer_is_finished_by_the_thread_waiting_for_it(pair):
    a, b, peer, (ta, la), (tb, lb) = pair
    seen = finishers(a)
    for src, dst in (([1, 2], [9, 3]), ([4], [11])):
        t = a.write(peer, src, dst, notify=b"lone")
        assert t.wait() is TransferState.DONE
        assert seen[-1] == (t.id, threading.current_thread().name)
        note = b.wait_notification(2)
        assert note.payload == b"lone" and note.blocks.tolist() == dst
    assert_blocks_equal(la, ta, [1, 2, 4], lb, tb, [9, 3, 11])
    assert_untouched(lb, tb, [9, 3, 11])
    assert len(b._grants) == 0


def test_transfers_queued_behind_one_another_go_to_the_completer_in_launch_order(pair):
    """Waiting on the last of three first: the caller takes none of them while others queue before
    or behind it; the notices arrive in launch order, and the bytes are right."""
    a, b, peer, (ta, la), (tb, lb) = pair
    seen = finishers(a)
    slowed(a, 0.05)
    ts = [a.write(peer, [i], [15 - i], notify=b"%d" % i) for i in range(3)]
    assert ts[2].wait() is TransferState.DONE
    assert all(t.wait() is TransferState.DONE for t in ts)
    notes = [b.wait_notification(2) for _ in ts]
    assert [n.payload for n in notes] == [b"0", b"1", b"2"]
    me = threading.current_thread().name
    order = [t.id for t in ts]
    firsts = [order.index(tid) for tid, _ in seen]  # the first job of each message (a batch takes the next)
    assert firsts[0] == 0 and firsts == sorted(firsts)
    assert all(name != me for tid, name in seen if tid != ts[2].id)  # only the last may be the caller's
    assert_blocks_equal(la, ta, [0, 1, 2], lb, tb, [15, 14, 13])
    assert_untouched(lb, tb, [15, 14, 13])


def test_a_wait_with_a_timeout_of_its_own_leaves_the_transfer_to_the_completer(pair):
    a, b, peer, (ta, la), (tb, lb) = pair
    seen = finishers(a)
    t = a.write(peer, [5], [6])
    assert t.wait(timeout=5) is TransferState.DONE
    assert seen == [(t.id, seen[0][1])] and seen[0][1] != threading.current_thread().name
    assert_blocks_equal(la, ta, [5], lb, tb, [6])
    assert_untouched(lb, tb, [6])


def test_two_threads_waiting_on_one_transfer_both_see_it_done(pair):
    a, b, peer, (ta, la), (tb, lb) = pair
    slowed(a, 0.1)
    t = a.write(peer, [7, 8], [1, 2])
    got = []
    other = threading.Thread(target=lambda: got.append(t.wait()))
    other.start()
    assert t.wait() is TransferState.DONE
    other.join(5)
    assert got == [TransferState.DONE]
    assert_blocks_equal(la, ta, [7, 8], lb, tb, [1, 2])
    assert_untouched(lb, tb, [1, 2])


def test_a_refusal_before_the_launch_ends_the_waiting_caller_at_once(pair):
    """The peer deregistered the region: its grant is refused, nothing moves, and the caller's
    wait (which waited to finish the transfer itself) raises at once, not at the deadline."""
    a, b, peer, (ta, la), (tb, lb) = pair
    b.deregister("kv")
    start = time.monotonic()
    t = a.write(peer, [1], [2])
    with pytest.raises(NotRegisteredError):
        t.wait()
    assert time.monotonic() - start < 2.0
    assert_untouched(lb, tb, [])


def test_the_deadline_starts_the_stop_while_the_caller_finishes_the_transfer(pair):
    """The peer sits on the notice past the deadline while the waiting caller finishes the
    transfer: the stop still begins at the deadline (STOPPING, its fence timed), the transfer ends
    TIMED_OUT by the grace, and the late notice is refused (nothing delivered)."""
    a, b, peer, (ta, la), (tb, lb) = pair
    grace = a.config.settings.fence.grace_s
    original = b._handle

    def slow(header, payload):
        if header.get("type") == "notify":
            time.sleep(grace + 1.5)
        return original(header, payload)
    b._server._handler = slow
    seen = finishers(a)
    start = time.monotonic()
    t = a.write(peer, [3], [4], timeout=0.5)
    with pytest.raises(TransferTimeoutError):
        t.wait()
    assert seen == [(t.id, threading.current_thread().name)]
    assert t.poll() is TransferState.TIMED_OUT and t.stopped_at is not None
    assert t.stopped_at - t.created < 0.5 + 0.3  # begun at the deadline, not at its end
    assert time.monotonic() - start < 0.5 + grace + 0.5
    time.sleep(grace + 2.0 - (time.monotonic() - start))
    assert b.notifications() == []


def test_an_interrupt_in_the_callers_thread_never_leaves_the_transfer_unfinished(pair):
    """An exception raised in the waiting caller while it finishes the transfer (as Ctrl-C would):
    it reaches the caller, the transfer ends failed (not RUNNING forever) and its grant is ended
    (the blocks are free: a second write into them is granted)."""
    a, b, peer, (ta, la), (tb, lb) = pair
    tr = next(iter(a.transports.values()))
    real = tr._finish_item

    def interrupted(job, event, batch=False):
        raise KeyboardInterrupt
    tr._finish_item = interrupted
    t = a.write(peer, [1], [2])
    with pytest.raises(KeyboardInterrupt):
        t.wait()
    assert t.poll() is TransferState.FAILED and "interrupted" in str(t.error)
    tr._finish_item = real
    end = time.monotonic() + 3
    while len(b._grants) and time.monotonic() < end:
        time.sleep(0.02)
    assert len(b._grants) == 0
    assert a.write(peer, [3], [2]).wait() is TransferState.DONE
    assert_blocks_equal(la, ta, [3], lb, tb, [2])
    assert_untouched(lb, tb, [2])


def test_an_interrupt_while_the_caller_waits_for_a_queued_copy_ends_the_transfer_only_after_the_copy(pair):
    """Ctrl-C while the waiting caller polls a copy still queued on a stream: the interrupt reaches
    the caller, but the transfer is reported ended (failed) only once the copy ended (a kernel
    cannot be stopped), and its grant ends after that too."""
    a, b, peer, (ta, la), (tb, lb) = pair
    tr = next(iter(a.transports.values()))
    real_launch, real_wait = tr._launch, tr._wait_copy

    class Queued:  # a copy that runs on for 0.3 s after its launch (its bytes landed at once here)
        def __init__(self):
            self.end = time.monotonic() + 0.3

        def query(self):
            return time.monotonic() >= self.end

        def synchronize(self):
            time.sleep(max(0.0, self.end - time.monotonic()))

    events = []

    def launch(job, prep=None):
        real_launch(job, prep)
        events.append(Queued())
        return events[-1]

    def interrupted(job, event):
        raise KeyboardInterrupt
    tr._launch, tr._wait_copy = launch, interrupted
    t = a.write(peer, [4], [5])
    with pytest.raises(KeyboardInterrupt):
        t.wait()
    assert t.poll() is TransferState.FAILED and t.finished >= events[0].end
    tr._launch, tr._wait_copy = real_launch, real_wait
    assert a.write(peer, [6], [5]).wait() is TransferState.DONE  # its grant ended: the blocks are free
    assert_blocks_equal(la, ta, [6], lb, tb, [5])
    assert_untouched(lb, tb, [5])
