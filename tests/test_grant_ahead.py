"""Grants issued ahead (xfer.ahead, issue 32): the target holds blocks for one initiator's WRITE
before it is posted, so the write moves its bytes without asking first, fenced as any WRITE.

Sides are agents in child processes whose caches live in shared memory, read from here: A writes
(the initiator), B is written (the target), C is another writer. Every write checks B's bytes:
the written blocks equal A's, every other block still poisoned; every refusal checks that B stayed
poisoned. Transports: ``local`` (one-sided copies, the path a grant ahead shortens) and ``ucx`` over
loopback (its REQ names the grant; the target ends it as it takes the transfer's own hold)."""

from __future__ import annotations

import json

import pytest
import torch

from fence_helpers import Side, kill, local_transports, wait_for
from xfer import LayoutKind
from xfer.ahead import Claims

KIND = LayoutKind.VLLM_FLASH_ATTN_NHD
DIMS = dict(num_layers=4, num_blocks=32, block_size=16, num_heads=2, head_dim=64)
SRC, DST = [1, 4, 6, 9], [20, 3, 17, 11]  # a request's blocks, not in order
POISON = 0xA5
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
SECRET = "grant-ahead-test-secret-0123456789"

pytestmark = pytest.mark.timeout(180)


class Trio:
    def __init__(self, transport: str, config=None):
        env = UCX_ENV if transport == "ucx" else {}
        self.A, self.B, self.C = (Side(n, transport, KIND, DIMS, env=env, config=config) for n in "ABC")
        for s in (self.A, self.C):
            s.call("connect", self.B.metadata)
            self.B.call("connect", s.metadata)

    def reset(self, seed: int) -> None:
        self.A.fill_random(seed)
        self.C.fill_random(seed + 1)
        self.B.poison(POISON)
        self.B.call("notes")

    def close(self) -> None:
        for s in (self.A, self.B, self.C):
            s.close()


@pytest.fixture(scope="module", params=local_transports())
def trio(request):
    t = Trio(request.param)
    t.transport = request.param
    yield t
    t.close()


def _grant(side: Side, peer: str, blocks) -> str:
    res = side.call("grant", (peer, list(blocks)))
    assert res[0] == "ok", res
    return res[1]


def _write(side: Side, dst, token, src=SRC, timeout=20.0):
    """Post a write under ``token``: ("DONE", "") or (state, error name) once it ended, or
    ("refused", error name) when the post itself raised."""
    i = side.call("post_granted", ("B", list(src), list(dst), timeout, b"req", token))
    if isinstance(i, tuple):
        return "refused", i[1], None
    res = side.call("wait", (i, None))
    return res[3], res[1] if res[0] == "error" else "", i


def _landed(trio: Trio, src, dst) -> None:
    assert torch.equal(trio.B.blocks(dst), trio.A.blocks(src)), "the written blocks differ from the source's"
    others = [b for b in range(DIMS["num_blocks"]) if b not in set(dst)]
    assert bool((trio.B.blocks(others) == POISON).all()), "a block outside the write changed"


def _untouched(trio: Trio) -> None:
    assert bool((trio.B.blocks(range(DIMS["num_blocks"])) == POISON).all()), "bytes landed from a refused write"


def test_a_write_granted_ahead_lands_exactly_and_asks_nothing(trio):
    trio.reset(1)
    token = _grant(trio.B, "A", DST)
    assert trio.B.call("holds") == 1
    state, err, i = _write(trio.A, DST, token)
    assert (state, err) == ("DONE", "")
    _landed(trio, SRC, DST)
    notes = trio.B.call("notes")
    assert [(n[1], n[2], n[3]) for n in notes] == [("A", "write", DST)]
    assert trio.B.call("holds") == 0, "the grant outlived its write"
    marks = trio.A.call("timeline", i)
    assert "asked" not in marks and "granted" not in marks, marks
    if trio.transport == "local":  # the same write without a grant asks first (the test can fail)
        trio.reset(2)
        j = trio.A.call("post", ("write", "B", SRC, DST, 20.0, b"req"))
        assert trio.A.call("wait", (j, None))[3] == "DONE"
        assert "asked" in trio.A.call("timeline", j)
        _landed(trio, SRC, DST)


def test_a_grant_serves_one_write_of_exactly_its_blocks(trio):
    trio.reset(3)
    token = _grant(trio.B, "A", DST)
    for dst in (DST[::-1], DST[:3], [DST[0], DST[1], DST[2], 0]):  # other order, fewer, another block
        state, err, _ = _write(trio.A, dst, token, src=SRC[:len(dst)])
        assert (state, err) == ("refused", "InvalidArgumentError"), dst
    for bad in ("not json", json.dumps([1, 2]), "{" * 100_000, json.dumps({"v": 1, "grant": True})):
        assert _write(trio.A, DST, bad)[:2] == ("refused", "InvalidArgumentError")
    assert _write(trio.C, DST, token)[:2] == ("refused", "InvalidArgumentError"), "a token is its initiator's"
    _untouched(trio)
    assert _write(trio.A, DST, token)[:2] == ("DONE", "")
    _landed(trio, SRC, DST)
    assert _write(trio.A, DST, token)[:2] == ("refused", "InvalidArgumentError"), "a token served twice"
    assert trio.B.call("holds") == 0


