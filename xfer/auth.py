"""Shared-secret authentication of agent metadata and control messages (HMAC-SHA256).

Agents of one deployment share a secret (``AgentConfig.secret`` or the ``XFER_SECRET``
environment variable). Every control frame carries ``ts`` (sender's wall clock), a random
``nonce`` and ``mac`` = HMAC(secret, canonical header without ``mac`` ‖ payload); a receiver
rejects a frame with a missing or wrong MAC, a timestamp outside ``max_skew_s``, or a nonce it
has seen (replay). Metadata carries ``auth`` = HMAC over its canonical JSON without ``auth``.

Threat model, and what this does not cover, is in the README ("Security").
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import os
import threading
import time

from .errors import AuthenticationError

__all__ = ["Authenticator", "secret_from"]


def secret_from(value: bytes | str | None) -> bytes | None:
    """The configured secret as bytes, or None (no auth). ``XFER_SECRET`` is read by
    ``xfer.settings`` (``AgentConfig.settings.secret``), which the agent passes when the config names none."""
    if value is None:
        return None
    return value.encode() if isinstance(value, str) else bytes(value)


def _canonical(d: dict, drop: str) -> bytes:
    return json.dumps({k: v for k, v in d.items() if k != drop}, sort_keys=True, separators=(",", ":")).encode()


class Authenticator:
    """Signs and checks control frames and metadata with one shared secret."""

    def __init__(self, secret: bytes, *, max_skew_s: float = 60.0):
        if len(secret) < 16:
            raise AuthenticationError(f"the shared secret must be at least 16 bytes, got {len(secret)}")
        self._key = hashlib.sha256(b"xfer-auth-v1" + secret).digest()
        self.max_skew_s = max_skew_s
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _mac(self, *parts: bytes) -> str:
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        for p in parts:
            h.update(len(p).to_bytes(8, "big"))
            h.update(p)
        return h.hexdigest()

    # ---- control frames ----------------------------------------------------------------------
    def stamp(self, header: dict, payload: bytes = b"") -> dict:
        out = dict(header, ts=time.time(), nonce=os.urandom(16).hex())
        out["mac"] = self._mac(_canonical(out, "mac"), payload)
        return out

    def check(self, header: dict, payload: bytes = b"") -> None:
        """Raise :class:`AuthenticationError` saying why ``header`` is not acceptable."""
        mac = header.get("mac")
        if not isinstance(mac, str):
            raise AuthenticationError("control message carries no MAC (peer has no shared secret?)")
        if not hmac.compare_digest(mac, self._mac(_canonical(header, "mac"), payload)):
            raise AuthenticationError("control message MAC does not verify (wrong secret or tampered message)")
        ts, nonce = header.get("ts"), header.get("nonce")
        if not isinstance(ts, (int, float)) or abs(time.time() - ts) > self.max_skew_s:
            raise AuthenticationError(f"control message timestamp {ts!r} is more than {self.max_skew_s:.0f} s "
                                      f"from this host's clock (replayed, or clocks out of sync)")
        if not isinstance(nonce, str):
            raise AuthenticationError("control message carries no nonce")
        now = time.monotonic()
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - 2 * self.max_skew_s:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise AuthenticationError(f"control message nonce {nonce[:8]}… was seen before (replay)")
            self._seen[nonce] = now

    # ---- metadata ----------------------------------------------------------------------------
    def sign_metadata(self, d: dict) -> dict:
        return dict(d, auth=self._mac(_canonical(d, "auth")))

    def check_metadata(self, d: dict) -> None:
        auth = d.get("auth")
        if not isinstance(auth, str):
            raise AuthenticationError(f"metadata of {d.get('name')!r} is not signed (peer has no shared secret?)")
        if not hmac.compare_digest(auth, self._mac(_canonical(d, "auth"))):
            raise AuthenticationError(f"metadata of {d.get('name')!r} fails its MAC (wrong secret or tampered)")
