"""The UCX transport between two processes on loopback: the seed workload byte-exact both ways,
layout conversion, many concurrent small requests to two peers, receiver-side validation with
typed refusals, and real faults (kill -9 of either side mid-transfer, a frozen peer past the
deadline, cancellation) ending in typed errors with no notification for a partial transfer."""

from __future__ import annotations

import contextlib
import signal
import time

import numpy as np
import pytest

pytest.importorskip("ucxx", reason="the UCX transport needs ucxx: pip install -e '.[ucx]'")

from helpers import assert_blocks_equal, assert_untouched, block_bytes, fill_random, poison  # noqa: E402
from fence_helpers import busy_cores, freeze  # noqa: E402,F401  (busy_cores: a fixture)
from ucx_helpers import CHUNK_DELAY, UcxPeer, expected_blocks, ucx_env, wait_until  # noqa: E402
from xfer import Agent, AgentConfig, LayoutKind, TransferState, make_kv_cache  # noqa: E402
from xfer.settings import UcxSettings  # noqa: E402
from xfer.errors import (BlockIdError, LayoutMismatchError, NotRegisteredError, PeerDisconnectedError,  # noqa: E402
                         TransferCancelledError, TransferTimeoutError)

pytestmark = pytest.mark.timeout(120)

# the seed case: 64 layers x K/V x 128 of 256 blocks, every other one: 16,384 separate 128-byte slices
SEED = dict(num_layers=64, num_blocks=256, block_size=4, num_heads=1, head_dim=16)
KIND = LayoutKind.VLLM_FLASH_ATTN_NHD
SMALL = dict(num_layers=4, num_blocks=64, block_size=4, num_heads=2, head_dim=8)
# long enough to be cut mid-way on any machine: 32 MiB in 4,096 chunks of 8 KiB, one in flight, 2 ms a chunk
SLOW = dict(num_layers=8, num_blocks=512, block_size=16, num_heads=2, head_dim=64)
SLOW_ENV = {"XFER_UCX_CHUNK_BYTES": "8K", "XFER_UCX_DEPTH": "1", CHUNK_DELAY: "0.002"}  # >= 8 s a transfer


@pytest.fixture
def env(monkeypatch):
    for k, v in ucx_env().items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def local(env):
    """This process's agent with a random seed cache, UCX pinned."""
    tensors, layout = make_kv_cache(KIND, **SEED)
    fill_random(tensors, seed=7)
    agent = Agent("prefill", AgentConfig(transport="ucx", default_timeout_s=20))
    agent.register("kv", tensors, layout)
    yield agent, tensors, layout
    agent.close()


@pytest.fixture(scope="module")
def decodes():
    """Two peer agents with seed-shaped caches, shared by the tests of this module."""
    peers = [UcxPeer(f"decode{i}" if i else "decode", KIND, SEED) for i in range(2)]
    yield peers
    for p in peers:
        p.close()


@pytest.fixture
def decode(decodes):
    """The first shared peer, its region fresh and poisoned."""
    assert decodes[0].call("reset") == "ok"
    return decodes[0]


@pytest.fixture(scope="module")
def slow():
    """A peer whose UCX slots are 8 KiB, one in flight: its transfers take long enough to cut."""
    box = [UcxPeer("slow", KIND, SLOW, env=SLOW_ENV)]
    yield box
    box[0].close()


@contextlib.contextmanager
def linked(peer: UcxPeer, regions: dict, *, me: str = "src", peer_region: str | None = None):
    """This process's agent (UCX pinned) with ``regions`` ({name: (tensors, layout)}) registered,
    connected to ``peer`` (given a poisoned region ``peer_region`` first, when named); yields
    (agent, the peer's name, peer). The peer process is stopped at the end, whatever happened."""
    try:
        if peer_region is not None:
            peer.metadata = peer.call("region", (peer_region, None))
        with Agent(me, AgentConfig(transport="ucx", default_timeout_s=20)) as agent:
            for region, (tensors, layout) in regions.items():
                agent.register(region, tensors, layout)
            yield agent, agent.connect(peer.metadata), peer
    finally:
        peer.close()


def test_seed_write_is_byte_exact_and_notifies(local, decode):
    agent, tensors, layout = local
    peer = agent.connect(decode.metadata)
    assert agent.route(peer).kind.value == "ucx"
    src, dst = list(range(0, 256, 2)), list(range(128, 256))[::-1]
    t = agent.write(peer, src, dst, notify=b"req-42")
    t.wait()
    assert t.poll() is TransferState.DONE and t.path.startswith("ucx (host staging")
    assert decode.call("notification", 5) == ("ok", "prefill", "write", dst, b"req-42")
    remote = decode.tensors()
    assert_blocks_equal(layout, tensors, src, decode.layout, remote, dst)
    assert_untouched(decode.layout, remote, dst)


def test_seed_read_is_byte_exact_and_notifies_the_owner(local, decode):
    agent, tensors, layout = local
    poison(tensors)
    assert decode.call("reset", 11) == "ok"
    peer = agent.connect(decode.metadata)
    src, dst = list(range(128)), list(range(64, 192))
    agent.read(peer, src, dst, notify=b"pulled").wait()
    assert decode.call("notification", 5) == ("ok", "prefill", "read", src, b"pulled")
    assert_blocks_equal(decode.layout, decode.tensors(), src, layout, tensors, dst)
    assert_untouched(layout, tensors, dst)


@pytest.mark.parametrize("mine,theirs", [(LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.VLLM_FLASH_ATTN_HND),
                                         (LayoutKind.PACKED_KV, LayoutKind.DISTSERVE)])
def test_layouts_convert_on_the_way(env, mine, theirs):
    """Different physical orders (NHD -> HND) and layouts whose blocks are not rows (packed K|V)."""
    tensors, layout = make_kv_cache(mine, **SMALL)
    fill_random(tensors, seed=3)
    with linked(UcxPeer("other", theirs, SMALL), {"kv": (tensors, layout)}) as (agent, name, peer):
        src, dst = [5, 1, 9, 33], [0, 63, 7, 8]
        agent.write(name, src, dst).wait()
        remote = peer.tensors()
        assert_blocks_equal(layout, tensors, src, peer.layout, remote, dst)
        assert_untouched(peer.layout, remote, dst)
        poison(tensors)
        agent.read(name, dst, [2, 3, 4, 5]).wait()
        assert_blocks_equal(peer.layout, remote, dst, layout, tensors, [2, 3, 4, 5])


def test_many_concurrent_small_requests_to_two_peers(local, decodes):
    agent, tensors, layout = local
    for p in decodes:
        assert p.call("reset") == "ok"
    names = [agent.connect(p.metadata) for p in decodes]
    rng = np.random.default_rng(0)
    plan = []  # (peer index, src ids, dst ids): 32 requests per peer, disjoint destinations
    for i in range(2):
        dst = rng.permutation(256)
        for r in range(32):
            plan.append((i, rng.integers(0, 256, 2).tolist(), dst[2 * r:2 * r + 2].tolist()))
    transfers = [agent.write(names[i], s, d, notify=f"r{k}".encode()) for k, (i, s, d) in enumerate(plan)]
    for t in transfers:
        t.wait()
    for i, p in enumerate(decodes):
        notes = p.call("notifications")
        wait_until(lambda: len(notes) == 32 or notes.extend(p.call("notifications")), 5, "32 notifications")
        mine = [(s, d, f"r{k}".encode()) for k, (j, s, d) in enumerate(plan) if j == i]
        assert sorted(n[3] for n in notes) == sorted(m[2] for m in mine)
        remote = p.tensors()
        for s, d, _ in mine:
            assert_blocks_equal(layout, tensors, s, p.layout, remote, d)
        assert_untouched(p.layout, remote, [x for _, d, _ in mine for x in d])


def test_receiver_validates_before_accepting(local, decode):
    """Stale metadata: the target's own checks refuse, with the typed error of the cause."""
    agent, _, _ = local
    peer = agent.connect(decode.metadata)
    agent.write(peer, [0], [0]).wait()  # connected and working
    assert len(decode.call("notifications")) == 1
    other = dict(SEED, head_dim=8)
    assert decode.call("reregister", (KIND.value, other)) == "ok"
    with pytest.raises(LayoutMismatchError, match="head_dim"):
        agent.write(peer, [1, 2], [3, 4]).wait()
    assert decode.call("reregister", (KIND.value, dict(SEED, num_blocks=8))) == "ok"
    with pytest.raises(BlockIdError):
        agent.write(peer, [1, 2], [3, 200]).wait()
    assert decode.call("reregister", None) == "ok"
    with pytest.raises(NotRegisteredError):
        agent.read(peer, [1], [3]).wait()
    assert decode.call("notifications") == []  # nothing refused was delivered


