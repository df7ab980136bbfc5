"""How a transfer starts and ends when the initiator moves the bytes itself (the one-sided
transports, and NVSHMEM's reads and empty transfers), over the agents' control channel:

- before any byte of a WRITE moves it asks the peer for a grant of its transfers
  (:func:`request_grants`, one message for several; :func:`ask_grants` sends it and returns at
  once, :func:`await_grants` takes the reply, so the copy is prepared meanwhile): the peer checks
  region, layout fingerprint, ids and the request's age, and holds the blocks (a refused one
  moves nothing). A READ writes
  only this side's memory: it copies at once, and its notice says when the copy began (the peer
  refuses it if its blocks were written or revoked since: xfer.transports.grants.check_read);
- once its copy ended it tells the peer which of its blocks were written or read, naming the grant
  and its time to live, and completes once the peer acknowledged (the peer delivered the
  notification); a refusal or a lost notice fails it. The peer never hears of blocks that did not
  fully land, of a transfer it revoked, nor of one whose notice came past its deadline;
- a transfer that stopped or failed after its grant ends it (:func:`end_grants`) once its copy
  ended, so the peer's blocks are free for the next writer.

A notice waits for the peer's reply up to ``grace`` past the transfer's deadline: a stop reached
during it is the peer's answer (DONE where it delivered, else the stop's state).

Transfers end only through :meth:`~xfer.transfer.Transfer.complete` / ``fail``.
"""

from __future__ import annotations

import functools
import os
import threading
import time

import numpy as np

from .. import errors
from ..error_codec import reply_error
from ..guard import PACKED_IDS
from .base import Job

__all__ = ["notify_peer", "notify_peer_batch", "raise_remote", "complete_notified", "request_grants", "ask_grants",
           "await_grants", "GrantAsk", "end_grants", "end_grants_soon", "send_landing_notice", "landing_reply",
           "landing_reply_of", "open_landing_lane", "send_notices", "notices_answer"]


@functools.lru_cache(maxsize=64)
def _fingerprint(layout) -> str:
    return layout.fingerprint_hash()


def raise_remote(reply: dict, peer: str) -> None:
    """Turn an error reply from ``peer`` into the typed exception it names (xfer.error_codec)."""
    error = reply_error(reply, peer)
    if error is not None:
        raise error


def _notice(job: Job, checked: bool = False) -> dict:
    now = time.monotonic()
    out = {"transfer_id": job.transfer.id, "op": job.op.value, "region": job.peer_region.name,
           "ttl": max(job.transfer.deadline - now, 0.0), "sent": now}
    if job.grant is None:  # a READ, NVSHMEM's reads, empty transfers: the notice names the blocks
        out["blocks"] = job.peer_ids.tolist()
        if job.started is not None:  # a one-sided READ: the peer checks nothing changed since
            out["started"] = job.started
            if checked:  # ... unless its initiator did (xfer.transports.onesided.readcheck)
                out["reader_checked"] = True
    else:  # the peer holds the blocks it checked under the grant
        out["grant"] = job.grant
    return out


def _who(sender: str, host: str) -> dict:
    return {"from": sender, "pid": os.getpid(), "host": host}


def _notices(jobs: list[Job], sender: str, host: str, grace: float, checked: bool = False) -> tuple:
    """(header, payload, deadline) of the notices of ``jobs`` (one peer): ``notify`` for one,
    ``notify_batch`` for several; ``checked``: READs their initiator checked (``reader_checked``)."""
    deadline = min(j.transfer.deadline for j in jobs) + grace
    if len(jobs) == 1:
        return {"type": "notify", **_who(sender, host), **_notice(jobs[0], checked)}, jobs[0].notify, deadline
    header = {"type": "notify_batch", **_who(sender, host),
              "batch": [{**_notice(j, checked), "payload_bytes": len(j.notify)} for j in jobs]}
    return header, b"".join(j.notify for j in jobs), deadline


def notify_peer(job: Job, sender: str, host: str = "", grace: float = 0.0) -> None:
    """Tell the peer which of its blocks this transfer wrote or read; return once it acknowledged."""
    header, payload, deadline = _notices([job], sender, host, grace)
    reply, _ = job.peer.request(header, payload, deadline=deadline)
    raise_remote(reply, job.peer.name)


def notify_peer_batch(jobs: list[Job], sender: str, host: str = "", grace: float = 0.0) -> list[errors.XferError | None]:
    """Notices of several transfers to one peer in one message (``notify_batch``); returns each
    one's refusal (None: delivered). Raises when the peer refused or missed the whole message."""
    header, payload, deadline = _notices(jobs, sender, host, grace)
    reply, _ = jobs[0].peer.request(header, payload, deadline=deadline)
    name = jobs[0].peer.name
    raise_remote(reply, name)
    failed = reply.get("failed") or {}
    return [reply_error({"ok": False, **failed[str(i)]}, name) if str(i) in failed else None
            for i in range(len(jobs))]


