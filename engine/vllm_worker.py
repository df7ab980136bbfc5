"""The worker side of the vLLM connector (``xfer.engine.vllm_connector``): one per TP rank.

Prefill ranks hold finished requests' blocks under a lease until every reader released them;
decode ranks load requests' blocks with one xfer READ per layer. Nothing here waits on the
network from vLLM's engine thread: finding and connecting to peers, posting reads and sending
releases run on a ``Background`` (see the connector's module doc). Imports nothing from vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from xfer import KVLayout
from xfer.errors import FenceTimeoutError, LayoutError, XferError
from xfer.transfer import Op

from .background import Background
from .kvlink import (KVLink, LeaseTable, LinkConfig, LoadErrors, TransferGroup, head_plan, rank_heads,
                     readers_of)
from .vllm_settings import LAYOUTS as _LAYOUTS
from .vllm_settings import XferSettings

__all__ = ["LoadSpec", "HoldSpec", "ReleaseSpec", "WorkerSide", "vllm_layer_layout"]

log = logging.getLogger("xfer.engine.vllm")


@dataclass
class LoadSpec:
    """Decode side: read ``remote_blocks`` of the prefill engine into ``local_blocks`` (all layers)."""

    req_id: str
    key: str  # the prefill side's request id: names its lease
    engine: str
    remote_tp: int
    remote_blocks: list[int]
    local_blocks: list[int]
    sync: bool
    lease_expires: float  # time.time() at which the prefill side may free the blocks
    store: str | None = None  # the store the prefill published in (None: this instance's own)


@dataclass
class HoldSpec:
    """Prefill side: keep ``blocks`` of request ``req_id`` until its readers release them (or the lease ends)."""

    req_id: str
    blocks: list[int]


@dataclass
class ReleaseSpec:
    """Decode side: a request finished before its load was planned (aborted before it was
    scheduled): tell the prefill ranks this rank would have read from to free ``key``'s blocks."""

    key: str
    engine: str
    remote_tp: int
    store: str | None = None


def vllm_layer_layout(t: torch.Tensor, *, mla: bool, kind: str = "auto") -> KVLayout:
    """The xfer layout of one layer's KV cache tensor as vLLM hands it to ``register_kv_caches``.

    vLLM >= 0.2x: ``[B, H, N, C]`` views (any stride order; K|V packed in C = 2*head_size, or the
    MLA latent with H = 1). Older: FlashAttention ``(2, B, N, H, C)`` (NHD/HND by strides),
    FlashInfer ``(B, 2, N, H, C)``, MLA ``(B, N, C)``.
    """
    if kind == "auto":
        if t.dim() == 5:
            kind = "flash_attn" if t.shape[0] == 2 else "flashinfer" if t.shape[1] == 2 else "?"
        elif t.dim() == 4:
            kind = "mla" if mla else "packed"
        elif t.dim() == 3 and mla:
            kind = "mla"
        else:
            kind = "?"
    if kind == "flash_attn":
        return KVLayout.vllm_flash_attn([t])
    if kind == "flashinfer":
        return KVLayout.vllm_flashinfer([t])
    if kind == "packed":
        return KVLayout.packed_kv([t])
    if kind == "mla" and t.dim() == 4:
        if t.shape[1] != 1:
            raise LayoutError(f"an MLA cache holds one latent head: expected [B, 1, N, C], got {tuple(t.shape)}")
        return KVLayout.from_tensors([t], "BHNC", num_kv=1, name="mla_fp8" if t.dtype == torch.uint8 else "mla")
    if kind == "mla" and t.dim() == 3:
        return KVLayout.mla([t])
    raise LayoutError(f"cannot tell the KV layout of a {tuple(t.shape)} tensor (use_mla={mla}); set "
                      f"kv_connector_extra_config.layout to one of {_LAYOUTS[1:]}")


def _tp_rank(s: XferSettings) -> int:
    if s.tp_rank is not None:
        return int(s.tp_rank)
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # no model-parallel group (single process, tests): rank 0
        return 0


