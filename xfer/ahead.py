"""Grants issued ahead: the target of WRITEs holds blocks for one initiator before it writes, so the
WRITE moves its bytes without first asking for them (one round trip less on a lone write).

A decode engine already hands its prefill the block ids a request's KV goes to; with
:meth:`xfer.Agent.grant` it hands a token along with them::

    token = decode.grant("prefill-0", dst_blocks)          # the target: hold the blocks for prefill-0
    ... the engine passes dst_blocks and token to prefill-0 as it passes block ids now ...
    prefill.write("decode-0", src_blocks, dst_blocks, grant=token).wait()

The fence is the one every WRITE gets (:mod:`xfer.transports.grants`): the grant is a hold, taken
(and checked: region, ids, other writers) when ``grant`` runs, ended by the write's notice (or its
end notice when it stopped), refused to other writers meanwhile. What differs is who may end it
without the write: a hold whose transfer never started may be given back only once its initiator
agreed never to use it, since its copy could be starting that instant. So revoking blocks a grant
ahead covers asks the initiator (``grant_release``, one round trip, off the data path): the
initiator answers *released* for a token it has not used (and refuses it from then on) or *claimed*
for one a write took (its notice or end notice ends the hold, as for any WRITE). Claim and release
are one step on the initiator (:class:`Claims`), so exactly one of them wins.

A token serves one WRITE of exactly the granted blocks, in the granted order, to the granted
region; it is JSON, signed with the deployment's secret where there is one (the initiator checks
it before any byte moves). Transports whose target side takes its own hold (ucx, NVSHMEM's staged
path) give the grant back first and run as usual (:meth:`Ahead.give_back`).
"""

from __future__ import annotations

import collections
import itertools
import json
import threading
import time

import numpy as np

from .errors import AuthenticationError, InvalidArgumentError, RevokedError, XferError
from .guard import loads
from .transports.completion import raise_remote

__all__ = ["Ahead", "Claims", "TOKEN_MAX_BYTES"]

TOKEN_MAX_BYTES = 1 << 20  # a token names at most ~100k blocks
CLAIMS_MAX = 65536  # tokens an initiator remembers (past it the oldest go, and older tokens are refused)
_CLAIMED, _RELEASED = 1, 2


class Claims:
    """The initiator's record of the tokens it was handed, per target agent id (a restarted target
    under the same name is another agent, its grant ids counted afresh): claimed (a write took it)
    or released (the target took it back unused). One lock makes a claim and a release one
    step each. Bounded: past :data:`CLAIMS_MAX` entries the oldest are dropped and every token of
    that target at or below the highest id dropped is refused (``_floor``); a release of such an
    id answers *claimed* (it may be a write in flight whose entry was dropped)."""

    def __init__(self, cap: int = CLAIMS_MAX):
        self._cap = cap
        self._lock = threading.Lock()
        self._table: collections.OrderedDict[tuple[str, int], int] = collections.OrderedDict()
        self._floor: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._table)

    def claim(self, target: str, hid: int, name: str | None = None) -> None:
        """Take grant ``hid`` of ``target`` (an agent id; ``name``: its name, for the errors) for a
        write, or raise (nothing moved)."""
        key, who = (target, hid), name or target
        with self._lock:
            state = self._table.get(key)
            if state == _CLAIMED:
                raise InvalidArgumentError(f"grant {hid} of {who!r} was used by a write already: a grant "
                                           f"serves one write")
            if state == _RELEASED or hid <= self._floor.get(target, 0):
                raise RevokedError(f"grant {hid} of {who!r} was given back (the target revoked its blocks) "
                                   f"before this write: nothing moved")
            self._table[key] = _CLAIMED
            self._trim()

    def release(self, target: str, hids) -> tuple[list[int], list[int]]:
        """The target takes grants ``hids`` back: (released: never to be used, claimed: a write took
        them; its notice ends them)."""
        released, claimed = [], []
        with self._lock:
            for hid in hids:
                if not isinstance(hid, int) or isinstance(hid, bool):
                    continue
                key = (target, hid)
                state = self._table.get(key)
                if state == _CLAIMED or (state is None and hid <= self._floor.get(target, 0)):
                    claimed.append(hid)
                    continue
                self._table[key] = _RELEASED
                released.append(hid)
            self._trim()
        return released, claimed

    def _trim(self) -> None:
        while len(self._table) > self._cap:
            (target, hid), _ = self._table.popitem(last=False)
            self._floor[target] = max(self._floor.get(target, 0), hid)

    def on_release(self, header: dict) -> dict:
        """The control message ``grant_release`` from the target agent ``agent`` (its id)."""
        hids, agent = header.get("grants"), header.get("agent")
        if not isinstance(hids, list) or not isinstance(agent, str):
            raise InvalidArgumentError("grant_release carries no list of grants or no agent id")
        released, claimed = self.release(agent[:128], hids[:4096])
        return {"ok": True, "released": released, "claimed": claimed}


