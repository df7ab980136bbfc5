"""The Agent API in one process: every layout, write and read, bad input before any byte moves,
deadlines, cancellation, transport pinning and close."""

import threading
import time

import numpy as np
import pytest

from helpers import assert_blocks_equal, assert_untouched, fill_random, poison, small_dims
from xfer import Agent, AgentConfig, LayoutKind, Op, TransferState, make_kv_cache
from xfer import TransportKind as TransportKindAlias
from xfer.errors import (AgentClosedError, BlockIdError, InvalidArgumentError, LayoutMismatchError,
                         LengthMismatchError, NotRegisteredError, PeerNotConnectedError, TransferCancelledError,
                         TransferTimeoutError, TransportUnavailableError)


class Pair:
    """Agents ``a`` (random data) and ``b`` (poisoned), connected both ways."""

    def __init__(self, kind_a, kind_b=None, *, config=None, **dims):
        kind_b = kind_b or kind_a
        d = small_dims(kind_a, **dims)
        self.ta, self.la = make_kv_cache(kind_a, **d)
        self.tb, self.lb = make_kv_cache(kind_b, **d)
        fill_random(self.ta, seed=1)
        poison(self.tb)
        self.a, self.b = Agent("a", config), Agent("b", config)
        self.a.register("kv", self.ta, self.la)
        self.b.register("kv", self.tb, self.lb)
        self.peer = self.a.connect(self.b.metadata())
        self.b.connect(self.a.metadata())

    def close(self):
        self.a.close()
        self.b.close()


@pytest.fixture
def pair():
    p = Pair(LayoutKind.VLLM_FLASH_ATTN_NHD)
    yield p
    p.close()


@pytest.mark.parametrize("kind", list(LayoutKind))
def test_write_every_layout(kind):
    p = Pair(kind)
    try:
        src, dst = [5, 0, 3, 3], [1, 7, 2, 6]  # unsorted, a repeated source block
        t = p.a.write(p.peer, src, dst, notify=b"req-1")
        t.wait()
        assert t.poll() is TransferState.DONE and t.done() and t.error is None
        assert t.nbytes == 4 * p.la.bytes_per_block and t.path == "local"
        assert_blocks_equal(p.la, p.ta, src, p.lb, p.tb, dst)
        assert_untouched(p.lb, p.tb, dst)
        note = p.b.wait_notification(1.0)
        assert (note.peer, note.op, note.region, note.payload) == ("a", Op.WRITE, "kv", b"req-1")
        assert note.blocks.tolist() == dst
    finally:
        p.close()


@pytest.mark.parametrize("kind", [LayoutKind.VLLM_FLASH_ATTN_HND, LayoutKind.SGLANG, LayoutKind.MLA_FP8])
def test_read_pulls_peer_blocks(kind):
    p = Pair(kind)
    try:
        # b pulls a's blocks 2, 4 into its blocks 0, 1; a is told its blocks were read
        p.b.read("a", [2, 4], [0, 1], notify=b"pulled").wait()
        assert_blocks_equal(p.la, p.ta, [2, 4], p.lb, p.tb, [0, 1])
        assert_untouched(p.lb, p.tb, [0, 1])
        note = p.a.wait_notification(1.0)
        assert (note.op, note.blocks.tolist(), note.payload) == (Op.READ, [2, 4], b"pulled")
    finally:
        p.close()


@pytest.mark.parametrize("kinds", [(LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.VLLM_FLASH_ATTN_HND),
                                   (LayoutKind.PACKED_KV, LayoutKind.DISTSERVE),
                                   (LayoutKind.VLLM_CROSS_LAYER, LayoutKind.SGLANG)])
def test_write_converts_between_physical_orders(kinds):
    p = Pair(*kinds)
    try:
        p.a.write(p.peer, [1, 2, 3], [6, 0, 4]).wait()
        assert_blocks_equal(p.la, p.ta, [1, 2, 3], p.lb, p.tb, [6, 0, 4])
        assert_untouched(p.lb, p.tb, [6, 0, 4])
    finally:
        p.close()


def test_zero_blocks_is_a_valid_transfer(pair):
    pair.a.write(pair.peer, [], [], notify=b"empty").wait()
    assert pair.b.wait_notification(1.0).blocks.size == 0
    assert_untouched(pair.lb, pair.tb, [])


@pytest.mark.parametrize("src,dst,exc,pattern", [
    ([0, 1], [0, 8], BlockIdError, "destination block ids contain id 8"),
    ([0, 1], [0, -2], BlockIdError, "negative id -2"),
    ([0, 1], [3, 3], BlockIdError, "repeat id 3"),
    ([0, 99], [0, 1], BlockIdError, "source block ids contain id 99"),
    ([0, 1, 2], [0, 1], LengthMismatchError, "3 source block ids but 2 destination"),
    ([0.5], [1], BlockIdError, "integers"),
])
def test_bad_block_ids_raise_before_any_byte_moves(pair, src, dst, exc, pattern):
    with pytest.raises(exc, match=pattern):
        pair.a.write(pair.peer, src, dst)
    with pytest.raises(exc):
        pair.b.read("a", src, dst)
    assert_untouched(pair.lb, pair.tb, [])
    assert pair.b.notifications() == [] and pair.a.notifications() == []


