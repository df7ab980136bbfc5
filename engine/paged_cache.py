"""A transformers ``Cache`` backed by paged xfer blocks: the drop-in KV layer of any HF causal LM.

``PagedCache(pool, tables, length)`` holds, per batch row, a block table (a list of block ids of
``pool``) and a common sequence length. Each attention layer calls ``update(k, v, layer_idx)``;
its ``PagedLayer`` stores the new tokens in the row's blocks and returns K/V of the whole sequence
(``[B, H, S, C]``, gathered from the blocks, contiguous: the same values DynamicCache returns).

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
        self.length = owner.start_length
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store ``key_states``/``value_states`` (``[B, H, S, C]``) after the cached tokens; return all of them."""
        owner, pool, start = self.owner, self.owner.pool, self.length
        s = key_states.shape[-2]
        if owner.before_layer is not None:
            owner.before_layer(self.layer)
        h0, h1 = owner.heads
        if self.layer == 0:
            owner._index.clear()  # a new forward: tables may have grown or been swapped in
        for row, table in enumerate(owner.tables):
            slots = owner.index(("slots", row, start, s), lambda r=row, t=table: self._slots(r, t, start, s))
            pool.write(self.layer, slots, key_states[row, h0:h1], value_states[row, h0:h1])
        self.length = start + s
        if owner.after_layer is not None:
            owner.after_layer(self.layer)
        if start == 0:
            return key_states, value_states  # nothing cached before: the blocks hold exactly these
        if not owner.reads_back:
            raise InvalidArgumentError(f"this cache holds kv-heads {owner.heads} only; attention over cached "
                                       f"tokens needs all {pool.model.num_kv_heads}")
        ks, vs = [], []
        for row, table in enumerate(owner.tables):
            table_t = owner.index(("table", row, self.length), lambda t=table: pool.table_tensor(t, self.length))
            k, v = pool.read(self.layer, table_t, self.length)
            ks.append(k)
            vs.append(v)
        return (torch.stack(ks).to(key_states.dtype), torch.stack(vs).to(value_states.dtype))

    def _slots(self, row: int, table: list[int], start: int, s: int):
        pool = self.owner.pool
        if len(table) * pool.block_size < start + s:
            raise InvalidArgumentError(f"row {row}: {len(table)} blocks of {pool.block_size} tokens cannot hold "
                                       f"{start + s} tokens; grow the block table first")
        return pool.slots(table, start, s)

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        """(kv length, kv offset) for the mask; transformers < 5.2x passes ``cache_position`` (a tensor)."""
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.length + query_length, 0

    def get_seq_length(self, *args) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a PagedCache does not crop; free the request's blocks instead")


class PagedCache(Cache):
    """The KV of ``len(tables)`` sequences of equal length in ``pool``.

    tables: per row, the sequence's block ids, grown by the caller (``BlockManager.append``) before
        a step needs a new block; the lists are held by reference. length: tokens already cached.
    heads: the absolute kv-head range stored (a TP rank's share); the pool must hold exactly it.
        Reading back needs all heads, so a partial-head cache serves prefill only (``reads_back`` off).
    """

    def __init__(self, pool: KVPool, tables: Sequence[list[int]], length: int = 0, *,
                 before_layer: LayerHook | None = None, after_layer: LayerHook | None = None,
                 heads: tuple[int, int] | None = None):
        if not tables or not all(isinstance(t, list) for t in tables):
            raise InvalidArgumentError("tables must be a non-empty sequence of block-id lists (one per row)")
        self.pool, self.tables, self.start_length = pool, list(tables), int(length)
        self.before_layer, self.after_layer = before_layer, after_layer
        full = (0, pool.model.num_kv_heads)
        self.heads = heads or full
        if (self.heads[1] - self.heads[0]) != pool.num_heads:
            raise InvalidArgumentError(f"heads {self.heads} do not match the pool's {pool.num_heads} kv-heads")
        self.reads_back = self.heads == full
        self._index: dict[tuple, object] = {}  # this forward's device index tensors, shared by all layers
        super().__init__(layers=[PagedLayer(self, layer) for layer in range(pool.model.num_layers)])

    def index(self, key: tuple, make: Callable[[], object]):
        """A device index tensor for ``key``, made by the first layer that asks (a forward's layers share it)."""
        if key not in self._index:
            self._index[key] = make()
        return self._index[key]

    def __repr__(self) -> str:
        return f"PagedCache(rows={len(self.tables)}, length={self.get_seq_length()}, heads={self.heads}, {self.pool!r})"
