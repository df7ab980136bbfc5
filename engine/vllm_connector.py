"""vLLM v1 KV connector backed by xfer (an out-of-tree ``KVConnectorBase_V1``).

Load it without registering anything in vLLM::

    --kv-transfer-config '{"kv_connector": "XferConnector",
                           "kv_connector_module_path": "xfer.engine.vllm_connector",
                           "kv_role": "kv_producer",        # kv_consumer on decode, kv_both for either
                           "kv_connector_extra_config": {"store": "tcp://10.0.0.1:29600"}}'

Protocol (pull, the one vLLM's P/D proxies speak): the proxy sends a request to a prefill
instance with ``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``; on finish,
``request_finished`` keeps the request's blocks under a lease and returns the parameters the
proxy forwards to a decode instance (``remote_engine_id``, ``remote_request_id``,
``remote_block_ids``, ``remote_tp_size``, ``lease_expires``...). The decode instance's scheduler
side reports the prompt as externally computed; its worker side posts one xfer READ per layer
(layer-wise: ``wait_for_layer_load`` waits for exactly that layer when loads are synchronous) and,
once every layer ended, tells each prefill rank it read from to release the blocks. Blocks of a
failed load come back through ``get_block_ids_with_load_errors`` (vLLM then recomputes or fails
the request, per ``kv_load_failure_policy``); unread prefill blocks free when their lease ends.

Nothing that waits on the network runs on vLLM's engine thread: finding and connecting to the
prefill ranks, posting the reads and every release message run on a ``Background`` thread, each
bounded by ``timeout_s``; ``start_load_kv`` and ``get_finished`` only post and poll. A load whose
peer lookup has not finished by its deadline is given up (its blocks reported for recompute).
A decode request aborted before it was scheduled, or while loading, tells the prefill ranks to
release its blocks at once (as vLLM's NIXL connector does); blocks are handed back to vLLM only
once the load's transfers have ended (``_WorkerSide._load_ended``, ``_WorkerSide._source_free``).

Extra config keys (``kv_connector_extra_config``), checked strictly (unknown keys raise): see
``xfer.engine.vllm_settings.EXTRA_KEYS``: ``store``, ``host_store``, ``lease_s`` (120), ``timeout_s``
(30), ``load_async`` (true), ``peer_tp_size``, ``listen_host``, ``transport``, ``transports``,
``layout`` (``auto`` | ``flash_attn`` | ``flashinfer`` | ``packed`` | ``mla``), and for tests
``tp_rank`` / ``tp_size`` / ``total_kv_heads`` / ``use_mla``. A decode instance looks the prefill
up in the store the prefill named (``remote_store``), or its own.

This module imports vLLM; ``import xfer.engine`` does not import this module.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, SupportsHMA)
from vllm.v1.request import RequestStatus

from xfer import KVLayout
from xfer.errors import InvalidArgumentError, LayoutError, XferError
from xfer.transfer import Op

from .background import Background
from .kvlink import (KVLink, LeaseTable, LinkConfig, LoadErrors, TransferGroup, head_plan, rank_heads,
                     readers_of)
from .vllm_settings import LAYOUTS as _LAYOUTS
from .vllm_settings import XferSettings

__all__ = ["XferConnector", "XferConnectorMetadata", "XferSettings", "LoadSpec", "HoldSpec", "ReleaseSpec",
           "vllm_layer_layout"]

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


@dataclass
class XferConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    holds: list[HoldSpec] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)


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


# ---- scheduler side -------------------------------------------------------------------------------
_HANDED_OFF = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)  # as NIXL: EOS-only too


class _SchedulerSide:
    def __init__(self, s: XferSettings):
        self.s = s
        self.loads: list[LoadSpec] = []
        self.holds: list[HoldSpec] = []
        self.releases: list[ReleaseSpec] = []
        self.local_hit: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        p = request.kv_transfer_params or {}
        if not (self.s.is_consumer and p.get("do_remote_prefill") and p.get("remote_block_ids")):
            return 0, False
        # async: vLLM recomputes the last prompt token itself; sync: leave it to the forward
        count = len(request.prompt_token_ids) - num_computed_tokens - (0 if self.s.load_async else 1)
        if count <= 0:
            return 0, False
        self.local_hit[request.request_id] = num_computed_tokens
        return count, self.s.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        p = request.kv_transfer_params or {}
        local_hit = self.local_hit.pop(request.request_id, 0)
        if not p.get("do_remote_prefill"):
            return
        p["do_remote_prefill"] = False  # load once, even if the request is preempted later
        if not num_external_tokens:  # nothing to read (the decode caches it all): free the prefill's blocks
            if p.get("remote_block_ids"):
                self.releases.append(self._release(p))
            return
        bs = self.s.block_size
        first, end = local_hit // bs, -(-(local_hit + num_external_tokens) // bs)
        local = list(blocks.get_block_ids()[0][first:end])
        remote = [int(b) for b in p["remote_block_ids"][first:end]]
        n = min(len(local), len(remote))
        self.loads.append(LoadSpec(
            req_id=request.request_id, key=str(p.get("remote_request_id")), engine=str(p["remote_engine_id"]),
            remote_tp=int(p.get("remote_tp_size", 1)), remote_blocks=remote[:n], local_blocks=local[:n],
            sync=not self.s.load_async, lease_expires=float(p.get("lease_expires", math.inf)),
            store=p.get("remote_store")))

    @staticmethod
    def _release(p: dict) -> ReleaseSpec:
        return ReleaseSpec(key=str(p.get("remote_request_id")), engine=str(p.get("remote_engine_id")),
                           remote_tp=int(p.get("remote_tp_size", 1)), store=p.get("remote_store"))

    def build_connector_meta(self, scheduler_output) -> XferConnectorMetadata:
        meta = XferConnectorMetadata(loads=self.loads, holds=self.holds, releases=self.releases)
        self.loads, self.holds, self.releases = [], [], []
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        p = request.kv_transfer_params or {}
        self.local_hit.pop(request.request_id, None)
        if self.s.is_consumer and p.get("do_remote_prefill"):
            # finished before its load was planned (aborted before it was scheduled): the prefill
            # still holds the blocks for us; tell it to free them now, not when the lease ends
            p["do_remote_prefill"] = False
            if p.get("remote_block_ids") and p.get("remote_engine_id"):
                self.releases.append(self._release(p))
            return False, None
        if not (self.s.is_producer and p.get("do_remote_decode")):
            return False, None
        if request.status not in _HANDED_OFF or not block_ids:
            return False, None  # aborted, or nothing computed: the decode side computes
        self.holds.append(HoldSpec(request.request_id, [int(b) for b in block_ids]))
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.s.engine_id,
            "remote_request_id": request.request_id, "remote_block_ids": [int(b) for b in block_ids],
            "remote_tp_size": self.s.tp_size, "remote_store": self.s.store_url,
            "lease_expires": time.time() + self.s.lease_s,
        }


# ---- worker side ----------------------------------------------------------------------------------
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


class _WorkerSide:
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
        for _ in range(self.early.pop(spec.req_id, 0)):
            self.release(spec.req_id)

    def release(self, key: str) -> None:
        if key not in self.leases:
            self.early[key] = self.early.get(key, 0) + 1
        elif self.leases.release(key):
            self._source_free(key)

    def _source_free(self, key: str) -> None:
        """The one place the prefill side hands ``key``'s blocks back to vLLM (last release, or the
        lease ended). Issue 29's fence tightens this: revoke the reads granted on these blocks and
        report them only once no byte can be read from them any more."""
        self.released.add(key)

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
        only once every read of it ended; issue 29's fence makes "ended" mean no byte lands later.
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


class XferConnector(KVConnectorBase_V1, SupportsHMA):
    """KV connector moving vLLM's paged KV between prefill and decode instances with xfer."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if len(groups) > 1:
            raise InvalidArgumentError(f"XferConnector moves one KV cache group; this model has {len(groups)} "
                                       f"(hybrid attention): run with --disable-hybrid-kv-cache-manager or a "
                                       f"single-group model")
        self.settings = XferSettings.from_vllm(vllm_config)
        self._sched = _SchedulerSide(self.settings) if role == KVConnectorRole.SCHEDULER else None
        self._worker = _WorkerSide(self.settings) if role == KVConnectorRole.WORKER else None

    # -- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self._sched.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        if len(block_ids) != 1:
            raise InvalidArgumentError(f"XferConnector moves one KV cache group, got {len(block_ids)}")
        return self._sched.request_finished(request, block_ids[0])

    def get_loaded_kv_cache_group_ids(self, request):
        return (0,)  # the request's own blocks, not a prefix store

    # -- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Posts and returns: the loads run on the worker's Background (see the module doc)."""
        meta = self._get_connector_metadata()
        for hold in meta.holds:
            self._worker.hold(hold)
        for release in meta.releases:
            self._worker.release_unread(release)
        for load in meta.loads:
            self._worker.start_load(load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return  # pull: the decode side reads once the request finished (see the module doc)

    def wait_for_save(self):
        return

    def get_finished(self, finished_req_ids):
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.errors.take()

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()
