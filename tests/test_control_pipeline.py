"""The control client's pipelined requests (issue 32): several requests in flight on one
connection, each reply handed to the request it answers, a waiter that gives up at its deadline
drops its reply without desynchronising the stream, and a broken stream fails every request in
flight (the next one connects afresh). Each runs also with both sides polling instead of sleeping
(XFER_CONTROL_SPIN_US)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from xfer.control import ControlServer
from xfer.control_client import ControlClient
from xfer.errors import PeerDisconnectedError, TransferTimeoutError

SECRET = b"pipeline-test-secret-0123456789"


@pytest.fixture(params=[(None, 0), (SECRET, 0), (SECRET, 500)], ids=["plain", "secret", "secret-spin"])
def channel(request):
    from xfer.auth import Authenticator
    from xfer.settings import ControlSettings

    secret, spin_us = request.param
    auth = None if secret is None else Authenticator(secret)
    seen, hold = [], threading.Event()

    def handler(header, payload):
        seen.append(header.get("n"))
        if header.get("slow"):
            hold.wait(5)
        return {"ok": True, "n": header.get("n")}, payload[::-1]

    server = ControlServer("127.0.0.1", 0, handler, max_payload=1 << 20, auth=auth, identity=("srv-id", "srv"),
                           limits=ControlSettings(spin_us=spin_us))
    client = ControlClient(server.address, "srv", 5.0, auth, identity=("cli-id", "cli"), peer_id="srv-id",
                           spin_s=spin_us * 1e-6)
    yield server, client, seen, hold
    client.close()
    server.close()


def test_requests_in_flight_are_answered_in_order_to_their_waiters(channel):
    server, client, seen, hold = channel
    soon = time.monotonic() + 5
    pending = [client.submit({"n": i}, b"ab%d" % i, deadline=soon) for i in range(8)]
    out = {}

    def wait(i):
        out[i] = client.result(pending[i], soon)

    threads = [threading.Thread(target=wait, args=(i,)) for i in reversed(range(8))]  # later ones wait first
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert {i: (r["n"], p) for i, (r, p) in out.items()} == {i: (i, (b"ab%d" % i)[::-1]) for i in range(8)}
    assert seen == list(range(8)) and server.connections == 1


def test_a_waiter_past_its_deadline_drops_its_reply_and_the_stream_stays_in_step(channel):
    server, client, seen, hold = channel
    client.request({"n": 0}, deadline=time.monotonic() + 5)
    slow = client.submit({"n": 1, "slow": True}, deadline=time.monotonic() + 5)
    with pytest.raises(TransferTimeoutError):
        client.result(slow, time.monotonic() + 0.1)
    hold.set()  # its reply comes now: dropped, the next request gets its own
    reply, payload = client.request({"n": 2}, b"xy", deadline=time.monotonic() + 5)
    assert (reply["n"], payload) == (2, b"yx") and seen == [0, 1, 2]
    assert server.connections == 1  # the same connection: nothing was out of step


def test_a_submit_that_must_not_wait_sends_nothing_before_a_connection_exists(channel):
    server, client, seen, hold = channel
    assert client.submit({"n": 0}, deadline=time.monotonic() + 5, block=False) is None
    assert seen == [] and server.connections == 0
    client.request({"n": 1}, deadline=time.monotonic() + 5)
    p = client.submit({"n": 2}, deadline=time.monotonic() + 5, block=False)
    assert p is not None and client.result(p, time.monotonic() + 5)[0]["n"] == 2


def test_a_broken_stream_fails_every_request_in_flight_and_the_next_one_reconnects(channel):
    server, client, seen, hold = channel
    client.request({"n": 0}, deadline=time.monotonic() + 5)
    pending = [client.submit({"n": i, "slow": True}, deadline=time.monotonic() + 5) for i in (1, 2, 3)]
    time.sleep(0.1)
    for p in list(server._peers):  # the connection breaks with replies outstanding
        p.sock.shutdown(socket.SHUT_RDWR)
    hold.set()
    for p in pending:
        with pytest.raises(PeerDisconnectedError):
            client.result(p, time.monotonic() + 5)
    reply, _ = client.request({"n": 4}, deadline=time.monotonic() + 5)
    assert reply["n"] == 4


def test_a_request_whose_deadline_passed_fails_alone(channel):
    """A request submitted past its deadline (a transfer that timed out meanwhile) raises at once
    and sends nothing; the requests in flight keep their replies (a reset would have failed them:
    a notice the peer delivered would read as failed, against the fence's promise)."""
    server, client, seen, hold = channel
    client.request({"n": 0}, deadline=time.monotonic() + 5)
    slow = client.submit({"n": 1, "slow": True}, deadline=time.monotonic() + 5)
    with pytest.raises(TransferTimeoutError, match="passed before the request was sent"):
        client.submit({"n": 2}, deadline=time.monotonic() - 0.001)
    hold.set()
    assert client.result(slow, time.monotonic() + 5)[0]["n"] == 1
    assert seen == [0, 1] and server.connections == 1


def test_a_reply_given_later_keeps_its_connection_in_order_and_the_server_serving():
    """A handler's Later (xfer.frames.Later): its reply comes once its poll says so; the same
    connection's next request is read only after it (replies in order), another connection is
    served meanwhile, a poll's exception is its reply (the server goes on), and a connection that
    ends first is no longer polled."""
    from xfer.frames import Later

    gate, polls = threading.Event(), []

    def handler(header, payload):
        if header.get("later"):
            def poll(now):
                polls.append(now)
                if header.get("boom"):
                    raise ValueError("a bug in a deferred reply")
                return ({"ok": True, "n": header["n"]}, b"") if gate.is_set() else None
            return Later(poll, spin_s=0.001)
        return {"ok": True, "n": header.get("n")}, b""

    server = ControlServer("127.0.0.1", 0, handler, max_payload=1 << 20, identity=("srv-id", "srv"))
    one = ControlClient(server.address, "srv", 5.0, identity=("a", "a"), peer_id="srv-id")
    two = ControlClient(server.address, "srv", 5.0, identity=("b", "b"), peer_id="srv-id")
    try:
        soon = time.monotonic() + 5
        waiting = one.submit({"n": 1, "later": True}, deadline=soon)
        behind = one.submit({"n": 2}, deadline=soon)
        assert two.request({"n": 3}, deadline=soon)[0]["n"] == 3  # the server serves others meanwhile
        time.sleep(0.05)
        assert not waiting.done and not behind.done and len(polls) > 1
        gate.set()
        assert one.result(waiting, soon)[0]["n"] == 1 and one.result(behind, soon)[0]["n"] == 2
        reply, _ = two.request({"n": 4, "later": True, "boom": True}, deadline=soon)
        assert reply.get("ok") is False and "deferred reply" in str(reply)
        assert two.request({"n": 5}, deadline=soon)[0]["n"] == 5  # and the connection goes on
        gate.clear()
        two.submit({"n": 6, "later": True}, deadline=soon)
        time.sleep(0.05)
        assert len(server._later) == 1
        two.close()
        deadline = time.monotonic() + 5
        while server._later and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server._later
        n = len(polls)
        time.sleep(0.05)
        assert len(polls) == n  # no longer polled
    finally:
        one.close()
        two.close()
        server.close()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "secret"])
