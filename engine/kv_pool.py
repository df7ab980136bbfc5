"""The paged KV pool of one instance: base tensors in a chosen layout, per-slot logical views, and the
per-layer (and per-head-range) ``KVLayout`` views registered as xfer regions.

Why one region per layer: ``Agent.write`` moves every slot of a region for the given blocks. A
region whose layout covers only layer ``l`` (``layer_layout``: the full layout's slot table cut to
that layer's K and V) lets the prefill side post layer ``l``'s blocks the moment that layer is
computed, without new API, for any layout (per-layer tensors or one cross-layer tensor). A head
range (``head_layout``) does the same along heads: a prefill rank holding heads ``[h0, h1)`` writes
straight into that slice of the decode pool's blocks.
"""

from __future__ import annotations

from dataclasses import replace
from collections.abc import Sequence

import torch

from xfer.errors import InvalidArgumentError
from xfer.layout import KVLayout, make_kv_cache

from .config import ModelSpec, PoolSpec

__all__ = ["KVPool", "layer_layout", "head_layout", "region_name", "pinned_empty"]


def region_name(layer: int, heads: tuple[int, int] | None = None) -> str:
    """Region of layer ``layer`` (and head range ``heads``): ``kv.3`` or ``kv.3.h2-4``."""
    return f"kv.{layer}" if heads is None else f"kv.{layer}.h{heads[0]}-{heads[1]}"


