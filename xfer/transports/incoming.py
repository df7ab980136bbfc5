"""The one check of a peer's request on the target side, before any byte of a region is read or
written: the region it names is registered here, the initiator's layout (or its fingerprint, or
its block order) matches the region's, and its block ids are in range (and unique where this side
is written). Used by the agent's grants and notices (one-sided transports), UCX's REQ and
NVSHMEM's begin/read messages; every failure is a typed :class:`~xfer.errors.XferError` naming the
value.

Time, the same way on every wire path: a peer's request carries its time to live (``ttl``, the
seconds left to its deadline when it left) and its send time (``sent``, the sender's monotonic
clock). :func:`check_ttl` refuses a non-finite or out-of-range value (a typed
InvalidArgumentError: a NaN would pass ``ttl <= 0`` and never expire); :func:`local_deadline`
turns them into a deadline here, less how long the request waited beyond its peer's usual delay
(:class:`ClockFloor`: in a socket while this process was stopped, behind a congested link), and
refuses one that arrives with (almost) nothing left: before any byte lands.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import numpy as np

from ..errors import InvalidArgumentError, LayoutMismatchError, NotRegisteredError, TransferTimeoutError
from ..layout import KVLayout
from ..transfer import Op
from .base import LocalRegion

__all__ = ["check_request", "check_ttl", "check_time", "local_deadline", "ClockFloor", "MAX_TTL_S", "CLOCK_DRIFT",
           "MARGIN_S"]

MAX_TTL_S = 7 * 86400.0  # the longest time to live a request may carry (a week)
# How fast two hosts' monotonic clocks may drift apart (a request's delay is judged against the least
# delay its peer has shown; that floor rises this fast, so drift never reads as delay): 100 ppm
CLOCK_DRIFT = 1e-4
# A request is admitted only with more than this much (or a tenth of its ttl) left, and its deadline
# here is that much earlier than the initiator's: the reply has time to travel back before the
# initiator's deadline, so the target never lands or delivers what the initiator already gave up
MARGIN_S = 0.05


@functools.lru_cache(maxsize=256)
def _fingerprint(layout: KVLayout) -> str:
    """A layout's fingerprint hash, made once (a JSON dump and a SHA-256: ~25 us a call)."""
    return layout.fingerprint_hash()


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_ttl(ttl, sent=None, *, what: str = "request") -> float:
    """``ttl`` as a float once it is a finite number of seconds in 0 .. MAX_TTL_S (and ``sent``,
    where given, a finite number): else the typed refusal, naming the value."""
    if not _number(ttl) or not 0 <= ttl <= MAX_TTL_S:
        raise InvalidArgumentError(f"{what}: ttl must be a finite number of seconds in 0..{MAX_TTL_S:g}, got {ttl!r}")
    if sent is not None and not _number(sent):
        raise InvalidArgumentError(f"{what}: send time must be a finite number, got {sent!r}")
    return float(ttl)


def check_time(value, *, what: str = "request") -> float:
    """A peer's monotonic time stamp as a float, once it is a finite number (else the typed refusal)."""
    if not _number(value):
        raise InvalidArgumentError(f"{what}: a time must be a finite number, got {value!r}")
    return float(value)


def local_deadline(ttl, late: float, now: float, *, what: str = "request") -> float:
    """This side's deadline (``time.monotonic``) for a request with ``ttl`` seconds left when sent
    and received ``late`` seconds beyond its peer's usual delay (:meth:`ClockFloor.delay`): earlier
    than the initiator's by the margin. Refused (TransferTimeoutError) when no more than the margin
    is left: nothing of it lands here."""
    ttl = check_ttl(ttl, what=what)
    left, margin = ttl - late, min(MARGIN_S, 0.1 * ttl)
    if left <= margin:
        raise TransferTimeoutError(f"{what} reached this side {late:.3f} s after it was sent with {ttl:.3f} s to "
                                   f"live: past (or at) its deadline; refused, nothing of it lands")
    return now + left - margin


class ClockFloor:
    """The least (arrival here - send time there) of one peer's messages, and when it was last moved:
    how much later than that a message arrives is how long it waited. Two clocks need no common
    origin, only a common rate: the floor rises by CLOCK_DRIFT a second, so drift never reads as
    delay. ``start``: the floor before any message (0.0 for a peer on this host, whose monotonic
    clock is this one: then even the first message's wait counts); None: set by the first."""

    __slots__ = ("skew", "at")

    def __init__(self, start: float | None = None, now: float = 0.0):
        self.skew, self.at = start, now

    def delay(self, sent: float, now: float) -> float:
        sample = now - sent
        if self.skew is None:
            self.skew, self.at = sample, now
            return 0.0
        floor = self.skew + CLOCK_DRIFT * (now - self.at)
        if sample <= floor:
            self.skew, self.at = sample, now
            return 0.0
        return sample - floor


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
    if fingerprint is not None and fingerprint != _fingerprint(layout):
        raise LayoutMismatchError(f"the initiator's layout fingerprint {fingerprint!r} differs from region "
                                  f"{local.name!r} ({layout.fingerprint()})")
    if order is not None and order != layout.inner_order:
        raise LayoutMismatchError(f"initiator expects block order {order!r}, region {local.name!r} is "
                                  f"{layout.inner_order!r} (stale metadata: reconnect)")
    if not isinstance(ids, np.ndarray):
        ids = np.asarray(ids, dtype=np.int64)
    return local, layout.check_block_ids(ids, what=what, unique=op is Op.WRITE)