def test_a_lane_is_a_connection_of_its_own_opened_at_once_and_closed_with_its_client(secret):
    """``lane()``: a second connection to the same peer (the same one each time). ``open()`` does
    its handshake now, so a request that must not wait is sent at once; a reply the server holds
    (a Later) on the first connection does not hold the lane's; closing the client closes the lane."""
    from xfer.auth import Authenticator
    from xfer.frames import Later

    auth = None if secret is None else Authenticator(secret)
    gate = threading.Event()

    def handler(header, payload):
        if header.get("later"):
            return Later(lambda now: ({"ok": True, "n": header["n"]}, b"") if gate.is_set() else None)
        return {"ok": True, "n": header.get("n")}, payload[::-1]

    server = ControlServer("127.0.0.1", 0, handler, max_payload=1 << 20, auth=auth, identity=("srv-id", "srv"))
    client = ControlClient(server.address, "srv", 5.0, auth, identity=("cli-id", "cli"), peer_id="srv-id")
    try:
        lane = client.lane()
        assert lane is client.lane() and lane is not client and not lane.is_open
        assert lane.submit({"n": 0}, deadline=time.monotonic() + 5, block=False) is None  # not open: nothing sent
        lane.open(time.monotonic() + 5)
        assert lane.is_open
        soon = time.monotonic() + 5
        held = client.submit({"n": 1, "later": True}, deadline=soon)  # the first connection's reply is held
        p = lane.submit({"n": 2}, b"xy", deadline=soon, block=False)
        assert p is not None
        assert lane.result(p, soon) == ({"ok": True, "n": 2}, b"yx")  # answered while the first one waits
        assert not held.done
        gate.set()
        assert client.result(held, soon)[0]["n"] == 1
        client.close()
        assert not lane.is_open
        with pytest.raises(PeerDisconnectedError):
            lane.request({"n": 3}, deadline=time.monotonic() + 2)
    finally:
        client.close()
        server.close()