def test_incompatible_layouts_name_the_field():
    p = Pair(LayoutKind.VLLM_FLASH_ATTN_NHD)
    try:
        t, l16 = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, **small_dims("vllm_flash_attn_nhd", bs=8))
        poison(t)
        p.b.register("kv8", t, l16)
        p.a.connect(p.b.metadata())
        with pytest.raises(LayoutMismatchError, match=r"block_size: local vllm_flash_attn_nhd has 4, peer .* has 8"):
            p.a.write(p.peer, [0], [0], peer_region="kv8")
        assert_untouched(l16, t, [])
    finally:
        p.close()


def test_unregistered_regions_and_unknown_peers(pair):
    with pytest.raises(NotRegisteredError, match="region 'nope' is not registered"):
        pair.a.write(pair.peer, [0], [0], region="nope")
    with pytest.raises(NotRegisteredError, match="peer 'b' has no region 'nope'"):
        pair.a.write(pair.peer, [0], [0], peer_region="nope")
    with pytest.raises(PeerNotConnectedError, match="no peer named 'zed'"):
        pair.a.write("zed", [0], [0])
    with pytest.raises(NotRegisteredError):
        pair.a.deregister("nope")
    assert_untouched(pair.lb, pair.tb, [])


def test_peer_deregistered_region_is_refused_and_nothing_reported(pair):
    pair.b.deregister("kv")
    t = pair.a.write(pair.peer, [0], [0])  # a still holds b's old metadata
    with pytest.raises(NotRegisteredError, match="no region 'kv'"):
        t.wait()
    assert t.poll() is TransferState.FAILED
    assert pair.b.notifications() == []


def test_bad_arguments(pair):
    with pytest.raises(InvalidArgumentError, match="timeout"):
        pair.a.write(pair.peer, [0], [0], timeout=0)
    with pytest.raises(InvalidArgumentError, match="notify payload of 70000 bytes"):
        pair.a.write(pair.peer, [0], [0], notify=b"x" * 70000)
    with pytest.raises(InvalidArgumentError, match="after must be 'stream', a torch.cuda.Event or None, got 'now'"):
        pair.a.write(pair.peer, [0], [0], after="now")
    with pytest.raises(InvalidArgumentError, match="after must be"):
        pair.a.read(pair.peer, [0], [0], after=1.5)
    pair.a.write(pair.peer, [1], [2], after=None).wait()  # host memory: no GPU ordering to add
    assert_blocks_equal(pair.la, pair.ta, [1], pair.lb, pair.tb, [2])
    with pytest.raises(InvalidArgumentError, match="already registered"):
        pair.a.register("kv", pair.ta, pair.la)
    with pytest.raises(InvalidArgumentError, match="timeout_s"):
        AgentConfig(default_timeout_s=-1)
    with pytest.raises(InvalidArgumentError, match="transport must be one of"):
        AgentConfig(transport="carrier-pigeon")
    assert_untouched(pair.lb, pair.tb, [2])


GRACE = AgentConfig().settings.fence.grace_s  # a stop waits this long for the peer's reply to its notice


def _stall_notifications(agent, seconds, kind="notify"):
    """Make ``agent`` sit on ``kind`` messages (notices, grant requests), as a frozen peer would."""
    original = agent._handle

    def slow(header, payload):
        if header.get("type") == kind:
            time.sleep(seconds)
        return original(header, payload)

    agent._server._handler = slow


def test_deadline_expires_with_typed_error(pair):
    """The deadline passes while the peer sits on the notice: the transfer reads STOPPING, waits
    up to the fence grace for the peer's reply, then TIMED_OUT; the peer, answering the notice
    after the deadline, refuses it (late): nothing is delivered."""
    _stall_notifications(pair.b, 3.0)
    start = time.monotonic()
    t = pair.a.write(pair.peer, [0, 1], [2, 3], timeout=0.5)
    with pytest.raises(TransferTimeoutError, match="deadline"):
        t.wait()
    assert time.monotonic() - start < 0.5 + GRACE + 0.5
    assert t.poll() is TransferState.TIMED_OUT and t.fence_time is not None and t.fence_time < GRACE + 0.5
    time.sleep(3.2 - (time.monotonic() - start))
    assert pair.b.notifications() == []  # the late notice was refused


def test_unwatched_transfer_still_ends_at_its_deadline(pair):
    _stall_notifications(pair.b, 2.0)
    t = pair.a.write(pair.peer, [0], [0], timeout=0.3)
    time.sleep(0.4)
    assert t.poll() is TransferState.STOPPING and isinstance(t.error, TransferTimeoutError) and not t.done()
    time.sleep(GRACE + 0.2)
    assert t.poll() is TransferState.TIMED_OUT and isinstance(t.error, TransferTimeoutError)


