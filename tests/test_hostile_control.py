"""Hostile peers against the control port (issue 30, cases 1, 4, 5, 6 and 7): each attacker runs in
its own process on loopback; the victim agent runs in another and must stay healthy (a
legitimate peer's write lands byte for byte afterwards), keep its memory and descriptors bounded,
and log each rejection with its reason."""

from __future__ import annotations

import socket
import struct
import time
import zlib

import pytest

import hostile_attacks as attacks
from hostile_helpers import SECRET, Attacker, Victim, assert_victim_holds, legit_write, report, run_attacker
from helpers import small_dims
from xfer import LayoutKind
from xfer import metadata as md_codec
from xfer.errors import MetadataError

KIND = LayoutKind.VLLM_FLASH_ATTN_NHD
DIMS = small_dims(KIND, blocks=16)
MiB = 1 << 20


def _control(victim: Victim) -> tuple[str, int]:
    return md_codec.decode(victim.metadata).control


def _healthy(victim: Victim, secret=None, src=(1, 2, 3), dst=(4, 5, 6), seed=5) -> None:
    """A legitimate peer's write lands byte for byte, notified; the victim's blocks are poisoned again."""
    expected = legit_write(KIND, DIMS, victim.metadata, secret=secret, src=src, dst=dst, seed=seed)
    assert_victim_holds(victim, expected, dst)
    notes = victim.call("notifications")
    assert [(n[0], n[2], n[3]) for n in notes] == [("legit", list(dst), b"legit")], notes
    victim.call("poison")


@pytest.fixture
def victim(request):
    secret = getattr(request, "param", None)
    v = Victim("victim", KIND, DIMS, secret=secret)
    v.secret = secret
    yield v
    v.close()


# ---- case 1 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("victim", [None, SECRET], indirect=True, ids=["no-secret", "secret"])
def test_case1_deep_json_header_is_refused_and_the_port_keeps_serving(victim):
    before = victim.rss()
    for _ in range(3):
        out = run_attacker(attacks.deep_json_header, _control(victim), 200_000, victim.secret is None)
        if victim.secret is None:  # the handshake needs no secret: the header itself is refused, parsed bounded
            assert "nests deeper than the JSON parser's recursion limit" in out["answer"], out
        else:  # before the key is proved only a hello of at most HELLO_MAX bytes is read
            assert "expected a hello of at most" in out["answer"], out
    _healthy(victim, victim.secret)
    report(victim, victim.call("rejections"), before)
    assert victim.rss() - before < 32 * MiB
    reason = "recursion limit" if victim.secret is None else "expected a hello of at most"
    assert victim.logged("dropped peer", reason), victim.call("logs")
    assert "xfer-control" in " ".join(victim.call("threads"))


# ---- case 4 -----------------------------------------------------------------------------------------
def test_case4_idle_connection_flood_is_bounded_and_peers_still_get_in(victim):
    base_fds = victim.fds()
    flood = [Attacker(attacks.idle_flood, _control(victim), 12_000) for _ in range(2)]
    try:
        opened = sum(a.recv()["opened"] for a in flood)
        assert opened >= 20_000, opened  # 24,000 asked; the host's own limits may take a few
        held = victim.fds() - base_fds
        report(victim, victim.call("rejections"))
        assert held <= 64 + 8, f"the victim holds {held} more descriptors (max_pending=64)"
        _healthy(victim)  # while the flood still holds its sockets
    finally:
        for a in flood:
            a.stop()
    # the flood's sockets come back once its processes are gone: within seconds, busy cores included
    deadline = time.monotonic() + 15.0
    while victim.fds() - base_fds > 8 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert victim.fds() - base_fds <= 8, f"{victim.fds() - base_fds} more descriptors 15 s after the flood left"
    assert victim.logged("dropped peer", "closed unauthenticated", "newer connections need the room")
    assert victim.call("rejections").get("evicted", 0) >= 10_000  # most were accepted, then closed for newer ones
    _healthy(victim)


def test_case4_out_of_descriptors_pauses_accepts_and_goes_on(victim):
    held = victim.call("exhaust_fds", 0)  # every descriptor taken, as a leak elsewhere in the process would
    assert held > 100
    try:
        answers = run_attacker(attacks.garbage, _control(victim), [b"x"] * 20)
        assert answers >= 0
        time.sleep(0.5)
    finally:
        victim.call("release_fds")
    assert victim.logged("cannot accept", "Too many open files", "pausing accepts")
    _healthy(victim)
    assert "xfer-control" in " ".join(victim.call("threads"))


# ---- case 5 -----------------------------------------------------------------------------------------
@pytest.fixture
def slow_victim():
    v = Victim("victim", KIND, DIMS, settings_env={"XFER_CONTROL_FRAME_S": "2"})
    yield v
    v.close()


