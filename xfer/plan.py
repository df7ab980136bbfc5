"""What the agent resolves once per route: this host's identity, and a post's plan."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from .layout import KVLayout
from .metadata import RegionRecord
from .transports.base import LocalRegion, PeerHandle, Transport

__all__ = ["Plan", "host_id"]


def host_id() -> str:
    """This host's identity for 'same host' decisions: its name and its boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True, slots=True)
class Plan:
    """What a post to one (peer, region, peer region, direction) needs, resolved and checked once."""

    local: LocalRegion
    handle: PeerHandle
    record: RegionRecord
    src_layout: KVLayout  # the source side's layout (local for a WRITE, the peer's for a READ)
    dst_layout: KVLayout
    transport: Transport
    kind: str  # the transport's name, the transfer's first ``path``
    cuda: bool  # the local region is CUDA memory (a post records the caller's stream)
    block_bytes: int  # bytes of one block, all layers and K/V
