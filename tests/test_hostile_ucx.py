"""Hostile peers against the UCX listener (issue 30, cases 2, 3, 5, 6, 8, 9 and 10): each attacker
runs in its own process on loopback; the victim agent runs in another and must stay healthy (a
legitimate peer's UCX write lands byte for byte afterwards), keep its memory bounded, and log each
rejection with its reason. Case 11 (the local target's own checks) is tests/test_fence.py's."""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("ucxx", reason="the UCX transport needs ucxx: pip install -e '.[ucx]'")

import hostile_attacks as attacks  # noqa: E402
from helpers import small_dims  # noqa: E402
from hostile_helpers import (SECRET, Attacker, Victim, assert_victim_holds, legit_write,  # noqa: E402
                             report, run_attacker)
from ucx_helpers import ucx_env  # noqa: E402
from xfer import LayoutKind  # noqa: E402
from xfer import metadata as md_codec  # noqa: E402

KIND = LayoutKind.VLLM_FLASH_ATTN_NHD
DIMS = small_dims(KIND, blocks=16)
MiB = 1 << 20
UCX = ("ucx",)


def _listener(victim: Victim) -> tuple[str, int]:
    info = md_codec.decode(victim.metadata).transports["ucx"]
    return info["address"], info["port"]


def _healthy(victim: Victim, secret=None, src=(1, 2, 3), dst=(4, 5, 6), seed=5) -> None:
    """A legitimate peer's UCX write lands byte for byte, notified; the victim's blocks are poisoned again."""
    expected = legit_write(KIND, DIMS, victim.metadata, secret=secret, enable=UCX, src=src, dst=dst, seed=seed)
    assert_victim_holds(victim, expected, dst)
    notes = victim.call("notifications")
    assert [(n[0], n[2], n[3]) for n in notes] == [("legit", list(dst), b"legit")], notes
    victim.call("poison")


@pytest.fixture
def victim(request, monkeypatch):
    for k, v in ucx_env().items():
        monkeypatch.setenv(k, v)
    secret = getattr(request, "param", None)
    v = Victim("victim", KIND, DIMS, secret=secret, enable=UCX, env=ucx_env())
    v.secret = secret
    yield v
    v.close()


both = pytest.mark.parametrize("victim", [None, SECRET], indirect=True, ids=["no-secret", "secret"])


# ---- case 2 -----------------------------------------------------------------------------------------
@both
def test_case2_deep_json_in_a_ucx_control_message_is_dropped_and_the_engine_goes_on(victim):
    _healthy(victim, victim.secret)  # the engine works, and has a connection of its own
    before = victim.rss()
    run_attacker(attacks.ucx_deep_json, *_listener(victim))
    counts = victim.call("rejections")
    report(victim, counts, before)
    if victim.secret is None:  # no MAC to check: the header is parsed, bounded, and refused
        assert counts.get("ucx:malformed") == 1, counts
        assert victim.logged("dropped a bad control message", "recursion limit")
    else:  # its PROOF fails (no secret), and before a PROOF only a PROOF is received
        assert counts.get("ucx:forged") == 1 and counts.get("ucx:size") == 1, counts
        assert victim.logged("drained a 200", "before its PROOF only the PROOF is taken")
    _healthy(victim, victim.secret, src=(7,), dst=(8,))
    assert victim.rss() - before < 32 * MiB


# ---- cases 3 and 5 ------------------------------------------------------------------------------------
@both
def test_case3_and_5_control_messages_claiming_1_TiB_and_3x100_MB_are_drained_unreceived(victim):
    before = victim.rss()
    out = run_attacker(attacks.ucx_big_messages, *_listener(victim), [1 << 40, 100_000_000, 100_000_000,
                                                                       100_000_000])
    assert out["completed"] >= 0
    counts = victim.call("rejections")
    report(victim, counts, before)
    assert counts.get("ucx:size") == 4, counts
    limit = "max_ctrl_bytes" if victim.secret is None else "before its PROOF only the PROOF is taken"
    assert victim.logged("drained a 1099511627776-byte control message", limit)
    assert len(victim.logged("drained a 100000000-byte control message", limit)) == 3
    assert victim.rss() - before < 32 * MiB, f"RSS grew by {(victim.rss() - before) / MiB:.0f} MiB"
    _healthy(victim, victim.secret)


@both
def test_case5_chunks_of_never_requested_transfers_are_bounded(victim):
    before = victim.rss()
    run_attacker(attacks.ucx_early_flood, *_listener(victim), 60_000, 1024, timeout=300)
    counts = victim.call("rejections")
    report(victim, counts, before)
    if victim.secret is None:  # the outsider can derive the tags: 1,024 held, then its connection failed
        assert counts.get("ucx:early") == 1, counts
        assert victim.logged("dropped peer", "more than 1024 chunks ahead of their requests (early_chunks)")
    else:  # no key, no valid tag: each one drained as it comes
        assert counts.get("ucx:forged", 0) >= 1_000, counts
        assert victim.logged("drained a chunk", "whose tag does not verify")
    # bound: early_chunks (1,024) x 1 KiB held by UCX at most, and the rest never received
    assert victim.rss() - before < 48 * MiB, f"RSS grew by {(victim.rss() - before) / MiB:.0f} MiB"
    _healthy(victim, victim.secret)