def test_wait_timeout_shorter_than_deadline(pair):
    _stall_notifications(pair.b, 1.0)
    t = pair.a.write(pair.peer, [0], [0], timeout=10)
    with pytest.raises(TransferTimeoutError, match="still RUNNING"):
        t.wait(timeout=0.1)
    t.wait()  # the transfer itself goes on and completes
    assert t.poll() is TransferState.DONE


def test_cancel(pair):
    """A cancel before the copy (the peer sits on the grant): STOPPING, then CANCELLED once the
    grant came back and was given back; nothing was copied or delivered."""
    _stall_notifications(pair.b, 1.0, kind="grant")
    t = pair.a.write(pair.peer, [0], [0], timeout=10)
    time.sleep(0.1)
    assert t.cancel() is True and t.cancel() is False and t.poll() is TransferState.STOPPING
    with pytest.raises(TransferCancelledError):
        t.wait()
    assert t.poll() is TransferState.CANCELLED and 0.5 < t.fence_time < 1.5
    assert_untouched(pair.lb, pair.tb, []) or pair.b.notifications() == []
    assert len(pair.b._grants) == 0  # the grant was ended before the transfer read CANCELLED


def test_cancel_during_the_notice_ends_done_when_the_peer_delivered(pair):
    """A stop that reaches the transfer while its notice is with the peer: the peer delivered it
    (its deadline is far), so the transfer reads DONE, never CANCELLED with a delivered notice."""
    _stall_notifications(pair.b, 0.5)
    t = pair.a.write(pair.peer, [0], [0], timeout=10, notify=b"n")
    time.sleep(0.2)
    assert t.cancel() is True and t.poll() is TransferState.STOPPING
    assert t.wait() is TransferState.DONE and t.error is None
    assert [n.payload for n in pair.b.notifications()] == [b"n"]

def test_route_is_reported_and_pinning_never_falls_back(pair):
    sel = pair.a.route(pair.peer)
    assert sel.kind.value == "local" and "able to serve" in sel.reason
    ta, la = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, **small_dims("vllm_flash_attn_nhd"))
    with Agent("pinned", AgentConfig(transport="ipc")) as c:
        c.register("kv", ta, la)
        peer = c.connect(pair.b.metadata())
        with pytest.raises(TransportUnavailableError, match="pinned transport .ipc. cannot serve"):
            c.write(peer, [0], [0])
    assert_untouched(pair.lb, pair.tb, [])


def test_closed_agent_refuses_everything(pair):
    md = pair.b.metadata()
    pair.a.close()
    pair.a.close()  # idempotent
    for call in (lambda: pair.a.write("b", [0], [0]), lambda: pair.a.metadata(), lambda: pair.a.connect(md),
                 lambda: pair.a.register("x", pair.ta, pair.la), lambda: pair.a.wait_notification(0.1)):
        with pytest.raises(AgentClosedError, match="agent 'a' is closed"):
            call()


def test_close_ends_inflight_transfers(pair):
    """close() stops what is in flight and returns once every transfer ended; one whose notice the
    peer delivered meanwhile reads DONE, any other CANCELLED, and nothing is delivered after."""
    _stall_notifications(pair.b, 1.0, kind="grant")
    t = pair.a.write(pair.peer, [0], [0], timeout=10)
    time.sleep(0.1)
    pair.a.close()
    assert t.poll() is TransferState.CANCELLED
    with pytest.raises(AgentClosedError):
        t.wait()
    time.sleep(1.2)
    assert pair.b.notifications() == [] and len(pair.b._grants) == 0
    assert_untouched(pair.lb, pair.tb, [])


def test_concurrent_transfers_from_threads(pair):
    blocks = list(range(8))
    errors = []

    def worker(i):
        try:
            pair.a.write(pair.peer, [blocks[i]], [blocks[7 - i]], notify=str(i).encode()).wait()
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert_blocks_equal(pair.la, pair.ta, blocks, pair.lb, pair.tb, blocks[::-1])
    notes = pair.b.notifications()
    assert sorted(n.payload for n in notes) == [str(i).encode() for i in range(8)]