def test_killed_target_mid_transfer_fails_fast_and_agent_recovers(env, slow, decodes):
    tensors, layout = make_kv_cache(KIND, **SLOW)
    fill_random(tensors, seed=2)
    with Agent("p", AgentConfig(transport="ucx", default_timeout_s=30)) as agent:
        agent.register("kv", tensors, layout)
        v = agent.connect(slow[0].metadata)
        t = agent.write(v, list(range(512)), list(range(512)), timeout=30)
        wait_until(lambda: t.poll() is TransferState.RUNNING, 5, "the transfer starting")
        time.sleep(0.2)
        assert t.poll() is TransferState.RUNNING, f"the transfer ended before the kill: {t.error!r}"
        start = time.monotonic()
        slow[0].kill()
        with pytest.raises(PeerDisconnectedError):
            t.wait()
        assert time.monotonic() - start < 5.0  # noticed by UCX, not at the 30 s deadline
        # the agent still serves other peers ...
        seed, seed_layout = make_kv_cache(KIND, **SEED)
        fill_random(seed, seed=4)
        agent.register("seed", seed, seed_layout)
        assert decodes[1].call("reset") == "ok"
        o = agent.connect(decodes[1].metadata)
        agent.write(o, [1, 2], [3, 4], region="seed", peer_region="kv").wait()
        assert_blocks_equal(seed_layout, seed, [1, 2], decodes[1].layout, decodes[1].tensors(), [3, 4])
        # ... and reconnects to the restarted one
        slow[0] = UcxPeer("slow", KIND, SLOW, env=SLOW_ENV)
        v = agent.connect(slow[0].metadata)
        agent.write(v, [7, 9], [0, 1], region="kv").wait()
        assert_blocks_equal(layout, tensors, [7, 9], slow[0].layout, slow[0].tensors(), [0, 1])


def test_killed_initiator_mid_transfer_delivers_nothing(env, decodes):
    """A partly received transfer never reports its blocks: the target drops it, stays usable."""
    tensors, layout = make_kv_cache(KIND, **SLOW)
    poison(tensors)
    seed_cache, seed_layout = make_kv_cache(KIND, **SEED)
    poison(seed_cache)
    with Agent("target", AgentConfig(transport="ucx", default_timeout_s=30)) as agent:
        agent.register("kv", tensors, layout)
        agent.register("seed", seed_cache, seed_layout)
        writer = UcxPeer("writer", KIND, SLOW, seed=9, env=SLOW_ENV)
        try:
            writer.call("connect", agent.metadata())
            writer.call("post", [("write", "target", list(range(512)), list(range(512)), 30, b"x")])
            wait_until(lambda: writer.call("states") == ["RUNNING"], 5, "the transfer starting")
            time.sleep(0.3)
            assert writer.call("states") == ["RUNNING"], "the transfer ended before the kill: make it longer"
            writer.kill()
            with pytest.raises(TransferTimeoutError):
                agent.wait_notification(1.5)
        finally:
            writer.close()
        other = decodes[1]  # another process is served normally
        assert other.call("reset", 9) == "ok"
        other.call("connect", agent.metadata())
        other.call("post", [("write", "target", [4, 5], [10, 11], 10, b"y", "seed")])
        assert other.call("wait")[0][0] == "ok"
        note = agent.wait_notification(5)
        assert note.payload == b"y" and note.blocks.tolist() == [10, 11] and note.region == "seed"
        exp = expected_blocks(KIND, SEED, 9, [4, 5])
        for a, b in zip(exp, block_bytes(seed_layout, seed_cache, [10, 11])):
            assert np.array_equal(a, b)


def test_frozen_peer_times_out_by_the_deadline_and_never_delivers(local, decode, busy_cores):
    agent, _, _ = local
    peer = agent.connect(decode.metadata)
    agent.write(peer, [0], [0]).wait()
    decode.call("notifications")
    freeze(decode.proc.pid)  # alive, holds its sockets, answers nothing
    start = time.monotonic()
    t = agent.write(peer, list(range(128)), list(range(128)), timeout=1.0)
    try:
        with pytest.raises(TransferTimeoutError):
            t.wait()
        # its stop waited the fence grace for the peer's STOPPED, then closed the connection
        assert time.monotonic() - start < 1.0 + GRACE + 0.5
        assert t.poll() is TransferState.TIMED_OUT
    finally:
        decode.signal(signal.SIGCONT)
    time.sleep(0.5)  # it wakes up past the deadline: it must drop the transfer, not deliver it
    assert decode.call("notifications") == []
    agent.write(peer, [3], [3], notify=b"after").wait()  # the connection is still good
    assert decode.call("notification", 5)[4] == b"after"


def test_a_frozen_peer_does_not_hold_up_transfers_to_another(local, decodes):
    """One engine serves every peer: with one peer stopped (its sockets full, a seed-sized write
    to it stuck in UCX), writes to the other still land byte-exact, each in well under the stuck
    write's deadline, which then ends it with a typed error and no delivery."""
    agent, tensors, layout = local
    for p in decodes:
        assert p.call("reset") == "ok"
    frozen, live = (agent.connect(p.metadata) for p in decodes)
    agent.write(frozen, [0], [0]).wait()
    decodes[0].call("notifications")
    decodes[0].signal(signal.SIGSTOP)
    try:
        posted = time.monotonic()
        stuck = agent.write(frozen, list(range(128)), list(range(128, 256)), timeout=3.0)
        rng = np.random.default_rng(3)
        dst = rng.permutation(256)
        for r in range(8):
            s, d = rng.integers(0, 256, 16).tolist(), dst[16 * r:16 * r + 16].tolist()
            t0 = time.monotonic()
            agent.write(live, s, d, notify=f"live{r}".encode()).wait()
            assert time.monotonic() - t0 < 1.0, f"write {r} to the live peer took {time.monotonic() - t0:.2f} s"
            assert_blocks_equal(layout, tensors, s, decodes[1].layout, decodes[1].tensors(), d)
        assert time.monotonic() - posted > 2.5 or not stuck.done()  # still stuck, not ended early
        with pytest.raises(TransferTimeoutError):
            stuck.wait()
    finally:
        decodes[0].signal(signal.SIGCONT)
    assert_untouched(decodes[1].layout, decodes[1].tensors(), dst[:128].tolist())
    time.sleep(0.5)  # the frozen one wakes past the deadline: nothing may be delivered there
    assert decodes[0].call("notifications") == []


def test_request_that_waited_past_its_deadline_is_refused_before_any_byte_lands(local, decode, monkeypatch,
                                                                                busy_cores):
    """A target stopped while a REQ sat in its socket must not count the ttl from when it woke:
    the REQ says when it was sent, the target measures how much longer than the connection's
    usual delay it took, and refuses it once that exceeds its ttl. The initiator's CANCEL is
    dropped here (as a cut link may lose it), so only that rule stands between the woken target
    and a delivery (without it: the chunks land and the peer is notified, every time)."""
    from xfer.transports.ucx.protocol import Protocol
    from xfer.transports.ucx.wire import Kind

    agent, _, _ = local
    peer = agent.connect(decode.metadata)
    agent.write(peer, [0], [0]).wait()  # the connection's usual delay
    decode.call("notifications")
    decode.call("reset")
    real = Protocol.send_ctrl
    monkeypatch.setattr(Protocol, "send_ctrl", lambda self, conn, kind, *a, **k:
                        None if kind is Kind.CANCEL else real(self, conn, kind, *a, **k))
    freeze(decode.proc.pid)  # every thread stopped: a REQ sent from now on waits in its socket
    try:
        t = agent.write(peer, list(range(128)), list(range(128)), timeout=1.0)
        with pytest.raises(TransferTimeoutError):
            t.wait()
    finally:
        decode.signal(signal.SIGCONT)
    time.sleep(0.5)
    assert decode.call("notifications") == []
    assert_untouched(decode.layout, decode.tensors(), [])  # refused before any byte landed
    monkeypatch.setattr(Protocol, "send_ctrl", real)
    agent.write(peer, [3], [3], notify=b"after").wait()
    assert decode.call("notification", 5)[4] == b"after"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 1e12])
def test_a_request_with_a_non_finite_or_out_of_range_ttl_is_refused(local, decode, monkeypatch, bad):
    """A REQ whose ttl (or send time) is NaN or inf never expired at the target (NaN passed
    ``ttl <= 0``): every later READ from that agent timed out behind it. Now the target refuses
    it with a typed error before any byte lands, and the next transfer goes through."""
    from xfer.errors import InvalidArgumentError
    from xfer.transports.ucx.protocol import Protocol
    from xfer.transports.ucx.wire import Kind

    agent, _, _ = local
    peer = agent.connect(decode.metadata)
    real = Protocol._encode

    def forged(self, conn, kind, header, ids, payload):
        if kind is not Kind.REQ:
            return real(self, conn, kind, header, ids, payload)
        from xfer.transports.ucx import wire  # encoded with the hostile value, as a peer (with the key) could send it
        now = time.monotonic()
        header["ttl"], header["sent"] = max(header.pop("deadline") - now, 0.0), now
        header["ttl" if bad != -1.0 else "sent"] = bad if bad != -1.0 else float("nan")
        return wire.encode(Kind.REQ, header, ids, payload, conn.session)
    monkeypatch.setattr(Protocol, "_encode", forged)
    for op in ("read", "write"):
        t = getattr(agent, op)(peer, [1, 2], [1, 2], timeout=5)
        with pytest.raises(InvalidArgumentError, match="ttl|send time"):
            t.wait()
    monkeypatch.setattr(Protocol, "_encode", real)
    assert_untouched(decode.layout, decode.tensors(), [])  # refused before any byte landed
    agent.write(peer, [3], [3], notify=b"after").wait()  # the agent and the peer go on
    assert decode.call("notification", 5)[4] == b"after"
    assert [n[3] for n in decode.call("notifications")] == []