class Ahead:
    """Both sides of grants issued ahead for one agent: the target's :meth:`grant` (a hold in
    ``grants``, the agent's :class:`~xfer.transports.grants.Grants`) and its release round trip on
    revocation; the initiator's :meth:`claim` of a token (``claims``: its :class:`Claims`).
    ``auth``: the deployment's Authenticator (tokens signed and checked) or None; ``peer(name)``:
    the connected peer's handle or None; ``bound_s``: the longest a release round trip waits."""

    def __init__(self, name: str, agent_id: str, grants, auth, peer, bound_s: float):
        self.name, self.agent_id, self._grants, self._auth, self._peer = name, agent_id, grants, auth, peer
        self._bound_s = bound_s
        self.claims = Claims()
        self._n = itertools.count(1)

    # ---- the target ------------------------------------------------------------------------------
    def grant(self, local, handle, blocks) -> str:
        """Hold blocks ``blocks`` of region ``local`` for the WRITE of peer ``handle``; its token."""
        ids = local.layout.check_block_ids(blocks, what="granted block ids", unique=True)
        if not ids.size:
            raise InvalidArgumentError("a grant names at least one block")
        md = handle.metadata
        hold = self._grants.hold(local, ids, writes=True, peer=md.name, tid=f"ahead-{next(self._n)}",
                                 owner=(md.name, md.pid, str(md.host_id)), pid=md.pid, host=str(md.host_id),
                                 on_revoke=self._release)
        body = {"v": 1, "agent": self.agent_id, "from": self.name, "to": md.name, "grant": hold.id,
                "region": local.name, "blocks": ids.tolist()}
        if self._auth is not None:
            body = self._auth.sign_token(body)
        return json.dumps(body, separators=(",", ":"))

    def _release(self, hold) -> None:
        """(``Grants.revoke``'s cue, its thread) Ask the initiator to give ``hold`` back; ended here
        when it was never used. Otherwise (used, or no answer) the hold ends as any WRITE's does."""
        handle = self._peer(hold.peer)
        if handle is None:
            return
        try:
            reply, _ = handle.request({"type": "grant_release", "from": self.name, "agent": self.agent_id,
                                       "grants": [hold.id]},
                                      deadline=time.monotonic() + self._bound_s)
        except XferError:
            return  # unreachable: the hold stays (revoke's bound says so; a dead initiator's is reaped)
        released = reply.get("released") if isinstance(reply, dict) else None
        if isinstance(released, list) and hold.id in released:
            self._grants.end(hold)

    # ---- the initiator ---------------------------------------------------------------------------
    def claim(self, token, handle, region: str, peer_ids: np.ndarray) -> int:
        """Check ``token`` against this WRITE (peer ``handle``, its region, its destination ids) and
        claim it; its grant id. Raises (nothing moved) when it does not match or was given back."""
        if not isinstance(token, (str, bytes)):
            raise InvalidArgumentError(f"grant must be the token Agent.grant returned (a str), got "
                                       f"{type(token).__name__}")
        raw = token.encode() if isinstance(token, str) else token
        d = loads(raw, max_bytes=TOKEN_MAX_BYTES, what="grant token")
        if self._auth is not None:
            self._auth.check_token(d)
        elif "auth" in d:
            raise AuthenticationError("the grant token is signed but this agent has no shared secret")
        md = handle.metadata
        hid, blocks = d.get("grant"), d.get("blocks")
        if d.get("v") != 1 or not isinstance(hid, int) or isinstance(hid, bool) or not isinstance(blocks, list):
            raise InvalidArgumentError("malformed grant token (fields v, grant, blocks)")
        if d.get("agent") != md.agent_id or d.get("from") != md.name:
            raise InvalidArgumentError(f"the grant token is from agent {str(d.get('from'))[:64]!r}, not from the "
                                       f"peer written, {md.name!r}")
        if d.get("to") != self.name:
            raise InvalidArgumentError(f"the grant token is for agent {str(d.get('to'))[:64]!r}, not {self.name!r}")
        if d.get("region") != region:
            raise InvalidArgumentError(f"the grant token covers region {str(d.get('region'))[:64]!r}, the write goes "
                                       f"to {region!r}")
        if len(blocks) != peer_ids.size or blocks != peer_ids.tolist():
            raise InvalidArgumentError(f"the write's destination blocks must be the granted ones, in the granted "
                                       f"order: granted {_short(blocks)}, written {_short(peer_ids.tolist())}")
        self.claims.claim(md.agent_id, hid, md.name)
        return hid

    def give_back(self, handle, hid: int, deadline: float) -> None:
        """End a claimed grant unused (its route's target takes its own hold): one round trip."""
        reply, _ = handle.request({"type": "grant_end", "from": self.name, "grants": [hid]}, deadline=deadline)
        raise_remote(reply, handle.name)


def _short(ids: list) -> str:
    return f"{ids[:8]}"[:-1] + (f", ... ({len(ids)} ids)]" if len(ids) > 8 else "]")
