"""Shared-secret authentication (metadata and control messages), bounds on remote requests, and
fuzzing of what peers send: nothing but typed errors, no crash, no hang, no byte moved."""

import json
import logging
import socket
import struct
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import assert_blocks_equal, assert_untouched, fill_random, poison, small_dims
from xfer import Agent, AgentConfig, KVLayout, LayoutKind, make_kv_cache
from xfer import metadata as md_codec
from hostile_helpers import RawControl, Refused, hello_ok
from xfer.errors import AuthenticationError, LayoutError, MetadataError, XferError

SECRET = b"0123456789abcdef-deployment-7"
LOCAL = ("local",)


def make_pair(secret_a, secret_b, kind=LayoutKind.VLLM_FLASH_ATTN_NHD, enable=LOCAL):
    d = small_dims(kind)
    ta, la = make_kv_cache(kind, **d)
    tb, lb = make_kv_cache(kind, **d)
    fill_random(ta, seed=9)
    poison(tb)
    a = Agent("a", AgentConfig(secret=secret_a, enable=enable))
    b = Agent("b", AgentConfig(secret=secret_b, enable=enable))
    a.register("kv", ta, la)
    b.register("kv", tb, lb)
    return a, b, (ta, la), (tb, lb)


def test_same_secret_moves_verified_blocks():
    a, b, (ta, la), (tb, lb) = make_pair(SECRET, SECRET)
    try:
        peer = a.connect(b.metadata())
        a.write(peer, [1, 2], [5, 6], notify=b"ok").wait()
        assert_blocks_equal(la, ta, [1, 2], lb, tb, [5, 6])
        assert b.wait_notification(1).payload == b"ok"
    finally:
        a.close(), b.close()


def test_peer_without_the_secret_is_rejected_and_the_log_says_why(caplog):
    a, b, _, (tb, lb) = make_pair(None, SECRET)
    try:
        with caplog.at_level(logging.WARNING, logger="xfer.control"):
            with pytest.raises(AuthenticationError, match="refused: it has no shared secret"):
                a.connect(b.metadata())
        assert any("dropped peer" in r.message and "no shared secret" in r.message for r in caplog.records)
        assert b.notifications() == []
        assert_untouched(lb, tb, [])
    finally:
        a.close(), b.close()


def test_agent_with_a_secret_refuses_a_server_without_one():
    a, b, _, _ = make_pair(SECRET, None)
    try:
        blob = b.metadata()
        with pytest.raises(AuthenticationError):  # unsigned metadata, and the handshake says so too
            a.connect(blob)
        with RawControl(b.address, secret=SECRET) as c:  # the handshake says it too, whoever asks
            with pytest.raises(Refused, match="requires a shared secret; this agent has none"):
                c.handshake()
    finally:
        a.close(), b.close()


def test_wrong_secret_fails_on_the_metadata_itself():
    a, b, _, _ = make_pair(b"another-secret-of-16+bytes", SECRET)
    try:
        with pytest.raises(AuthenticationError, match="fails its MAC"):
            a.connect(b.metadata())
    finally:
        a.close(), b.close()


def test_tampered_or_unsigned_metadata_is_rejected():
    a, b, _, _ = make_pair(SECRET, SECRET)
    try:
        blob = b.metadata()
        d = json.loads(blob[14:])
        d["control"][1] = d["control"][1] + 1 if d["control"][1] < 65535 else 1  # point it elsewhere
        body = json.dumps(d, separators=(",", ":"), sort_keys=True).encode()
        forged = struct.pack("!4sHII", md_codec.MAGIC, md_codec.VERSION, len(body), zlib.crc32(body)) + body
        with pytest.raises(AuthenticationError, match="fails its MAC"):
            a.connect(forged)
        d.pop("auth")
        body = json.dumps(d, separators=(",", ":"), sort_keys=True).encode()
        unsigned = struct.pack("!4sHII", md_codec.MAGIC, md_codec.VERSION, len(body), zlib.crc32(body)) + body
        with pytest.raises(AuthenticationError, match="not signed"):
            a.connect(unsigned)
    finally:
        a.close(), b.close()


def _raw_request(address, header, payload=b"", secret=None) -> dict:
    with RawControl(address, secret=secret) as c:
        c.handshake()
        return c.request(header, payload)