def test_request_delay_is_judged_against_the_connections_least_delay():
    """Conn.req_delay: the first REQ sets the floor; a later one's delay beyond it is returned; a
    faster one lowers it; the floor creeps up by CLOCK_DRIFT a second, so slow drift is no delay."""
    from xfer.transports.ucx.conn import Conn
    from xfer.transports.ucx.wire import CLOCK_DRIFT

    conn = Conn(None, 1, outgoing=False)
    offset = 5000.0  # the peer's clock is 5000 s behind: no common origin needed
    assert conn.req_delay(100.0 - offset, 100.001) == 0.0  # 1 ms: the floor
    assert conn.req_delay(101.0 - offset, 102.0) == pytest.approx(1.0 - 0.001 - CLOCK_DRIFT * 1.999, abs=1e-9)
    assert conn.req_delay(103.0 - offset, 103.0005) == 0.0  # faster than the floor: the new floor
    assert conn.req_delay(104.0 - offset, 104.0006) == pytest.approx(0.0001 - CLOCK_DRIFT, abs=1e-9)
    # an hour of 50 ppm drift (the peer's clock slower) reads as no delay
    hour = 3600.0
    assert conn.req_delay(104.0 + hour * (1 - 50e-6) - offset, 104.0005 + hour) == 0.0


def test_control_messages_round_trip_and_malformed_ones_are_refused():
    """Control headers are binary for the fields a kind always carries, JSON for the rest (a
    REQ's layout); every value comes back with its type; the MAC and sequence number are checked
    before anything past the prefix is decoded (a tampered, replayed or other-connection message
    is an AuthenticationError); a short, truncated or unknown message is an InvalidArgumentError,
    never a crash."""
    from xfer.auth import Authenticator, Session
    from xfer.errors import AuthenticationError, InvalidArgumentError
    from xfer.transports.ucx import wire as wire

    key = Authenticator(b"k" * 16).session_key(b"ucx", "a", "b", b"1" * 16, b"2" * 16)
    tx, rx = Session(key, outgoing=True), Session(key, outgoing=False)
    req = {"k": 7, "op": "write", "region": "kv é", "n": 3, "bpc": 2, "lpc": 4, "xid": 9, "ttl": 1.25,
           "sent": 123.5, "tid": "1-ab", "from": "src", "order": "NHC", "lid": 1, "layout": {"x": [1]}}
    msg = wire.encode(wire.Kind.REQ, req, np.arange(3), b"note", tx)
    kind, header, binary = wire.open_message(msg, rx)
    assert kind is wire.Kind.REQ and header == req and [type(header[k]) for k in req] == [type(v) for v in req.values()]
    assert wire.split_ids(binary, 3)[0].tolist() == [0, 1, 2] and wire.split_ids(binary, 3)[1] == b"note"
    cancel = {"k": 2, "init": True, "why": "TransferTimeoutError"}
    assert wire.open_message(wire.encode(wire.Kind.CANCEL, cancel, session=tx), rx) == (wire.Kind.CANCEL, cancel, b"")
    ack = wire.encode(wire.Kind.ACK, {"k": 2}, session=tx)
    assert wire.open_message(ack, rx) == (wire.Kind.ACK, {"k": 2}, b"")
    assert len(ack) == wire.PREFIX_BYTES + 8  # no JSON at all
    with pytest.raises(AuthenticationError, match="sequence number"):  # replayed on its own connection
        wire.open_message(ack, rx)
    other = Session(Authenticator(b"k" * 16).session_key(b"ucx", "a", "b", b"3" * 16, b"2" * 16), outgoing=False)
    tampered = wire.encode(wire.Kind.ACK, {"k": 3}, session=tx)
    tampered[-1] ^= 1
    for m, session in ((wire.encode(wire.Kind.ACK, {"k": 4}, session=tx), other), (tampered, rx)):
        with pytest.raises(AuthenticationError, match="MAC does not verify"):  # another connection's key; tampered
            wire.open_message(m, session)

    def sealed(kind: int, h: bytes, b: bytes = b"") -> np.ndarray:  # well MAC'd, whatever it says
        seq, mac = tx.seal(kind, h, b)
        return np.frombuffer(wire._MSG.pack(kind, len(h), len(b), seq, mac) + h + b, np.uint8)
    for m in (msg[:4], msg[:30], sealed(99, b"x" * 8), sealed(int(wire.Kind.ACK), b"\0" * 8 + b"[" * 5000),
              sealed(int(wire.Kind.REFUSE), b"\0" * 8 + b"\xff\xff")):
        with pytest.raises(InvalidArgumentError):
            wire.open_message(m, rx)


def test_cancel_mid_transfer(env, slow):
    tensors, layout = make_kv_cache(KIND, **SLOW)
    fill_random(tensors, seed=1)
    peer = slow[0]
    assert peer.call("reset") == "ok"
    with Agent("p", AgentConfig(transport="ucx", default_timeout_s=30)) as agent:
        agent.register("kv", tensors, layout)
        name = agent.connect(peer.metadata)
        t = agent.write(name, list(range(512)), list(range(512)))
        wait_until(lambda: t.poll() is TransferState.RUNNING, 5, "the transfer starting")
        time.sleep(0.1)
        assert t.cancel(), f"the transfer ended before the cancel: {t.error!r}"
        with pytest.raises(TransferCancelledError):
            t.wait()
        time.sleep(0.3)
        assert peer.call("notifications") == []
        agent.write(name, [1], [1], notify=b"next").wait()
        assert peer.call("notification", 5)[4] == b"next"


