"""Coalesced KV-block copies: every layer and K/V of a block list in one kernel launch.

``copy_blocks`` moves blocks between two caches (converting physical orders), ``gather`` /
``scatter`` go through a dense staging buffer, ``swap_out`` / ``swap_in`` move blocks to and from
pinned host memory. Triton is imported only when a kernel runs (CI imports xfer without a GPU).
"""

from ._dispatch import CopyPath, copy_blocks, gather, scatter, select_path, swap_in, swap_out

__all__ = ["copy_blocks", "gather", "scatter", "swap_out", "swap_in", "CopyPath", "select_path"]
