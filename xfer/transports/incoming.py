"""The one check of a peer's request on the target side, before any byte of a region is read or
written: the region it names is registered here, the initiator's layout (or its fingerprint, or
its block order) matches the region's, and its block ids are in range (and unique where this side
is written). Used by the agent's notices (one-sided transports), UCX's REQ and NVSHMEM's
begin/read messages; every failure is a typed :class:`~xfer.errors.XferError` naming the value.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import LayoutMismatchError, NotRegisteredError
from ..layout import KVLayout
from ..transfer import Op
from .base import LocalRegion

__all__ = ["check_request"]


def check_request(lookup: Callable, *, region, op: Op, ids, what: str, agent: str = "this agent",
                  initiator: str = "?", sender_layout: KVLayout | None = None, fingerprint=None,
                  order: str | None = None) -> tuple[LocalRegion, np.ndarray]:
    """(the local region, its checked int64 block ids) of a peer's ``op`` on region ``region``.

    ``lookup(name)``: this agent's registered regions; ``agent`` names this side in the error.
    ``op`` is the initiator's: for a WRITE this side is written, so its ids must be unique.
    ``sender_layout``: the initiator's layout, checked compatible; ``fingerprint``: the hash of it
    (``KVLayout.fingerprint_hash``) where only that travels; ``order``: the block order the
    initiator expects this side's bytes in (a READ it lands as they are).
    """
    local = lookup(region) if isinstance(region, str) else None
    if local is None:
        raise NotRegisteredError(f"{agent} has no region {region!r}")
    layout = local.layout
    if sender_layout is not None:
        layout.check_compatible(sender_layout, what=f"initiator {initiator!r}")
    if fingerprint is not None and fingerprint != layout.fingerprint_hash():
        raise LayoutMismatchError(f"the initiator's layout fingerprint {fingerprint!r} differs from region "
                                  f"{local.name!r} ({layout.fingerprint()})")
    if order is not None and order != layout.inner_order:
        raise LayoutMismatchError(f"initiator expects block order {order!r}, region {local.name!r} is "
                                  f"{layout.inner_order!r} (stale metadata: reconnect)")
    if not isinstance(ids, np.ndarray):
        ids = np.asarray(ids, dtype=np.int64)
    return local, layout.check_block_ids(ids, what=what, unique=op is Op.WRITE)
