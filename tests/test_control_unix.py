"""The control channel between agents of one host over an abstract Unix socket (XFER_CONTROL_UNIX).

The server publishes a random socket name in its metadata; a peer with the same host id connects
there, and falls back to TCP where nothing listens on it (another network namespace, a name no
server holds). Every case moves blocks and checks the bytes (moved blocks the source's, every
other byte still poisoned)."""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest

from helpers import assert_blocks_equal, assert_untouched, local_pair
from xfer import metadata as md
from xfer.transfer import TransferState


@pytest.fixture
def pair():
    yield from local_pair("unix", seed=11)


def _hosts(agent) -> dict:
    return dict(agent._server._per_host)


def test_peers_on_this_host_talk_over_the_unix_socket(pair):
    a, b, peer, (ta, la), (tb, lb) = pair
    name = md.decode(b.metadata()).control_unix
    assert name is not None and md.UNIX_NAME.fullmatch(name)
    assert a._clients[peer].unix == name
    assert a.write(peer, [1, 2, 3], [4, 5, 6], notify=b"n").wait() is TransferState.DONE
    assert set(_hosts(b)) == {"unix"}  # every connection of a came over the Unix socket
    assert b.wait_notification(2).payload == b"n"
    assert_blocks_equal(la, ta, [1, 2, 3], lb, tb, [4, 5, 6])
    assert_untouched(lb, tb, [4, 5, 6])


def _with_unix(blob: bytes, name: str) -> bytes:
    d = json.loads(blob[struct.calcsize("!4sHII"):])
    d["control_unix"] = name
    payload = json.dumps(d).encode()
    import zlib
    return struct.pack("!4sHII", md.MAGIC, md.VERSION, len(payload), zlib.crc32(payload)) + payload


def test_a_unix_socket_nobody_listens_on_falls_back_to_tcp(pair):
    """Metadata naming a socket no server holds (as a peer in another network namespace sees the
    real one): the connection goes over TCP, now and after."""
    a, b, peer, (ta, la), (tb, lb) = pair
    a.disconnect(peer)
    name = a.connect(_with_unix(b.metadata(), "xfer-ctl-" + "0" * 24))
    assert a._clients[name].unix is None
    assert a.write(name, [1, 2], [3, 4]).wait() is TransferState.DONE
    assert "unix" not in _hosts(b) and sum(_hosts(b).values()) >= 1
    assert_blocks_equal(la, ta, [1, 2], lb, tb, [3, 4])
    assert_untouched(lb, tb, [3, 4])


def test_junk_on_the_unix_socket_is_dropped_and_the_server_serves_on(pair):
    a, b, peer, (ta, la), (tb, lb) = pair
    name = md.decode(b.metadata()).control_unix
    junk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    junk.connect("\0" + name)
    junk.sendall(b"\xff" * 4096)
    junk.settimeout(5)
    try:
        while junk.recv(4096):  # the server closes it (a REJECT first, maybe)
            pass
    except (ConnectionResetError, socket.timeout):
        pass
    junk.close()
    assert a.write(peer, [1], [2]).wait() is TransferState.DONE
    assert_blocks_equal(la, ta, [1], lb, tb, [2])
    assert_untouched(lb, tb, [2])


def test_off_publishes_no_socket_and_talks_tcp(monkeypatch):
    from xfer.settings import reload

    monkeypatch.setenv("XFER_CONTROL_UNIX", "0")
    reload()
    gen = local_pair("tcponly", seed=12)
    a, b, peer, (ta, la), (tb, lb) = next(gen)
    try:
        assert md.decode(b.metadata()).control_unix is None and a._clients[peer].unix is None
        assert a.write(peer, [5], [6]).wait() is TransferState.DONE
        assert "unix" not in _hosts(b)
        assert_blocks_equal(la, ta, [5], lb, tb, [6])
        assert_untouched(lb, tb, [6])
    finally:
        gen.close()
        monkeypatch.delenv("XFER_CONTROL_UNIX")
        reload()


def test_unix_connections_count_under_one_address_for_the_per_host_limit(monkeypatch):
    """A flood of connections over the Unix socket meets max_conns_per_host as loopback TCP does:
    past it each new one (none has its handshake done) closes the oldest handshaking one, and
    the limit is never exceeded; a legitimate peer then still connects and moves its blocks."""
    from xfer.settings import reload

    monkeypatch.setenv("XFER_CONTROL_MAX_CONNS_PER_HOST", "4")
    reload()
    gen = local_pair("unixflood", seed=13)
    a, b, peer, (ta, la), (tb, lb) = next(gen)
    socks = []
    try:
        name = md.decode(b.metadata()).control_unix
        a.disconnect(peer)
        end = time.monotonic() + 5
        while len(b._server._peers) and time.monotonic() < end:  # a's connections closed
            time.sleep(0.01)
        for _ in range(12):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0" + name)
            socks.append(s)
        time.sleep(0.3)
        assert _hosts(b).get("unix", 0) <= 4
        for s in socks:
            s.close()
        peer = a.connect(b.metadata())
        assert a.write(peer, [1], [2]).wait() is TransferState.DONE
        assert_blocks_equal(la, ta, [1], lb, tb, [2])
        assert_untouched(lb, tb, [2])
    finally:
        for s in socks:
            s.close()
        gen.close()