def test_replayed_and_forged_control_messages_are_refused():
    a, b, _, (tb, lb) = make_pair(SECRET, SECRET)
    try:
        notify = {"type": "notify", "from": "mallory", "transfer_id": "x", "op": "write", "region": "kv",
                  "blocks": [0, 1]}
        with RawControl(b.address, secret=SECRET) as c:  # a holder of the secret: accepted once
            c.handshake()
            assert c.request(notify, b"p")["ok"] is True
            captured = c.last_frame
            c.send_raw(captured)  # the same frame again on its own connection: its sequence number fails
            with pytest.raises(Refused, match="sequence number 1 is not above the last one"):
                c.reply()
        with RawControl(b.address, secret=SECRET) as c:  # on another connection: the MAC fails
            c.handshake()
            c.send_raw(captured)
            with pytest.raises(Refused, match="MAC does not verify"):
                c.reply()
        with RawControl(b.address, secret=SECRET) as c:  # tampered: a header byte changed after signing
            c.handshake()
            frame = bytearray(c.frame(notify, b"p"))
            frame[frame.index(b"[0,1]") + 1] = ord("2")
            c.send_raw(bytes(frame))
            with pytest.raises(Refused, match="MAC does not verify"):
                c.reply()
        with RawControl(b.address, secret=b"not-the-deployment-secret") as c:  # wrong secret: the proof fails
            c.handshake()
            c.send_raw(c.frame(notify, b"p"))
            with pytest.raises(Refused, match="proof of the session key does not verify"):
                c.reply()
        with RawControl(b.address) as c:  # no secret at all
            with pytest.raises(Refused, match="no shared secret"):
                c.handshake()
        assert len(b.notifications()) == 1  # only the first, genuine one
        assert_untouched(lb, tb, [])
    finally:
        a.close(), b.close()


def test_the_handshake_name_not_the_header_says_who_sent_it():
    a, b, _, _ = make_pair(None, None)
    try:
        with RawControl(b.address, name="honest-name") as c:
            c.handshake()
            assert c.request({"type": "message", "from": "someone-else"}, b"hi")["ok"] is True
        (note,) = b.notifications()
        assert note.peer == "honest-name" and note.payload == b"hi"
    finally:
        a.close(), b.close()


def test_short_secret_is_refused():
    with pytest.raises(AuthenticationError, match="at least 16 bytes"):
        Agent("weak", AgentConfig(secret="short", enable=LOCAL))


def test_secret_from_environment(monkeypatch):
    monkeypatch.setenv("XFER_SECRET", SECRET.decode())
    a, b, (ta, la), (tb, lb) = make_pair(None, None)
    try:
        assert b"\"auth\"" in b.metadata()
        a.write(a.connect(b.metadata()), [0], [0]).wait()
        assert_blocks_equal(la, ta, [0], lb, tb, [0])
    finally:
        a.close(), b.close()
    assert "secret" not in repr(AgentConfig(secret=SECRET)).replace("secret=", "") or SECRET.decode() not in \
        repr(AgentConfig(secret=SECRET))


# ---- bounds: a remote request naming blocks outside the layout never lands -----------------------
def test_forged_notification_outside_the_layout_is_refused():
    a, b, _, (tb, lb) = make_pair(None, None)
    try:
        for blocks, pattern in (([lb.num_blocks], "contain id"), ([-1], "negative"), ([1, 1], "repeat")):
            reply = _raw_request(b.address, {"type": "notify", "from": "m", "transfer_id": "t",
                                             "op": "write", "region": "kv", "blocks": blocks})
            assert reply["ok"] is False and reply["error"] == "BlockIdError" and pattern in reply["message"]
        assert b.notifications() == []
    finally:
        a.close(), b.close()


# ---- fuzzing ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    tensors, layout = make_kv_cache(LayoutKind.VLLM_FLASHINFER, **small_dims("vllm_flashinfer"))
    poison(tensors)
    agent = Agent("fuzz-target", AgentConfig(enable=LOCAL))
    agent.register("kv", tensors, layout)
    yield agent, tensors, layout
    agent.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_fuzzed_control_bytes_never_crash_the_server(target, data):
    agent, tensors, layout = target
    with socket.create_connection(agent.address, timeout=2) as s:
        s.sendall(data)
    # the server is still there and still correct
    reply = _raw_request(agent.address, {"type": "hello", "from": "probe", "agent_id": "x"})
    assert reply["ok"] is True and reply["agent_id"] == agent.agent_id
    agent.notifications()
    assert_untouched(layout, tensors, [])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.dictionaries(st.sampled_from(["type", "op", "region", "blocks", "from", "transfer_id"]),
                              st.one_of(st.none(), st.integers(-5, 10**6), st.text(max_size=8),
                                        st.lists(st.integers(-3, 40), max_size=6), st.sampled_from(
                                            ["notify", "write", "read", "kv", "message", "ucx.x"]))))
