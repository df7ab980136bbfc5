"""What the agent resolves once per route: this host's identity, a post's plan, whether two
regions can exchange blocks, and the warning for a pair of one host on a cross-host transport."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Mapping

from .errors import LayoutMismatchError
from .layout import KVLayout
from .metadata import RegionRecord
from .transports import TransportKind
from .transports.base import LocalRegion, PeerHandle, Selection, Transport

__all__ = ["Plan", "host_id", "check_pair", "unservable", "slow_route", "FIXED_FIELDS"]

# The layout fields every view of a region keeps, whatever view of it an agent registers later:
# one layer of a cross-layer cache changes num_layers, a TP rank's share of the heads num_heads
# (xfer.engine's KVLink.ensure_heads registers those, SGLang's prefill after it connected), but
# no view changes these. Regions that differ in one of them can never exchange blocks.
FIXED_FIELDS = ("num_kv", "block_size", "head_dim", "dtype")


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


def check_pair(agent: str, local: LocalRegion, peer: str, record: RegionRecord) -> None:
    """Raise :class:`LayoutMismatchError` when ``local`` and the peer's ``record`` cannot exchange
    blocks (``KVLayout.check_compatible``, the check every post's plan makes; the fingerprint is
    symmetric, so one check serves a WRITE and a READ), naming both regions and the first field
    that differs with both values."""
    try:
        local.layout.check_compatible(record.layout, what="peer")
    except LayoutMismatchError as exc:
        raise LayoutMismatchError(f"{agent}:{local.name} -> {peer}:{record.name}: {exc}") from None


def unservable(agent: str, regions: Mapping[str, LocalRegion], peer: str,
               records: Mapping[str, RegionRecord]) -> str | None:
    """Why no region of ``agent`` can ever exchange blocks with any region ``peer`` registered, or
    None when a pair may (or one side registered nothing yet). Only :data:`FIXED_FIELDS` count:
    a pair that differs in its layers or heads alone may be served by a view registered later."""
    if not regions or not records:
        return None
    why = []
    for record in records.values():
        for local in regions.values():
            try:
                local.layout.check_compatible(record.layout, what="peer", fields=FIXED_FIELDS)
            except LayoutMismatchError as exc:
                why.append(f"{agent}:{local.name} -> {peer}:{record.name}: {exc}")
            else:
                return None
    shown = "; ".join(why[:4]) + (f"; and {len(why) - 4} more pairs" if len(why) > 4 else "")
    return f"no region of peer {peer!r} can exchange blocks with a region of {agent!r}: {shown}"


def slow_route(agent: str, here: str, local: LocalRegion, handle: PeerHandle, record: RegionRecord,
               sel: Selection) -> str | None:
    """The one-line warning for two agents of one host (``here``: this agent's host id) that a
    cross-host transport carries because every faster one refused them: the route, each refusal
    and the fix. None when no warning is due: another transport carries it, the peer is on
    another host, or the transport was pinned (nothing was refused)."""
    md = handle.metadata
    if sel.kind is not TransportKind.UCX or md.host_id != here or not sel.rejected:
        return None
    refused = "; ".join(f"{k} refused: {r}" for k, r in sel.rejected.items())
    if local.device.type == "cpu" and record.device == "cpu":
        fix = ("allocate the caches in shared memory, in both processes: xfer.shared_empty, or "
               "make_kv_cache(..., empty=xfer.shared_empty)")
    else:
        fix = ("what the refusals name: CUDA memory both processes can reach (ipc), or host memory from "
               "xfer.shared_empty / make_kv_cache(..., empty=xfer.shared_empty) on both sides (local)")
    return (f"{agent}:{local.name} -> {md.name}:{record.name} goes over ucx (network stack, far slower than a "
            f"memory copy) although both agents are on host {md.hostname!r}: {refused}. Fix: {fix}")
