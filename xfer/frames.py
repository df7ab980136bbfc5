"""The control channel's frames and handshake (who sends what when: xfer.control).

Every frame starts with a fixed 36-byte prefix, then its header and payload:

    !BBHIIQ16s   kind, flags (0), 0, header length, payload length, sequence number, MAC

Kinds, in the order a connection uses them:

    HELLO    client -> server   who the client is (agent id, name), who it expects, its nonce
    WELCOME  server -> client   who the server is, its nonce, its limits, its proof of the key
    PROOF    client -> server   the client's proof of the key (sent with its first request)
    REQUEST  client -> server   JSON header + payload bytes, MAC'd (xfer.auth.Session)
    REPLY    server -> client   the same, answering the request before it
    REJECT   server -> client   why the server refuses (authentication, limits, protocol); it closes

HELLO, WELCOME, PROOF and REJECT bodies are binary and of bounded size (``HELLO_MAX`` and
friends): a server reads nothing else, and nothing bigger, from a peer that has not proved the
key. REQUEST and REPLY headers are JSON, parsed only after their MAC and sequence number are
checked and their length bounded (:func:`xfer.guard.loads`). Without a secret the MACs and
proofs are zeros and not checked; everything else is the same.
"""

from __future__ import annotations

import enum
import struct
from typing import Callable

from .auth import NO_MAC, NONCE_BYTES, PROOF_BYTES, Authenticator, new_nonce, proof
from .errors import AuthenticationError, InvalidArgumentError

__all__ = ["Kind", "PREFIX", "frame", "Hello", "Welcome", "hello_body", "parse_hello", "welcome_body",
           "parse_welcome", "session_key", "reject_body", "parse_reject", "Reject",
           "HELLO_MAX", "WELCOME_MAX", "REJECT_MAX", "PREAUTH_MAX", "VERSION", "MAGIC"]

MAGIC = b"XFC2"
VERSION = 2
PREFIX = struct.Struct("!BBHIIQ16s")
_HELLO = struct.Struct("!4sBB32s32s16sB")  # magic, version, flags, agent id, expected peer id, nonce, name length
_WELCOME = struct.Struct("!4sBB32s16sIII32sB")  # magic, version, flags, agent id, nonce, idle ms, max header,
# max payload, proof, name length
NAME_MAX = 255
HELLO_MAX = _HELLO.size + NAME_MAX
WELCOME_MAX = _WELCOME.size + NAME_MAX
REJECT_MAX = 512
PREAUTH_MAX = PREFIX.size + HELLO_MAX  # the most a server buffers for a peer that has not proved the key
_HAS_SECRET = 1
CHANNEL = b"control"


class Kind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    PROOF = 3
    REQUEST = 4
    REPLY = 5
    REJECT = 6


class Reject(enum.IntEnum):
    AUTH = 1  # no secret, wrong secret, proof fails
    BUSY = 2  # connection limits
    PROTOCOL = 3  # a frame this side does not take here


def frame(kind: Kind, header: bytes, payload: bytes = b"", seq: int = 0, mac: bytes = NO_MAC) -> bytes:
    return PREFIX.pack(int(kind), 0, 0, len(header), len(payload), seq, mac) + header + payload


def _id(agent_id: str) -> bytes:
    raw = agent_id.encode()
    if len(raw) > 32:
        raise InvalidArgumentError(f"agent id {agent_id!r} is longer than 32 bytes")
    return raw.ljust(32, b"\0")


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")


class Hello:
    __slots__ = ("body", "agent_id", "expected", "nonce", "name", "has_secret")

    def __init__(self, body: bytes):
        if not _HELLO.size <= len(body) <= HELLO_MAX:
            raise InvalidArgumentError(f"hello of {len(body)} bytes (expected {_HELLO.size}..{HELLO_MAX})")
        magic, version, flags, agent_id, expected, nonce, n = _HELLO.unpack_from(body)
        if magic != MAGIC:
            raise InvalidArgumentError(f"not an xfer control client: hello starts with {magic!r}")
        if version != VERSION:
            raise InvalidArgumentError(f"peer speaks control protocol version {version}, this agent {VERSION}")
        if len(body) != _HELLO.size + n:
            raise InvalidArgumentError(f"hello names a {n}-byte agent name in {len(body) - _HELLO.size} bytes")
        self.body, self.nonce, self.has_secret = body, nonce, bool(flags & _HAS_SECRET)
        self.agent_id, self.expected = _text(agent_id), _text(expected)
        self.name = body[_HELLO.size:].decode(errors="replace")