# ---- case 6 -----------------------------------------------------------------------------------------
def test_case6_malformed_ucx_control_messages_are_logged_with_their_reason(victim):
    run_attacker(attacks.ucx_malformed, *_listener(victim))
    assert victim.call("rejections").get("ucx:malformed") == 3
    assert victim.logged("dropped a bad control message", "string field why of 65535 bytes overruns the header") or \
        victim.logged("dropped a bad control message", "overruns")
    assert victim.logged("dropped a bad control message", "99 is not a valid Kind")
    assert victim.logged("dropped a bad control message", "9999+0 bytes announced")
    _healthy(victim)


# ---- case 8 -----------------------------------------------------------------------------------------
def test_case8_a_captured_request_and_the_attackers_chunk_land_nothing(victim, monkeypatch):
    from xfer.transports.ucx import wire
    from xfer.transports.ucx.protocol import Protocol

    victim.secret = SECRET
    c = Victim("c", KIND, DIMS, secret=SECRET, enable=UCX, env=ucx_env())
    try:
        captured = []
        real = Protocol._send

        def tap(self, conn, msg):  # what an attacker on the path captures: the REQ frames B sends C
            if int(msg[0]) == int(wire.Kind.REQ):
                captured.append((wire.ctrl_tag(conn.remote_id), bytes(msg)))
            return real(self, conn, msg)
        monkeypatch.setattr(Protocol, "_send", tap)
        expected = legit_write(KIND, DIMS, c.metadata, secret=SECRET, enable=UCX, src=(1, 2), dst=(3, 4))
        monkeypatch.setattr(Protocol, "_send", real)
        assert captured, "the tap saw no REQ"
        assert_victim_holds(c, expected, (3, 4))
        assert [n[2] for n in c.call("notifications")] == [[3, 4]]
        chunk = c.layout.bytes_per_block * 2  # the REQ's one chunk: blocks 3 and 4, every layer, K and V
        run_attacker(attacks.ucx_replay, *_listener(c), captured, chunk, [1, 2, 3])
        time.sleep(0.5)
        assert c.call("notifications") == []  # nothing delivered as from B
        assert_victim_holds(c, expected, (3, 4))  # nothing landed: blocks 3 and 4 as B wrote them, the rest poisoned
        counts = c.call("rejections")
        report(c, counts)
        assert counts.get("ucx:size", 0) >= 1, counts  # on its own connection: not even received
        assert counts.get("ucx:forged", 0) >= 1, counts  # with the legitimate connection's tag: replay refused
        assert c.logged("dropped a control message", "sequence number")
        c.call("poison")
        _healthy(c, SECRET)
    finally:
        c.close()


# ---- case 9 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("victim", [SECRET], indirect=True, ids=["secret"])
def test_case9_forged_acks_on_a_legitimate_connections_tag_close_nothing(victim):
    from helpers import block_bytes, fill_random
    from xfer import Agent, AgentConfig, make_kv_cache

    tensors, layout = make_kv_cache(KIND, **DIMS)
    fill_random(tensors, 11)
    with Agent("legit", AgentConfig(secret=SECRET, enable=UCX, default_timeout_s=20)) as a:
        a.register("kv", tensors, layout)
        peer = a.connect(victim.metadata)
        a.write(peer, [0], [0]).wait()  # the legitimate connection exists (id 1 or 2 at the victim)
        flood = Attacker(attacks.ucx_forged_acks, *_listener(victim), [1, 2, 3, 4])
        failed, done = [], 0
        try:
            time.sleep(0.5)
            end = time.monotonic() + 6
            while time.monotonic() < end:
                ts = [a.write(peer, [i], [i], timeout=20) for i in range(1, 9)]
                for t in ts:
                    try:
                        t.wait()
                        done += 1
                    except Exception as exc:  # noqa: BLE001 - counted
                        failed.append(repr(exc))
        finally:
            flood.stop()
        expected = block_bytes(layout, tensors, list(range(9)))
    assert failed == [] and done >= 50, (done, failed[:3])
    assert_victim_holds(victim, expected, range(9))
    counts = victim.call("rejections")
    report(victim, counts)
    assert counts.get("ucx:forged", 0) >= 100, counts
    assert victim.logged("dropped a control message", "MAC does not verify")
    victim.call("poison")
    _healthy(victim, SECRET)


# ---- case 10 ----------------------------------------------------------------------------------------
def _other_address() -> str | None:
    """An address of this host that is not loopback (None if it has none)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # no packet is sent: only a route is chosen
        ip = s.getsockname()[0]
        return None if ip.startswith("127.") else ip
    except OSError:
        return None
    finally:
        s.close()


def _listening(port: int) -> list[str]:
    """Local addresses of the TCP sockets listening on ``port`` (from /proc/net/tcp)."""
    out = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                out.append(addr)
    return out


def test_case10_the_ucx_listener_binds_listen_host_and_an_exposed_agent_says_so(victim):
    host, port = _listener(victim)
    assert md_codec.decode(victim.metadata).transports["ucx"]["bind"] == "127.0.0.1"
    assert _listening(port) == ["0100007F"], _listening(port)  # 127.0.0.1 only, not 0.0.0.0
    other = _other_address()
    if other is not None:
        assert run_attacker(attacks.tcp_connect, other, port) == "ConnectionRefusedError"
    assert not victim.logged("beyond loopback")
    exposed = Victim("exposed", KIND, DIMS, enable=UCX, env=ucx_env(), listen_host="0.0.0.0")
    try:
        lines = exposed.logged("beyond loopback", "without a shared secret")
        assert len(lines) == 1 and "ucx listener on 0.0.0.0" in lines[0] and "control port on 0.0.0.0" in lines[0]
    finally:
        exposed.close()
    _healthy(victim)