def test_post_plans_follow_register_deregister_and_connect(pair):
    """A post reuses its pair's resolved regions, layout check and route: each change to the
    regions or peers must be seen by the next post (a stale plan would move bytes it must not)."""
    pair.a.write(pair.peer, [0], [1]).wait()  # the plan for (b, None, None, WRITE) is made
    t2, l2 = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, **small_dims("vllm_flash_attn_nhd"))
    pair.a.register("kv2", t2, l2)
    with pytest.raises(NotRegisteredError, match="has regions \\['kv', 'kv2'\\]: name one"):
        pair.a.write(pair.peer, [0], [2])
    pair.a.write(pair.peer, [0], [2], region="kv").wait()
    pair.a.deregister("kv2")
    pair.a.deregister("kv")
    with pytest.raises(NotRegisteredError, match="region 'kv' is not registered"):
        pair.a.write(pair.peer, [0], [2], region="kv")  # its plan went with the region
    t8, l8 = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, **small_dims("vllm_flash_attn_nhd", bs=8))
    pair.a.register("kv", t8, l8)
    with pytest.raises(LayoutMismatchError, match="block_size: local vllm_flash_attn_nhd has 8"):
        pair.a.write(pair.peer, [0], [3])
    pair.a.deregister("kv")
    pair.a.register("kv", pair.ta, pair.la)
    pair.a.write(pair.peer, [4], [5], region="kv").wait()
    pair.a.disconnect(pair.peer)
    with pytest.raises(PeerNotConnectedError, match="no peer named 'b'"):
        pair.a.write(pair.peer, [4], [5], region="kv")
    pair.a.connect(pair.b.metadata())
    pair.a.write(pair.peer, [4], [5], region="kv").wait()  # a plan naming the peer's region "kv"
    # the peer re-registers under another name and is reconnected: the old region name is gone
    pair.b.deregister("kv")
    pair.b.register("kv-new", pair.tb, pair.lb)
    pair.a.connect(pair.b.metadata())
    pair.a.write(pair.peer, [4], [5], region="kv").wait()  # the peer's one region, whatever its name
    with pytest.raises(NotRegisteredError, match="peer 'b' has no region 'kv'"):
        pair.a.write(pair.peer, [4], [6], region="kv", peer_region="kv")
    assert_blocks_equal(pair.la, pair.ta, [0, 0, 4], pair.lb, pair.tb, [1, 2, 5])
    assert_untouched(pair.lb, pair.tb, [1, 2, 5])


def test_many_waiters_of_one_transfer_all_return(pair):
    _stall_notifications(pair.b, 0.3)
    t = pair.a.write(pair.peer, [0, 1], [2, 3], notify=bytearray(b"ba"), timeout=5)
    done = []
    threads = [threading.Thread(target=lambda: (t.wait(), done.append((t.poll(), time.monotonic()))))
               for _ in range(4)]
    for th in threads:
        th.start()
    t.wait()
    for th in threads:
        th.join(timeout=5)
    assert [state for state, _ in done] == [TransferState.DONE] * 4
    # woken by the end, not by the deadline (5 s after the post; the stall is 0.3 s)
    assert all(when < t.deadline - 2.5 for _, when in done), (t.deadline, done)
    t.wait()  # a finished transfer's wait returns at once, any number of times
    assert_blocks_equal(pair.la, pair.ta, [0, 1], pair.lb, pair.tb, [2, 3])
    assert [n.payload for n in pair.b.notifications()] == [b"ba"]


def test_connect_to_stale_metadata_is_refused(pair):
    md = pair.b.metadata()
    pair.b.close()
    with Agent("c") as c:
        with pytest.raises(Exception) as info:
            c.connect(md)
        assert "PeerDisconnected" in type(info.value).__name__ or "Metadata" in type(info.value).__name__


def test_notification_wait_times_out(pair):
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="no notification"):
        pair.b.wait_notification(0.2)
    assert 0.15 < time.monotonic() - start < 1.0
    assert np.asarray(pair.b.notifications()).size == 0


def test_enable_limits_the_transports_started():
    with Agent("only-local", AgentConfig(enable=("local",))) as a:
        assert list(a.transports) == [TransportKindAlias.LOCAL]
        assert all("not enabled" in r for r in a.unavailable.values())
    with pytest.raises(InvalidArgumentError, match="enable must list transports"):
        AgentConfig(enable=("pigeon",))
    with pytest.raises(InvalidArgumentError, match="not in enable"):
        AgentConfig(enable=("local",), transport="ucx")


def test_send_delivers_a_message_without_blocks(pair):
    pair.a.send(pair.peer, b"token 42")
    note = pair.b.wait_notification(1.0)
    assert (note.op, note.payload, note.blocks.size, note.peer) == (Op.MESSAGE, b"token 42", 0, "a")
    with pytest.raises(PeerNotConnectedError):
        pair.a.send("nobody", b"x")
    with pytest.raises(InvalidArgumentError, match="max_notify_bytes"):
        pair.a.send(pair.peer, b"x" * 70000)
    _stall_notifications(pair.b, 2.0)
    pair.b._server._handler = (lambda h, p, f=pair.b._server._handler: (time.sleep(2), f(h, p))[1])
    with pytest.raises(TransferTimeoutError):
        pair.a.send(pair.peer, b"late", timeout=0.3)


def test_notices_of_a_burst_share_messages_and_each_stands_alone(monkeypatch):
    """Transfers to one peer whose copies ended while a notice was in flight go in one
    ``notify_batch`` message; every transfer still gets its own notification, in order, with its
    payload, and a notice the peer refuses fails only its own transfer. (Early notices off: the
    burst's first, lone write would otherwise send its notice at its launch, not through the slow
    first round trip the burst queues behind.)"""
    from xfer.transports import completion

    monkeypatch.setenv("XFER_NOTICE_EARLY", "0")
    pair = Pair(LayoutKind.VLLM_FLASH_ATTN_NHD)
    try:
        _burst_notices(pair, monkeypatch, completion)
    finally:
        pair.close()


