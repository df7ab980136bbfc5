"""Completion notices over the agents' control channel, shared by the one-sided transports."""

from __future__ import annotations

from .. import errors
from .base import Job

__all__ = ["notify_peer", "raise_remote"]


def raise_remote(reply: dict, peer: str) -> None:
    """Turn an error reply from ``peer`` into the typed exception it names."""
    if reply.get("ok"):
        return
    name = reply.get("error")
    cls = getattr(errors, name, None) if isinstance(name, str) and name in errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, errors.XferError)):
        cls = errors.TransportError
    raise cls(f"peer {peer!r} refused: {reply.get('message', '(no message)')}")


def notify_peer(job: Job, sender: str) -> None:
    """Tell the peer which of its blocks this transfer wrote or read; return once it acknowledged."""
    header = {
        "type": "notify", "from": sender, "transfer_id": job.transfer.id, "op": job.op.value,
        "region": job.peer_region.name, "blocks": job.peer_ids.tolist(),
    }
    reply, _ = job.peer.request(header, job.notify, deadline=job.transfer.deadline)
    raise_remote(reply, job.peer.name)
