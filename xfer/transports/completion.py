"""Completion notices over the agents' control channel, shared by the one-sided transports."""

from __future__ import annotations

from .. import errors
from ..error_codec import reply_error
from .base import Job

__all__ = ["notify_peer", "notify_peer_batch", "raise_remote"]


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
