"""A decode instance: admits a request only when its blocks fit (back-pressure), receives its KV from
prefill instances layer by layer, decodes greedily on the paged pool with continuous batching (every
running request's next token in one forward; requests join and leave between steps), frees, and
under memory pressure swaps whole requests to host memory and back (``swap.Swapper``).

A request's life: ``submit`` -> waiting -> ``admit`` (blocks allocated; the caller tells a prefill
instance where to write) -> WAITING_KV -> RUNNING (all layers landed and the first token came, or
with ``WaitMode.LAYER`` as soon as the token came: the forward then waits at each layer) ->
[SWAPPING_OUT -> SWAPPED -> SWAPPING_IN -> RUNNING]* -> FINISHED (blocks freed).
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass, field
from collections.abc import Callable

import torch

from xfer import Agent, AgentConfig, shared_empty
from xfer.errors import FenceTimeoutError, TransferTimeoutError

from .block_manager import BlockManager, blocks_for
from .config import ModelSpec, PoolSpec, WaitMode
from .kv_pool import KVPool
from .model import build_model, mask_dtype, next_token_logits
from .paged_cache import PagedCache
from .protocol import LayerNote, Request, decode
from .swap import SwapHandle, Swapper

__all__ = ["DecodeInstance", "Sequence", "State"]


class State(enum.IntEnum):
    WAITING_KV = 0
    RUNNING = 1
    SWAPPING_OUT = 2
    SWAPPED = 3
    SWAPPING_IN = 4
    FINISHED = 5


@dataclass
class Sequence:
    """A request on this instance: its block table (grown in place; a swap-in replaces its contents) and progress."""

    req: Request
    blocks: list[int]
    state: State = State.WAITING_KV
    length: int = 0  # tokens whose KV is in the blocks
    tokens: list[int] = field(default_factory=list)  # generated so far (the first came from prefill)
    landed: collections.Counter = field(default_factory=collections.Counter)  # layer -> shards landed
    host_blocks: list[int] = field(default_factory=list)
    swap: SwapHandle | None = None
    swaps: int = 0
    swap_s: float = 0.0  # seconds its swaps took (out and in), overlapped with other requests' decoding
    confirmed: bool = False  # every layer and the first token landed (prefill may drop its copy)
    times: dict = field(default_factory=dict)  # time.time() stamps: admit, prefill_start, forward, ready, done
    token_times: list[float] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.req.id

    def result(self) -> dict:
        return {"id": self.id, "tokens": self.tokens, "arrival": self.req.arrival, "swaps": self.swaps,
                "swap_s": self.swap_s,
                "token_times": self.token_times, **self.times}


class DecodeInstance:
    """Decode on ``pool`` blocks; prefill instances write into them through ``self.agent``.

    shards: the kv-head ranges prefill TP ranks write (each gets per-layer regions
    ``kv.<l>.h<a>-<b>``); a layer has landed once every shard's write for it did. swap_blocks:
    host blocks for swapping (0: no swap; each request then reserves its blocks for all its tokens).
    on_ready(seq): called once a request's KV landed (the confirmation a prefill lease waits for);
    on_finish(seq): called when a request finished or failed, its blocks already freed (a failed
    one's blocks once the agent revoked them: a prefill write may still be landing; until then
    they wait in ``quarantine`` and a later step frees them).
    max_batch: at most this many requests decode in one forward (continuous batching: requests join
    and leave between steps).
    """

    def __init__(self, name: str, model: ModelSpec, pool: PoolSpec, *, wait: WaitMode = WaitMode.REQUEST,
                 shards: list[tuple[int, int]] | None = None, swap_blocks: int = 0, layer_timeout_s: float = 30.0,
                 agent_config: AgentConfig | None = None, on_ready: Callable | None = None,
                 on_finish: Callable | None = None, torch_model=None, max_batch: int = 64):
        self.name, self.spec, self.wait = name, model, WaitMode(wait)
        self.device = torch.device(pool.device)
        self.model = torch_model if torch_model is not None else build_model(model, self.device)
        # a CPU pool must be in shared memory: prefill processes write into it (local transport)
        self.pool = KVPool(model, pool, empty=shared_empty if self.device.type == "cpu" else torch.empty)
        self.blocks = BlockManager(pool.num_blocks, pool.block_size)
        self.shards = [tuple(s) for s in shards] if shards else []
        self.agent = Agent(name, agent_config or AgentConfig())
        self.pool.register(self.agent, self.shards)
        self.swapper = Swapper(self.pool, swap_blocks) if swap_blocks else None
        self.layer_timeout_s, self.on_ready, self.on_finish = layer_timeout_s, on_ready, on_finish
        self.waiting: collections.deque[Request] = collections.deque()
        self.seqs: dict[str, Sequence] = {}
        self.finished: list[Sequence] = []
        self.max_batch = max_batch
        self.batch_sizes: collections.Counter = collections.Counter()  # forward batch size -> steps
        self.recent_batches: collections.deque = collections.deque(maxlen=256)  # request ids of recent steps
        # blocks of failed requests a prefill may still write (issue 29's fence): freed once revoked
        self.quarantine: list[list[int]] = []

    def __repr__(self) -> str:
        states = collections.Counter(s.state.name for s in self.seqs.values())
        return f"DecodeInstance({self.name!r}, {self.blocks}, waiting={len(self.waiting)}, {dict(states)})"

    def close(self) -> None:
        if self.swapper is not None:
            self.swapper.close()
        self.agent.close()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.seqs)

    # ---- admission (back-pressure) -----------------------------------------------------------
    def blocks_needed(self, req: Request) -> int:
        tokens = len(req.prompt) + (1 if self.swapper else req.max_new_tokens)
        return blocks_for(tokens, self.pool.block_size)

    def can_admit(self, req: Request) -> bool:
        swapped = any(s.state in (State.SWAPPED, State.SWAPPING_OUT) for s in self.seqs.values())
        return not swapped and self.blocks.can_allocate(self.blocks_needed(req))

    def admit(self, req: Request) -> list[int]:
        """Allocate ``req``'s blocks and expect its KV; returns the block ids prefill writes into."""
        seq = Sequence(req, self.blocks.allocate(self.blocks_needed(req)))
        seq.times["admit"] = time.time()
        self.seqs[req.id] = seq
        return list(seq.blocks)

    def admit_waiting(self) -> list[tuple[Request, list[int]]]:
        """Admit submitted requests in order while they fit; fail at once one that could never fit."""
        out = []
        while self.waiting and self.blocks_needed(self.waiting[0]) > self.blocks.num_blocks:
            req = self.waiting.popleft()
            seq = Sequence(req, [])
            self.seqs[req.id] = seq
            self.abort(req.id, f"OutOfBlocksError: request {req.id} needs {self.blocks_needed(req)} blocks, the "
                               f"decode pool of {self.name!r} has {self.blocks.num_blocks}")
        while self.waiting and self.can_admit(self.waiting[0]):
            req = self.waiting.popleft()
            out.append((req, self.admit(req)))
        return out

    # ---- arrivals ----------------------------------------------------------------------------
    def poll(self, timeout: float = 0.0) -> int:
        """Take in landed layers and first tokens (waiting up to ``timeout`` for the first); returns how many."""
        notes = self.agent.notifications()
        if not notes and timeout > 0:
            try:
                notes = [self.agent.wait_notification(timeout)]
            except TransferTimeoutError:
                return 0
        for n in notes:
            self._take(decode(n.payload))
        return len(notes)

    def _take(self, note) -> None:
        seq = self.seqs.get(note.req)
        if seq is None:
            return  # a request that already failed or finished
        if isinstance(note, LayerNote):
            seq.landed[note.layer] += 1
        else:
            if note.layer >= 0:
                seq.landed[note.layer] += 1
            seq.tokens.append(note.token)
            now = time.time()
            seq.times.update(prefill_start=note.t_start, forward=note.t_forward, ready=now)
            seq.token_times.append(now)
        landed = bool(seq.tokens) and self._all_landed(seq)
        if landed and not seq.confirmed:
            seq.confirmed = True
            if self.on_ready is not None:
                self.on_ready(seq)
        if seq.state is State.WAITING_KV and seq.tokens and (self.wait is WaitMode.LAYER or landed):
            self._start(seq)

    def _all_landed(self, seq: Sequence) -> bool:
        return all(seq.landed[layer] >= self._per_layer for layer in range(self.spec.num_layers))

    @property
    def _per_layer(self) -> int:
        return max(1, len(self.shards))

    def _start(self, seq: Sequence) -> None:
        seq.length = len(seq.req.prompt)
        seq.state = State.RUNNING
        if len(seq.tokens) >= seq.req.max_new_tokens:
            self._finish(seq)

    def _wait_layer(self, seq: Sequence, layer: int) -> None:
        deadline = time.monotonic() + self.layer_timeout_s
        while seq.landed[layer] < self._per_layer:
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"request {seq.id}: layer {layer} landed from {seq.landed[layer]} of "
                                           f"{self._per_layer} shards within {self.layer_timeout_s} s")
            self.poll(timeout=0.05)

    # ---- decoding ----------------------------------------------------------------------------
    def step(self) -> int:
        """One decode step of every running request that has its blocks, in one forward; returns tokens made.

        Continuous batching: the batch is whatever is RUNNING now (up to ``max_batch``, oldest
        first); requests that arrived since the last step join, finished ones have left. Rows
        have their own lengths: the paged cache gives per-row positions and a padding mask.
        With ``WaitMode.LAYER`` a request whose KV is still landing joins too, and the forward
        waits at each layer until that layer of every such request landed.
        """
        self._reap_swaps()
        self._free_quarantined()
        self._schedule_swaps()
        batch = []
        for seq in self.seqs.values():
            if len(batch) == self.max_batch:
                break
            if seq.state is not State.RUNNING or not self.blocks.can_append(seq.blocks, seq.length):
                continue  # not running, or waits for blocks (freed by a finishing or swapped-out request)
            self.blocks.append(seq.blocks, seq.length)
            batch.append(seq)
        if not batch:
            return 0
        landing = [s for s in batch if not s.confirmed]
        hook = None
        if landing and self.wait is WaitMode.LAYER:
            def hook(layer, landing=landing):
                for s in landing:
                    self._wait_layer(s, layer)
        cache = PagedCache(self.pool, [s.blocks for s in batch], [s.length for s in batch], before_layer=hook)
        ids = self.pool.to_device(torch.tensor([[s.tokens[-1]] for s in batch], dtype=torch.long))
        logits = next_token_logits(self.model, ids, cache, **cache.model_inputs(1, mask_dtype=mask_dtype(self.model)))
        tokens = logits.argmax(-1).tolist()  # the one host sync of the step
        now = time.time()
        self.batch_sizes[len(batch)] += 1
        self.recent_batches.append(tuple(s.id for s in batch))
        for seq, token in zip(batch, tokens, strict=True):
            seq.length += 1
            seq.tokens.append(token)
            seq.token_times.append(now)
            if len(seq.tokens) >= seq.req.max_new_tokens:
                self._finish(seq)
        return len(batch)

    def abort(self, req_id: str, reason: str) -> bool:
        """Fail a request (e.g. its prefill could not deliver); frees its blocks. False if unknown."""
        seq = self.seqs.get(req_id)
        if seq is None or seq.swap is not None:
            return False
        seq.times["error"] = reason
        self._finish(seq)
        return True

    def _finish(self, seq: Sequence) -> None:
        if "error" in seq.times and seq.blocks and not self._revoked(seq.blocks):
            self.quarantine.append(list(seq.blocks))  # a write may still land: not reusable yet
        else:
            self.blocks.free(seq.blocks if seq.blocks else [])
        if seq.host_blocks and self.swapper is not None:
            self.swapper.blocks.free(seq.host_blocks)
        seq.state = State.FINISHED
        seq.times["done"] = time.time()
        del self.seqs[seq.id]
        self.finished.append(seq)
        if self.on_finish is not None:
            self.on_finish(seq)

    def _revoked(self, blocks: list[int]) -> bool:
        """Whether no prefill write can land in ``blocks`` any more (the agent revoked them; never waits)."""
        try:
            self.agent.revoke(blocks, timeout=0)
            return True
        except FenceTimeoutError:
            return False

    def _free_quarantined(self) -> None:
        """Blocks of failed requests whose writes have been fenced meanwhile go back to the pool."""
        keep = []
        for b in self.quarantine:
            if self._revoked(b):
                self.blocks.free(b)
            else:
                keep.append(b)
        self.quarantine = keep

    # ---- swap --------------------------------------------------------------------------------
    def _reap_swaps(self) -> None:
        for seq in [s for s in self.seqs.values() if s.swap is not None and s.swap.done()]:
            handle, seq.swap = seq.swap, None
            self.swapper.finish(handle)
            seq.swap_s += handle.seconds
            if handle.direction == "out":
                self.blocks.free(seq.blocks)
                seq.blocks.clear()
                seq.host_blocks, seq.state = handle.host_blocks, State.SWAPPED
            else:
                seq.blocks[:] = handle.device_blocks  # in place: the cache holds this list
                seq.host_blocks, seq.state = [], State.RUNNING

    def _schedule_swaps(self) -> None:
        """Swap the youngest running requests out while the running ones need more blocks than are
        free; swap the oldest swapped request back in once its blocks (and the running need) fit."""
        if self.swapper is None:
            return
        running = [s for s in self.seqs.values() if s.state is State.RUNNING]
        need = sum(self.blocks.blocks_to_append(s.blocks, s.length) for s in running)
        while need > self.blocks.num_free and len(running) > 1 and self.swapper.can_swap_out(running[-1].blocks):
            victim = running.pop()
            need -= self.blocks.blocks_to_append(victim.blocks, victim.length)
            victim.swap, victim.state = self.swapper.swap_out(victim.id, victim.blocks), State.SWAPPING_OUT
            victim.swaps += 1
        if any(s.state is State.SWAPPING_OUT for s in self.seqs.values()):
            return
        for seq in [s for s in self.seqs.values() if s.state is State.SWAPPED]:
            if self.blocks.num_free - need < len(seq.host_blocks) + 1:
                break
            dev = self.blocks.allocate(len(seq.host_blocks))
            seq.swap, seq.state = self.swapper.swap_in(seq.id, seq.host_blocks, dev), State.SWAPPING_IN