def test_check_route_and_probe(local, monkeypatch):
    import builtins

    from xfer.metadata import decode
    from xfer.transports.base import PeerHandle
    from xfer.transports.ucx import UcxTransport

    agent, _, _ = local
    md = decode(agent.metadata())
    transport = agent.transports[next(k for k in agent.transports if k.value == "ucx")]
    info = transport.info()
    assert info["port"] > 0 and info["address"] == "127.0.0.1"
    region = agent._regions["kv"]
    no_ucx = PeerHandle(metadata=md.__class__(**{**md.__dict__, "transports": {}}), request=None)
    assert "offers no ucx" in transport.check_route(region, no_ucx, md.regions["kv"], "write")
    other_host = PeerHandle(metadata=md.__class__(**{**md.__dict__, "host_id": "elsewhere"}), request=None)
    assert transport.check_route(region, other_host, md.regions["kv"], "write") is None

    real_import = builtins.__import__

    def no_ucxx(name, *a, **kw):
        if name.startswith("ucxx"):
            raise ImportError("No module named 'ucxx'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ucxx)
    assert "needs ucxx" in UcxTransport.probe()


def test_chunk_plan_bounds_the_staging_footprint():
    from xfer.transports.chunking import chunk_list, plan_chunks

    _, layout = make_kv_cache(KIND, device="meta", **SEED)
    for n, chunk in ((128, 64 << 10), (1, 4096), (256, 1 << 20)):
        bpc, lpc = plan_chunks(layout, n, chunk, 4)
        chunks = chunk_list(layout, n, bpc, lpc)
        assert all(c.nbytes <= chunk for c in chunks)
        assert sum(c.nbytes for c in chunks) == n * layout.bytes_per_block
        covered = {(b, layer) for c in chunks for b in range(c.b0, c.b1) for layer in range(c.l0, c.l1)}
        assert len(covered) == n * layout.num_layers


def test_chunk_layouts_are_memoized_and_kernel_copies_round_trip():
    """The copier's per-chunk layouts are built once per (layout, layers, blocks); the kernel path
    (not whole rows: packed K|V; an HND sender into NHD rows converts) still moves exact bytes."""
    import torch

    from xfer import KVLayout
    from xfer.transports.ucx.staging import BlockCopier, staging_layout, sub_layout

    src_t, layout = make_kv_cache(LayoutKind.PACKED_KV, **SMALL)
    fill_random(src_t, seed=3)
    sub = sub_layout(layout, 1, 3)
    assert sub is sub_layout(layout, 1, 3) is sub_layout(KVLayout.from_dict(layout.to_dict()), 1, 3)
    assert sub.num_layers == 2 and sub_layout(layout, 0, layout.num_layers) == layout
    assert staging_layout(layout, 1, 3, 5) is staging_layout(layout, 1, 3, 5) == sub.staging(5)
    ids, to = np.array([5, 1, 9]), np.array([0, 7, 3])
    for kind in (LayoutKind.PACKED_KV, LayoutKind.VLLM_FLASH_ATTN_NHD):
        dst_t, dst_layout = make_kv_cache(kind, **SMALL)
        poison(dst_t)
        src, dst = BlockCopier(layout, src_t), BlockCopier(dst_layout, dst_t)
        assert src._kw == {} and not src.rows
        for l0, l1 in ((0, 1), (1, 3), (3, 4)):
            buf = torch.empty(ids.size * (l1 - l0) * layout.num_kv * layout.block_nbytes, dtype=torch.uint8)
            src.gather(ids, l0, l1, buf)
            dst.scatter(buf, to, l0, l1, layout)  # the staging is in the sender's (packed: HNC) order
        assert_blocks_equal(layout, src_t, ids, dst_layout, dst_t, to)
        assert_untouched(dst_layout, dst_t, to)
        # a slot is bound once: the same buffer with other ids reuses its checked copy
        bound = len(src._bounds)
        slot = torch.empty(2 * layout.num_layers * layout.num_kv * layout.block_nbytes, dtype=torch.uint8)
        for pair, dst_ids in (([2, 4], [6, 8]), ([11, 0], [10, 2])):
            src.gather(np.array(pair), 0, layout.num_layers, slot)
            dst.scatter(slot, np.array(dst_ids), 0, layout.num_layers, layout)
        assert len(src._bounds) == bound + 1
        written = [*to, 6, 8, 10, 2]
        assert_blocks_equal(layout, src_t, [*ids, 2, 4, 11, 0], dst_layout, dst_t, written)
        assert_untouched(dst_layout, dst_t, written)


@pytest.mark.parametrize("kind", [LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.SGLANG, LayoutKind.VLLM_CROSS_LAYER])
def test_iov_addresses_are_the_gather_in_order(kind):
    """A scatter-gather send's (address, length) list reads exactly the bytes a gather would
    stage, in the same order: random blocks of every layer range, read back through the addresses."""
    import ctypes

    import torch

    from xfer.transports.ucx.staging import BlockCopier

    tensors, layout = make_kv_cache(kind, **SMALL)
    fill_random(tensors, seed=9)
    copier = BlockCopier(layout, tensors)
    assert copier.rows
    ids = np.array([17, 3, 60, 4, 0])
    for l0, l1 in ((0, 4), (1, 3), (3, 4)):
        staged = torch.empty(ids.size * (l1 - l0) * layout.num_kv * layout.block_nbytes, dtype=torch.uint8)
        copier.gather(ids, l0, l1, staged)
        iov = copier.iov(ids, l0, l1)
        assert iov.dtype == np.uint64 and iov.shape == (ids.size * (l1 - l0) * layout.num_kv, 2)
        assert (iov[:, 1] == layout.block_nbytes).all()
        read = b"".join(ctypes.string_at(int(a), int(n)) for a, n in iov)
        assert read == staged.numpy().tobytes()


def test_iov_requests_complete_fail_and_free_once(monkeypatch):
    """An IOV send's request: done at once (NULL), failed at once (an error pointer), or polled
    until UCX completes it, then freed exactly once; its address list is dropped when done."""
    from xfer.transports.ucx import io_raw as ucx_iov

    class Lib:
        def __init__(self):
            self.status, self.freed = {}, []

        def check_status(self, ptr):
            return self.status[ptr]

        def free(self, ptr):
            self.freed.append(ptr)

        def status_string(self, status):
            return f"status {status}"

    lib, iov = Lib(), np.zeros((3, 2), dtype=np.uint64)
    done = ucx_iov.IovRequest(lib, None, iov)
    assert done.completed and done._iov is None
    done.check_error()
    failed = ucx_iov.IovRequest(lib, (1 << 64) - 16, iov)  # UCS_PTR_STATUS(UCS_ERR_CANCELED)
    assert failed.completed
    with pytest.raises(ucx_iov.IovError, match="status -16"):
        failed.check_error()
    lib.status[0x1000] = 1  # UCS_INPROGRESS
    live = ucx_iov.IovRequest(lib, 0x1000, iov)
    assert not live.completed and live._iov is iov and lib.freed == []
    lib.status[0x1000] = -25
    assert live.completed and live.completed and lib.freed == [0x1000] and live._iov is None
    with pytest.raises(ucx_iov.IovError):
        live.check_error()
    with pytest.raises(ValueError, match="uint64"):
        ucx_iov.IovSender.send(object(), 0, np.zeros((2, 2), dtype=np.int64), 1)
    from xfer.settings import Settings
    assert Settings.from_env({"XFER_UCX_IOV": "0"}).ucx.iov is False  # the engine then takes ucxx's API only


def test_a_real_iov_send_that_ucx_fails_reports_the_error():
    """Against the real libucp: an IOV send nobody receives, whose endpoint is then closed, ends
    failed (UCX's status is one signed byte; read as an int, the failure looked like success)."""
    import ucxx._lib.libucxx as u

    from xfer.transports.ucx import io_raw as ucx_iov

    sender, why = ucx_iov.iov_sender()
    if sender is None:
        pytest.skip(why)
    ctx = u.UCXContext({}, feature_flags=(u.Feature.TAG, u.Feature.STREAM))
    wa, wb = u.UCXWorker(ctx), u.UCXWorker(ctx)
    conns = []
    listener = u.UCXListener.create(wa, 0, conns.append)
    ep = u.UCXEndpoint.create(wb, "127.0.0.1", listener.port, True)
    wait_until(lambda: (wa.progress(), wb.progress(), bool(conns))[2], 10, "the connection")
    peer_ep = listener.create_endpoint_from_conn_request(conns.pop(), True)
    blocks = [np.full(4 << 20, i, dtype=np.uint8) for i in range(2)]  # rendezvous-sized: waits for a receive
    iov = np.array([[b.ctypes.data, b.nbytes] for b in blocks], dtype=np.uint64)
    req = sender.send(ep.handle, iov, 9)
    for _ in range(50):
        wa.progress_once(), wb.progress_once()
    assert not req.completed  # nobody posted a receive
    ep.close_blocking(10_000, 100)
    wait_until(lambda: (wb.progress(), req.completed)[1], 10, "the send's end")
    assert req.status < 0
    with pytest.raises(ucx_iov.IovError, match="UCS status -"):
        req.check_error()
    del peer_ep


@pytest.mark.parametrize("iov", ["on", "off"])
def test_chunks_sent_from_the_blocks_are_byte_exact_both_ways(monkeypatch, env, iov):
    """Host chunks sent straight from the blocks (UCX scatter-gather; forced here for 128-byte
    blocks, 32 chunks of 64 KiB a transfer) or gathered first (``XFER_UCX_IOV=0``): a write (this
    side sends) and a read (the peer sends) of the seed workload land byte-exact, untouched blocks
    still poisoned, and the transfer's path says which way it went."""
    both = {"XFER_UCX_IOV_MIN_BYTES": "0", "XFER_UCX_CHUNK_BYTES": "64K", "XFER_UCX_IOV": "1" if iov == "on" else "0"}
    for k, v in both.items():
        monkeypatch.setenv(k, v)
    tensors, layout = make_kv_cache(KIND, **SEED)
    fill_random(tensors, seed=13)
    with linked(UcxPeer("iov", KIND, SEED, seed=14, env=both), {"kv": (tensors, layout)}, me="me",
                peer_region="dst") as (agent, name, peer):
        src, dst = list(range(0, 256, 2)), list(range(128, 256))[::-1]
        t = agent.write(name, src, dst, peer_region="dst", notify=b"iov")
        t.wait()
        assert ("sent in place" in t.path) == (iov == "on"), t.path
        remote = peer.tensors("dst")
        assert_blocks_equal(layout, tensors, src, peer.layout, remote, dst)
        assert_untouched(peer.layout, remote, dst)
        poison(tensors)
        pulled, into = list(range(1, 256, 2)), list(range(128))
        r = agent.read(name, pulled, into, peer_region="kv")
        r.wait()
        assert ("received in place" in r.path) == (iov == "on"), r.path
        exp = expected_blocks(KIND, SEED, 14, pulled)
        for a, b in zip(exp, block_bytes(layout, tensors, into)):
            assert np.array_equal(a, b), "blocks read from the peer differ from its source"
        assert_untouched(layout, tensors, into)


@pytest.mark.parametrize("ended", ["by UCX", "never"])
def test_a_stopped_flow_is_held_while_a_receive_lands_in_place(monkeypatch, env, ended):
    """A READ whose chunks land straight in its blocks, cancelled while a receive of it is in
    flight, reads STOPPING until no receive may still write the blocks: until UCX ends that
    receive (the peer confirmed its side at once), or, if its end is not heard of within the fence
    grace, after the connection was closed to stop it; a receive never heard of leaves it STOPPING
    (no false fence: wait() says so). The agent then reconnects."""
    both = {"XFER_UCX_IOV_MIN_BYTES": "0", "XFER_UCX_CHUNK_BYTES": "64K"}
    from xfer.transports.ucx.flow import Flow

    for k, v in both.items():
        monkeypatch.setenv(k, v)
    heard, real = [], Flow.landed_in_place
    monkeypatch.setattr(Flow, "landed_in_place", lambda self, slot, err: heard.append((self, slot, err)))
    tensors, layout = make_kv_cache(KIND, **SEED)
    poison(tensors)
    with linked(UcxPeer("held", KIND, SEED, seed=15, env=both), {"kv": (tensors, layout)}, me="me") as (agent, name, _):
        engine = agent.transports[next(k for k in agent.transports if k.value == "ucx")]._engine
        grace = engine.flows.grace
        if ended == "by UCX":  # no closing while the test looks
            engine.flows.grace = 30.0
        t = agent.read(name, list(range(1, 256, 2)), list(range(128)), timeout=10)
        wait_until(lambda: heard, 10, "a chunk received in place")  # UCX ended it; the flow has not heard
        assert "received in place" in t.path
        flow = heard[0][0]
        conn = flow.conn
        assert t.cancel()
        wait_until(lambda: flow.peer_fenced, 5, "the peer's STOPPED")
        time.sleep(0.3)
        assert t.poll() is TransferState.STOPPING and not flow.settled()
        if ended == "by UCX":
            assert not conn.dead
            engine.call_soon(lambda: [real(*h) for h in heard])
            with pytest.raises(TransferCancelledError):
                t.wait()
            assert not conn.dead
        else:  # not heard of: the connection is closed after the grace; still not fenced as far as it knows
            wait_until(lambda: conn.dead, grace + 2, "the connection closed")
            with pytest.raises(TransferTimeoutError, match="still STOPPING"):
                t.wait(timeout=0.5)
            engine.call_soon(lambda: [real(*h) for h in heard])
            with pytest.raises(TransferCancelledError):
                t.wait()
        monkeypatch.setattr(Flow, "landed_in_place", real)
        engine.flows.grace = grace
        agent.write(name, [3], [3]).wait()  # the agent is still good (reconnected where it closed)


def test_request_layouts_are_described_once_per_connection(env):
    """A REQ describes the initiator's layout the first time a connection carries it, then names it
    by id: two local regions of different layouts (NHD, HND) writing alternately to one peer region
    land byte-exact; a REQ naming an id no earlier REQ described is refused (typed), as is a bad id."""
    from xfer.errors import InvalidArgumentError
    from xfer.transports.ucx.conn import Conn
    from xfer.transports.ucx.protocol import Protocol

    conn, proto = Conn(None, 1, outgoing=False), Protocol.__new__(Protocol)
    nhd = make_kv_cache(KIND, device="meta", **SMALL)[1]
    assert proto._their_layout(conn, {"lid": 1, "layout": nhd.to_dict()}) == nhd
    assert proto._their_layout(conn, {"lid": 1}) == nhd
    with pytest.raises(LayoutMismatchError, match="layout id 2"):
        proto._their_layout(conn, {"lid": 2})
    with pytest.raises(InvalidArgumentError, match="layout id 'x'"):
        proto._their_layout(conn, {"lid": "x", "layout": nhd.to_dict()})

    caches = {k: make_kv_cache(k, **SMALL) for k in (KIND, LayoutKind.VLLM_FLASH_ATTN_HND)}
    for seed, (tensors, _) in enumerate(caches.values()):
        fill_random(tensors, seed=30 + seed)
    peer = UcxPeer("two-layouts", KIND, SMALL)
    try:
        with Agent("me", AgentConfig(transport="ucx", default_timeout_s=20)) as agent:
            for kind, (tensors, layout) in caches.items():
                agent.register(kind.value, tensors, layout)
            name = agent.connect(peer.metadata)
            plan = [(KIND, [1, 2], [0, 1]), (LayoutKind.VLLM_FLASH_ATTN_HND, [3, 4], [2, 3]),
                    (KIND, [5], [4]), (LayoutKind.VLLM_FLASH_ATTN_HND, [6, 7, 8], [5, 6, 7])]
            for kind, src, dst in plan:
                agent.write(name, src, dst, region=kind.value, peer_region="kv").wait()
            remote = peer.tensors()
            for kind, src, dst in plan:
                tensors, layout = caches[kind]
                assert_blocks_equal(layout, tensors, src, peer.layout, remote, dst)
            assert_untouched(peer.layout, remote, [x for *_, d in plan for x in d])
        # a REQ refused for another reason still describes its layout to the ones behind it
        tensors, layout = make_kv_cache(LayoutKind.VLLM_FLASHINFER, **SMALL)
        fill_random(tensors, seed=33)
        with Agent("me2", AgentConfig(transport="ucx", default_timeout_s=20)) as agent:
            agent.register("kv", tensors, layout)
            name = agent.connect(peer.metadata)
            assert peer.call("reregister", None) == "ok"  # the peer's kv is gone: the first REQ is refused
            with pytest.raises(NotRegisteredError, match="has no region 'kv'"):
                agent.write(name, [1], [0]).wait()
            assert peer.call("reset") == "ok"  # back, poisoned, same layout
            agent.write(name, [9, 4], [2, 5]).wait()  # its REQ names the layout by id only
            remote = peer.tensors()
            assert_blocks_equal(layout, tensors, [9, 4], peer.layout, remote, [2, 5])
            assert_untouched(peer.layout, remote, [2, 5])
    finally:
        peer.close()


# thousands of block ids: a REQ (8 bytes an id) above UCX's eager limit goes by rendezvous
MANY = dict(num_layers=2, num_blocks=4096, block_size=1, num_heads=1, head_dim=8)


def test_a_big_request_then_small_ones_all_land_in_order(env):
    """Regression: the REQ of a 3,000-block write goes by rendezvous and landed after the small
    REQs posted right behind it; handled first, a small one advanced the connection's transfer id
    and the big one was refused as stale ("transfer id N is not a new one"), every time. Control
    messages are now handled in arrival order: all land byte-exact and notify."""
    tensors, layout = make_kv_cache(KIND, **MANY)
    fill_random(tensors, seed=17)
    with linked(UcxPeer("many", KIND, MANY), {"kv": (tensors, layout)}, me="me") as (agent, name, peer):
        rng = np.random.default_rng(3)
        perm = rng.permutation(4096)
        big_src, big_dst = rng.integers(0, 4096, 3000).tolist(), perm[:3000].tolist()
        small = [([int(s)], [int(d)]) for s, d in zip(rng.integers(0, 4096, 5), perm[3000:3005])]
        ts = [agent.write(name, big_src, big_dst, notify=b"big")]
        ts += [agent.write(name, s, d, notify=f"s{k}".encode()) for k, (s, d) in enumerate(small)]
        for t in ts:
            t.wait()
        remote = peer.tensors()
        src = big_src + [x for s, _ in small for x in s]
        dst = big_dst + [x for _, d in small for x in d]
        assert_blocks_equal(layout, tensors, src, peer.layout, remote, dst)
        assert_untouched(peer.layout, remote, dst)
        notes = peer.call("notifications")
        assert sorted(n[3] for n in notes) == sorted([b"big"] + [f"s{k}".encode() for k in range(5)])


# small rendezvous chunks, a two-slot ring: every chunk of 8 KiB goes by rendezvous (UCX_RNDV_THRESH=4k)
RING = dict(num_layers=4, num_blocks=256, block_size=8, num_heads=1, head_dim=32)  # 4 KiB a block
RING_ENV = {"UCX_RNDV_THRESH": "4k", "XFER_UCX_CHUNK_BYTES": "8K", "XFER_UCX_SLOTS": "2", "XFER_UCX_DEPTH": "2"}


@pytest.mark.parametrize("inline", ["1M", "0"], ids=["copies-inline", "copy-thread"])
def test_concurrent_rendezvous_both_ways_with_a_small_ring(monkeypatch, env, inline):
    """Regression: many concurrent rendezvous transfers in both directions between two agents with
    two staging slots each. Slots were once taken for receives whose chunks had not arrived, while
    the sends that would fill them waited for slots held by sends the other side could not take:
    every transfer ended TIMED_OUT at its deadline. Every transfer must complete, byte-exact; with
    the chunks copied on the engine thread and on the copy thread."""
    ring_env = dict(RING_ENV, XFER_UCX_INLINE_BYTES=inline)
    for k, v in ring_env.items():
        monkeypatch.setenv(k, v)
    src, src_layout = make_kv_cache(KIND, **RING)
    fill_random(src, seed=21)
    dst, dst_layout = make_kv_cache(KIND, **RING)
    poison(dst)
    ring = UcxPeer("ring", KIND, RING, seed=22, env=ring_env)  # its kv: the source of its writes
    with linked(ring, {"src": (src, src_layout), "dst": (dst, dst_layout)}, me="me",
                peer_region="dst") as (agent, name, peer):
        assert peer.call("connect", agent.metadata()) == "me"
        rng = np.random.default_rng(5)
        mine, theirs = rng.permutation(256), rng.permutation(256)
        out, back, pulls = [], [], []  # (src ids, dst ids): 1-8 blocks each, disjoint destinations
        for plan, perm, count, at in ((out, mine, 24, 0), (back, theirs, 24, 0), (pulls, theirs, 8, 120)):
            for _ in range(count):
                n = int(rng.integers(1, 9))
                plan.append((rng.integers(0, 256, n).tolist(), perm[at:at + n].tolist()))
                at += n
        assert sum(len(d) for _, d in back) <= 120
        # 24 writes each way and 8 reads (the peer sends those too), all in flight together
        peer.call("post", [("write", "me", s, d, 15, f"b{k}".encode(), "dst", "kv")
                           for k, (s, d) in enumerate(back)])
        mine_t = [agent.write(name, s, d, region="src", peer_region="dst", timeout=15, notify=f"o{k}".encode())
                  for k, (s, d) in enumerate(out)]
        mine_t += [agent.read(name, s, d, region="dst", peer_region="kv", timeout=15) for s, d in pulls]
        errs = []
        for t in mine_t:
            try:
                t.wait()
            except Exception as exc:
                errs.append(repr(exc))
        theirs_res = peer.call("wait", timeout=30)
        assert not errs and all(r[0] == "ok" for r in theirs_res), (errs[:3], [r for r in theirs_res if r[0] != "ok"][:3])
        remote = peer.tensors("dst")
        for s, d in out:
            assert_blocks_equal(src_layout, src, s, peer.layout, remote, d)
        assert_untouched(peer.layout, remote, [x for _, d in out for x in d])
        landed = back + pulls  # both from the peer's kv (seed 22) into my dst
        exp = expected_blocks(KIND, RING, 22, [x for s, _ in landed for x in s])
        got = block_bytes(dst_layout, dst, [x for _, d in landed for x in d])
        for a, b in zip(exp, got):
            assert np.array_equal(a, b), "blocks from the peer differ from its source"
        assert_untouched(dst_layout, dst, [x for _, d in landed for x in d])
        notes = {n.payload for n in agent.notifications()}
        assert notes == {f"b{k}".encode() for k in range(len(back))}


def test_ucx_bench_dry_run_writes_its_record(tmp_path):
    """bench/ucx_bench.py end to end on its smallest case (verified bytes, then one timed round):
    the JSON names versions, the UCX environment and each case's path; an unknown case is named."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", UCX_NET_DEVICES="lo")
    out = tmp_path / "ucx.json"
    run = subprocess.run([sys.executable, str(root / "bench" / "ucx_bench.py"), "--iters", "1", "--cases",
                          "32x64x512B", "--json", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["link"] == "loopback" and doc["ucx"] and doc["env"]["UCX_NET_DEVICES"] == "lo"
    (res,) = doc["results"]
    assert res["case"] == "32x64x512B" and res["path"].startswith("ucx (host staging")  # 512 B blocks: gathered
    assert res["xfer_vs_tcp"] > 0 and f"path: {res['path']} (32x64x512B)" in run.stdout
    assert res["burst"] == 8 and res["burst_gb_per_s"] > 0 and res["burst_vs_ucxx"] > 0
    bad = subprocess.run([sys.executable, str(root / "bench" / "ucx_bench.py"), "--cases", "2"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "unknown case(s) ['2']" in bad.stderr


def test_ucx_floor_measures_ucx_and_the_gather_without_xfer(tmp_path):
    """bench/ucx_floor.py on the 512 B case: ucx_perftest's one-way times (contiguous, the blocks as
    a list on either side) and the gather warm and cold land in its JSON, every figure positive."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "floor.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", UCX_NET_DEVICES="lo")
    run = subprocess.run([sys.executable, str(root / "bench" / "ucx_floor.py"), "--cases", "32x64x512B", "--iters",
                          "20", "--json", str(out)], capture_output=True, text=True, env=env, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    (res,) = json.loads(out.read_text())["results"]
    assert res["case"] == "32x64x512B" and res["block_bytes"] == 512 and res["entries"] * 512 == res["bytes"]
    assert set(res["one_way_ms"]) == {"contig", "iov-contig", "contig-iov"} and min(res["one_way_ms"].values()) > 0
    assert min(res["copy_ms"].values()) > 0 and res["cold_gather_vs_contig_send"] > 0
    assert "32x64x512B" in run.stdout


def test_no_iov_send_on_an_endpoint_ucx_reported_closed():
    """UCX calls the close callback inside progress, where the endpoint's handle may already be
    freed; the connection only fails on the next loop turn. The raw IOV send must not use the
    handle in between: the chunk ends with PeerDisconnectedError and nothing is sent."""
    from types import SimpleNamespace

    from xfer.transports.ucx.conn import Conn
    from xfer.transports.ucx.datapath import DataPath
    from xfer.transports.ucx.handshake import Gate

    deferred = []
    engine = SimpleNamespace(call_soon=lambda fn, *a: deferred.append((fn, a)), conns=SimpleNamespace(fail=None))
    gate = Gate.__new__(Gate)
    gate.e = engine
    conn = Conn(None, 3, outgoing=True, name="gone")
    gate._ep_closed(conn)
    assert conn.closed and not conn.dead and len(deferred) == 1  # failing the conn waits for the loop
    ended = []
    flow = SimpleNamespace(conn=conn, tid="t1", key=1, sends=0, sent=lambda slot, err: ended.append((slot, err)))
    data = DataPath(engine, SimpleNamespace(send_iov=lambda *a: pytest.fail("sent on a closed endpoint")))
    data.send_iov(flow, SimpleNamespace(seq=0), "slot", np.zeros((1, 2), dtype=np.uint64))
    assert ended and ended[0][0] == "slot" and isinstance(ended[0][1], PeerDisconnectedError)


def test_sends_go_raw_only_on_a_live_endpoint():
    """Sends (control messages, host slots, device slots) go by the raw ``ucp_tag_send_nbx`` with
    the buffer's own address and length (a numpy array's, or a tensor's data pointer and bytes),
    the buffer kept with the request; on an endpoint UCX reported closed (its handle may be freed)
    the send goes through ucxx, which fails a dead one cleanly."""
    from types import SimpleNamespace

    import torch

    from xfer.transports.ucx.conn import Conn
    from xfer.transports.ucx.io_raw import RawIO
    from xfer.transports.ucx.io_ucxx import UcxxIO

    raw, via_ucxx = [], []
    ucxx = UcxxIO.__new__(UcxxIO)
    ucxx._array, ucxx._tag = (lambda b: ("array", b)), (lambda t: ("tag", t))
    io = RawIO(SimpleNamespace(send_contig=lambda *a: raw.append(a) or "raw-req"), SimpleNamespace(handle=1), ucxx,
               receives_in_place=True)
    conn = Conn(None, 3, outgoing=True, name="peer")
    conn.ep = SimpleNamespace(handle=0xABC, tag_send=lambda arr, tag: via_ucxx.append((arr, tag)) or "ucxx-req")
    buf = np.arange(17, dtype=np.uint8)
    assert io.send(conn, buf, 5) == "raw-req"
    assert raw == [(0xABC, buf.ctypes.data, 17, 5, buf)] and not via_ucxx
    t = torch.zeros(8, dtype=torch.int16)[2:]  # a tensor view: its own address, its bytes
    io.send(conn, t, 6)
    assert raw[1] == (0xABC, t.data_ptr(), 12, 6, t) and not via_ucxx
    conn.closed = True
    assert io.send(conn, buf, 7) == "ucxx-req"
    assert len(raw) == 2 and via_ucxx == [(("array", buf), ("tag", 7))]
    assert (io.name, io.sends_in_place, io.receives_in_place) == ("raw libucp", True, True)
    assert (UcxxIO.name, UcxxIO.sends_in_place, UcxxIO.receives_in_place) == ("ucxx", False, False)


def test_in_place_conditions_and_the_chunk_plan_they_pick():
    """A side moves its chunks in place only for host rows of blocks >= iov_min_bytes (a send) or
    iov_recv_min_bytes (a receive) with the raw binding (a receive also needs the sender's block
    order); a transfer whose initiator moves
    in place is cut into min_chunks_in_place chunks, a staged one into min_chunks."""
    from types import SimpleNamespace

    from xfer.transports.ucx.flow import in_place
    from xfer.transports.chunking import plan_chunks

    dims = {**SEED, "num_heads": 2}  # (with one head the two inner orders are the same bytes)
    layout = make_kv_cache(KIND, **dims)[1]
    other_order = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_HND, **dims)[1]
    assert layout.inner_order != other_order.inner_order
    copier = SimpleNamespace(rows=True, layout=layout)
    host, pinned = SimpleNamespace(kind="host"), SimpleNamespace(kind="pinned")

    def engine(sends=True, receives=True, **st):
        return SimpleNamespace(io=SimpleNamespace(sends_in_place=sends, receives_in_place=receives),
                               settings=SimpleNamespace(**{"iov_min_bytes": 0, "iov_recv_min_bytes": 0, **st}))
    eng = engine()
    assert in_place(eng, True, copier, host, layout) and in_place(eng, False, copier, host, layout)
    assert not in_place(eng, True, copier, pinned, layout)  # CUDA blocks staged through pinned memory
    assert not in_place(eng, False, copier, host, other_order)  # the sender's order differs
    assert in_place(eng, True, copier, host, other_order)  # a send is in the sender's own order
    assert not in_place(engine(False, False), True, copier, host, layout)  # ucxx's API: no in-place I/O
    assert not in_place(engine(True, False), False, copier, host, layout)  # XFER_UCX_IOV_RECV=0
    over = layout.block_nbytes + 1
    big = engine(iov_min_bytes=over, iov_recv_min_bytes=over)
    assert not in_place(big, True, copier, host, layout) and not in_place(big, False, copier, host, layout)
    # the two thresholds apart: small blocks received in place but sent from a slot, and the reverse
    rx_only = engine(iov_min_bytes=over)
    assert not in_place(rx_only, True, copier, host, layout) and in_place(rx_only, False, copier, host, layout)
    tx_only = engine(iov_recv_min_bytes=over)
    assert in_place(tx_only, True, copier, host, layout) and not in_place(tx_only, False, copier, host, layout)
    assert not in_place(eng, True, SimpleNamespace(rows=False, layout=layout), host, layout)
    n, cap = 256, 1 << 40  # slots big enough for anything: the minimum chunk count decides
    per = layout.bytes_per_block
    staged = plan_chunks(layout, n, cap, UcxSettings().min_chunks, 0)[0]
    placed = plan_chunks(layout, n, cap, UcxSettings().min_chunks_in_place, 0)[0]
    assert -(-n // staged) == UcxSettings().min_chunks and -(-n // placed) == UcxSettings().min_chunks_in_place
    assert placed * per > staged * per


def test_the_peers_side_in_place_is_judged_from_its_metadata_and_cuts_fewer_chunks():
    """The initiator plans min_chunks_in_place chunks also where only the PEER moves its
    side in place (a gathered send into a receive straight into the blocks: one copy stage left),
    judged from the thresholds the peer publishes in its UCX info (None: never) and its region's
    record; an agent publishes its own."""
    from types import SimpleNamespace

    from xfer.transports.ucx.flow import peer_in_place

    dims = {**SEED, "num_heads": 2}  # (with one head the two inner orders are the same bytes)
    layout = make_kv_cache(KIND, **dims)[1]
    other_order = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_HND, **dims)[1]
    packed = make_kv_cache(LayoutKind.PACKED_KV, **dims)[1]  # K | V in one row: not whole rows
    host = SimpleNamespace(layout=layout, device="cpu")
    info = {"iov_min_bytes": 0, "iov_recv_min_bytes": 0}
    assert peer_in_place(info, host, False, layout) and peer_in_place(info, host, True, layout)
    assert not peer_in_place(info, host, False, other_order)  # lands in the sender's order: must match
    assert peer_in_place(info, SimpleNamespace(layout=other_order, device="cpu"), True, other_order)
    assert not peer_in_place(info, SimpleNamespace(layout=layout, device="cuda:0"), False, layout)
    assert not peer_in_place(info, SimpleNamespace(layout=packed, device="cpu"), False, packed)
    over = layout.block_nbytes + 1
    for bad in (None, over, True, -1, "0"):  # off, blocks too small, not an int (an older or odd peer)
        assert not peer_in_place({"iov_min_bytes": bad, "iov_recv_min_bytes": bad}, host, False, layout)
        assert not peer_in_place({"iov_min_bytes": bad, "iov_recv_min_bytes": bad}, host, True, layout)
    assert not peer_in_place({}, host, False, layout)
    # the directions apart: the peer's receive threshold decides a WRITE, its send threshold a READ
    assert peer_in_place({"iov_min_bytes": over, "iov_recv_min_bytes": 0}, host, False, layout)
    assert not peer_in_place({"iov_min_bytes": over, "iov_recv_min_bytes": 0}, host, True, layout)



