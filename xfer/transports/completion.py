"""How a transfer ends when the initiator moved the bytes itself (the one-sided transports, and
NVSHMEM's reads and empty transfers): it tells the peer which of its blocks were written or read,
over the agents' control channel, and completes once the peer acknowledged; a refusal or a lost
notice fails it. The peer never hears of blocks that did not fully land.

Transfers end only through :meth:`~xfer.transfer.Transfer.complete` / ``fail``.
"""

from __future__ import annotations

from .. import errors
from ..error_codec import reply_error
from .base import Job

__all__ = ["notify_peer", "notify_peer_batch", "raise_remote", "complete_notified"]


def raise_remote(reply: dict, peer: str) -> None:
    """Turn an error reply from ``peer`` into the typed exception it names (xfer.error_codec)."""
    error = reply_error(reply, peer)
    if error is not None:
        raise error


def _notice(job: Job) -> dict:
    return {"transfer_id": job.transfer.id, "op": job.op.value, "region": job.peer_region.name,
            "blocks": job.peer_ids.tolist()}


def notify_peer(job: Job, sender: str) -> None:
    """Tell the peer which of its blocks this transfer wrote or read; return once it acknowledged."""
    reply, _ = job.peer.request({"type": "notify", "from": sender, **_notice(job)}, job.notify,
                                deadline=job.transfer.deadline)
    raise_remote(reply, job.peer.name)


def notify_peer_batch(jobs: list[Job], sender: str) -> list[errors.XferError | None]:
    """Notices of several transfers to one peer in one message (``notify_batch``); returns each
    one's refusal (None: delivered). Raises when the peer refused or missed the whole message."""
    header = {"type": "notify_batch", "from": sender,
              "batch": [{**_notice(j), "payload_bytes": len(j.notify)} for j in jobs]}
    reply, _ = jobs[0].peer.request(header, b"".join(j.notify for j in jobs),
                                    deadline=min(j.transfer.deadline for j in jobs))
    name = jobs[0].peer.name
    raise_remote(reply, name)
    failed = reply.get("failed") or {}
    return [reply_error({"ok": False, **failed[str(i)]}, name) if str(i) in failed else None
            for i in range(len(jobs))]


def complete_notified(batch: list[Job], sender: str) -> None:
    """Notify the peer of every job of ``batch`` (one peer; one message, ``notify_batch``, for
    several), then end each transfer: DONE once acknowledged, failed where the peer refused its
    notice, every one failed when the message itself failed."""
    try:
        if len(batch) == 1:
            notify_peer(batch[0], sender)
            refused = [None]
        else:
            refused = notify_peer_batch(batch, sender)
    except BaseException as exc:  # noqa: BLE001 - every failure ends the transfers
        for job in batch:
            job.transfer.fail(exc)
        return
    for job, error in zip(batch, refused):
        job.transfer.mark("acked")
        if error is None:
            job.transfer.complete()
        else:
            job.transfer.fail(error)