def test_fuzzed_control_messages_get_typed_refusals(target, header):
    agent, tensors, layout = target
    reply = _raw_request(agent.address, header)
    assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool)
    if not reply["ok"]:
        import xfer.errors as errors
        assert issubclass(getattr(errors, reply["error"]), XferError)
    assert_untouched(layout, tensors, [])  # notifications never write blocks
    agent.notifications()


@settings(max_examples=150, deadline=None)
@given(d=st.dictionaries(st.sampled_from(list(KVLayout.__dataclass_fields__)),
                         st.one_of(st.integers(-3, 5000), st.text(max_size=6), st.lists(st.integers(-2, 99), max_size=4),
                                   st.none(), st.sampled_from(["bfloat16", "uint8", "nope"]))))
def test_fuzzed_layout_records_raise_layout_errors_only(d):
    _, good = make_kv_cache(LayoutKind.MLA, **small_dims("mla"), device="meta")
    record = dict(good.to_dict(), **d)
    try:
        KVLayout.from_dict(record)
    except LayoutError:
        pass


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(src=st.lists(st.one_of(st.integers(-3, 12), st.floats(allow_nan=True)), max_size=6),
       dst=st.lists(st.integers(-3, 12), max_size=6))
def test_fuzzed_transfer_requests_fail_typed_before_any_byte_moves(src, dst):
    a, b, (ta, la), (tb, lb) = _fuzz_pair()
    try:
        t = a.write("b", src, dst, timeout=5)
        t.wait()
    except XferError:
        assert_untouched(lb, tb, [])
        return
    written = [int(x) for x in dst]
    assert_blocks_equal(la, ta, [int(x) for x in src], lb, tb, written)
    assert_untouched(lb, tb, written)
    poison(tb)


_PAIR = {}


def _fuzz_pair():
    if not _PAIR:
        a, b, ra, rb = make_pair(None, None)
        a.connect(b.metadata())
        _PAIR["p"] = (a, b, ra, rb)
    return _PAIR["p"]


def teardown_module(module):
    if _PAIR:
        a, b, _, _ = _PAIR.pop("p")
        a.close()
        b.close()


def test_metadata_of_random_bytes_is_a_metadata_error():
    rng = np.random.default_rng(0)
    for n in range(0, 400, 7):
        with pytest.raises(MetadataError):
            md_codec.decode(bytes(rng.integers(0, 256, n, dtype=np.uint8)))


def test_ucx_messages_are_authenticated():
    pytest.importorskip("ucxx", reason="the UCX transport needs ucxx: pip install -e '.[ucx]'")
    ucx = ("ucx",)
    a, b, (ta, la), (tb, lb) = make_pair(SECRET, SECRET, enable=ucx)
    try:
        peer = a.connect(b.metadata())
        assert a.route(peer).kind.value == "ucx"
        a.write(peer, [3, 4], [0, 7], timeout=20).wait()
        assert_blocks_equal(la, ta, [3, 4], lb, tb, [0, 7])
        assert_untouched(lb, tb, [0, 7])
    finally:
        a.close(), b.close()
    # an agent that signs nothing is refused by the control channel at connect already; a UCX
    # request that is not signed is dropped by the receiving transport:
    a, b, _, (tb, lb) = make_pair(SECRET, SECRET, enable=ucx)
    try:
        peer = a.connect(b.metadata())
        a.transports[next(iter(a.transports))].ctx.auth = None  # a's transport stops signing
        t = a.write(peer, [1], [1], timeout=3)
        with pytest.raises(XferError):
            t.wait()
        assert b.notifications() == []
        assert_untouched(lb, tb, [])
    finally:
        a.close(), b.close()


def test_metrics_and_transfer_logs(caplog):
    prometheus_client = pytest.importorskip("prometheus_client", reason="the metrics need prometheus-client: pip install -e '.[metrics]'")
    a, b, _, _ = make_pair(None, None)
    try:
        peer = a.connect(b.metadata())
        with caplog.at_level(logging.DEBUG, logger="xfer.transfer"):
            t = a.write(peer, [0, 1], [2, 3])
            t.wait()
            b.deregister("kv")
            bad = a.write(peer, [0], [0])
            with pytest.raises(XferError):
                bad.wait()
        get = prometheus_client.REGISTRY.get_sample_value
        labels = {"agent": "a", "op": "write", "path": "local"}
        end = time.monotonic() + 2  # the metrics are counted right after wait() returns, on the transport's thread
        while get("xfer_errors_total", dict(labels, error="NotRegisteredError")) is None and time.monotonic() < end:
            time.sleep(0.01)
        assert get("xfer_bytes_total", labels) >= t.nbytes
        assert get("xfer_transfers_total", dict(labels, state="DONE")) >= 1
        assert get("xfer_errors_total", dict(labels, error="NotRegisteredError")) >= 1
        assert get("xfer_transfer_seconds_count", labels) >= 2
        assert get("xfer_routes_total", {"agent": "a", "peer": "b", "path": "local"}) >= 1
        lines = [r.getMessage() for r in caplog.records if r.name == "xfer.transfer"]
        assert any(f"id={t.id}" in m and "state=DONE" in m for m in lines)
        assert any(f"id={bad.id}" in m and "error=NotRegisteredError" in m for m in lines)
    finally:
        a.close(), b.close()