def test_a_gathered_write_into_an_in_place_receive_is_cut_into_fewer_chunks(env, monkeypatch):
    """End to end, two agents over UCX: a write of blocks too small to send in place, to a peer that
    publishes that it receives in place (the default), is planned with min_chunks_in_place;
    to a peer with in-place receives off (``XFER_UCX_IOV_RECV=0``: it publishes None), with
    min_chunks. Either way every byte lands and nothing else is touched."""
    from xfer.metadata import decode
    from xfer.transports.ucx import protocol as ucx_proto

    plans = []
    real = ucx_proto.plan_chunks
    monkeypatch.setattr(ucx_proto, "plan_chunks", lambda *a: plans.append(a[3]) or real(*a))
    src, layout = make_kv_cache(KIND, **SEED)
    fill_random(src, seed=11)
    ids, dst_ids = list(range(0, 64, 2)), list(range(1, 64, 2))[::-1]
    with Agent("init", AgentConfig(transport="ucx", default_timeout_s=20)) as agent:
        agent.register("kv", src, layout)
        for recv_in_place, want in (("1", UcxSettings().min_chunks_in_place), ("0", UcxSettings().min_chunks)):
            monkeypatch.setenv("XFER_UCX_IOV_RECV", recv_in_place)
            dst, dst_layout = make_kv_cache(KIND, **SEED)
            poison(dst)
            with Agent("target", AgentConfig(transport="ucx", default_timeout_s=20)) as target:
                target.register("kv", dst, dst_layout)
                info = decode(target.metadata()).transports["ucx"]
                assert info["iov_min_bytes"] == 8192  # the default: 4 KiB blocks and smaller are gathered
                assert info["iov_recv_min_bytes"] == (0 if recv_in_place == "1" else None)
                plans.clear()
                agent.write(agent.connect(target.metadata()), ids, dst_ids).wait()
                assert plans == [want]
                assert_blocks_equal(layout, src, ids, dst_layout, dst, dst_ids)
                assert_untouched(dst_layout, dst, dst_ids)