def test_case5_slow_big_headers_are_bounded_in_memory_and_time(slow_victim):
    victim = slow_victim
    before = victim.rss()
    attacker = Attacker(attacks.slow_big_frames, _control(victim), 400, MiB, 1.5)
    peak = before
    try:
        end = time.monotonic() + 60
        while not attacker.conn.poll(0.05) and time.monotonic() < end:
            peak = max(peak, victim.rss())
        sent = attacker.recv()
        assert sent["connected"] <= 128, sent  # max_conns_per_host
        assert sent["refused"] >= 400 - 128 - 64, sent
        for _ in range(60):
            peak = max(peak, victim.rss())
            time.sleep(0.05)
    finally:
        attacker.stop()
    # bound: buffer_bytes (64 MiB) of unfinished frames, plus what the interpreter keeps of freed buffers
    print(f"\n[case 5] peak RSS {(peak - before) / MiB:+.1f} MiB over {before / MiB:.0f} MiB; {sent}")
    assert peak - before < 64 * MiB + 48 * MiB, f"RSS grew by {(peak - before) / MiB:.0f} MiB"
    counts = victim.call("rejections")
    report(victim, counts, before)
    assert counts.get("per-host", 0) >= 400 - 128 - 64 or counts.get("evicted", 0), counts
    assert counts.get("slow", 0) + counts.get("memory", 0) >= 1, counts
    assert victim.logged("dropped peer", "took over 2 s (frame_s)") or \
        victim.logged("dropped peer", "unfinished frames", "buffer_bytes")
    assert victim.logged("refused a connection", "max_conns_per_host")
    _healthy(victim)


# ---- case 6 (the metadata half; the UCX half is in test_hostile_ucx) ---------------------------------
def _forged_metadata(body: bytes) -> bytes:
    return struct.pack("!4sHII", md_codec.MAGIC, md_codec.VERSION, len(body), zlib.crc32(body)) + body


def test_case6_deep_json_metadata_is_a_metadata_error(victim):
    from xfer import Agent, AgentConfig

    blobs = run_attacker(_make_bad_metadata)
    with Agent("legit-connector", AgentConfig(enable=("local",))) as a:
        for blob, why in blobs:
            with pytest.raises(MetadataError, match=why):
                a.connect(blob)
    _healthy(victim)


def _make_bad_metadata():
    return [(_forged_metadata(b"[" * 200_000), "recursion limit"),
            (_forged_metadata(b'{"a":' * 40 + b"1" + b"}" * 40), "deeper than 16 levels"),
            (_forged_metadata(b'{"x": "\xff"}'), "not JSON")]


# ---- case 7 -----------------------------------------------------------------------------------------
class _Tap:
    """Records what a legitimate agent's control client sends on the wire (what an attacker on the
    network path would capture: the channel is cleartext by design)."""

    def __init__(self, monkeypatch):
        import xfer.control_client as cc

        self.streams: list[bytearray] = []
        real = socket.create_connection

        def create_connection(*args, **kw):
            sock = real(*args, **kw)
            stream = bytearray()
            self.streams.append(stream)
            return _Recording(sock, stream)

        class _Socket:  # the module's view of `socket`, with a tapped create_connection
            def __getattr__(self, name):
                return create_connection if name == "create_connection" else getattr(socket, name)
        monkeypatch.setattr(cc, "socket", _Socket())


class _Recording:
    def __init__(self, sock, stream):
        self._sock, self._stream = sock, stream

    def sendall(self, data):
        self._stream += data
        return self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _requests(stream: bytes) -> list[bytes]:
    """The REQUEST frames of a captured client stream."""
    from xfer import frames

    out, at = [], 0
    while at + frames.PREFIX.size <= len(stream):
        kind, _, _, hlen, plen, _, _ = frames.PREFIX.unpack_from(stream, at)
        end = at + frames.PREFIX.size + hlen + plen
        if kind == frames.Kind.REQUEST:
            out.append(bytes(stream[at:end]))
        at = end
    return out