def _burst_notices(pair, monkeypatch, completion):

    sizes, real_single, real_batch = [], completion.notify_peer, completion.notify_peer_batch

    def slow_single(job, *args):  # a slow first round trip lets the burst queue up behind it
        time.sleep(0.05)
        sizes.append(1)
        return real_single(job, *args)

    def batch(jobs, *args):
        sizes.append(len(jobs))
        return real_batch(jobs, *args)

    monkeypatch.setattr(completion, "notify_peer", slow_single)
    monkeypatch.setattr(completion, "notify_peer_batch", batch)
    n = pair.la.num_blocks
    ts = [pair.a.write(pair.peer, [i], [n - 1 - i], notify=b"note-%d" % i) for i in range(n)]
    for t in ts:
        t.wait()
    assert sum(sizes) == n and max(sizes) > 1, sizes
    notes = pair.b.notifications()
    assert [x.payload for x in notes] == [b"note-%d" % i for i in range(n)]
    assert [x.transfer_id for x in notes] == [t.id for t in ts]
    assert [x.blocks.tolist() for x in notes] == [[n - 1 - i] for i in range(n)]
    assert_blocks_equal(pair.la, pair.ta, list(range(n)), pair.lb, pair.tb, [n - 1 - i for i in range(n)])
    # the peer's handler: a bad notice is refused alone, the good ones are delivered
    header = {"type": "notify_batch", "from": "a", "batch": [
        {"transfer_id": "x1", "op": "write", "region": "kv", "blocks": [0], "payload_bytes": 2},
        {"transfer_id": "x2", "op": "write", "region": "nope", "blocks": [1], "payload_bytes": 0},
        {"transfer_id": "x3", "op": "write", "region": "kv", "blocks": [n], "payload_bytes": 1},
        {"transfer_id": "x4", "op": "read", "region": "kv", "blocks": [2], "payload_bytes": 1}]}
    reply, _ = pair.b._handle(header, b"abcd")
    assert reply["ok"] and set(reply["failed"]) == {"1", "2"}
    assert reply["failed"]["1"]["error"] == "NotRegisteredError" and reply["failed"]["2"]["error"] == "BlockIdError"
    assert [(x.transfer_id, x.payload) for x in pair.b.notifications()] == [("x1", b"ab"), ("x4", b"d")]
    with pytest.raises(InvalidArgumentError, match="do not add up"):
        pair.b._handle({**header, "batch": header["batch"][:1]}, b"abcd")


@pytest.mark.parametrize("setting,stream,inline", [(None, False, False), (None, True, True), ("1", False, True),
                                                     ("0", True, False)])
def test_who_sends_a_lone_writes_grant_request(monkeypatch, setting, stream, inline):
    """XFER_ASK_INLINE: a lone WRITE's grant request leaves from the posting thread (one send, no
    wait) or from the worker; unset, from the posting thread where the copy launches on a stream
    (ipc, NVSHMEM direct: here a host copy taken for one), from the worker for host copies. Either
    way the bytes land and the untouched blocks stay poisoned."""
    from xfer.transports.onesided import transport as onesided

    if setting is None:
        monkeypatch.delenv("XFER_ASK_INLINE", raising=False)
    else:
        monkeypatch.setenv("XFER_ASK_INLINE", setting)
    if stream:
        monkeypatch.setattr(onesided.OneSidedTransport, "_launches_async", lambda self, job: True)
    askers, real_ask = [], onesided.ask_grants

    def ask(jobs, *args, **kw):
        out = real_ask(jobs, *args, **kw)
        askers.append(threading.current_thread().name)
        return out

    monkeypatch.setattr(onesided, "ask_grants", ask)
    p = Pair(LayoutKind.VLLM_FLASH_ATTN_NHD)
    try:
        me = threading.current_thread().name
        for src, dst in (([1, 2], [5, 3]), ([4], [0])):
            p.a.write(p.peer, src, dst).wait()  # each alone: nothing queued before it
        assert len(askers) == 2 and all((who == me) is inline for who in askers), askers
        assert_blocks_equal(p.la, p.ta, [1, 2, 4], p.lb, p.tb, [5, 3, 0])
        assert_untouched(p.lb, p.tb, [0, 3, 5])
    finally:
        p.close()


