"""Coalesced KV-block copies: every layer and K/V of a block list in one kernel launch.

``copy_blocks`` moves blocks between two caches (converting physical orders), ``gather`` /
``scatter`` go through a dense staging buffer, ``swap_out`` / ``swap_in`` move blocks to and from
pinned host memory; ``BoundCopy`` does the same between two fixed caches (a registered region and
a peer's, or a staging slot), checked once, each call then only uploading its block ids. Copies
touching CUDA memory run by the Triton kernel or by the copy engines
(``path=``/``XFER_COPY_PATH``: kernel, batch, 2d, auto; see :mod:`xfer.kernels._dispatch`, :mod:`xfer.kernels.paths` and
:mod:`xfer.kernels.copy_engine`). Triton is imported only when a kernel runs (CI imports xfer
without a GPU).
"""

from ._dispatch import (BoundCopy, CopyPath, StagingCopies, copy_blocks, copy_table, gather, order_after_stream,
                        scatter, select_path, set_copy_table, staging_layout, swap_in, swap_out)

__all__ = ["copy_blocks", "BoundCopy", "StagingCopies", "staging_layout", "gather", "scatter", "swap_out", "swap_in",
           "CopyPath", "select_path", "copy_table", "set_copy_table", "order_after_stream"]
