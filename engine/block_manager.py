"""Block manager: which KV blocks of one pool are free, and who holds the others.

Plain structures (a deque of free ids, a ref count per id) and check/act pairs: call
``can_allocate(n)`` before ``allocate(n)``; ``allocate`` raises when the check would have failed.
Blocks are shared by ref count (``share``), and return to the free list when the last holder frees.
"""

from __future__ import annotations

from collections import deque

from xfer.errors import InvalidArgumentError, XferError

__all__ = ["BlockManager", "OutOfBlocksError", "blocks_for"]


class OutOfBlocksError(XferError):
    """An allocation asked for more blocks than are free (call ``can_allocate`` first)."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Allocates block ids ``0..num_blocks-1`` of one KV pool of ``block_size``-token blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidArgumentError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts: list[int] = [0] * num_blocks

    def __repr__(self) -> str:
        return f"BlockManager(free={self.num_free}/{self.num_blocks}, block_size={self.block_size})"

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    # ---- allocate / free -------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        """``n`` free block ids, each with ref count 1."""
        if not self.can_allocate(n):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self.free_ids)} of {self.num_blocks} are free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        """Add a holder to blocks already allocated (e.g. a prefix shared by two requests)."""
        for i in ids:
            self._check_held(i)
        for i in ids:
            self.ref_counts[i] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one holder of each block; a block whose count reaches 0 is free again."""
        for i in ids:
            self._check_held(i)
        for i in ids:
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free_ids.append(i)

    # ---- grow a sequence by tokens ---------------------------------------------------------
    def can_append(self, table: list[int], num_tokens: int, new_tokens: int = 1) -> bool:
        """Whether ``table`` (holding ``num_tokens``) can take ``new_tokens`` more."""
        return self.can_allocate(self.blocks_to_append(table, num_tokens, new_tokens))

    def append(self, table: list[int], num_tokens: int, new_tokens: int = 1) -> list[int]:
        """Extend ``table`` in place with the blocks ``new_tokens`` more tokens need; returns the new ids."""
        ids = self.allocate(self.blocks_to_append(table, num_tokens, new_tokens))
        table.extend(ids)
        return ids

    def blocks_to_append(self, table: list[int], num_tokens: int, new_tokens: int = 1) -> int:
        return max(0, blocks_for(num_tokens + new_tokens, self.block_size) - len(table))

    def _check_held(self, i: int) -> None:
        if not isinstance(i, int) or not 0 <= i < self.num_blocks:
            raise InvalidArgumentError(f"block id {i!r} is not in 0..{self.num_blocks - 1}")
        if self.ref_counts[i] == 0:
            raise InvalidArgumentError(f"block {i} is not allocated (double free?)")
