"""A prefill instance: runs a prompt through the model on its own paged pool and streams each layer's
KV blocks into the decode instance's blocks while the forward goes on.

Leases: the source blocks stay allocated after the transfer until the decode instance confirms
(``release``) or the lease runs out (``expire_leases``), so a decode side that finds a layer
missing can still be served, and a decode side that died never pins them for good.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from xfer import Agent, AgentConfig

from .block_manager import BlockManager, blocks_for
from .config import ModelSpec, PoolSpec
from .kv_pool import KVPool
from .model import build_model, next_token_logits
from .paged_cache import PagedCache
from .streamer import LayerStreamer, Poster

__all__ = ["PrefillInstance", "PrefillResult", "Lease"]


@dataclass
class Lease:
    req: str
    blocks: list[int]
    expires: float  # time.monotonic()


@dataclass
class PrefillResult:
    """One prefill: its first token and ``time.time()`` stamps (start, forward done, all KV landed)."""

    req: str
    token: int
    t_start: float
    t_forward: float
    t_landed: float

    @property
    def exposed_transfer_s(self) -> float:
        """Transfer time not hidden behind the forward."""
        return max(0.0, self.t_landed - self.t_forward)


class PrefillInstance:
    """Prefill on ``pool`` blocks, streaming to decode peers through ``self.agent``.

    Tensor parallel, two ways:

    - ``tp=(rank, world)``: real TP. This process is rank ``rank`` of a ``torch.distributed``
      group of ``world`` prefill processes (joined beforehand, ``tp.init_group``); its model is
      sharded (``tp.shard_model``: its share of attention and MLP, all-reduced per layer), so it
      computes and holds only kv-heads ``tp.shard_heads(...)`` and streams that slice.
    - ``heads=(h0, h1)`` alone: a rank that runs the *full* forward but holds and sends only
      kv-heads ``[h0, h1)`` (no process group needed; what the in-process tests use).

    rank: its TP rank (rank 0 also sends the first token). lease_s: how long source blocks wait
    for the decode side's confirmation.
    """

    def __init__(self, name: str, model: ModelSpec, pool: PoolSpec, *, heads: tuple[int, int] | None = None,
                 rank: int = 0, lease_s: float = 30.0, transfer_timeout_s: float = 30.0,
                 agent_config: AgentConfig | None = None, torch_model=None, tp: tuple[int, int] | None = None):
        self.name, self.spec, self.rank, self.heads = name, model, rank, heads
        self.lease_s, self.transfer_timeout_s = lease_s, transfer_timeout_s
        # False (default): post the last layer at once (it overlaps that layer's MLP and lm_head) and
        # the token as its own zero-block message. True: hold the last layer's write until the first
        # token is known and send both in one write. On the H200 (8B, 4k prompt, 15 paired runs,
        # bench/results/2026-12-03-h200-engine.json) the message adds a median 1.5 % to TTFT, holding
        # 2.6 %. Both have returned tokens that differ from HF's, only ever from a step where HF's
        # top-2 logits tie exactly (gap 0): another kernel's rounding picks the other token there.
        self.hold_last = False
        self.device = torch.device(pool.device)
        self.model = torch_model if torch_model is not None else build_model(model, self.device)
        self.tp = tuple(tp) if tp else (0, 1)
        if self.tp[1] > 1:
            from .tp import shard_model

            self.rank = self.tp[0]
            self.heads = heads = shard_model(self.model, *self.tp)
        self.pool = KVPool(model, pool, heads=heads)
        self.blocks = BlockManager(pool.num_blocks, pool.block_size)
        self.leases: dict[str, Lease] = {}
        self.expired = 0
        self.last_streamer: LayerStreamer | None = None  # the latest request's (its transfers, for benchmarks)
        self.agent = Agent(name, agent_config or AgentConfig(default_timeout_s=transfer_timeout_s))
        self.pool.register(self.agent)
        self.poster = Poster(f"stream-{name}") if self.device.type == "cuda" else None

    def __repr__(self) -> str:
        return f"PrefillInstance({self.name!r}, rank={self.rank}, {self.blocks}, leases={len(self.leases)})"

    def close(self) -> None:
        if self.poster is not None:
            self.poster.close()
        self.agent.close()

    # ---- admission ---------------------------------------------------------------------------
    def can_prefill(self, prompt_len: int) -> bool:
        self.expire_leases()
        return self.blocks.can_allocate(blocks_for(prompt_len, self.pool.block_size))

    def prefill(self, req: str, prompt: list[int], peer: str, dst_blocks: list[int], *,
                peer_heads: tuple[int, int] | None = None, stream: bool = True) -> PrefillResult:
        """Prefill ``prompt`` and stream its KV into the peer's ``dst_blocks`` (call ``can_prefill`` first).

        ``peer_heads``: the decode-side head range this instance writes (TP); ``stream=False``
        runs the forward alone (the no-transfer baseline). The blocks are then held under a lease.
        """
        table = self.blocks.allocate(blocks_for(len(prompt), self.pool.block_size))
        try:
            return self._run(req, prompt, table, peer, dst_blocks, peer_heads, stream)
        finally:
            self.leases[req] = Lease(req, table, time.monotonic() + self.lease_s)

    def _run(self, req, prompt, table, peer, dst_blocks, peer_heads, stream) -> PrefillResult:
        streamer = None
        if stream:
            streamer = LayerStreamer(self.agent, peer, req, table, dst_blocks[:len(table)], rank=self.rank,
                                     num_layers=self.spec.num_layers, peer_heads=peer_heads,
                                     timeout=self.transfer_timeout_s, device=self.device, hold_last=self.hold_last,
                                     poster=self.poster)
            self.last_streamer = streamer
        cache = PagedCache(self.pool, [table], after_layer=streamer.layer_done if streamer else None,
                           heads=self.heads)
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        t_start = time.time()
        token = int(next_token_logits(self.model, ids, cache).argmax(-1)[0])  # .item() syncs the device
        t_forward = time.time()
        if streamer is None:
            return PrefillResult(req, token, t_start, t_forward, t_forward)
        t_landed = streamer.finish(token if self.rank == 0 else None, t_start, t_forward)
        return PrefillResult(req, token, t_start, t_forward, t_landed)

    # ---- leases ------------------------------------------------------------------------------
    def release(self, req: str) -> bool:
        """The decode side confirmed ``req``'s KV: free its source blocks. False if already gone."""
        lease = self.leases.pop(req, None)
        if lease is not None:
            self.blocks.free(lease.blocks)
        return lease is not None

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Free the blocks of every lease past its deadline; returns their request ids."""
        now = time.monotonic() if now is None else now
        gone = [r for r, lease in self.leases.items() if lease.expires <= now]
        for r in gone:
            self.blocks.free(self.leases.pop(r).blocks)
        self.expired += len(gone)
        return gone
