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
once the load's transfers have ended (``WorkerSide._load_ended``, ``WorkerSide._source_free`` in ``vllm_worker``).

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
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, SupportsHMA)
from vllm.v1.request import RequestStatus

from xfer.errors import InvalidArgumentError

from .vllm_settings import XferSettings
from .vllm_worker import HoldSpec, LoadSpec, ReleaseSpec, WorkerSide, vllm_layer_layout

__all__ = ["XferConnector", "XferConnectorMetadata", "XferSettings", "LoadSpec", "HoldSpec", "ReleaseSpec",
           "vllm_layer_layout"]

log = logging.getLogger("xfer.engine.vllm")


@dataclass
class XferConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    holds: list[HoldSpec] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)


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
        self._worker = WorkerSide(self.settings) if role == KVConnectorRole.WORKER else None

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