def test_the_engine_wake_adds_one_to_its_eventfd_and_ignores_a_closed_one():
    """``_wake`` (libc write with the GIL held, so the poster does not wait out the woken engine's
    first burst of work) adds 1 to the engine's eventfd, once per call; a closed fd (-1 after the
    engine's teardown) raises nothing."""
    import os

    from xfer.transports.ucx.loop import _wake

    fd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        _wake(fd)
        _wake(fd)
        assert os.eventfd_read(fd) == 2
        with pytest.raises(BlockingIOError):  # the read reset it: nothing more to wake for
            os.eventfd_read(fd)
    finally:
        os.close(fd)
    _wake(-1)


def test_device_slots_have_their_own_size_and_device_transfers_are_not_cut_below_it():
    """Device staging has its own slot size (published as ``device_chunk_bytes``) and count; the
    initiator plans with the slot of the pool the peer stages its region in, and a transfer
    between two device regions is cut into as few chunks as fit (min_chunks_device)."""
    from types import SimpleNamespace

    from xfer.errors import InvalidArgumentError
    from xfer.transports.ucx.protocol import Protocol
    from xfer.transports.chunking import plan_chunks

    st = UcxSettings(chunk_bytes=1 << 20, device_chunk_bytes=64 << 20, slots=8, device_slots=4)
    assert (st.slot_bytes("host"), st.slot_bytes("pinned"), st.slot_bytes("cuda:1")) == (1 << 20, 1 << 20, 64 << 20)
    assert (st.slot_count("host"), st.slot_count("cuda:0")) == (8, 4)
    for bad in ({"device_chunk_bytes": 100}, {"device_slots": 1}):
        with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
            UcxSettings(**bad)
    info = {"ucx": {"chunk_bytes": 1 << 20, "device_chunk_bytes": 8 << 20, "cuda": True}}
    meta = SimpleNamespace(transports=info)
    assert Protocol._peer_slot(meta, SimpleNamespace(device="cuda:3")) == (8 << 20, True)
    assert Protocol._peer_slot(meta, SimpleNamespace(device="cpu")) == (1 << 20, False)
    info["ucx"]["cuda"] = False  # the peer stages CUDA regions through pinned host slots
    assert Protocol._peer_slot(meta, SimpleNamespace(device="cuda:0")) == (1 << 20, False)
    layout = make_kv_cache(KIND, **SEED)[1]
    n = 128
    whole = plan_chunks(layout, n, 1 << 40, UcxSettings().min_chunks_device, UcxSettings().min_chunk_bytes)[0]
    assert whole == n  # one chunk: the whole transfer fits a slot


