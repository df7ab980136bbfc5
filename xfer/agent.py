"""The Agent: one per process (or per engine rank). Register KV memory once, connect to peers
from their metadata, then move blocks by id lists. Every transfer ends by its deadline."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Sequence

import torch

from . import metadata as md_codec
from .ahead import Ahead
from .auth import Authenticator, secret_from
from .config import AgentConfig
from .control import ControlClient, ControlServer
from .frames import Later
from .error_codec import error_reply
from .guard import warn_if_exposed
from .inbox import Inbox
from .errors import (AgentClosedError, InvalidArgumentError, LayoutError, LayoutMismatchError, LengthMismatchError,
                     MetadataError, NotRegisteredError, PeerNotConnectedError, XferError)
from .layout import KVLayout
from .metadata import AgentMetadata, RegionRecord
from .metrics import Metrics
from .transfer import Notification, Op, Transfer
from .kernels import order_after_stream
from .transports import start as start_transports
from .transports.completion import raise_remote
from .transports.base import Job, LocalRegion, PeerHandle, Selection, TransportContext
from .transports.grants import Grants
from .plan import Plan as _Plan, Router, check_pair, check_post, host_id, unservable

__all__ = ["Agent"]

log = logging.getLogger("xfer.agent")


class Agent:
    """Moves KV blocks between this process and its peers.

    >>> with Agent("prefill-0") as agent:
    ...     agent.register("kv", tensors, layout)
    ...     peer = agent.connect(decode_metadata)
    ...     agent.write(peer, src_blocks=[3, 4], dst_blocks=[0, 1], notify=b"req-7").wait()
    """

    def __init__(self, name: str, config: AgentConfig | None = None):
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"agent name must be a non-empty str, got {name!r}")
        self.name = name
        self.config = config or AgentConfig()
        self.agent_id = uuid.uuid4().hex
        self._lock = threading.RLock()
        self._closed = False
        self._regions: dict[str, LocalRegion] = {}
        self._exports: dict[str, dict] = {}
        self._peers: dict[str, PeerHandle] = {}
        self._clients: dict[str, ControlClient] = {}
        # (peer, region, peer_region, is a write) -> what a post needs, its regions resolved, layouts
        # found compatible and route chosen once; emptied by register, deregister, connect, disconnect
        self._plans: dict[tuple, _Plan] = {}
        self._inflight: set[Transfer] = set()
        self._prune_at = 64
        here = host_id()
        self._grants = Grants(here)  # the target side's holds on blocks peers may write or read
        config = self.config
        self._fence_s = config.settings.fence.bound_s
        secret = secret_from(config.secret if config.secret is not None else config.settings.secret)
        self._auth = Authenticator(secret) if secret is not None else None
        # grants issued ahead: this agent's tokens (a target) and the tokens it was handed (an initiator)
        self._ahead = Ahead(name, self.agent_id, self._grants, self._auth, self._peers.get, self._fence_s)
        self._inbox = Inbox(name, self._regions.get, self._grants, here, self._ahead.claims)
        ctx = TransportContext(agent_name=name, agent_id=self.agent_id, host_id=here, config=self.config,
                               log=log, auth=self._auth, region=self._regions.get,
                               regions=lambda: list(self._regions.values()), deliver=self._inbox.deliver,
                               grants=self._grants)
        self.transports, self.unavailable = start_transports(config, ctx)
        self.metrics = Metrics(name)
        self._router = Router(name, here, config, self.transports, self.unavailable, self.metrics)
        self._server = ControlServer(self.config.listen_host, self.config.listen_port, self._handle,
                                     max_payload=self.config.max_notify_bytes, auth=self._auth,
                                     identity=(self.agent_id, name), limits=config.settings.control)
        self._host_id = here
        warn_if_exposed(log, name, self._auth is not None, {"control port": self.address[0], **{
            f"{k.value} listener": t.info().get("bind") for k, t in self.transports.items()}})

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"Agent({self.name!r}, id={self.agent_id[:8]}, {state}, regions={list(self._regions)}, "
                f"peers={list(self._peers)}, control={self.address[0]}:{self.address[1]})")

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def address(self) -> tuple[str, int]:
        return self._server.address

    def _check_open(self) -> None:
        if self._closed:
            raise AgentClosedError(f"agent {self.name!r} is closed")

    # ---- memory ------------------------------------------------------------------------------
    def register(self, name: str, kv_tensors: Sequence[torch.Tensor], layout: KVLayout) -> None:
        """Register a KV cache: ``kv_tensors`` are the base tensors ``layout`` describes."""
        self._check_open()
        if not isinstance(layout, KVLayout):
            raise LayoutError(f"layout must be a KVLayout, got {type(layout).__name__}")
        tensors = layout.check_tensors(kv_tensors)
        with self._lock:
            if name in self._regions:
                raise InvalidArgumentError(f"region {name!r} is already registered; deregister it first")
            region = LocalRegion(name=name, tensors=tensors, layout=layout)
            exports = {}
            for kind, transport in self.transports.items():
                desc = transport.export_region(region)
                if desc is not None:
                    exports[kind.value] = desc
            self._regions[name], self._exports[name] = region, exports
            self._plans = {}  # a region named None resolves to the only one: no longer

    def deregister(self, name: str) -> None:
        self._check_open()
        with self._lock:
            region = self._regions.pop(name, None)
            if region is None:
                raise NotRegisteredError(f"region {name!r} is not registered; registered: {sorted(self._regions)}")
            self._exports.pop(name, None)
            self._grants.retire(region)  # READs still copying from it are refused (their own check too)
            for transport in self.transports.values():
                transport.release_region(region)
            self._router.forget(region=name)
            self._plans = {}

    # ---- peers -------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """Everything a peer needs to connect and reach the registered regions."""
        self._check_open()
        with self._lock:
            regions = {n: RegionRecord(name=n, layout=r.layout, device=str(r.device), exports=self._exports[n])
                       for n, r in self._regions.items()}
        return md_codec.encode(auth=self._auth, md=AgentMetadata(
            name=self.name, agent_id=self.agent_id, pid=os.getpid(), hostname=socket.gethostname(),
            host_id=self._host_id, control=self.address, control_unix=self._server.unix_name,
            transports={k.value: t.info() for k, t in self.transports.items()}, regions=regions))

    def connect(self, peer_metadata: bytes) -> str:
        """Connect to a peer (re-connecting refreshes its metadata); returns its name.

        Raises :class:`LayoutMismatchError` (before any byte moves, the peer left unconnected) when
        no region registered here can ever exchange blocks with any region the peer registered:
        every pair differs in dtype, K/V count, block size or head dim (``xfer.plan.FIXED_FIELDS``).
        Pairs that differ only in layers or heads pass here (a one-layer or TP-heads view may be
        registered later); ``route()`` and the first post raise for such a pair."""
        self._check_open()
        md = md_codec.decode(peer_metadata, auth=self._auth)
        if md.agent_id == self.agent_id:
            raise InvalidArgumentError(f"agent {self.name!r} cannot connect to itself")
        client = ControlClient(md.control, md.name, self.config.connect_timeout_s, auth=self._auth,
                               identity=(self.agent_id, self.name), peer_id=md.agent_id,
                               max_header=self.config.settings.control.max_header,
                               spin_s=self.config.settings.control.spin_us * 1e-6,
                               unix=md.control_unix if md.host_id == self._host_id and
                               self.config.settings.control.unix else None)
        deadline = time.monotonic() + self.config.connect_timeout_s
        reply, _ = client.request({"type": "hello", "from": self.name, "agent_id": self.agent_id}, deadline=deadline)
        try:
            raise_remote(reply, md.name)
        except XferError:
            client.close()
            raise
        if reply.get("agent_id") != md.agent_id:
            client.close()
            raise MetadataError(f"stale metadata for {md.name!r}: {md.control[0]}:{md.control[1]} is served by "
                                f"agent {reply.get('agent_id')!r}, the metadata names {md.agent_id!r}")
        if any(t.notices_early for t in self.transports.values()):  # landing notices' own connection
            try:
                client.lane().open(deadline)
            except XferError:
                pass  # opened by the first transfer that finds it closed
        with self._lock:
            why = unservable(self.name, dict(self._regions), md.name, md.regions)
        if why is not None:
            client.close()
            raise LayoutMismatchError(why)
        with self._lock:
            self._check_open()
            old = self._clients.pop(md.name, None)
            if old is not None:
                old.close()
                for transport in self.transports.values():
                    transport.disconnect(self._peers[md.name].metadata.agent_id)
            self._clients[md.name] = client
            self._peers[md.name] = PeerHandle(metadata=md, request=client.request)
            self._router.forget(peer=md.name)
            self._plans = {}
        return md.name

    def publish(self, store) -> str:
        """Put this agent's metadata in ``store`` (an :class:`xfer.store.MetadataStore`) under its name.

        Call again after ``register`` so peers see the new regions. Returns the key.
        """
        key = f"agents/{self.name}"
        store.set(key, self.metadata())
        return key

    def connect_by_name(self, store, name: str, timeout: float | None = None) -> str:
        """Wait (up to ``timeout``, default ``connect_timeout_s``) for ``name`` in ``store``, then connect."""
        self._check_open()
        return self.connect(store.get(f"agents/{name}", self.config.connect_timeout_s if timeout is None else timeout))

    def disconnect(self, peer: str) -> None:
        with self._lock:
            handle = self._peers.pop(peer, None)
            if handle is None:
                raise PeerNotConnectedError(f"no peer named {peer!r}; connected: {sorted(self._peers)}")
            self._clients.pop(peer).close()
            self._router.forget(peer=peer)
            self._plans = {}
        for transport in self.transports.values():
            transport.disconnect(handle.metadata.agent_id)

    @property
    def peers(self) -> list[str]:
        return sorted(self._peers)

    def route(self, peer: str, op: Op | str = Op.WRITE, *, region: str | None = None,
              peer_region: str | None = None) -> Selection:
        """Which transport carries ``op`` between the two regions, and why (the choice is cached).

        Printed, the :class:`Selection` names the transport and why each one preferred over it was
        refused. Raises :class:`LayoutMismatchError` when the two regions' layouts cannot exchange
        blocks (the check every post makes), :class:`TransportUnavailableError` when no transport
        can serve them. Two agents of one host that only ``ucx`` can serve log one warning per
        peer (logger ``xfer.agent``) with the refusals and the fix."""
        self._check_open()
        local, handle, record = self._resolve(peer, region, peer_region)
        check_pair(self.name, local, handle.name, record)
        return self._router.select(local, handle, record, Op(op))

    def _local(self, region: str | None) -> LocalRegion:
        """The registered region ``region`` (None: the only one)."""
        if region is None:
            if len(self._regions) != 1:
                raise NotRegisteredError(f"agent {self.name!r} has regions {sorted(self._regions)}: name one")
            region = next(iter(self._regions))
        local = self._regions.get(region)
        if local is None:
            raise NotRegisteredError(f"region {region!r} is not registered; registered: {sorted(self._regions)}")
        return local

    def _resolve(self, peer: str, region: str | None, peer_region: str | None):
        handle = self._peers.get(peer)
        if handle is None:
            raise PeerNotConnectedError(f"no peer named {peer!r}; connected: {sorted(self._peers)}")
        local = self._local(region)
        regions = handle.metadata.regions
        if peer_region is None:  # the peer's region of the same name, else its only one
            peer_region = local.name if local.name in regions or len(regions) != 1 else next(iter(regions))
        record = regions.get(peer_region)
        if record is None:
            raise NotRegisteredError(f"peer {peer!r} has no region {peer_region!r}; it has {sorted(regions)}")
        return local, handle, record

    # ---- transfers ---------------------------------------------------------------------------
    def write(self, peer: str, src_blocks, dst_blocks, *, region: str | None = None, peer_region: str | None = None,
              notify: bytes = b"", timeout: float | None = None, after="stream", grant: str | None = None) -> Transfer:
        """Copy local blocks ``src_blocks`` onto the peer's blocks ``dst_blocks`` (all layers, K/V).

        The peer receives a :class:`Notification` carrying ``notify`` once every byte landed.
        ``after`` (CUDA regions): ``"stream"`` (default) orders the copy after the work already
        queued on the caller's current stream of the region's device (the KV a forward just
        wrote); a ``torch.cuda.Event`` orders it after that event only; ``None`` adds no ordering
        (the caller has synchronised). A pipelined producer should pass its per-layer event: the
        whole stream would also hold the copy behind every later layer already queued.
        ``grant``: the token the peer's :meth:`grant` returned for exactly ``dst_blocks`` (in that
        order): the write moves its bytes without first asking the peer for them (xfer.ahead).
        """
        return self._post(Op.WRITE, peer, src_blocks, dst_blocks, region, peer_region, notify, timeout, after,
                          grant)

    def read(self, peer: str, src_blocks, dst_blocks, *, region: str | None = None, peer_region: str | None = None,
             notify: bytes = b"", timeout: float | None = None, after="stream") -> Transfer:
        """Copy the peer's blocks ``src_blocks`` into local blocks ``dst_blocks``; the peer is notified.
        ``after``: as for :meth:`write` (here it orders the overwrite of the local blocks)."""
        return self._post(Op.READ, peer, src_blocks, dst_blocks, region, peer_region, notify, timeout, after)

    def _post(self, op, peer, src_blocks, dst_blocks, region, peer_region, notify, timeout,
              after="stream", grant=None) -> Transfer:
        if self._closed:
            self._check_open()
        timeout, notify = check_post(after, timeout, notify, self.config)
        with self._lock:
            plan = self._plans.get((peer, region, peer_region, op is Op.WRITE))  # (an enum's hash runs Python)
            if plan is None:
                plan = self._plan(op, peer, region, peer_region)
            src_ids = plan.src_layout.check_block_ids(src_blocks, what="source block ids")
            dst_ids = plan.dst_layout.check_block_ids(dst_blocks, what="destination block ids", unique=True)
            if src_ids.size != dst_ids.size:
                raise LengthMismatchError(f"{src_ids.size} source block ids but {dst_ids.size} destination block ids")
            local_ids, peer_ids = (src_ids, dst_ids) if op is Op.WRITE else (dst_ids, src_ids)
            hid = None if grant is None else self._ahead.claim(grant, plan.handle, plan.record.name, peer_ids)
            n = len(src_ids)
            transfer = Transfer(peer=peer, op=op, num_blocks=n, nbytes=n * plan.block_bytes,
                                path=plan.kind, timeout=float(timeout), observer=self.metrics.ended,
                                fence_s=self._fence_s)
            if len(self._inflight) >= self._prune_at:  # amortised: O(1) per post
                self._inflight = {t for t in self._inflight if not t._state.terminal}
                self._prune_at = max(64, 2 * len(self._inflight))
            self._inflight.add(transfer)
        ready = None
        if plan.cuda and after is not None:  # order after what the caller queued
            # an event of the caller's, else one recorded on its current stream (None: nothing queued there)
            ready = after if isinstance(after, torch.cuda.Event) else order_after_stream(plan.local.device)
        job = Job(transfer=transfer, op=op, local=plan.local, peer=plan.handle, peer_region=plan.record,
                  local_ids=local_ids, peer_ids=peer_ids, notify=notify, ready=ready)
        if hid is not None:
            if plan.transport.takes_grant(job):
                job.grant = hid
            else:  # its target takes its own hold: the grant goes back first (one round trip)
                try:
                    self._ahead.give_back(plan.handle, hid, transfer.deadline)
                except XferError as exc:
                    transfer.fail(exc)
                    return transfer
        plan.transport.post(job)
        return transfer

    def _plan(self, op: Op, peer: str, region: str | None, peer_region: str | None) -> _Plan:
        """Resolve a post's regions, check their layouts and choose its route; cached (``_plans``)
        once it all passed: a post to a known pair only checks its block ids."""
        local, handle, record = self._resolve(peer, region, peer_region)
        check_pair(self.name, local, handle.name, record)
        src_layout, dst_layout = (local.layout, record.layout) if op is Op.WRITE else (record.layout, local.layout)
        selection = self._router.select(local, handle, record, op)
        plan = _Plan(local=local, handle=handle, record=record, src_layout=src_layout, dst_layout=dst_layout,
                     transport=self.transports[selection.kind], kind=selection.kind.value,
                     cuda=local.device.type == "cuda", block_bytes=local.layout.bytes_per_block)
        self._plans[(peer, region, peer_region, op is Op.WRITE)] = plan
        return plan

    def send(self, peer: str, payload: bytes, *, timeout: float | None = None) -> None:
        """Deliver ``payload`` to ``peer`` as a :class:`Notification` (op MESSAGE, no blocks);
        returns once the peer has queued it, or raises (PeerDisconnectedError, TransferTimeoutError)."""
        self._check_open()
        if not isinstance(payload, (bytes, bytearray)) or len(payload) > self.config.max_notify_bytes:
            raise InvalidArgumentError(f"payload must be bytes of at most max_notify_bytes="
                                       f"{self.config.max_notify_bytes}, got {type(payload).__name__} "
                                       f"of {len(payload) if isinstance(payload, (bytes, bytearray)) else '?'}")
        client = self._clients.get(peer)
        if client is None:
            raise PeerNotConnectedError(f"no peer named {peer!r}; connected: {sorted(self._peers)}")
        timeout = self.config.default_timeout_s if timeout is None else timeout
        reply, _ = client.request({"type": "message", "from": self.name}, bytes(payload),
                                  deadline=time.monotonic() + timeout)
        raise_remote(reply, peer)

    # ---- passive side ------------------------------------------------------------------------
    def grant(self, peer: str, blocks, *, region: str | None = None) -> str:
        """Hold blocks ``blocks`` of ``region`` for one WRITE of ``peer`` now, ahead of it; returns
        the token the peer passes to :meth:`write` (``grant=``) with exactly these blocks, in this
        order. That write then moves its bytes at once instead of asking for them first (one round
        trip less); it is fenced as any WRITE (xfer.ahead). Raises :class:`BlocksBusyError` when
        another peer's unfenced transfer holds some of them. Blocks granted and not to be written
        (the request was dropped) are taken back by :meth:`revoke`, which asks ``peer`` first."""
        self._check_open()
        with self._lock:
            handle = self._peers.get(peer)
            if handle is None:
                raise PeerNotConnectedError(f"no peer named {peer!r}; connected: {sorted(self._peers)}")
            local = self._local(region)
        return self._ahead.grant(local, handle, blocks)

    def revoke(self, blocks, *, region: str | None = None, timeout: float | None = None) -> int:
        """Take back blocks peers were granted (the destination of their WRITEs, the source of their
        READs; ``region``: one region, None: every one, skipping ids past a region's end): returns
        once no byte of any incoming transfer into (or out of) them can still move, with how many
        transfers it stopped; no notification of those is delivered from then on (one delivered
        before is in the inbox), and a one-sided READ of them begun before is refused at its end.
        Raises :class:`FenceTimeoutError` after ``timeout`` (default ``settings.fence.bound_s``)
        when a transfer may still write them (its initiator stopped mid-copy): keep them
        quarantined and revoke again later."""
        self._check_open()
        with self._lock:
            if region is not None and region not in self._regions:
                raise NotRegisteredError(f"region {region!r} is not registered; registered: {sorted(self._regions)}")
            regions = list(self._regions.values()) if region is None else [self._regions[region]]
        return self._grants.revoke(regions, blocks, self._fence_s if timeout is None else timeout,
                                   strict=region is not None)

    @property
    def regions(self) -> list[str]:
        """The names of the registered regions."""
        return sorted(self._regions)

    def notifications(self, peer: str | None = None) -> list[Notification]:
        """Drain the notifications received so far (from ``peer`` only, if given)."""
        return self._inbox.take(peer)

    def wait_notification(self, timeout: float, *, peer: str | None = None) -> Notification:
        """The next notification (from ``peer``), waiting at most ``timeout`` seconds."""
        self._check_open()
        note = self._inbox.wait(timeout, peer, lambda: self._closed)
        self._check_open()
        return note

    def _handle(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        """The control server's handler (its thread): hello, notices and messages, else the
        transport the message type names (``"<kind>.<what>"``)."""
        kind = header.get("type")
        if kind == "hello":
            return {"ok": True, "agent_id": self.agent_id, "name": self.name}, b""
        reply = self._inbox.handle(kind, header, payload)  # grants, notices, messages
        if reply is not None:
            return reply if isinstance(reply, Later) else (reply, b"")
        prefix = kind.split(".", 1)[0] if isinstance(kind, str) and "." in kind else None
        for tkind, transport in self.transports.items():
            if tkind.value == prefix:
                return transport.handle_control(header, payload)
        return error_reply(InvalidArgumentError(f"unknown control message {kind!r}")), b""

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop in-flight transfers, close transports (each fences or fails what it carried) and the
        control port. Idempotent. Once it returned, no byte moves into or out of the regions."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            inflight, self._inflight = self._inflight, set()
            for region in self._regions.values():  # peers' READs still copying from them are refused
                self._grants.retire(region)
        for t in inflight:
            t.stop(AgentClosedError(f"agent {self.name!r} closed before transfer {t.id} ended"))
        for transport in self.transports.values():
            transport.close()
        for t in inflight:  # the transports' threads are gone: nothing of these moves any more
            t.fail(AgentClosedError(f"agent {self.name!r} closed before transfer {t.id} ended"))
        for client in self._clients.values():
            client.close()
        self._server.close()
        self._inbox.wake()
        for region in self._regions.values():
            for transport in self.transports.values():
                transport.release_region(region)