def test_another_writer_is_refused_while_the_grant_holds_the_blocks(trio):
    trio.reset(4)
    token = _grant(trio.B, "A", DST)
    i = trio.C.call("post", ("write", "B", SRC, DST, 20.0, b"c"))
    res = trio.C.call("wait", (i, None))
    assert (res[3], res[1]) == ("FAILED", "BlocksBusyError"), res
    assert trio.B.call("grant", ("C", DST))[1] == "BlocksBusyError"
    _untouched(trio)
    assert _write(trio.A, DST, token)[:2] == ("DONE", "")
    _landed(trio, SRC, DST)


def test_revoking_an_unused_grant_asks_the_initiator_and_the_token_is_refused_after(trio):
    trio.reset(5)
    token = _grant(trio.B, "A", DST)
    res = trio.B.call("revoke", (DST, 5.0))
    assert res[:2] == ("ok", 1), res
    assert res[2] < 2.0, f"the release took {res[2]:.3f} s"
    assert trio.B.call("holds") == 0
    assert _write(trio.A, DST, token)[:2] == ("refused", "RevokedError")
    _untouched(trio)
    assert trio.B.call("notes") == []


def test_a_granted_write_stopped_before_it_moved_ends_its_grant(trio):
    trio.reset(6)
    token = _grant(trio.B, "A", DST)
    state, err, _ = _write(trio.A, DST, token, timeout=1e-6)  # its deadline passes before it starts
    assert state in ("FAILED", "TIMED_OUT", "CANCELLED") and err, (state, err)
    wait_for(lambda: trio.B.call("holds") == 0, 10, "the stopped write's grant to end")
    _untouched(trio)
    assert trio.B.call("notes") == []


def test_a_signed_token_is_checked_and_a_tampered_one_refused():
    t = Trio("local", config={"secret": SECRET})
    try:
        t.reset(7)
        token = _grant(t.B, "A", DST)
        d = json.loads(token)
        assert "auth" in d
        forged = json.dumps({**d, "blocks": [0, 1, 2, 5]})
        assert _write(t.A, [0, 1, 2, 5], forged)[:2] == ("refused", "AuthenticationError")
        unsigned = json.dumps({k: v for k, v in d.items() if k != "auth"})
        assert _write(t.A, DST, unsigned)[:2] == ("refused", "AuthenticationError")
        _untouched(t)
        assert _write(t.A, DST, token)[:2] == ("DONE", "")
        _landed(t, SRC, DST)
    finally:
        t.close()


def test_kill_9_of_an_initiator_holding_an_unused_grant_then_revoke():
    t = Trio("local")
    try:
        t.reset(8)
        _grant(t.B, "A", DST)
        kill(t.A)
        res = t.B.call("revoke", (DST, 5.0))
        assert res[:2] == ("ok", 1), res
        assert t.B.call("holds") == 0
        j = t.C.call("post", ("write", "B", SRC, DST, 20.0, b"c"))
        assert t.C.call("wait", (j, None))[3] == "DONE", "the blocks stayed held after their initiator died"
    finally:
        t.close()


# ---- the initiator's table -------------------------------------------------------------------------
def test_claims_claim_and_release_exclude_each_other():
    c = Claims()
    c.claim("B", 1)
    assert c.release("B", [1, 2]) == ([2], [1])  # 1 claimed: its notice ends it; 2 never used: released
    with pytest.raises(Exception) as e:
        c.claim("B", 2)
    assert type(e.value).__name__ == "RevokedError"
    with pytest.raises(Exception) as e:
        c.claim("B", 1)
    assert type(e.value).__name__ == "InvalidArgumentError"
    c.claim("C", 2)  # per target agent (a restarted target counts its grant ids afresh)
    assert c.release("B", ["x", True, None]) == ([], [])


def test_claims_stay_bounded_and_refuse_what_they_forgot():
    c = Claims(cap=4)
    for hid in range(1, 7):
        c.claim("B", hid)
    assert len(c) == 4
    assert c.release("B", [1, 2, 7]) == ([7], [1, 2])  # forgotten ids: maybe a write in flight
    with pytest.raises(Exception) as e:
        c.claim("B", 2)
    assert type(e.value).__name__ == "RevokedError"


def test_a_malformed_release_is_refused_and_the_server_answers_on():
    c = Claims()
    with pytest.raises(Exception) as e:
        c.on_release({"from": "B", "agent": "b-id", "grants": "all"})
    assert type(e.value).__name__ == "InvalidArgumentError"
    with pytest.raises(Exception) as e:
        c.on_release({"from": "B", "grants": [1]})  # no agent id
    assert type(e.value).__name__ == "InvalidArgumentError"
    big = list(range(1, 10_000))
    reply = c.on_release({"from": "B", "agent": "b-id", "grants": big})
    assert len(reply["released"]) == 4096 and reply["claimed"] == []