def test_device_copies_are_polled_until_their_event_completes():
    """``copy_device`` launches at once and calls back on the engine thread once the copy's event
    completed, exactly once; a failed launch or a CUDA error polling the event reaches the callback
    as the error; device UCX requests are counted in flight until they end (the loop polls then)."""
    from types import SimpleNamespace

    from xfer.transports.ucx.datapath import device_req
    from xfer.transports.ucx.loop import Engine
    from xfer.transports.ucx.tables import Flows

    class Ev:
        def __init__(self, turns, error=None):
            self.turns, self.error = turns, error

        def query(self):
            if self.error:
                raise self.error
            self.turns -= 1
            return self.turns < 0

    eng = SimpleNamespace(_reqs=[], _dev_copies=0)
    eng.track = lambda req, cb: Engine.track(eng, req, cb)
    got = []
    Engine.copy_device(eng, lambda: Ev(1), lambda err: got.append(("a", err)))
    Engine.copy_device(eng, lambda: Ev(0), lambda err: got.append(("b", err)))
    boom = RuntimeError("launch failed")
    Engine.copy_device(eng, lambda: (_ for _ in ()).throw(boom), lambda err: got.append(("c", err)))
    assert got == [("c", boom)] and len(eng._reqs) == 2 and eng._dev_copies == 2  # the loop polls
    assert Engine._check_reqs(eng) and got[1:] == [("b", None)] and eng._dev_copies == 1
    assert Engine._check_reqs(eng) and got[2:] == [("a", None)] and not eng._reqs and eng._dev_copies == 0
    assert not Engine._check_reqs(eng)
    cuda_err = RuntimeError("CUDA error: an illegal memory access")
    Engine.copy_device(eng, lambda: Ev(5, cuda_err), lambda err: got.append(("d", err)))
    assert Engine._check_reqs(eng) and got[-1] == ("d", cuda_err) and not eng._reqs and eng._dev_copies == 0
    class FakeFlow(SimpleNamespace):  # a flow is hashed by identity, as Flow is
        __hash__ = object.__hash__

    ended, flows = [], Flows(None)
    flow = FakeFlow(dev_reqs=0, initiator=False, key=2, sending=True, conn=SimpleNamespace(local_id=1, flows={}))
    cb = device_req(flow, ended.append)
    assert flow.dev_reqs == 1 and not flows.device_reqs()  # not a live flow of this engine
    flows.add(flow)
    assert flows.device_reqs() and flows.target(1, 2) is flow and flow.conn.flows == {flow: None}
    cb(None)
    assert flow.dev_reqs == 0 and ended == [None] and not flows.device_reqs()