def test_opening_a_connection_to_a_peer_that_never_answers_ends_by_its_deadline():
    """A listener that accepts and never answers the hello: ``open`` raises a typed error by its
    deadline (the completer's reopening of a landing connection waits no longer than that)."""
    quiet = socket.create_server(("127.0.0.1", 0))
    try:
        client = ControlClient(quiet.getsockname()[:2], "quiet", 5.0, None, identity=("cli-id", "cli"))
        start = time.monotonic()
        with pytest.raises((TransferTimeoutError, PeerDisconnectedError)):
            client.open(start + 0.2)
        assert time.monotonic() - start < 1.0 and not client.is_open
        client.close()
    finally:
        quiet.close()


def test_poll_reply_never_waits_and_leaves_the_request_in_flight(channel):
    """``poll_reply`` reads only what the connection holds now: with the reply not sent yet it
    returns False at once (not after the reading socket's timeout, which an earlier waiter set to
    its own deadline), the request stays in flight, and its reply is taken when it comes."""
    server, client, seen, hold = channel
    client.request({"n": 0}, deadline=time.monotonic() + 5)  # a waiter set the reading socket's timeout
    slow = client.submit({"n": 1, "slow": True}, deadline=time.monotonic() + 5)
    for _ in range(3):
        t0 = time.monotonic()
        assert client.poll_reply(slow) is False
        assert time.monotonic() - t0 < 0.5, "poll_reply waited for the reply"
    assert not slow.done and slow.error is None  # still in flight: the connection is not failed
    hold.set()
    until = time.monotonic() + 5
    while not client.poll_reply(slow):
        assert time.monotonic() < until, "the reply never came"
        time.sleep(0.005)
    reply, _ = client.result(slow, time.monotonic() + 1)
    assert reply["n"] == 1 and seen == [0, 1] and server.connections == 1


def test_poll_reply_after_a_waiter_gave_up_does_not_fail_the_connection(channel):
    """A waiter that gave up at its deadline leaves the reading socket's timeout at what little it
    had left; a ``poll_reply`` after it, with the next reply not sent yet, must neither wait that
    out nor take the empty wait for a broken stream (which would fail every request in flight on a
    healthy connection with PeerDisconnectedError)."""
    server, client, seen, hold = channel
    slow = client.submit({"n": 1, "slow": True}, deadline=time.monotonic() + 5)
    with pytest.raises(TransferTimeoutError):
        client.result(slow, time.monotonic() + 0.05)
    later = client.submit({"n": 2}, b"z", deadline=time.monotonic() + 5)  # answered after the slow one
    assert client.poll_reply(later) is False
    assert not later.done and later.error is None
    hold.set()
    reply, payload = client.result(later, time.monotonic() + 5)
    assert (reply["n"], payload) == (2, b"z") and seen == [1, 2] and server.connections == 1