def test_the_metrics_tally_counts_what_ended_when_scraped(monkeypatch):
    """Ended transfers are counted when scraped (xfer.metrics._Tally), or, two at a time, by the
    threads that end more once too many wait (never while a scrape holds the counts): every count,
    byte, error and histogram bucket as prometheus would."""
    pytest.importorskip("prometheus_client", reason="the metrics need prometheus-client")
    from xfer import metrics

    monkeypatch.setattr(metrics, "_DRAIN_AT", 3)
    tally = metrics._Tally()
    from xfer import Op, TransferState

    w, done, failed = Op.WRITE, TransferState.DONE, TransferState.FAILED
    ended = [("a", w, "ipc (copy: triton)", done, "", 2e-4, 100),
             ("a", w, "ipc", done, "", 1e-4, 50),  # on a bucket's bound: counted in it
             ("a", w, "ipc", failed, "PeerDisconnectedError", 5.0, 7),
             ("a", Op.READ, "local", done, "", 99.0, 1)]
    for item in ended[:3]:
        tally.add(item)
    assert len(tally._ended) == 3
    with tally._lock:  # a scrape in progress: the ending thread does not wait for it
        tally.add(ended[3])
    assert len(tally._ended) == 4
    tally.add(ended[3])  # a fifth (the fourth again, for the test): two counted by this thread
    assert len(tally._ended) == 3
    tally._ended.pop()  # (the repeated item, not counted yet)
    fams = {f.name: f for f in tally.collect()}
    samples = {(x.name, tuple(sorted(x.labels.items()))): x.value for f in fams.values() for x in f.samples}
    ipc = (("agent", "a"), ("op", "write"), ("path", "ipc"))
    assert samples[("xfer_transfers_total", tuple(sorted(ipc + (("state", "DONE"),))))] == 2
    assert samples[("xfer_transfers_total", tuple(sorted(ipc + (("state", "FAILED"),))))] == 1
    assert samples[("xfer_bytes_total", ipc)] == 150  # DONE only
    assert samples[("xfer_errors_total", tuple(sorted(ipc + (("error", "PeerDisconnectedError"),))))] == 1
    le = lambda b: ("xfer_transfer_seconds_bucket", tuple(sorted(ipc + (("le", b),))))  # noqa: E731
    assert [samples[le(b)] for b in ("0.0001", "0.0003", "3.0", "10.0", "+Inf")] == [1, 2, 2, 3, 3]
    assert samples[("xfer_transfer_seconds_count", ipc)] == 3
    assert samples[("xfer_transfer_seconds_sum", ipc)] == pytest.approx(5.0003)
    read = (("agent", "a"), ("op", "read"), ("path", "local"))
    assert samples[("xfer_transfer_seconds_bucket", tuple(sorted(read + (("le", "30.0"),))))] == 0
    assert samples[("xfer_transfer_seconds_bucket", tuple(sorted(read + (("le", "+Inf"),))))] == 1


def test_an_agent_listening_beyond_loopback_without_a_secret_says_so_once(caplog):
    with caplog.at_level(logging.WARNING, logger="xfer.agent"):
        Agent("quiet", AgentConfig(enable=LOCAL)).close()  # 127.0.0.1: nothing to say
        Agent("guarded", AgentConfig(enable=LOCAL, listen_host="0.0.0.0", secret=SECRET)).close()
        assert not [r for r in caplog.records if "beyond loopback" in r.getMessage()]
        Agent("open", AgentConfig(enable=LOCAL, listen_host="0.0.0.0")).close()
    lines = [r.getMessage() for r in caplog.records if "beyond loopback" in r.getMessage()]
    assert len(lines) == 1 and "'open'" in lines[0] and "control port on 0.0.0.0" in lines[0], lines
