"""What the agent resolves once per route: this host's identity, a post's plan, whether two
regions can exchange blocks, the route chosen for a pair (:class:`Router`, the one owner of the
routes table) and the warning for a pair of one host on a cross-host transport."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Mapping

import torch

from .errors import InvalidArgumentError, LayoutMismatchError, TransportUnavailableError
from .layout import KVLayout
from .metadata import RegionRecord
from .transfer import Op
from .transports import PREFERENCE, TransportKind
from .transports.base import LocalRegion, PeerHandle, Selection, Transport

__all__ = ["Plan", "Router", "host_id", "check_pair", "check_post", "unservable", "slow_route", "FIXED_FIELDS"]

log = logging.getLogger("xfer.agent")

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


def check_post(after, timeout, notify, config) -> tuple[float, bytes]:
    """A post's ``after``, ``timeout`` and ``notify`` checked (``config``: its AgentConfig): the
    timeout (the config's default for None) and the payload as bytes. The defaults (no deadline
    given, no payload, after="stream") pass without a check each: a post meets cold caches, where
    every call and isinstance costs microseconds."""
    if after is not None and not (after.__class__ is str and after == "stream") and \
            not isinstance(after, torch.cuda.Event):
        raise InvalidArgumentError(f"after must be 'stream', a torch.cuda.Event or None, got {after!r}")
    if timeout is None:
        timeout = config.default_timeout_s  # validated by AgentConfig
    elif not isinstance(timeout, (int, float)) or not timeout > 0 or timeout == float("inf"):
        raise InvalidArgumentError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if notify.__class__ is not bytes:
        if not isinstance(notify, (bytes, bytearray)):
            raise InvalidArgumentError(f"notify must be bytes, got {type(notify).__name__}")
        notify = bytes(notify)
    if len(notify) > config.max_notify_bytes:
        raise InvalidArgumentError(f"notify payload of {len(notify)} bytes exceeds max_notify_bytes="
                                   f"{config.max_notify_bytes}")
    return timeout, notify


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


class Router:
    """The routes an agent chose: which transport carries each (peer, region, peer region, op) and
    why, chosen once (the first transport of ``PREFERENCE``, or the pinned one, able to serve the
    pair) and kept until :meth:`forget`. ``transports`` / ``unavailable``: the agent's started
    transports and the reasons of the others, by kind. Logs each choice, and one warning per peer
    when two agents of one host got ``ucx`` because the faster paths refused them."""

    def __init__(self, agent: str, here: str, config, transports: dict, unavailable: dict, metrics) -> None:
        self.agent, self.here, self.config, self.metrics = agent, here, config, metrics
        self.transports, self.unavailable = transports, unavailable
        self._routes: dict[tuple, Selection] = {}
        self._slow_warned: set[str] = set()  # agent ids of the peers a slow-route warning named

    def forget(self, peer: str | None = None, region: str | None = None) -> None:
        """Drop the routes of ``peer`` (its metadata changed, it left) or of local ``region``."""
        self._routes = {k: v for k, v in self._routes.items()
                        if not (peer is not None and k[0] == peer or region is not None and k[1] == region)}

    def select(self, local: LocalRegion, handle: PeerHandle, record: RegionRecord, op: Op) -> Selection:
        """The route of ``op`` between ``local`` and the peer's ``record``; raises
        :class:`TransportUnavailableError` naming every refusal when no transport can serve it."""
        key = (handle.name, local.name, record.name, op)
        if key in self._routes:
            return self._routes[key]
        pinned = self.config.transport
        rejected = {}
        for kind in PREFERENCE:
            if pinned is not None and kind is not pinned:
                continue
            transport = self.transports.get(kind)
            if transport is None:
                reason = self.unavailable[kind].removeprefix(f"{kind.value}: ")
            elif kind.value not in handle.metadata.transports:
                reason = f"peer {handle.name!r} does not offer {kind.value}"
            else:
                reason = transport.check_route(local, handle, record, op)
            if reason is None:
                why = "pinned by config" if pinned is not None else (
                    f"first of {[k.value for k in PREFERENCE]} able to serve this pair")
                sel = Selection(kind=kind, reason=why, rejected=rejected)
                self.metrics.route(handle.name, kind.value)
                log.info("xfer route %s:%s -> %s:%s (%s): %s", self.agent, local.name, handle.name, record.name,
                         op.value, sel)
                self._routes[key] = sel
                self._warn_if_slow(local, handle, record, sel)
                return sel
            rejected[kind.value] = reason
        if pinned is not None:
            raise TransportUnavailableError(f"pinned transport {pinned.value!r} cannot serve {self.agent}:{local.name} "
                                            f"-> {handle.name}:{record.name}: {rejected[pinned.value]}")
        raise TransportUnavailableError(f"no transport can serve {self.agent}:{local.name} -> {handle.name}:"
                                        f"{record.name}: " + "; ".join(f"{k}: {v}" for k, v in rejected.items()))

    def _warn_if_slow(self, local: LocalRegion, handle: PeerHandle, record: RegionRecord, sel: Selection) -> None:
        """One warning per peer (not per region: an engine registers one region per layer); none
        where the config left out both same-host paths (``AgentConfig.enable``)."""
        enable = self.config.enable
        if enable is not None and TransportKind.LOCAL not in enable and TransportKind.IPC not in enable:
            return
        if handle.metadata.agent_id in self._slow_warned:
            return
        line = slow_route(self.agent, self.here, local, handle, record, sel)
        if line is not None:
            self._slow_warned.add(handle.metadata.agent_id)
            log.warning("xfer slow route: %s (logged once per peer)", line)