class _Load:
    """One request's load on this rank. ``begun`` is the Background call that finds the prefill
    ranks and posts the reads; the engine thread only polls it and the group."""

    __slots__ = ("spec", "group", "sources", "begun", "deadline", "lock", "aborted", "abandoned")

    def __init__(self, spec: LoadSpec, layers: int, deadline: float):
        self.spec, self.deadline = spec, deadline  # deadline: time.monotonic() the load must end by
        self.group = TransferGroup(spec.req_id, layers)
        self.sources: set[str] = set()
        self.begun = None
        self.lock = threading.Lock()  # held by the Background call while it posts; never waited on by the engine
        self.aborted = self.abandoned = False


class WorkerSide:
    def __init__(self, s: XferSettings):
        self.s = s
        self.rank = _tp_rank(s)
        self.link = KVLink(LinkConfig(name=f"{s.engine_id}.tp{self.rank}", store_url=s.store_url,
                                      host_store=s.host_store, timeout_s=s.timeout_s, listen_host=s.listen_host,
                                      transport=s.transport, enable=s.transports))
        self.bg = Background(f"xfer-{s.engine_id}.tp{self.rank}")
        self.layer_index: dict[str, int] = {}
        self.leases = LeaseTable()
        self.errors = LoadErrors()
        self.loading: dict[str, _Load] = {}
        self.finished_seen: set[str] = set()
        self.released: set[str] = set()
        self.early: dict[str, int] = {}  # releases that came before their hold
        self.lease_blocks: dict[str, list[int]] = {}  # a lease's source blocks, revoked before they go back
        self.revoking: dict[str, tuple] = {}  # key -> (blocks, its Background revoke waiting for reads to settle)

    def heads_of(self, tp: int, rank: int):
        return (0, 1) if self.s.use_mla else rank_heads(self.s.total_kv_heads, tp, rank)

    def plan(self, src_tp: int, dst_tp: int, dst_rank: int):
        """[(source rank, heads or None)] a destination rank reads; None = the whole MLA latent."""
        if self.s.use_mla:
            return [(dst_rank % src_tp, None)]
        return head_plan(self.s.total_kv_heads, src_tp, dst_tp, dst_rank)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors, layouts, seen = [], [], {}
        for name, t in kv_caches.items():
            ident = (t.data_ptr(), tuple(t.shape), t.stride())
            if ident in seen:  # a layer sharing another layer's cache: moved once
                self.layer_index[name] = seen[ident]
                continue
            seen[ident] = self.layer_index[name] = len(layouts)
            tensors.append([t])
            layouts.append(vllm_layer_layout(t, mla=self.s.use_mla, kind=self.s.layout))
        own = self.heads_of(self.s.tp_size, self.rank)
        if layouts[0].num_heads != own[1] - own[0]:
            raise LayoutError(f"rank {self.rank} of TP {self.s.tp_size} should hold kv heads {own} of "
                              f"{self.s.total_kv_heads}; its cache has {layouts[0].num_heads} heads")
        self.link.register_layers(tensors, layouts, own_heads=own)
        if not self.s.use_mla:  # regions a TP mismatch reads through
            if self.s.is_producer:
                for d in range(self.s.peer_tp):
                    for src, heads in self.plan(self.s.tp_size, self.s.peer_tp, d):
                        if src == self.rank:
                            self.link.ensure_heads(heads, publish=False)
            if self.s.is_consumer:
                for _, heads in self.plan(self.s.peer_tp, self.s.tp_size, self.rank):
                    self.link.ensure_heads(heads, publish=False)
            self.link.publish()

    # -- prefill side: leases
    def readers(self) -> int:
        if self.s.use_mla:
            return len([d for d in range(self.s.peer_tp) if d % self.s.tp_size == self.rank])
        return len(readers_of(self.s.total_kv_heads, self.s.tp_size, self.s.peer_tp, self.rank))

    def hold(self, spec: HoldSpec) -> None:
        self.leases.hold(spec.req_id, spec.blocks, ttl=self.s.lease_s, readers=self.readers())
        self.lease_blocks[spec.req_id] = list(spec.blocks)
        for _ in range(self.early.pop(spec.req_id, 0)):
            self.release(spec.req_id)

    def release(self, key: str) -> None:
        if key not in self.leases:
            self.early[key] = self.early.get(key, 0) + 1
        elif self.leases.release(key):
            self._source_free(key)

    def _source_free(self, key: str) -> None:
        """The one place the prefill side hands ``key``'s blocks back to vLLM (last release, or the
        lease ended), once revoked: no read of them can go on (a one-sided READ begun before is
        refused at its end; a UCX one's sends settled). The engine thread never waits: a revoke
        that must wait runs on the Background and ``get_finished`` reports the blocks after it."""
        blocks = self.lease_blocks.pop(key, None)
        if blocks:
            try:
                self.link.agent.revoke(blocks, timeout=0)
            except FenceTimeoutError:
                self.revoking[key] = (blocks, self.bg.submit(self.link.agent.revoke, blocks))
                return
        self.released.add(key)

    def _revoked(self) -> None:
        """Revokes that waited on the Background: their blocks go back; one that timed out again
        keeps its blocks (still readable by a stuck transfer) and tries again."""
        for key, (blocks, fut) in list(self.revoking.items()):
            if not fut.done():
                continue
            if fut.exception() is None:
                del self.revoking[key]
                self.released.add(key)
            else:
                log.warning("xfer: blocks of %s still read by a transfer after the fence bound: kept (%s)", key,
                            fut.exception())
                self.revoking[key] = (blocks, self.bg.submit(self.link.agent.revoke, blocks))

    # -- decode side: loads (posted from the engine thread, run on the Background)
    def start_load(self, spec: LoadSpec) -> None:
        left = spec.lease_expires - time.time()
        load = _Load(spec, self.link.num_layers, time.monotonic() + max(0.0, min(self.s.timeout_s, left - 1.0)))
        self.loading[spec.req_id] = load
        if left < 2.0:
            load.group.fail(f"the prefill lease of {spec.key!r} ends in {left:.1f} s: too late to read")
        elif spec.remote_tp != self.s.peer_tp and not self.s.use_mla:
            load.group.fail(f"prefill engine {spec.engine!r} runs TP {spec.remote_tp}; this decode instance was "
                            f"configured for peer_tp_size={self.s.peer_tp}")
        else:
            load.begun = self.bg.submit(self._begin, load)

    def _begin(self, load: _Load) -> None:
        """Background: find each prefill rank this rank reads from, connect, post one READ per layer."""
        spec = load.spec
        for src, heads in self.plan(spec.remote_tp, self.s.tp_size, self.rank):
            name = f"{spec.engine}.tp{src}"
            try:
                peer = self.link.peer(name, store_url=spec.store)
                peer_heads = None if heads is None else self.heads_of(spec.remote_tp, src)
                with load.lock:
                    if load.abandoned or load.aborted:
                        return
                    load.sources.add(peer)
                    timeout = load.deadline - time.monotonic()
                    if timeout <= 0:
                        load.group.fail(f"reading {spec.key!r} from {name}: no time left before the deadline")
                        return
                    for layer in range(self.link.num_layers):
                        load.group.add(layer, self.link.post(Op.READ, peer, layer, spec.local_blocks,
                                                             spec.remote_blocks, heads=heads, peer_heads=peer_heads,
                                                             timeout=timeout, note={"k": spec.key, "l": layer}))
            except XferError as exc:
                load.group.fail(f"reading {spec.key!r} from {name}: {exc}")
                return

    def _settled(self, load: _Load) -> bool:
        """Engine thread, never waits: True once the load's reads have all ended (or none will start)."""
        running = load.begun is not None and not load.begun.done()
        if running or load.aborted:
            if not load.aborted and time.monotonic() < load.deadline:
                return False
            if not load.abandoned:  # stop: nothing more is posted, what was posted is cancelled
                if not load.lock.acquire(blocking=False):
                    return False  # the Background is posting right now: look again next step
                try:
                    load.abandoned = True
                    load.group.fail("aborted" if load.aborted else
                                    f"finding or connecting to prefill engine {load.spec.engine!r} took longer "
                                    f"than {self.s.timeout_s:g} s")
                    load.group.cancel()
                finally:
                    load.lock.release()
        elif load.begun is not None and load.begun.exception() is not None:
            load.group.fail(f"load of {load.spec.key!r}: {load.begun.exception()!r}")
        return load.group.poll() is not None

    def _load_ended(self, req_id: str) -> bool:
        """The one place a load's destination blocks go back to vLLM (recving / load errors), called
        only once every read of it ended: a transfer reads ended only once fenced (no byte of it
        lands later, issue 29), so a read cancelled or timed out mid-copy is waited out here.
        Then the prefill ranks are told to release their blocks (on the Background)."""
        load = self.loading.pop(req_id)
        ok = bool(load.group.poll())
        if not ok and not load.aborted:
            log.warning("xfer: load of %s failed, %d blocks marked for recompute: %s", req_id,
                        len(load.spec.local_blocks), "; ".join(load.group.errors)[:500])
            self.errors.add(load.spec.local_blocks)
        spec = load.spec  # every prefill rank this rank reads from, connected or not (an abort may come first)
        self.release_unread(ReleaseSpec(key=spec.key, engine=spec.engine, remote_tp=spec.remote_tp, store=spec.store))
        return ok

    def _send_release(self, peer: str, key: str) -> None:
        try:
            self.link.send(peer, {"t": "release", "k": key})
        except XferError as exc:  # the lease frees the blocks anyway
            log.info("xfer: release of %s to %s not delivered: %s", key, peer, exc)

    def release_unread(self, spec: ReleaseSpec) -> None:
        """Tell the prefill ranks this rank reads from to free ``spec.key``'s blocks (a load ended, or
        a request that will never load: aborted before it was scheduled), on the Background."""
        self.bg.submit(self._release_unread, spec)

    def _release_unread(self, spec: ReleaseSpec) -> None:
        for src, _ in self.plan(spec.remote_tp, self.s.tp_size, self.rank):
            try:
                self._send_release(self.link.peer(f"{spec.engine}.tp{src}", store_url=spec.store), spec.key)
            except XferError as exc:
                log.info("xfer: release of %s to %s.tp%d not delivered: %s", spec.key, spec.engine, src, exc)

    def abort(self, req_id: str) -> None:
        """vLLM finished ``req_id`` while it loads: stop its reads (ended and released by get_finished)."""
        load = self.loading.get(req_id)
        if load is not None:
            load.aborted = True  # _settled cancels its reads without waiting on the Background

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        for load in list(self.loading.values()):
            if not load.spec.sync:
                continue
            if load.begun is not None and not load.begun.done():  # a synchronous load waits by design,
                try:  # for the forward it feeds, bounded by its deadline
                    load.begun.result(timeout=max(0.0, load.deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - a timeout or the lookup's error: _settled reports it
                    pass
            if load.begun is not None and not load.begun.done():
                self._settled(load)  # past its deadline: given up
                continue
            load.group.wait_layer(layer)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for req_id in finished_req_ids:
            if req_id in self.loading:
                self.abort(req_id)
        # only requests holding blocks here matter (holds arrive before this call in the same step)
        self.finished_seen |= {r for r in finished_req_ids if r in self.leases or r in self.released}
        for _peer, op, msg in self.link.messages():
            if op is Op.MESSAGE and msg.get("t") == "release":
                self.release(str(msg.get("k")))
        for key in self.leases.expired():
            log.warning("xfer: lease of %s ended before its readers released it; freeing its blocks", key)
            self._source_free(key)
        self._revoked()
        sending = {k for k in self.released if k in self.finished_seen}
        self.released -= sending
        self.finished_seen -= sending
        recving = set()
        for req_id, load in list(self.loading.items()):
            if self._settled(load):
                self._load_ended(req_id)
                if not load.spec.sync:
                    recving.add(req_id)
        return sending or None, recving or None

    def close(self) -> None:
        for load in self.loading.values():
            load.aborted = True
            self._settled(load)
        self.bg.close()
        self.link.close()
