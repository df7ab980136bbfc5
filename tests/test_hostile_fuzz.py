"""Fuzzing both listeners of a victim agent (issue 30): random bytes, and valid frames with bytes
flipped, cut or appended, at every stage of each protocol (before the handshake, during it, after
it with the key). Bounded: a few seconds each in CI. The victim runs in its own process; after
the run it must still serve a legitimate peer byte for byte, with every block outside that write
still poisoned, and hold no more descriptors than before."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import small_dims
from hostile_helpers import SECRET, RawControl, Refused, Victim, assert_victim_holds, legit_write
from xfer import LayoutKind, frames
from xfer import metadata as md_codec
from xfer.frames import Kind

KIND = LayoutKind.VLLM_FLASH_ATTN_NHD
DIMS = small_dims(KIND, blocks=16)
FUZZ = settings(max_examples=80, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def victim():
    v = Victim("fuzz-victim", KIND, DIMS, secret=SECRET, enable=("local", "ucx"),
               env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"})
    v.fds_before = v.fds()
    yield v
    try:
        expected = legit_write(KIND, DIMS, v.metadata, secret=SECRET, enable=("local",), src=(2, 3), dst=(7, 8))
        assert_victim_holds(v, expected, (7, 8))
        assert v.fds() - v.fds_before <= 8
    finally:
        v.close()


def _control(v):
    return md_codec.decode(v.metadata).control


def _mutate(data: bytes, edits) -> bytes:
    out = bytearray(data)
    for kind, at, value in edits:
        if not out and kind != "append":
            continue
        i = at % max(len(out), 1)
        if kind == "flip":
            out[i] ^= value or 1
        elif kind == "cut":
            del out[i:]
        else:
            out[i:i] = bytes([value]) * (1 + at % 64)
    return bytes(out)


EDITS = st.lists(st.tuples(st.sampled_from(["flip", "cut", "append"]), st.integers(0, 10_000), st.integers(0, 255)),
                 min_size=1, max_size=4)


def _send(address, data: bytes, *, then_read: bool = True) -> None:
    try:
        with socket.create_connection(address, timeout=2) as s:
            s.sendall(data)
            if then_read:
                s.settimeout(0.01)
                try:
                    s.recv(4096)
                except (socket.timeout, ConnectionResetError):
                    pass
    except OSError:
        pass


@FUZZ
@given(data=st.binary(max_size=800))
def test_fuzz_control_random_bytes(victim, data):
    _send(_control(victim), data)


@FUZZ
@given(edits=EDITS)
def test_fuzz_control_mutated_hello(victim, edits):
    hello = frames.hello_body("f" * 32, "fuzzer", None, True, bytes(16))
    _send(_control(victim), _mutate(frames.frame(Kind.HELLO, hello), edits))


@FUZZ
@given(edits=EDITS, header=st.sampled_from([b'{"type":"hello"}', b'{"type":"notify","op":"write","region":"kv",'
                                            b'"blocks":[1,2],"transfer_id":"t"}', b'{"type":"ucx.x"}', b"[" * 3000]),
       payload=st.binary(max_size=64))
def test_fuzz_control_mutated_requests_with_the_key(victim, edits, header, payload):
    """An insider (it holds the secret) sending mutated requests: refused or answered, never more."""
    try:
        with RawControl(_control(victim), secret=SECRET, timeout=2) as c:
            c.handshake()
            frame = c.frame(header, payload)
            c.send_raw(_mutate(frame, edits))
            c.sock.settimeout(0.02)
            try:
                c.read_frame()
            except (Refused, OSError):
                pass
    except (Refused, OSError):
        pass


def test_fuzz_control_leaves_the_victim_serving(victim):
    assert victim.logged("control port", "dropped peer")
    expected = legit_write(KIND, DIMS, victim.metadata, secret=SECRET, enable=("local",), src=(4,), dst=(9,))
    assert_victim_holds(victim, expected, (9,))
    victim.call("poison")
    time.sleep(0.2)


# ---- the UCX listener ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ucx_victim():
    """A victim without a secret: no MAC stops a message, so every one reaches the parser."""
    pytest.importorskip("ucxx", reason="the UCX transport needs ucxx: pip install -e '.[ucx]'")
    from ucx_helpers import ucx_env

    v = Victim("fuzz-ucx", KIND, DIMS, enable=("ucx",), env=ucx_env())
    info = md_codec.decode(v.metadata).transports["ucx"]
    v.ucx = (info["address"], info["port"])
    v.fds_before = v.fds()
    with pytest.MonkeyPatch.context() as mp:  # this process's legitimate agent: UCX on loopback too
        for k, val in ucx_env().items():
            mp.setenv(k, val)
        yield v
        try:
            expected = legit_write(KIND, DIMS, v.metadata, enable=("ucx",), src=(2, 3), dst=(7, 8))
            assert_victim_holds(v, expected, (7, 8))
        finally:
            v.close()


@pytest.fixture(scope="module")
def ucx_client(ucx_victim):
    from hostile_attacks import UcxClient

    c = UcxClient(*ucx_victim.ucx, name="fuzzer")
    c.proof()
    return c


@FUZZ
@given(data=st.binary(max_size=800))
def test_fuzz_ucx_listener_random_bytes(ucx_victim, data):
    _send(ucx_victim.ucx, data)


def _valid_messages(c):
    from hostile_attacks import _req_fields

    k = c.wire.Kind
    return [c.message(k.REQ, _req_fields(xid=5, layout={"num_layers": 2}), np.arange(2), b"note"),
            c.message(k.ACK, {"k": 3}), c.message(k.CANCEL, {"k": 3, "init": True, "why": "x"}),
            c.message(k.REFUSE, {"k": 3, "error": "BlockIdError", "message": "m"})]


@FUZZ
@given(which=st.integers(0, 3), edits=EDITS, tag_kind=st.sampled_from(["ctrl", "data", "other"]),
       bits=st.integers(0, 2**32 - 1))
def test_fuzz_ucx_mutated_messages(ucx_victim, ucx_client, which, edits, tag_kind, bits):
    c = ucx_client
    msg = _mutate(_valid_messages(c)[which], edits)
    if tag_kind == "ctrl":
        tag = c.ctrl()
    elif tag_kind == "data":
        tag = c.ctrl() | (bits & 0xFFFF or 1) << 32 | bits
    else:
        tag = bits << 32 | bits
    c.send(tag, msg or b"\0", wait=False)
    c.progress(0.002)


def test_fuzz_ucx_leaves_the_victim_serving(ucx_victim, ucx_client):
    ucx_client.progress(0.5)
    counts = ucx_victim.call("rejections")
    assert sum(v for k, v in counts.items() if k.startswith("ucx:")) > 10, counts
    expected = legit_write(KIND, DIMS, ucx_victim.metadata, enable=("ucx",), src=(4,), dst=(9,))
    assert_victim_holds(ucx_victim, expected, (9,))
    ucx_victim.call("poison")
