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

Extra config keys (``kv_connector_extra_config``): ``store`` (metadata store URL, required across
processes), ``host_store`` (bool: this instance may host a ``tcp://`` store), ``lease_s`` (120),
``timeout_s`` (30, per layer transfer), ``load_async`` (True; False = layer-wise synchronous load),
``peer_tp_size`` (the other side's TP size, default: this side's), ``listen_host``, ``transport``
(pin one), ``transports`` (start only these),
``layout`` (``auto`` | ``flash_attn`` | ``flashinfer`` | ``packed`` | ``mla``), and for tests
``tp_rank`` / ``tp_size`` / ``total_kv_heads`` / ``use_mla`` overrides.

This module imports vLLM; ``import xfer.engine`` does not import this module.
"""

from __future__ import annotations

import logging
import math
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

from .kvlink import (KVLink, LeaseTable, LinkConfig, LoadErrors, TransferGroup, head_plan, rank_heads,
                     readers_of)

__all__ = ["XferConnector", "XferConnectorMetadata", "XferSettings", "LoadSpec", "HoldSpec", "vllm_layer_layout"]

log = logging.getLogger("xfer.engine.vllm")

_LAYOUTS = ("auto", "flash_attn", "flashinfer", "packed", "mla")


@dataclass(frozen=True)
class XferSettings:
    """What the connector reads from ``VllmConfig`` and ``kv_connector_extra_config``."""

    engine_id: str
    is_producer: bool
    is_consumer: bool
    block_size: int
    tp_size: int = 1
    tp_rank: int | None = None  # None: ask vLLM's parallel state in the worker
    peer_tp_size: int | None = None
    total_kv_heads: int = 1
    use_mla: bool = False
    store_url: str | None = None
    host_store: bool = False
    lease_s: float = 120.0
    timeout_s: float = 30.0
    load_async: bool = True
    listen_host: str = "127.0.0.1"
    transport: str | None = None
    transports: tuple[str, ...] | None = None
    layout: str = "auto"

    def __post_init__(self) -> None:
        if self.layout not in _LAYOUTS:
            raise InvalidArgumentError(f"kv_connector_extra_config.layout must be one of {_LAYOUTS}, got {self.layout!r}")
        for name in ("lease_s", "timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise InvalidArgumentError(f"kv_connector_extra_config.{name} must be a number > 0, got {v!r}")
        if self.lease_s <= self.timeout_s:
            raise InvalidArgumentError(f"lease_s ({self.lease_s}) must exceed timeout_s ({self.timeout_s}): a lease "
                                       f"shorter than one transfer frees blocks a reader is still copying")

    @property
    def peer_tp(self) -> int:
        return self.peer_tp_size or self.tp_size

    @classmethod
    def from_vllm(cls, vllm_config) -> "XferSettings":
        kv = vllm_config.kv_transfer_config
        extra = dict(kv.kv_connector_extra_config or {})
        mc = vllm_config.model_config
        return cls(
            engine_id=str(kv.engine_id), is_producer=bool(kv.is_kv_producer), is_consumer=bool(kv.is_kv_consumer),
            block_size=int(vllm_config.cache_config.block_size),
            tp_size=int(extra.get("tp_size", vllm_config.parallel_config.tensor_parallel_size)),
            tp_rank=extra.get("tp_rank"), peer_tp_size=extra.get("peer_tp_size"),
            total_kv_heads=int(extra.get("total_kv_heads") or mc.get_total_num_kv_heads()),
            use_mla=bool(extra.get("use_mla", mc.use_mla)), store_url=extra.get("store"),
            host_store=bool(extra.get("host_store", False)), lease_s=float(extra.get("lease_s", 120.0)),
            timeout_s=float(extra.get("timeout_s", 30.0)), load_async=bool(extra.get("load_async", True)),
            listen_host=str(extra.get("listen_host", "127.0.0.1")), transport=extra.get("transport"),
            transports=tuple(extra["transports"]) if extra.get("transports") else None,
            layout=str(extra.get("layout", "auto")))


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


@dataclass
class HoldSpec:
    """Prefill side: keep ``blocks`` of request ``req_id`` until its readers release them (or the lease ends)."""

    req_id: str
    blocks: list[int]


@dataclass
class XferConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    holds: list[HoldSpec] = field(default_factory=list)


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
class _SchedulerSide:
    def __init__(self, s: XferSettings):
        self.s = s
        self.loads: list[LoadSpec] = []
        self.holds: list[HoldSpec] = []
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
        if not num_external_tokens or not p.get("do_remote_prefill"):
            return
        p["do_remote_prefill"] = False  # load once, even if the request is preempted later
        bs = self.s.block_size
        first, end = local_hit // bs, -(-(local_hit + num_external_tokens) // bs)
        local = list(blocks.get_block_ids()[0][first:end])
        remote = [int(b) for b in p["remote_block_ids"][first:end]]
        n = min(len(local), len(remote))
        self.loads.append(LoadSpec(
            req_id=request.request_id, key=str(p.get("remote_request_id")), engine=str(p["remote_engine_id"]),
            remote_tp=int(p.get("remote_tp_size", 1)), remote_blocks=remote[:n], local_blocks=local[:n],
            sync=not self.s.load_async, lease_expires=float(p.get("lease_expires", math.inf))))

    def build_connector_meta(self, scheduler_output) -> XferConnectorMetadata:
        meta = XferConnectorMetadata(loads=self.loads, holds=self.holds)
        self.loads, self.holds = [], []
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        p = request.kv_transfer_params or {}
        self.local_hit.pop(request.request_id, None)
        if not (self.s.is_producer and p.get("do_remote_decode")):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            return False, None  # aborted, stopped early, or nothing computed: the decode side computes
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


class _WorkerSide:
    def __init__(self, s: XferSettings):
        self.s = s
        self.rank = _tp_rank(s)
        self.link = KVLink(LinkConfig(name=f"{s.engine_id}.tp{self.rank}", store_url=s.store_url,
                                      host_store=s.host_store, timeout_s=s.timeout_s, listen_host=s.listen_host,
                                      transport=s.transport, enable=s.transports))
        self.layer_index: dict[str, int] = {}
        self.leases = LeaseTable()
        self.errors = LoadErrors()
        self.loading: dict[str, tuple[TransferGroup, LoadSpec, set[str]]] = {}
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
            self.released.add(key)

    # -- decode side: loads
    def start_load(self, spec: LoadSpec) -> None:
        group, sources = TransferGroup(spec.req_id, self.link.num_layers), set()
        self.loading[spec.req_id] = (group, spec, sources)
        left = spec.lease_expires - time.time()
        if left < 2.0:
            group.fail(f"the prefill lease of {spec.key!r} ends in {left:.1f} s: too late to read")
            return
        if spec.remote_tp != self.s.peer_tp and not self.s.use_mla:
            group.fail(f"prefill engine {spec.engine!r} runs TP {spec.remote_tp}; this decode instance was "
                       f"configured for peer_tp_size={self.s.peer_tp}")
            return
        timeout = min(self.s.timeout_s, left - 1.0)
        for src, heads in self.plan(spec.remote_tp, self.s.tp_size, self.rank):
            try:
                peer = self.link.peer(f"{spec.engine}.tp{src}")
                sources.add(peer)
                peer_heads = None if heads is None else self.heads_of(spec.remote_tp, src)
                for layer in range(self.link.num_layers):
                    group.add(layer, self.link.post(Op.READ, peer, layer, spec.local_blocks, spec.remote_blocks,
                                                    heads=heads, peer_heads=peer_heads, timeout=timeout,
                                                    note={"k": spec.key, "l": layer}))
            except XferError as exc:
                group.fail(f"reading {spec.key!r} from {spec.engine}.tp{src}: {exc}")
                break

    def finish_load(self, req_id: str) -> bool:
        group, spec, sources = self.loading.pop(req_id)
        ok = bool(group.wait())
        if not ok:
            log.warning("xfer: load of %s failed, %d blocks marked for recompute: %s", req_id,
                        len(spec.local_blocks), "; ".join(group.errors)[:500])
            self.errors.add(spec.local_blocks)
        for peer in sources:
            try:
                self.link.send(peer, {"t": "release", "k": spec.key})
            except XferError as exc:  # the lease frees the blocks anyway
                log.info("xfer: release of %s to %s not delivered: %s", spec.key, peer, exc)
        return ok

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        for group, spec, _ in self.loading.values():
            if spec.sync:
                group.wait_layer(layer)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # only requests holding blocks here matter (holds arrive before this call in the same step)
        self.finished_seen |= {r for r in finished_req_ids if r in self.leases or r in self.released}
        for _peer, op, msg in self.link.messages():
            if op is Op.MESSAGE and msg.get("t") == "release":
                self.release(str(msg.get("k")))
        for key in self.leases.expired():
            log.warning("xfer: lease of %s ended before its readers released it; freeing its blocks", key)
            self.released.add(key)
        sending = {k for k in self.released if k in self.finished_seen}
        self.released -= sending
        self.finished_seen -= sending
        recving = set()
        for req_id, (group, spec, _) in list(self.loading.items()):
            if spec.sync or group.poll() is not None:
                self.finish_load(req_id)
                if not spec.sync:
                    recving.add(req_id)
        return sending or None, recving or None

    def close(self) -> None:
        for group, _, _ in self.loading.values():
            group.cancel()
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
        meta = self._get_connector_metadata()
        for hold in meta.holds:
            self._worker.hold(hold)
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