def test_copies_launch_after_their_grants_in_posting_order_and_posts_never_wait(pair, monkeypatch):
    """Every copy waits for the peer's grant, asked by the posting thread when nothing waits
    before it (one send, no wait: issue 32), else by the worker: a post returns at once whatever
    is queued, jobs queued together are granted in one message, and launches keep posting order
    (three writes of one destination block from different sources: the last one's bytes are
    what remain)."""
    from xfer.transports import completion
    from xfer.transports.onesided import transport as onesided

    launched, gate, entered, grants = [], threading.Event(), threading.Event(), []
    real_launch, real_ask = onesided.OneSidedTransport._launch, completion.ask_grants

    def launch(self, job, prep=None):
        if job.notify == b"held":
            entered.set()
            assert gate.wait(10)
        launched.append((job.notify, threading.current_thread().name))
        return real_launch(self, job, prep)

    def ask(jobs, *args, **kw):
        out = real_ask(jobs, *args, **kw)
        if out is not None:
            grants.append(len(jobs))
        return out

    monkeypatch.setattr(onesided.OneSidedTransport, "_launch", launch)
    monkeypatch.setattr(onesided, "ask_grants", ask)
    me = threading.current_thread().name
    pair.a.write(pair.peer, [1], [1], notify=b"first").wait()
    held = pair.a.write(pair.peer, [2], [6], notify=b"held")  # held at launch, on the worker
    assert entered.wait(10)  # the worker is in that launch: what is posted now queues together
    t0 = time.monotonic()
    behind = [pair.a.write(pair.peer, [b], [7 - b], notify=b"behind-%d" % b) for b in (3, 4)]
    assert time.monotonic() - t0 < 1.0  # queued behind the held one: the posts did not wait for it
    time.sleep(0.1)
    assert [n for n, _ in launched] == [b"first"] and not any(t.poll().terminal for t in [held, *behind])
    gate.set()
    for t in [held, *behind]:
        t.wait()
    assert [n for n, _ in launched] == [b"first", b"held", b"behind-3", b"behind-4"]
    assert all(th != me for _, th in launched)  # the worker launched them, in order
    assert sum(grants) == 4 and max(grants) > 1, grants  # jobs queued together: one grant message
    assert_blocks_equal(pair.la, pair.ta, [1, 2, 3, 4], pair.lb, pair.tb, [1, 6, 4, 3])
    assert [n.payload for n in pair.b.notifications()] == [b"first", b"held", b"behind-3", b"behind-4"]
    assert_untouched(pair.lb, pair.tb, [1, 3, 4, 6])
    assert len(pair.b._grants) == 0  # every grant ended with its notice


def test_a_reads_stream_copy_launches_on_the_posting_thread_when_nothing_waits(pair, monkeypatch):
    """A READ waits for no grant: its copy queued on a stream is launched by the posting thread when
    nothing posted earlier waits to launch (one thread hand-off less); behind a queued WRITE it goes
    through the worker, in posting order."""
    from xfer.transports.onesided import transport as onesided
    from xfer.transports.onesided.local import LocalTransport

    launched, real_launch = [], onesided.OneSidedTransport._launch

    def launch(self, job, prep=None):
        launched.append((job.notify, threading.current_thread().name))
        return real_launch(self, job, prep)

    monkeypatch.setattr(onesided.OneSidedTransport, "_launch", launch)
    # CPU tensors with a "stream": the copy still runs on the host, at launch
    monkeypatch.setattr(LocalTransport, "stream", lambda self, job: object())
    me = threading.current_thread().name
    pair.a.read(pair.peer, [1], [2], notify=b"inline").wait()
    w = pair.a.write(pair.peer, [3], [4], notify=b"write")
    r = pair.a.read(pair.peer, [5], [6], notify=b"behind")
    w.wait()
    r.wait()
    assert launched[0] == (b"inline", me) and [n for n, _ in launched] == [b"inline", b"write", b"behind"]
    assert launched[1][1] != me
    assert_blocks_equal(pair.lb, pair.tb, [1, 5], pair.la, pair.ta, [2, 6])


def test_a_transfer_ends_once_through_complete_or_fail_and_the_exception_names_its_state():
    """Transports end a transfer with ``complete()`` or ``fail(exc)``; ``state_for`` is the one map
    from an exception to a state (deadline TIMED_OUT, cancel or agent closed CANCELLED, anything
    else FAILED; a bug's exception reported as a TransportError); the first ending stands, the
    cancel hook runs only when a stop begins, and ``wait()`` returns DONE or raises the error."""
    from xfer.errors import PeerDisconnectedError, TransferCancelledError, TransportError
    from xfer.transfer import Transfer, state_for

    def transfer():
        return Transfer(peer="p", op=Op.WRITE, num_blocks=1, nbytes=8, path="test", timeout=10.0)

    cases = [(TransferTimeoutError("late"), TransferState.TIMED_OUT),
             (TransferCancelledError("stop"), TransferState.CANCELLED),
             (AgentClosedError("closed"), TransferState.CANCELLED),
             (PeerDisconnectedError("gone"), TransferState.FAILED),
             (ValueError("a bug"), TransferState.FAILED)]
    for exc, state in cases:
        assert state_for(exc) is state
        t, hooked = transfer(), []
        t.begin(on_cancel=hooked.append)
        assert t.poll() is TransferState.RUNNING and t.fail(exc) and t.poll() is state and hooked == []
        assert not t.complete() and not t.fail(TransferTimeoutError("again")) and t.poll() is state
        expected = TransportError if isinstance(exc, ValueError) else type(exc)
        assert type(t.error) is expected and ("a bug" in str(t.error) if expected is TransportError else True)
        with pytest.raises(expected):
            t.wait()
    t, hooked = transfer(), []
    t.begin(on_cancel=hooked.append)
    t.mark("landed")
    assert t.complete() and not t.fail(PeerDisconnectedError("late")) and hooked == []
    assert t.wait() is TransferState.DONE and t.error is None and "landed" in t.timeline()