GRACE = AgentConfig().settings.fence.grace_s


# ---- GPU: device regions, GPU-direct -------------------------------------------------------------
# 64 layers x 128 blocks of 4 KiB slices: 64 MiB, cut into 16 device chunks of 4 MiB (device
# slots: 4, so sends and receives each cycle their 2 slots eight times)
DEV = dict(num_layers=64, num_blocks=160, block_size=16, num_heads=2, head_dim=64)
DEV_ENV = {"UCX_TLS": "all", "XFER_UCX_DEVICE_CHUNK_BYTES": "4M"}


@pytest.fixture
def gpu_env(monkeypatch):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for k, v in {**ucx_env(), **DEV_ENV}.items():
        monkeypatch.setenv(k, v)


@pytest.mark.gpu
def test_device_regions_move_gpu_direct_both_ways(gpu_env):
    """Two processes on one GPU, both caches in device memory: a WRITE and a READ of 128 blocks in
    16 device chunks, byte-exact, the rest of the destination still poisoned, the path reported."""
    tensors, layout = make_kv_cache(KIND, device="cuda", **DEV)
    fill_random(tensors, seed=21)
    with linked(UcxPeer("gpu-peer", KIND, {**DEV, "device": "cuda"}, env=DEV_ENV),
                {"kv": (tensors, layout)}) as (agent, name, peer):
        src = np.random.default_rng(3).permutation(160)[:128].tolist()
        dst = list(range(159, 31, -1))
        t = agent.write(name, src, dst, notify=b"dev")
        t.wait()
        assert "GPU-direct" in t.path, t.path
        assert peer.call("notification", 5) == ("ok", "src", "write", dst, b"dev")
        remote = peer.tensors()
        assert_blocks_equal(layout, [x.cpu() for x in tensors], src, peer.layout, remote, dst)
        assert_untouched(peer.layout, remote, dst)
        poison(tensors)
        assert peer.call("reset", 5) == "ok"
        t = agent.read(name, dst, src, notify=b"back")
        t.wait()
        mine = [x.cpu() for x in tensors]
        assert_blocks_equal(peer.layout, peer.tensors(), dst, layout, mine, src)
        assert_untouched(layout, mine, src)


@pytest.mark.gpu
def test_device_write_waits_for_the_callers_stream(gpu_env):
    """Blocks still being written on the caller's stream when write() is called (behind a ~50 ms
    sleep kernel): the transfer carries the new bytes, not the old ones."""
    import torch

    tensors, layout = make_kv_cache(KIND, device="cuda", **DEV)
    poison(tensors)
    want = [torch.randn(t.shape, device="cuda").to(t.dtype) for t in tensors]
    torch.cuda.synchronize()
    with linked(UcxPeer("gpu-peer", KIND, {**DEV, "device": "cuda"}, env=DEV_ENV),
                {"kv": (tensors, layout)}) as (agent, name, peer):
        src, dst = list(range(40)), list(range(100, 140))
        agent.write(name, src, dst).wait()  # connected and warm
        torch.cuda._sleep(50_000_000)  # the caller's stream is busy ...
        for t, w in zip(tensors, want):
            t.copy_(w)  # ... and then writes the blocks
        agent.write(name, src, dst).wait()
        torch.cuda.synchronize()
        assert_blocks_equal(layout, [x.cpu() for x in tensors], src, peer.layout, peer.tensors(), dst)


@pytest.mark.gpu
def test_killed_device_peer_ends_the_transfer_and_the_engine_stops_polling(gpu_env):
    """kill -9 of a device peer mid-transfer: the WRITE ends with PeerDisconnectedError well before
    its deadline; the engine, which polls while device work is in flight, goes back to sleeping
    (this process then uses almost no CPU); the agent serves a new device peer byte-exact."""
    tensors, layout = make_kv_cache(KIND, device="cuda", **DEV)
    fill_random(tensors, seed=8)
    slow_env = {**DEV_ENV, "XFER_UCX_DEVICE_CHUNK_BYTES": "512K", CHUNK_DELAY: "0.01"}  # 128 chunks, >= 1.3 s
    with Agent("p", AgentConfig(transport="ucx", default_timeout_s=30)) as agent:
        agent.register("kv", tensors, layout)
        victim = UcxPeer("victim", KIND, {**DEV, "device": "cuda"}, env=slow_env)
        try:
            t = agent.write(agent.connect(victim.metadata), list(range(128)), list(range(128)), timeout=30)
            wait_until(lambda: t.poll() is TransferState.RUNNING, 5, "the transfer starting")
            time.sleep(0.3)
            assert t.poll() is TransferState.RUNNING, f"the transfer ended before the kill: {t.error!r}"
            start = time.monotonic()
            victim.kill()
            with pytest.raises(PeerDisconnectedError):
                t.wait()
            assert time.monotonic() - start < 5.0  # noticed by UCX, not at the 30 s deadline
        finally:
            victim.close()
        time.sleep(0.2)
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(1.0)
        used = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        assert used < 0.3, f"the agent kept {used:.0%} of a core busy after its device transfer ended"
        fresh = UcxPeer("fresh", KIND, {**DEV, "device": "cuda"}, env=DEV_ENV)
        try:
            agent.write(agent.connect(fresh.metadata), [3, 1, 4], [0, 9, 2]).wait()
            remote = fresh.tensors()
            assert_blocks_equal(layout, [x.cpu() for x in tensors], [3, 1, 4], fresh.layout, remote, [0, 9, 2])
            assert_untouched(fresh.layout, remote, [0, 9, 2])
        finally:
            fresh.close()


@pytest.mark.gpu
def test_device_regions_staged_through_pinned_host_where_ucx_has_no_cuda(gpu_env, monkeypatch):
    """UCX limited to TCP (no CUDA transport): CUDA regions are staged through pinned host slots,
    the transfer says so, and both directions are byte-exact."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    tensors, layout = make_kv_cache(KIND, device="cuda", **DEV)
    fill_random(tensors, seed=12)
    with linked(UcxPeer("pinned-peer", KIND, {**DEV, "device": "cuda"}, env={**DEV_ENV, "UCX_TLS": "tcp"}),
                {"kv": (tensors, layout)}) as (agent, name, peer):
        src, dst = list(range(100, 20, -1)), list(range(80))
        t = agent.write(name, src, dst)
        t.wait()
        assert "pinned host" in t.path, t.path
        remote = peer.tensors()
        assert_blocks_equal(layout, [x.cpu() for x in tensors], src, peer.layout, remote, dst)
        assert_untouched(peer.layout, remote, dst)
        poison(tensors)
        assert peer.call("reset", 13) == "ok"
        agent.read(name, dst, src).wait()
        mine = [x.cpu() for x in tensors]
        assert_blocks_equal(peer.layout, peer.tensors(), dst, layout, mine, src)
        assert_untouched(layout, mine, src)


@pytest.mark.gpu
@pytest.mark.parametrize("mine,theirs", [("cuda", "cpu"), ("cpu", "cuda")])
def test_device_and_host_regions_move_between_each_other(gpu_env, mine, theirs):
    """One side's cache in device memory, the other's in host memory: a WRITE and a READ of 128
    blocks, each chunk staged in its own side's pool (device slots of 4 MiB, host slots of the
    default size), byte-exact, the rest of the destination still poisoned."""
    tensors, layout = make_kv_cache(KIND, device=mine, **DEV)
    fill_random(tensors, seed=31)
    with linked(UcxPeer("mixed-peer", KIND, {**DEV, "device": theirs}, env=DEV_ENV),
                {"kv": (tensors, layout)}) as (agent, name, peer):
        src = np.random.default_rng(5).permutation(160)[:128].tolist()
        dst = list(range(159, 31, -1))
        t = agent.write(name, src, dst, notify=b"mix")
        t.wait()
        assert ("GPU-direct" in t.path) == (mine == "cuda"), t.path
        assert peer.call("notification", 5) == ("ok", "src", "write", dst, b"mix")
        remote = peer.tensors()
        assert_blocks_equal(layout, [x.cpu() for x in tensors], src, peer.layout, remote, dst)
        assert_untouched(peer.layout, remote, dst)
        poison(tensors)
        assert peer.call("reset", 5) == "ok"
        agent.read(name, dst, src).wait()
        mine_now = [x.cpu() for x in tensors]
        assert_blocks_equal(peer.layout, peer.tensors(), dst, layout, mine_now, src)
        assert_untouched(layout, mine_now, src)
