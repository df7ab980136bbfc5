"""Shared-secret authentication: signed metadata, and per-connection sessions (HMAC-SHA256).

Agents of one deployment share a secret (``AgentConfig.secret`` or ``XFER_SECRET``, >= 16 bytes).

Metadata carries ``auth`` = HMAC over its canonical JSON without ``auth``.

Connections (the control channel's TCP connections, UCX endpoints) start with a handshake: each
side sends a fresh 16-byte nonce and its agent id; both derive the connection's session key

    key = HKDF-SHA256(ikm = secret, salt = nonce_initiator || nonce_acceptor,
                      info = channel || initiator id || acceptor id)

and each proves it holds it (an HMAC over the handshake transcript, :func:`proof`) before the
other accepts anything else. Every later message carries

    mac = HMAC-SHA256(key, direction || seq || kind || lengths || header || payload)[:16]

with ``seq`` strictly increasing per direction (:class:`Session`). The key names the two agents
and this connection (both nonces are fresh), the direction and the sequence number are in the
MAC: a message captured on one connection fails on any other connection, at any other agent, in
the other direction, and a replay on its own connection fails its sequence number. No clocks
and no nonce caches are involved. Without a secret the same framing runs with no MAC (the
sequence numbers are still checked: they catch a desynchronised stream, not an attacker).

What this protects and what it does not is in docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct

from .errors import AuthenticationError

__all__ = ["Authenticator", "Session", "secret_from", "proof", "NONCE_BYTES", "MAC_BYTES", "PROOF_BYTES",
           "NO_MAC", "new_nonce"]

NONCE_BYTES = 16
MAC_BYTES = 16  # HMAC-SHA256 truncated to 128 bits (RFC 2104 section 5)
PROOF_BYTES = 32
NO_MAC = bytes(MAC_BYTES)
_MAC_HEAD = struct.Struct("!BQBII")  # direction, seq, kind, header length, payload length


def secret_from(value: bytes | str | None) -> bytes | None:
    """The configured secret as bytes, or None (no auth). ``XFER_SECRET`` is read by
    ``xfer.settings`` (``AgentConfig.settings.secret``), which the agent passes when the config names none."""
    if value is None:
        return None
    return value.encode() if isinstance(value, str) else bytes(value)


def _canonical(d: dict, drop: str) -> bytes:
    return json.dumps({k: v for k, v in d.items() if k != drop}, sort_keys=True, separators=(",", ":")).encode()


def _field(b: bytes) -> bytes:
    return len(b).to_bytes(2, "big") + b


def proof(key: bytes, role: bytes, transcript: bytes) -> bytes:
    """What a side sends to show it derived ``key``: HMAC(key, role || SHA-256(transcript))."""
    return hmac.digest(key, role + hashlib.sha256(transcript).digest(), "sha256")


class Authenticator:
    """The deployment's secret: signs and checks metadata, derives connections' session keys."""

    def __init__(self, secret: bytes):
        if len(secret) < 16:
            raise AuthenticationError(f"the shared secret must be at least 16 bytes, got {len(secret)}")
        self._key = hashlib.sha256(b"xfer-auth-v1" + secret).digest()  # metadata
        self._ikm = hmac.digest(b"xfer-session-v2", secret, "sha256")  # sessions (never used as a MAC key)

    def _mac(self, *parts: bytes) -> str:
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        for p in parts:
            h.update(len(p).to_bytes(8, "big"))
            h.update(p)
        return h.hexdigest()

    # ---- sessions ----------------------------------------------------------------------------
    def session_key(self, channel: bytes, initiator: str, acceptor: str, n_init: bytes, n_acc: bytes) -> bytes:
        """The session key of one connection (HKDF-SHA256, RFC 5869, one output block)."""
        if len(n_init) != NONCE_BYTES or len(n_acc) != NONCE_BYTES:
            raise AuthenticationError("handshake nonces must be 16 bytes each")
        prk = hmac.digest(n_init + n_acc, self._ikm, "sha256")  # extract
        info = b"xfer-v2 " + _field(channel) + _field(initiator.encode()) + _field(acceptor.encode())
        return hmac.digest(prk, info + b"\x01", "sha256")  # expand

    # ---- metadata ----------------------------------------------------------------------------
    def sign_metadata(self, d: dict) -> dict:
        return dict(d, auth=self._mac(_canonical(d, "auth")))

    def check_metadata(self, d: dict) -> None:
        auth = d.get("auth")
        if not isinstance(auth, str):
            raise AuthenticationError(f"metadata of {str(d.get('name'))[:64]!r} is not signed (peer has no shared "
                                      f"secret?)")
        try:
            canonical = _canonical(d, "auth")
        except (ValueError, RecursionError) as exc:
            raise AuthenticationError(f"metadata cannot be checked: {exc}"[:200]) from None
        if not hmac.compare_digest(auth, self._mac(canonical)):
            raise AuthenticationError(f"metadata of {str(d.get('name'))[:64]!r} fails its MAC (wrong secret or "
                                      f"tampered)")

    # ---- grant tokens (xfer.ahead) --------------------------------------------------------------
    def sign_token(self, d: dict) -> dict:
        return dict(d, auth=self._mac(b"grant-token", _canonical(d, "auth")))

    def check_token(self, d: dict) -> None:
        auth = d.get("auth")
        if not isinstance(auth, str):
            raise AuthenticationError("the grant token is not signed (its target has no shared secret?)")
        try:
            canonical = _canonical(d, "auth")
        except (ValueError, TypeError, RecursionError) as exc:
            raise AuthenticationError(f"the grant token cannot be checked: {exc}"[:200]) from None
        if not hmac.compare_digest(auth, self._mac(b"grant-token", canonical)):
            raise AuthenticationError("the grant token fails its MAC (wrong secret or tampered)")


class Session:
    """One connection's message authentication: ``seal`` the messages this side sends, ``open``
    the ones it receives. ``key`` None: no secret (sequence numbers only). ``outgoing``: this side
    initiated the connection (it picks the direction byte of each way)."""

    __slots__ = ("key", "_out_dir", "_in_dir", "sent", "received")

    def __init__(self, key: bytes | None, outgoing: bool):
        self.key = key
        self._out_dir, self._in_dir = (1, 2) if outgoing else (2, 1)
        self.sent = 0  # the last sequence number sent
        self.received = 0  # the last one accepted

    def _mac(self, direction: int, seq: int, kind: int, header: bytes, payload: bytes) -> bytes:
        msg = _MAC_HEAD.pack(direction, seq, kind, len(header), len(payload)) + header + payload
        return hmac.digest(self.key, msg, "sha256")[:MAC_BYTES]

    def seal(self, kind: int, header: bytes, payload: bytes = b"") -> tuple[int, bytes]:
        """(sequence number, MAC) of the next message this side sends."""
        self.sent += 1
        if self.key is None:
            return self.sent, NO_MAC
        return self.sent, self._mac(self._out_dir, self.sent, kind, header, payload)

    def open(self, seq: int, kind: int, header: bytes, payload: bytes, mac: bytes) -> None:
        """Accept a received message, or raise :class:`AuthenticationError` saying why. Checked
        before anything of it is decoded."""
        if self.key is not None and not hmac.compare_digest(
                mac, self._mac(self._in_dir, seq, kind, header, payload)):
            raise AuthenticationError("message MAC does not verify (wrong secret, tampered, or taken from another "
                                      "connection)")
        if seq <= self.received:
            raise AuthenticationError(f"message sequence number {seq} is not above the last one, {self.received} "
                                      f"(replayed)")
        self.received = seq


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)