def test_a_stop_reads_stopping_until_the_transport_fenced_it():
    """cancel() and the deadline start a stop: STOPPING (non-terminal, ordered between the ended
    failures and the live states, so min over ranks stays meaningful), the hook runs once, wait()
    blocks until the transport's fail() (whose own error yields to the stop's cause) or
    complete() (DONE: the peer was notified), and raises FenceTimeoutError (never a
    TimeoutError) when the fence bound passes first."""
    from xfer.errors import FenceTimeoutError, PeerDisconnectedError
    from xfer.transfer import Transfer

    S = TransferState
    assert S.FAILED < S.TIMED_OUT < S.CANCELLED < S.STOPPING < S.QUEUED < S.RUNNING < S.DONE
    assert [s for s in S if s.terminal] == [S.FAILED, S.TIMED_OUT, S.CANCELLED, S.DONE]
    assert min(S.DONE, S.STOPPING) is S.STOPPING and min(S.STOPPING, S.CANCELLED) is S.CANCELLED

    def transfer(timeout=10.0, fence=5.0):
        return Transfer(peer="p", op=Op.READ, num_blocks=1, nbytes=8, path="t", timeout=timeout, fence_s=fence)

    t, hooked = transfer(), []
    t.begin(on_cancel=hooked.append)
    assert t.cancel() is True and t.cancel() is False and hooked == [t]
    assert t.poll() is S.STOPPING and not t.done() and t.cancel_requested and isinstance(t.error,
                                                                                         TransferCancelledError)
    threading.Timer(0.3, t.fail, args=(PeerDisconnectedError("the fence came by a closed link"),)).start()
    t0 = time.monotonic()
    with pytest.raises(TransferCancelledError):
        t.wait()
    assert 0.25 < time.monotonic() - t0 < 1.0 and t.poll() is S.CANCELLED and 0.25 < t.fence_time < 1.0
    assert "stopping" in t.timeline() and hooked == [t]

    t = transfer()  # a stop before the transport began: the hook runs when it begins
    t.cancel()
    hooked = []
    t.begin(on_cancel=hooked.append)
    assert hooked == [t] and t.complete() and t.wait() is S.DONE  # completed first: DONE

    t, hooked = transfer(timeout=0.2, fence=0.4), []  # the deadline starts the stop; nobody fences it
    t.begin(on_cancel=hooked.append)
    t0 = time.monotonic()
    with pytest.raises(FenceTimeoutError, match="quarantined") as info:
        t.wait()
    assert not isinstance(info.value, TimeoutError) and 0.55 < time.monotonic() - t0 < 1.2
    assert t.poll() is S.STOPPING and hooked == [t] and isinstance(t.error, TransferTimeoutError)
    with pytest.raises(TransferTimeoutError, match="still STOPPING"):
        transfer_waiting = t
        transfer_waiting.deadline += 10  # a caller's own short wait says the transfer has not ended
        transfer_waiting.wait(timeout=0.05)
    assert t.stop(AgentClosedError("closed")) is False and t.fail(PeerDisconnectedError("x"))
    assert t.poll() is S.TIMED_OUT


