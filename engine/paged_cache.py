"""A transformers ``Cache`` backed by paged xfer blocks: the drop-in KV layer of any HF causal LM.

``PagedCache(pool, tables, lengths)`` holds, per batch row, a block table (a list of block ids of
``pool``) and that row's cached length: rows may differ (a continuously batched decode step runs
requests of different lengths in one forward). Each attention layer calls
``update(k, v, layer_idx)``; its ``PagedLayer`` stores every row's new tokens in that row's blocks
(one scatter for the whole batch) and returns K/V of the whole batch, ``[B, H, max_len, C]``,
gathered from the blocks in one indexed read. Row ``b``'s tokens sit at ``0..len_b-1``; the
positions after them are padding that :meth:`PagedCache.model_inputs` masks out.

Rows of different lengths need, besides the cache, per-row ``position_ids`` (RoPE) and a 4-D
attention mask (padding + causal), both from :meth:`PagedCache.model_inputs`: transformers takes an
already prepared 4-D mask as it is, in every 5.x version. Rows of one length need neither: the
model builds the usual causal mask (or none) from the cache's sizes, exactly as with its own
``DynamicCache``, so a batch of one computes what ``model.generate`` computes.

Two hooks make it an engine's KV connector: ``before_layer(l)`` runs before layer ``l`` reads the
blocks (a decode instance waits there for layer ``l`` to land) and ``after_layer(l)`` runs once
layer ``l``'s new tokens are in the blocks (a prefill instance posts layer ``l``'s transfer there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from xfer.errors import InvalidArgumentError

from .kv_pool import KVPool

__all__ = ["PagedCache", "PagedLayer"]

LayerHook = Callable[[int], None]


class PagedLayer(CacheLayerMixin):
    """One attention layer's view of the paged pool (owned by a :class:`PagedCache`)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: PagedCache, layer: int):
        super().__init__()
        self.owner, self.layer = owner, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store ``key_states``/``value_states`` (``[B, H, S, C]``) after each row's cached tokens; return all.

        H is either all kv-heads (the slice ``heads`` of the cache is stored) or exactly the cache's
        heads (a tensor-parallel rank that computed only its own heads).
        """
        owner, pool = self.owner, self.owner.pool
        b, h, s = key_states.shape[0], key_states.shape[1], key_states.shape[-2]
        if b != len(owner.tables):
            raise InvalidArgumentError(f"the forward has {b} rows, the cache {len(owner.tables)} block tables")
        if owner.before_layer is not None:
            owner.before_layer(self.layer)
        if self.layer == 0 or owner._step is None:
            owner._begin(s, key_states.device)
        step = owner._step
        k_own, v_own = key_states, value_states
        if h != pool.num_heads:
            h0, h1 = owner.heads
            k_own, v_own = key_states[:, h0:h1], value_states[:, h0:h1]
        # [B, H, S, C] -> [B*S, H, C]: row-major tokens, matching the slot order of ``_begin``
        k_tok = k_own.transpose(1, 2).reshape(b * s, pool.num_heads, -1)
        v_tok = v_own.transpose(1, 2).reshape(b * s, pool.num_heads, -1)
        pool.write_tokens(self.layer, step["slots"], k_tok, v_tok)
        if owner.after_layer is not None:
            owner.after_layer(self.layer)
        if self.layer == owner.num_layers - 1:
            owner._end(s)
        if step["fresh"]:
            return key_states, value_states  # nothing cached before: the blocks hold exactly these
        if not owner.reads_back:
            raise InvalidArgumentError(f"this cache holds kv-heads {owner.heads} only; attention over cached "
                                       f"tokens needs all {pool.model.num_kv_heads}")
        k, v = pool.read_batch(self.layer, step["table"], step["kv_len"])
        return k.to(key_states.dtype), v.to(value_states.dtype)

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        """(kv length, kv offset) for the mask; transformers < 5.2x passes ``cache_position`` (a tensor)."""
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.owner.max_length + query_length, 0

    def get_seq_length(self, *args) -> int:
        return self.owner.max_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.owner.lengths = [0] * len(self.owner.lengths)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a PagedCache does not crop; free the request's blocks instead")


class PagedCache(Cache):
    """The KV of ``len(tables)`` sequences in ``pool``.

    tables: per row, the sequence's block ids, grown by the caller (``BlockManager.append``) before
        a step needs a new block; the lists are held by reference (a swap-in may replace their
        contents between forwards). lengths: tokens already cached, one int for all rows or one per row.
    heads: the absolute kv-head range stored (a TP rank's share); the pool must hold exactly it.
        Reading back needs all heads, so a partial-head cache serves prefill only (``reads_back`` off).
    """

    def __init__(self, pool: KVPool, tables: Sequence[list[int]], lengths: int | Sequence[int] = 0, *,
                 before_layer: LayerHook | None = None, after_layer: LayerHook | None = None,
                 heads: tuple[int, int] | None = None):
        if not tables or not all(isinstance(t, list) for t in tables):
            raise InvalidArgumentError("tables must be a non-empty sequence of block-id lists (one per row)")
        self.pool, self.tables = pool, list(tables)
        self.lengths = [int(lengths)] * len(self.tables) if isinstance(lengths, int) else [int(x) for x in lengths]
        if len(self.lengths) != len(self.tables) or min(self.lengths) < 0:
            raise InvalidArgumentError(f"lengths {lengths!r} must be one int >= 0 or one per row "
                                       f"({len(self.tables)} rows)")
        self.before_layer, self.after_layer = before_layer, after_layer
        full = (0, pool.model.num_kv_heads)
        self.heads = tuple(heads) if heads else full
        if (self.heads[1] - self.heads[0]) != pool.num_heads:
            raise InvalidArgumentError(f"heads {self.heads} do not match the pool's {pool.num_heads} kv-heads")
        self.reads_back = self.heads == full
        self.num_layers = pool.model.num_layers
        self._step: dict | None = None  # this forward's index tensors, built by layer 0, shared by all layers
        super().__init__(layers=[PagedLayer(self, layer) for layer in range(self.num_layers)])

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    @property
    def uniform(self) -> bool:
        return min(self.lengths) == max(self.lengths)

    def __repr__(self) -> str:
        return f"PagedCache(rows={len(self.tables)}, lengths={self.lengths}, heads={self.heads}, {self.pool!r})"

    # ---- one forward ---------------------------------------------------------------------------
    def _begin(self, s: int, device: torch.device) -> None:
        """Index tensors of a forward adding ``s`` tokens to every row (built once, used by every layer).

        A host->device copy of a pageable table waits for the stream: built per layer it would stall
        the CPU behind the GPU and leave launch gaps in the forward. Here they are built once, from
        pinned memory when the pool is on a GPU.
        """
        pool = self.pool
        for row, (table, start) in enumerate(zip(self.tables, self.lengths, strict=True)):
            if len(table) * pool.block_size < start + s:
                raise InvalidArgumentError(f"row {row}: {len(table)} blocks of {pool.block_size} tokens cannot hold "
                                           f"{start + s} tokens; grow the block table first")
        fresh = self.max_length == 0
        kv_len = self.max_length + s
        self._step = {"fresh": fresh, "kv_len": kv_len, "slots": pool.slots_batch(self.tables, self.lengths, s),
                      "table": None if fresh else pool.table_batch(self.tables, kv_len)}

    def _end(self, s: int) -> None:
        self.lengths = [n + s for n in self.lengths]
        self._step = None

    def model_inputs(self, s: int = 1, *, device=None, mask_dtype: torch.dtype = torch.bool) -> dict:
        """``position_ids`` and ``attention_mask`` for a forward of ``s`` new tokens per row ({} if rows agree).

        Row ``b`` attends to key ``k`` from query ``j`` iff ``k <= len_b + j`` (its own cached
        tokens, causally; the padding after them never). The mask is boolean (True: attend), what
        the ``sdpa`` attention takes; pass ``mask_dtype`` (a float dtype) for an additive mask.
        """
        if self.uniform:
            return {}
        device = device or self.pool.device
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        lengths = self.pool.to_device(lengths) if device == self.pool.device else lengths.to(device)
        q = torch.arange(s, device=device)
        pos = lengths[:, None] + q[None, :]  # [B, s]
        keys = torch.arange(self.max_length + s, device=device)
        allowed = keys[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, s, kv]
        if mask_dtype != torch.bool:
            allowed = torch.zeros(allowed.shape, dtype=mask_dtype, device=device).masked_fill_(
                ~allowed, torch.finfo(mask_dtype).min)
        return {"position_ids": pos, "attention_mask": allowed}