def send_landing_notice(job: Job, sender: str, host: str, grace: float, landing: dict):
    """Send ``job``'s notice now, before its copy ended, naming its landing slot (``landing``: box,
    slot, seq; xfer.transports.onesided.mailbox) on the peer's landing connection, without waiting
    for the reply: (client, pending), or None where that connection cannot take it at once
    (not open: :func:`open_landing_lane`; busy) and nothing was sent."""
    lane = _landing_lane(job.peer)
    if lane is None or not lane.is_open:
        return None
    header = {"type": "notify", **_who(sender, host), **_notice(job), "landing": landing}
    pending = lane.submit(header, job.notify, deadline=job.transfer.deadline + grace, block=False)
    return None if pending is None else (lane, pending)


def _landing_lane(peer):
    """The peer's second control connection, which carries landing notices only: the peer holds
    a landing notice's connection until the slot is written, and the completer waits, meanwhile,
    on replies of the notices before it (on the first connection); on one connection the two
    would wait on each other until the deadline. Its landing notices are answered in the order
    they were sent, which is the completer's (launch) order."""
    client = _pipelined(peer)
    return None if client is None or not callable(getattr(client, "lane", None)) else client.lane()


def open_landing_lane(peer, deadline: float) -> bool:
    """Open the peer's landing connection unless it is open (a landing notice is sent only on an
    open one, without waiting): True when it is open."""
    lane = _landing_lane(peer)
    if lane is None:
        return False
    if not lane.is_open:
        try:
            lane.open(deadline)
        except errors.XferError:
            return False
    return True


def landing_reply(job: Job, client, pending, grace: float) -> None:
    """The peer's answer to a landing notice (:func:`send_landing_notice`), once the slot was
    written: returns when it delivered, raises what it refused (or the message's failure)."""
    client.result(pending, job.transfer.deadline + grace)
    landing_reply_of(pending, job.peer.name)


def send_notices(jobs: list[Job], sender: str, host: str = "", grace: float = 0.0):
    """Send the notices of READs their initiator checked itself (``reader_checked``; one peer, one
    message: ``notify_batch`` for several) without waiting for the answer: (client, pending), or
    None where the peer's channel takes one request at a time (then it was answered here). Raises
    where sending failed."""
    header, payload, deadline = _notices(jobs, sender, host, grace, checked=True)
    client = _pipelined(jobs[0].peer)
    if client is None:
        reply, _ = jobs[0].peer.request(header, payload, deadline=deadline)
        notices_answer(reply, jobs[0].peer.name)
        return None
    return client, client.submit(header, payload, deadline=deadline)


def notices_answer(reply: dict, peer_name: str) -> None:
    """Raise what the peer refused of a ``notify`` or ``notify_batch`` message (the first refusal
    of a batch), or return."""
    raise_remote(reply, peer_name)
    failed = reply.get("failed") or {}
    if failed:
        first = next(iter(failed.values()))
        raise reply_error({"ok": False, **first}, peer_name) or errors.TransportError(
            f"peer {peer_name!r} refused {len(failed)} notice(s)")


def landing_reply_of(pending, peer_name: str) -> None:
    """The answer to a landing notice that came (``pending.done``): returns when the peer
    delivered, raises what it refused (or the message's failure)."""
    if pending.error is not None:
        raise pending.error
    notices_answer(pending.reply[0], peer_name)


class GrantAsk:
    """A grant request of ``jobs`` (one peer) on its way: :func:`await_grants` takes the reply.
    ``pending``: the control client's pending reply (the request is sent); None where the peer's
    channel takes one request at a time (then it is sent when awaited)."""

    __slots__ = ("jobs", "header", "payload", "deadline", "client", "pending")

    def __init__(self, jobs: list[Job], header: dict, payload: bytes, deadline: float, client=None, pending=None):
        self.jobs, self.header, self.payload, self.deadline = jobs, header, payload, deadline
        self.client, self.pending = client, pending


def _pipelined(peer):
    """The peer's control client where it takes several requests in flight (xfer.control_client), else None."""
    client = getattr(peer.request, "__self__", None)
    return client if callable(getattr(client, "submit", None)) else None