def pinned_empty(shape, *, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Page-locked host memory (what the swap kernels need beside a GPU pool)."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


def layer_layout(layout: KVLayout, layer: int) -> tuple[KVLayout, list[int]]:
    """The layout of layer ``layer`` alone, and which base tensors of ``layout`` it uses (in order)."""
    if not 0 <= layer < layout.num_layers:
        raise InvalidArgumentError(f"layer {layer} is not in 0..{layout.num_layers - 1}")
    slots = [layout.slot(layer, kv) for kv in range(layout.num_kv)]
    used = sorted({layout.slot_tensor[s] for s in slots})
    return replace(layout, name=f"{layout.name}.layer{layer}", num_layers=1,
                   slot_tensor=tuple(used.index(layout.slot_tensor[s]) for s in slots),
                   slot_offset=tuple(layout.slot_offset[s] for s in slots),
                   tensor_numel=tuple(layout.tensor_numel[t] for t in used)), used


def head_layout(layout: KVLayout, heads: tuple[int, int]) -> KVLayout:
    """The same blocks restricted to kv-heads ``[h0, h1)`` (a prefill TP rank's share)."""
    h0, h1 = heads
    if not 0 <= h0 < h1 <= layout.num_heads:
        raise InvalidArgumentError(f"head range {heads} is not inside 0..{layout.num_heads}")
    return replace(layout, name=f"{layout.name}.h{h0}-{h1}", num_heads=h1 - h0,
                   slot_offset=tuple(o + h0 * layout.head_stride for o in layout.slot_offset))


class KVPool:
    """``num_blocks`` blocks of ``block_size`` tokens for every layer, K and V, of heads ``heads``.

    ``views[slot]``: ``[num_blocks, block_size, heads, head_dim]`` logical view of slot
    ``layer * 2 + kv`` (no copy, any physical order). ``empty`` allocates the base tensors:
    ``xfer.shared_empty`` for a CPU pool another process writes into, ``pinned_empty`` for swap space.
    """

    def __init__(self, model: ModelSpec, pool: PoolSpec, *, heads: tuple[int, int] | None = None,
                 empty=torch.empty, device: str | None = None, zero: bool = True):
        self.model, self.spec = model, pool
        self.heads = heads or (0, model.num_kv_heads)
        if not 0 <= self.heads[0] < self.heads[1] <= model.num_kv_heads:
            raise InvalidArgumentError(f"heads {heads} not inside 0..{model.num_kv_heads}")
        self.device = torch.device(device or pool.device)
        self.tensors, self.layout = make_kv_cache(
            pool.layout, num_layers=model.num_layers, num_blocks=pool.num_blocks, block_size=pool.block_size,
            num_heads=self.heads[1] - self.heads[0], head_dim=model.head_dim, dtype=model.torch_dtype,
            device=self.device, empty=empty)
        if zero:
            for t in self.tensors:
                t.zero_()  # padding rows of a batched read gather unused slots: keep them finite
        self.views = self.layout.views(self.tensors)

    def __repr__(self) -> str:
        return (f"KVPool({self.layout.name}, {self.spec.num_blocks} blocks x {self.spec.block_size} tokens, "
                f"heads {self.heads}, {self.model.num_layers} layers, {self.layout.dtype}, {self.device})")

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    # ---- tokens in and out -----------------------------------------------------------------
    # Index tensors are built once per forward (``slots_batch`` / ``table_batch``) and reused by
    # every layer: a host->device copy of a pageable table waits for the stream, which per layer
    # would stall the CPU behind the GPU and leave launch gaps in the forward. On a GPU they are
    # staged through pinned memory (torch's caching host allocator: no allocation after warm-up),
    # so the copy is queued without waiting for the stream.
    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the pool's device, queued without waiting for the stream."""
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True)
        return x

    def slots(self, table: Sequence[int], start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets in block) of tokens ``start..start+count-1``: two int64 ``[count]`` device tensors."""
        return self.slots_batch([table], [start], count)

    def slots_batch(self, tables: Sequence[Sequence[int]], starts: Sequence[int],
                    count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of ``count`` new tokens after ``starts[b]`` in every row ``b``, row-major: ``[B * count]`` each."""
        bs = self.block_size
        if count == 1:  # a decode step: plain lists beat a few small tensor ops per row
            ids = [[t[p // bs] for t, p in zip(tables, starts, strict=True)], [p % bs for p in starts]]
            both = self.to_device(torch.tensor(ids, dtype=torch.long))
            return both[0], both[1]
        parts = []
        for table, start in zip(tables, starts, strict=True):
            pos = torch.arange(start, start + count)
            parts.append(torch.stack([torch.as_tensor(table, dtype=torch.long)[pos // bs], pos % bs]))
        both = self.to_device(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
        return both[0], both[1]

    def table_tensor(self, table: Sequence[int], length: int) -> torch.Tensor:
        """The blocks holding tokens ``0..length-1``: int64 ``[ceil(length / block_size)]`` on the device."""
        nb = -(-length // self.block_size)
        return self.to_device(torch.as_tensor(table[:nb], dtype=torch.long))

    def table_batch(self, tables: Sequence[Sequence[int]], length: int) -> torch.Tensor:
        """``[B, ceil(length / block_size)]`` block ids; a row with fewer blocks repeats its first block
        (padding the attention mask hides: every block holds finite values, the pool starts zeroed)."""
        nb = -(-length // self.block_size)
        rows = [list(t[:nb]) + [t[0]] * (nb - min(nb, len(t))) for t in tables]
        return self.to_device(torch.tensor(rows, dtype=torch.long))

    def write(self, layer: int, slots: tuple[torch.Tensor, torch.Tensor], key: torch.Tensor,
              value: torch.Tensor) -> None:
        """Store tokens at ``slots`` (from :meth:`slots`); key, value: ``[H, S, C]``, H this pool's heads."""
        self.write_tokens(layer, slots, key.transpose(0, 1), value.transpose(0, 1))

    def write_tokens(self, layer: int, slots: tuple[torch.Tensor, torch.Tensor], key: torch.Tensor,
                     value: torch.Tensor) -> None:
        """Store tokens at ``slots``; key, value: ``[T, H, C]`` (token-major), T the number of slots."""
        blocks, offs = slots
        for kv, x in enumerate((key, value)):
            self.views[2 * layer + kv][blocks, offs] = x.to(self.layout.dtype)

    def read(self, layer: int, table_t: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``0..length-1`` as contiguous K and V, each ``[H, length, C]``.

        table_t: from :meth:`table_tensor`.
        """
        k, v = self.read_batch(layer, table_t[None], length)
        return k[0], v[0]

    def read_batch(self, layer: int, table_b: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``0..length-1`` of every row of ``table_b`` (from :meth:`table_batch`): K, V ``[B, H, length, C]``."""
        out = []
        b = table_b.shape[0]
        for kv in range(2):
            x = self.views[2 * layer + kv][table_b]  # [B, nb, N, H, C] (a copy)
            out.append(x.reshape(b, -1, self.num_heads, x.shape[-1])[:, :length].transpose(1, 2).contiguous())
        return out[0], out[1]

    # ---- regions -----------------------------------------------------------------------------
    def layer_region(self, layer: int, heads: tuple[int, int] | None = None) -> tuple[KVLayout, list[torch.Tensor]]:
        """Layout and base tensors of layer ``layer`` (restricted to absolute kv-heads ``heads``)."""
        layout, used = layer_layout(self.layout, layer)
        if heads is not None:
            layout = head_layout(layout, (heads[0] - self.heads[0], heads[1] - self.heads[0]))
        return layout, [self.tensors[t] for t in used]

    def register(self, agent, shards: Sequence[tuple[int, int]] = ()) -> list[str]:
        """Register one region per layer (``kv.<l>``), plus one per layer and head range in ``shards``."""
        names = []
        for layer in range(self.model.num_layers):
            for heads in (None, *shards):
                layout, tensors = self.layer_region(layer, heads)
                agent.register(region_name(layer, heads), tensors, layout)
                names.append(region_name(layer, heads))
        return names