def test_a_write_refused_at_its_grant_after_its_copy_was_prepared_lands_nothing(pair, monkeypatch):
    """Issue 32: the worker prepares a WRITE's stream copy (bound copy, path, ids staged for the
    launch) while its grant request travels. A WRITE the target refuses (blocks an unfenced transfer of
    another initiator holds) after that preparation ran moves no byte, its prepared resources are
    given back (``_release``), and a later write of the same blocks, once the holder ended, lands."""
    from xfer.errors import BlocksBusyError
    from xfer.transports.onesided import transport as onesided
    from xfer.transports.onesided.local import LocalTransport

    prepared, released = [], []
    real_prepare, real_release = onesided.OneSidedTransport._prepare, onesided._release

    def prepare(self, job):
        prep = real_prepare(self, job)
        prep.staged = None  # (a host copy stages nothing; stand in for a stream copy's uploaded ids)
        prepared.append((job.transfer.id, prep))
        return prep

    def release(prep):
        released.append(prep)
        return real_release(prep)

    monkeypatch.setattr(onesided.OneSidedTransport, "_prepare", prepare)
    monkeypatch.setattr(onesided, "_release", release)
    # CPU tensors with a "stream" (the copy still runs on the host): prepared while the grant travels, as
    # a stream copy is
    monkeypatch.setattr(LocalTransport, "stream", lambda self, job: object())
    region = pair.b._regions["kv"]
    other = pair.b._grants.hold(region, np.array([2, 3], dtype=np.int64), writes=True, peer="someone-else",
                                tid="x", owner=("someone-else", None, "elsewhere"))
    t = pair.a.write(pair.peer, [1, 4], [2, 3], notify=b"refused")
    with pytest.raises(BlocksBusyError):
        t.wait()
    assert t.poll() is TransferState.FAILED
    assert [tid for tid, _ in prepared] == [t.id]  # it was prepared before its grant was refused
    assert released == [prepared[0][1]]  # ... and what it prepared given back
    assert_untouched(pair.lb, pair.tb, [])  # not a byte landed
    assert pair.b.notifications() == []
    pair.b._grants.end(other)
    pair.a.write(pair.peer, [1, 4], [2, 3], notify=b"after").wait()
    assert_blocks_equal(pair.la, pair.ta, [1, 4], pair.lb, pair.tb, [2, 3])
    assert_untouched(pair.lb, pair.tb, [2, 3])
    assert len(pair.b._grants) == 0


def test_back_to_back_writes_of_one_initiator_over_the_same_blocks_need_no_window(pair, monkeypatch):
    """Issue 32: one initiator's overlapping WRITEs are its own order to keep (the grants' owner
    rule), so a burst that reuses block sets while earlier writes into them are in flight (the
    IPC bench's back to back without ``--window``) is granted, launched in posting order (the last
    write of each set is what remains) and its grant requests are pipelined: the next batch's
    request leaves before the previous batch's copies launch, several writes to one message."""
    from xfer.transports import completion
    from xfer.transports.onesided import transport as onesided

    asks, real_ask = [], completion.ask_grants

    def ask(jobs, *args, **kw):
        out = real_ask(jobs, *args, **kw)
        if out is not None:
            asks.append(len(jobs))
        return out

    monkeypatch.setattr(onesided, "ask_grants", ask)
    n = pair.la.num_blocks
    sets = [[0, 1], [2, 3], [4, 5]]
    ts = [pair.a.write(pair.peer, [(i + j) % n for j in range(2)], sets[i % 3], notify=b"%d" % i) for i in range(24)]
    for t in ts:
        assert t.wait() is TransferState.DONE
    for k, dst in enumerate(sets):  # the last write of set k was i = 21 + k: sources 21 + k, 22 + k
        last = 21 + k
        assert_blocks_equal(pair.la, pair.ta, [last % n, (last + 1) % n], pair.lb, pair.tb, dst)
    assert [x.payload for x in pair.b.notifications()] == [b"%d" % i for i in range(24)]
    assert sum(asks) == 24 and len(asks) < 24, asks  # queued writes asked together
    assert len(pair.b._grants) == 0


@pytest.mark.parametrize("peer_takes", [64 << 10, None, 8], ids=["packed", "older-peer", "over-its-limit"])
def test_grant_requests_pack_their_ids_where_the_peer_takes_them(pair, monkeypatch, peer_takes):
    """A grant request's block ids travel packed in its payload (int64, ``nblocks`` per transfer)
    where the peer's transport info says it takes that many payload bytes (``grant_packed``), else
    as JSON lists (a peer of an older version; ids that would pass its payload limit): either way
    every write lands byte for byte."""
    from xfer.transports.onesided import transport as onesided

    seen, real = [], onesided.ask_grants

    def spy(jobs, *args, **kw):
        ask = real(jobs, *args, **kw)
        if ask is not None:
            seen.append(([sorted(e) for e in ask.header["transfers"]], len(ask.payload), sum(len(j.peer_ids) for j in jobs)))
        return ask
    monkeypatch.setattr(onesided, "ask_grants", spy)
    info = pair.a._peers[pair.peer].metadata.transports["local"]
    assert info["grant_packed"] == pair.b.config.max_notify_bytes
    if peer_takes is None:
        info.pop("grant_packed")
    else:
        info["grant_packed"] = peer_takes
    src, dst = [[1, 2], [3], [4, 5, 6]], [[0, 7], [2], [6, 5, 3]]
    ts = [pair.a.write(pair.peer, s, d) for s, d in zip(src, dst)]
    assert [t.wait() for t in ts] == [TransferState.DONE] * 3
    flat_src, flat_dst = [b for s in src for b in s], [b for d in dst for b in d]
    assert_blocks_equal(pair.la, pair.ta, flat_src, pair.lb, pair.tb, flat_dst)
    assert_untouched(pair.lb, pair.tb, flat_dst)
    assert seen
    for keys, payload, nids in seen:
        packed = peer_takes is not None and 8 * nids <= peer_takes
        assert all(("nblocks" in k) is packed and ("blocks" in k) is not packed for k in keys), keys
        assert payload == (8 * nids if packed else 0)