def ask_grants(jobs: list[Job], sender: str, host: str, *, block: bool = True, packed: int = 0) -> GrantAsk | None:
    """Send the grant request of ``jobs`` (one peer, ``jobs[0].peer``; one message) and return at
    once; :func:`await_grants` takes the reply. ``block`` False: None where it cannot be sent
    without waiting (the channel busy or not connected yet), nothing sent. ``packed``: the most
    payload bytes the peer takes (its transport info's ``grant_packed``; 0: none): where the ids fit,
    they travel as little-endian int64 in the message's payload, each transfer naming how many are
    its (``nblocks``), not as JSON lists (on the CPU VM the encoding, parsing and checking of a
    burst's 32 transfers of 128 ids took 0.67-0.73 ms so, against 1.18-1.19). Raises when sending failed
    (then nothing was granted)."""
    now = time.monotonic()
    pack = packed > 0 and PACKED_IDS.itemsize * sum(len(j.peer_ids) for j in jobs) <= packed
    entries = []
    for j in jobs:
        e = {"transfer_id": j.transfer.id, "op": j.op.value, "region": j.peer_region.name,
             "fingerprint": _fingerprint(j.peer_region.layout), "ttl": max(j.transfer.deadline - now, 0.0), "sent": now}
        if pack:
            e["nblocks"] = len(j.peer_ids)
        else:
            e["blocks"] = j.peer_ids.tolist()
        entries.append(e)
    header = {"type": "grant", **_who(sender, host), "transfers": entries}
    payload = b"".join(np.asarray(j.peer_ids, dtype=PACKED_IDS).tobytes() for j in jobs) if pack else b""
    deadline = min(j.transfer.deadline for j in jobs)
    client = _pipelined(jobs[0].peer)
    if client is None:
        return GrantAsk(jobs, header, payload, deadline) if block else None
    pending = client.submit(header, payload, deadline=deadline, block=block)
    return None if pending is None else GrantAsk(jobs, header, payload, deadline, client, pending)


def await_grants(ask: GrantAsk) -> list[errors.XferError | None]:
    """The reply to ``ask``: set each granted job's ``grant`` and return each one's refusal (None:
    granted). Raises when the message itself failed (then nothing was granted, or
    :func:`end_grants` by transfer id ends it)."""
    jobs = ask.jobs
    if ask.pending is None:
        reply, _ = jobs[0].peer.request(ask.header, ask.payload, deadline=ask.deadline)
    else:
        reply, _ = ask.client.result(ask.pending, ask.deadline)
    name = jobs[0].peer.name
    raise_remote(reply, name)
    granted, failed = reply.get("grants") or {}, reply.get("failed") or {}
    out = []
    for i, job in enumerate(jobs):
        hid = granted.get(str(i))
        if isinstance(hid, int) and not isinstance(hid, bool):
            job.grant = hid
            out.append(None)
        else:
            out.append(reply_error({"ok": False, **failed[str(i)]}, name) if str(i) in failed else
                       errors.TransportError(f"peer {name!r} answered no grant for transfer {job.transfer.id}"))
    return out


def request_grants(jobs: list[Job], sender: str, host: str) -> list[errors.XferError | None]:
    """Ask the peer (one, ``jobs[0].peer``) to grant every job's blocks, in one message; set each
    granted job's ``grant`` and return each one's refusal (None: granted). Raises when the message
    itself failed (then nothing was granted, or :func:`end_grants` by transfer id ends it)."""
    return await_grants(ask_grants(jobs, sender, host))


def end_grants(jobs: list[Job], sender: str, deadline: float, by_id: bool = False) -> None:
    """The jobs' transfers (one peer) stopped or failed after their grants, their copies ended:
    the peer ends their grants (``by_id``: named by transfer id, where the grant reply was lost).
    Raises when the message failed (the caller retries)."""
    header = {"type": "grant_end", "from": sender, "grants": [j.grant for j in jobs if j.grant is not None]}
    if by_id:
        header["tids"] = [j.transfer.id for j in jobs]
    reply, _ = jobs[0].peer.request(header, deadline=deadline)
    raise_remote(reply, jobs[0].peer.name)


def end_grants_soon(job: Job, sender: str, grace: float = 1.0) -> None:
    """``job`` (a WRITE under a grant issued ahead, xfer.ahead) ended before its target heard of
    it: end the grant from a thread of its own (one attempt, by the transfer's deadline + ``grace``;
    unanswered, the target's revoke names it). For callers that must not wait (an event loop)."""
    if job.grant is None:
        return

    def end() -> None:
        try:
            end_grants([job], sender, job.transfer.deadline + grace)
        except BaseException:  # noqa: BLE001 - best effort: the target's revoke or reap ends it
            pass
    threading.Thread(target=end, name="xfer-grant-end", daemon=True).start()


def complete_notified(batch: list[Job], sender: str, host: str = "", grace: float = 0.0, ended=None) -> None:
    """Notify the peer of every job of ``batch`` (one peer; one message, ``notify_batch``, for
    several), then end each transfer: DONE once acknowledged, failed where the peer refused its
    notice (which ended its grant), every one failed when the message itself failed (after
    ``ended(jobs)``: the caller ends their grants)."""
    try:
        if len(batch) == 1:
            notify_peer(batch[0], sender, host, grace)
            refused = [None]
        else:
            refused = notify_peer_batch(batch, sender, host, grace)
    except BaseException as exc:  # noqa: BLE001 - every failure ends the transfers
        if ended is not None:
            ended(batch)
        for job in batch:
            job.transfer.fail(exc)
        return
    for job, error in zip(batch, refused):
        job.transfer.mark("acked")
        if error is None:
            job.transfer.complete()
        else:
            job.transfer.fail(error)
