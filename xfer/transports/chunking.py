"""The one chunk planner: how many whole blocks (and, for UCX, layers) a chunk of a transfer
holds, for every transport that moves a transfer in pieces (UCX's staged and in-place chunks,
NVSHMEM's staging chunks, the one-sided host copies that check the deadline between chunks).

Pure Python over a layout's sizes: no transport state, no I/O.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..layout import KVLayout

__all__ = ["blocks_per_chunk", "Chunk", "plan_chunks", "chunk_list", "ChunkPlan", "plan_blocks"]


def blocks_per_chunk(n: int, bytes_per_block: int, chunk_bytes: int, min_chunks: int = 1, min_bytes: int = 0) -> int:
    """Whole blocks per chunk for ``n`` blocks: at most ``chunk_bytes`` a chunk (one block at
    least); a transfer that fits fewer than ``min_chunks`` chunks is still cut into about that
    many (so that its stages overlap), but no chunk below ``min_bytes`` (each chunk has fixed
    costs: a message, completions, copy calls)."""
    want = max(-(-max(n, 1) * bytes_per_block // max(min_chunks, 1)), min_bytes)
    return max(1, min(max(n, 1), min(chunk_bytes, want) // bytes_per_block))


@dataclass(frozen=True)
class Chunk:
    """Blocks ``ids[b0:b1]`` of layers ``l0:l1``; staged as ``[layers, K, blocks, block bytes]``."""

    seq: int
    b0: int
    b1: int
    l0: int
    l1: int
    nbytes: int


def plan_chunks(layout: KVLayout, n: int, chunk_bytes: int, min_chunks: int = 1,
                min_bytes: int = 0) -> tuple[int, int]:
    """(blocks per chunk, layers per chunk) for ``n`` blocks, each chunk at most ``chunk_bytes``
    (:func:`blocks_per_chunk`); a block bigger than a chunk is cut by layers."""
    per_block = layout.bytes_per_block
    if per_block <= chunk_bytes:
        return blocks_per_chunk(n, per_block, chunk_bytes, min_chunks, min_bytes), layout.num_layers
    per_layer = layout.num_kv * layout.block_nbytes
    if per_layer > chunk_bytes:
        raise InvalidArgumentError(f"one layer of one block is {per_layer} bytes, more than the UCX chunk of "
                                   f"{chunk_bytes} bytes: raise XFER_UCX_CHUNK_BYTES")
    return 1, chunk_bytes // per_layer


@functools.lru_cache(maxsize=256)
def chunk_list(layout: KVLayout, n: int, bpc: int, lpc: int) -> tuple[Chunk, ...]:
    """The chunks of ``n`` blocks at ``bpc`` blocks x ``lpc`` layers a chunk, in send order.
    Memoized: an engine repeats a few transfer shapes, and building the list costs ~15 us of a
    lone small transfer's critical path on a cold CPU cache, on each side."""
    per = layout.num_kv * layout.block_nbytes
    out = []
    for b0 in range(0, n, bpc):
        b1 = min(n, b0 + bpc)
        for l0 in range(0, layout.num_layers, lpc):
            l1 = min(layout.num_layers, l0 + lpc)
            out.append(Chunk(len(out), b0, b1, l0, l1, (b1 - b0) * (l1 - l0) * per))
    return tuple(out)


@dataclass(frozen=True)
class ChunkPlan:
    """``n`` blocks cut into chunks of ``per`` whole blocks (the last one shorter)."""

    n: int
    per: int

    @property
    def chunks(self) -> int:
        return math.ceil(self.n / self.per)

    def bounds(self, k: int) -> tuple[int, int]:
        return k * self.per, min(self.n, (k + 1) * self.per)


def plan_blocks(n: int, bytes_per_block: int, chunk_cap: int, chunk_bytes: int, what: str, hint: str = "") -> ChunkPlan:
    """Whole blocks per chunk within ``min(chunk_cap, chunk_bytes)``; ``what`` names the staging
    that caps a chunk and ``hint`` the remedy, for the error when one block does not fit it."""
    if bytes_per_block > chunk_cap:
        raise InvalidArgumentError(f"one block is {bytes_per_block} bytes (all layers, K/V) but {what} holds "
                                   f"{chunk_cap}{hint}")
    return ChunkPlan(n=n, per=blocks_per_chunk(n, bytes_per_block, min(chunk_cap, chunk_bytes)))