def hello_body(agent_id: str, name: str, expected: str | None, has_secret: bool, nonce: bytes) -> bytes:
    raw = name.encode()[:NAME_MAX]
    return _HELLO.pack(MAGIC, VERSION, _HAS_SECRET if has_secret else 0, _id(agent_id), _id(expected or ""),
                       nonce, len(raw)) + raw


def parse_hello(body: bytes) -> Hello:
    return Hello(body)


class Welcome:
    __slots__ = ("body", "agent_id", "nonce", "idle_s", "max_header", "max_payload", "proof", "name",
                 "has_secret")

    def __init__(self, body: bytes):
        if not _WELCOME.size <= len(body) <= WELCOME_MAX:
            raise InvalidArgumentError(f"welcome of {len(body)} bytes (expected {_WELCOME.size}..{WELCOME_MAX})")
        magic, version, flags, agent_id, nonce, idle_ms, mh, mp, prf, n = _WELCOME.unpack_from(body)
        if magic != MAGIC or version != VERSION:
            raise InvalidArgumentError(f"peer is not an xfer control server of version {VERSION} "
                                       f"({magic!r}, version {version})")
        if len(body) != _WELCOME.size + n:
            raise InvalidArgumentError(f"welcome names a {n}-byte agent name in {len(body) - _WELCOME.size} bytes")
        self.body, self.nonce, self.proof, self.has_secret = body, nonce, prf, bool(flags & _HAS_SECRET)
        self.agent_id, self.idle_s, self.max_header, self.max_payload = _text(agent_id), idle_ms / 1000, mh, mp
        self.name = body[_WELCOME.size:].decode(errors="replace")

    def transcript(self, hello: bytes) -> bytes:
        """The handshake as both sides saw it, with this welcome's proof field zeroed."""
        at = _WELCOME.size - 1 - PROOF_BYTES
        return hello + self.body[:at] + bytes(PROOF_BYTES) + self.body[at + PROOF_BYTES:]


def welcome_body(agent_id: str, name: str, has_secret: bool, nonce: bytes, idle_s: float, max_header: int,
                 max_payload: int, prf: bytes = bytes(PROOF_BYTES)) -> bytes:
    raw = name.encode()[:NAME_MAX]
    return _WELCOME.pack(MAGIC, VERSION, _HAS_SECRET if has_secret else 0, _id(agent_id), nonce,
                         min(int(idle_s * 1000), 0xFFFFFFFF), max_header, max_payload, prf, len(raw)) + raw


def parse_welcome(body: bytes) -> Welcome:
    return Welcome(body)


def session_key(auth: Authenticator | None, hello: Hello, welcome_agent_id: str, welcome_nonce: bytes) -> bytes | None:
    """The connection's session key (None without a secret): client = initiator."""
    if auth is None:
        return None
    return auth.session_key(CHANNEL, hello.agent_id, welcome_agent_id, hello.nonce, welcome_nonce)


def server_proof(key: bytes | None, transcript: bytes) -> bytes:
    return bytes(PROOF_BYTES) if key is None else proof(key, b"server", transcript)


def client_proof(key: bytes | None, transcript: bytes, server: bytes) -> bytes:
    return bytes(PROOF_BYTES) if key is None else proof(key, b"client", transcript + server)


def reject_body(code: Reject, reason: str) -> bytes:
    return bytes([int(code)]) + reason.encode()[:REJECT_MAX - 1]


def parse_reject(body: bytes) -> tuple[int, str]:
    if not body:
        return 0, "(no reason given)"
    return body[0], body[1:REJECT_MAX].decode(errors="replace")


def check_secret_match(mine: bool, theirs: bool, peer: str) -> None:
    """Both sides have a secret, or neither: anything else fails before a byte of a request moves."""
    if mine and not theirs:
        raise AuthenticationError(f"peer {peer!r} has no shared secret; this agent requires the deployment's secret")
    if theirs and not mine:
        raise AuthenticationError(f"peer {peer!r} requires the deployment's shared secret; this agent has none")


__all__ += ["server_proof", "client_proof", "check_secret_match", "new_nonce", "NONCE_BYTES", "CHANNEL", "Later"]


class Later:
    """A reply its handler gives later. The server's loop calls ``poll(now)`` (on its own thread)
    until it returns (reply header, payload); meanwhile no further request of that connection is
    read, so its replies stay in order. The loop polls without sleeping for ``spin_s`` after the
    request, then once a millisecond. ``poll`` must end by itself (a deadline of its own); an
    exception it raises is the reply (an error). A connection that ends first takes it along."""

    __slots__ = ("poll", "spin_s", "since")

    def __init__(self, poll: Callable[[float], "tuple[dict, bytes] | None"], spin_s: float = 0.002) -> None:
        self.poll, self.spin_s, self.since = poll, spin_s, 0.0