def test_case7_a_captured_notify_is_invalid_at_another_agent_and_on_another_connection(monkeypatch):
    b = Victim("b", KIND, DIMS, secret=SECRET)
    c = Victim("c", KIND, DIMS, secret=SECRET)
    try:
        from xfer.settings import reload

        monkeypatch.setenv("XFER_CONTROL_UNIX", "0")  # the tap sees TCP: what crosses a network
        reload()
        tap = _Tap(monkeypatch)
        expected = legit_write(KIND, DIMS, b.metadata, secret=SECRET, src=(1, 2), dst=(3, 4))
        assert_victim_holds(b, expected, (3, 4))
        (stream,) = tap.streams
        notifies = [f for f in _requests(bytes(stream)) if b'"type":"notify"' in f]
        assert notifies, "the tap saw no notify frame"
        monkeypatch.undo()
        # at another agent of the deployment the hello names the wrong agent: refused as stale
        as_is = run_attacker(attacks.replay_stream, _control(c), bytes(stream))
        assert as_is["frames"] == [("REJECT", as_is["frames"][0][1])], as_is
        assert "stale metadata" in as_is["frames"][0][1]
        assert c.logged("dropped peer", "stale metadata")
        for target in (c, b):  # another agent, and the same agent on a new connection: the proof fails
            whole = run_attacker(attacks.replay_stream, _control(target), bytes(stream), target is c)
            assert whole["frames"][0][0] == "WELCOME" and whole["frames"][-1][0] == "REJECT", whole
            assert "proof of the session key does not verify" in whole["frames"][-1][1], whole
            alone = run_attacker(attacks.replay_request_frames, _control(target), notifies)
            assert all("proof of the session key does not verify" in a for a in alone["answers"]), alone
            assert target.logged("dropped peer", "proof of the session key does not verify")
        assert c.call("notifications") == []
        assert [n[2] for n in b.call("notifications")] == [[3, 4]]  # the one genuine notice only
        b.call("poison")
        _healthy(c, SECRET)
        _healthy(b, SECRET)
    finally:
        b.close()
        c.close()


# ---- grant requests: block ids as JSON lists or packed in the payload ---------------------------------
def test_malformed_grant_requests_are_refused_typed_and_the_port_keeps_serving(victim):
    """A peer's grant request names each transfer's blocks as a JSON list (``blocks``) or packed in
    the payload as little-endian int64 (``nblocks`` each). Counts that do not add up to the payload,
    a payload no transfer names, counts that are not non-negative integers: the whole request is
    refused, typed, before any id is read. Ids out of range, repeated or not integers: that
    transfer is refused, typed, and holds nothing. A well-formed packed request is granted. The
    victim serves on: a legitimate write lands afterwards, byte for byte."""
    from hostile_helpers import RawControl

    layout = md_codec.decode(victim.metadata).regions["kv"].layout
    n = DIMS["num_blocks"]

    def grant(c, payload=b"", **fields):
        e = {"transfer_id": "m-1", "op": "write", "region": "kv", "fingerprint": layout.fingerprint_hash(),
             "ttl": 5.0, "sent": time.monotonic(), **fields}
        return c.request({"type": "grant", "from": "mallory", "pid": 1, "host": "elsewhere", "transfers": [e]},
                         payload)

    q = lambda *ids: struct.pack(f"<{len(ids)}q", *ids)  # noqa: E731
    with RawControl(_control(victim)) as c:
        c.handshake()
        for payload, fields, why in [
                (q(1, 2), {"nblocks": 3}, "do not add up"),
                (q(1, 2, 3), {"nblocks": 2}, "do not add up"),
                (b"", {"nblocks": -1}, "do not add up"),
                (q(1, 2), {"nblocks": "2"}, "do not add up"),
                (q(1, 2)[:-1], {"nblocks": 1}, "do not add up"),
                (q(1), {"blocks": [1]}, "names no packed block ids")]:
            reply = grant(c, payload, **fields)
            assert reply.get("ok") is False and reply["error"] == "InvalidArgumentError", (fields, reply)
            assert why in reply["message"], (fields, reply)
        for payload, fields, why in [
                (q(1, n), {"nblocks": 2}, f"contain id {n}"),
                (q(-3), {"nblocks": 1}, "negative id -3"),
                (q(3, 3), {"nblocks": 2}, "repeat id 3"),
                (b"", {"blocks": [n + 5]}, f"contain id {n + 5}"),
                (b"", {"blocks": [[1, 2]]}, "must be 1-D"),
                (b"", {"blocks": ["x"]}, "malformed grant request")]:
            reply = grant(c, payload, **fields)
            assert reply.get("ok") is True and not reply["grants"], (fields, reply)
            failed = reply["failed"]["0"]
            assert failed["error"] in ("BlockIdError", "InvalidArgumentError") and why in failed["message"], \
                (fields, failed)
        reply = grant(c, q(9, 10), nblocks=2)  # well formed: granted, then ended
        assert reply.get("ok") is True and list(reply["grants"]) == ["0"] and not reply["failed"], reply
        ended = c.request({"type": "grant_end", "from": "mallory", "grants": [reply["grants"]["0"]]})
        assert ended.get("ok") is True, ended
    _healthy(victim)
