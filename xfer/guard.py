"""What a peer's input may cost before it is trusted, in one place.

- :func:`loads`: JSON parsed only after its length is bounded, to a bounded depth; every failure
  (bad UTF-8, bad JSON, a nesting deep enough to exhaust the parser's recursion, a value of the
  wrong type) is one :class:`~xfer.errors.InvalidArgumentError` naming it. Nothing a peer sends
  raises anything else from here.
- :func:`packed_ids`: block ids a request carries packed in its payload, read only once the counts
  its header names add up to the payload's size.
- :class:`Rejections`: the warnings a listener logs when it rejects a peer, rate-limited (a token
  bucket per listener) so that an attacker cannot flood the log; what was suppressed is counted
  and summarised in the next line that gets through, and every rejection is counted by reason
  (``counts``) whether logged or not.

The limits themselves are knobs (:mod:`xfer.settings`, group ``limits``) and are listed, with the
threat model, in docs/security.md.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import socket
import threading
import time

import numpy as np

from .errors import InvalidArgumentError

__all__ = ["loads", "depth", "Rejections", "MAX_DEPTH", "beyond_loopback", "warn_if_exposed", "PACKED_IDS", "packed_ids"]

MAX_DEPTH = 8  # a control header nests 3 deep (a batch of notices with block lists); a layout 2


def depth(value, limit: int) -> int:
    """How deeply ``value`` nests lists and dicts, counted until it passes ``limit`` (iterative:
    never recurses, whatever the input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > deepest:
            deepest = d
            if deepest > limit:
                break
        items = v.values() if isinstance(v, dict) else v
        stack.extend((x, d + 1) for x in items if isinstance(x, (list, dict)))
    return deepest


def loads(raw, *, max_bytes: int, what: str, max_depth: int = MAX_DEPTH, kind=dict):
    """``raw`` (bytes) as JSON of type ``kind``, at most ``max_bytes`` long and ``max_depth`` deep."""
    raw = bytes(raw)
    n = len(raw)
    if n > max_bytes:
        raise InvalidArgumentError(f"{what} of {n} bytes is over the limit of {max_bytes}")
    try:
        value = json.loads(raw)
    except RecursionError:
        raise InvalidArgumentError(f"{what} nests deeper than the JSON parser's recursion limit") from None
    except Exception as exc:  # UnicodeDecodeError, JSONDecodeError, MemoryError, anything
        raise InvalidArgumentError(f"{what} is not JSON: {str(exc)[:120]}") from None
    if not isinstance(value, kind):
        want = "an object" if kind is dict else f"a JSON {kind.__name__}"
        raise InvalidArgumentError(f"{what} must be {want}, got {type(value).__name__}")
    # every list or dict opens with one of these two bytes: fewer of them than the limit, no walk
    if raw.count(b"[") + raw.count(b"{") > max_depth and depth(value, max_depth) > max_depth:
        raise InvalidArgumentError(f"{what} nests deeper than {max_depth} levels")
    return value


class Rejections:
    """Rate-limited warnings of one listener's rejections: ``burst`` lines at once, then one per
    ``1 / rate`` seconds; the lines held back are counted and named in the next one logged.
    ``counts``: every rejection by its reason key (logged or not), for tests and operators."""

    def __init__(self, log, what: str, *, burst: int = 20, rate: float = 1.0):
        self.log, self.what, self.burst, self.rate = log, what, burst, rate
        self._tokens, self._at = float(burst), time.monotonic()
        self._held = 0
        self.counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def __call__(self, reason: str, fmt: str, *args) -> None:
        """Count a rejection under ``reason`` (a short key) and log ``fmt % args`` if the budget allows."""
        with self._lock:
            self.counts[reason] += 1
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens < 1:
                self._held += 1
                return
            self._tokens -= 1
            held, self._held = self._held, 0
        if held:
            fmt += f" ({held} more rejections not logged since the last line: rate limit)"
        self.log.warning(f"{self.what}: {fmt}", *args)


# a request's block ids sent packed in its payload (a grant's, ``grant_packed``): little-endian int64
PACKED_IDS = np.dtype("<i8")


def packed_ids(entries: list, payload: bytes, what: str) -> list[np.ndarray] | None:
    """The block ids of each of ``entries`` (dicts) where they travel packed in ``payload``: entry i
    names how many are its (``nblocks``), in order. None where no entry names any (the ids are in
    the entries, ``blocks``). Raises InvalidArgumentError, before anything is read, where the counts
    are not non-negative integers adding up to the payload's size."""
    counts = [e.get("nblocks") for e in entries]
    if all(n is None for n in counts):
        if payload:
            raise InvalidArgumentError(f"{what} carries {len(payload)} payload bytes and names no packed block ids")
        return None
    if not all(_int(n) and n >= 0 for n in counts) or sum(counts) * PACKED_IDS.itemsize != len(payload):
        raise InvalidArgumentError(f"{what}'s packed block id counts {counts[:8]} do not add up to its "
                                   f"{len(payload)} payload bytes"[:300])
    out, off = [], 0
    for n in counts:
        out.append(np.frombuffer(payload, dtype=PACKED_IDS, count=n, offset=off).astype(np.int64))
        off += n * PACKED_IDS.itemsize
    return out


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def beyond_loopback(host: str) -> bool:
    """Whether a listener bound to ``host`` can be reached from other hosts (a wildcard, or any
    address it resolves to that is not loopback; a name that does not resolve counts as reachable)."""
    if host in ("", "0.0.0.0", "::", "*"):
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return True
    return not all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def warn_if_exposed(log, agent: str, has_secret: bool, listeners: dict) -> bool:
    """Log ONE warning when an agent without a secret listens beyond loopback (``listeners``: what
    -> the address it is bound to); True if it did."""
    if has_secret:
        return False
    exposed = {what: host for what, host in listeners.items() if host is not None and beyond_loopback(host)}
    if not exposed:
        return False
    log.warning("agent %r listens beyond loopback (%s) without a shared secret: any process that reaches these "
                "addresses and holds its metadata can write into its registered memory. Set AgentConfig.secret or "
                "XFER_SECRET, or listen on 127.0.0.1 (docs/security.md)", agent,
                ", ".join(f"{what} on {host}" for what, host in exposed.items()))
    return True
