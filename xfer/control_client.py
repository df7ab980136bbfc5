"""The control channel's client: one connection to a peer's control server, one request in flight.

It connects lazily, runs the handshake (xfer.frames: HELLO, the server's WELCOME and proof, our
PROOF sent together with the first request), then sends MAC'd requests and checks each reply's
MAC and sequence number before parsing it. The server says in its WELCOME how long it keeps an
idle connection; the client opens a new one before reusing one idle for most of that.
"""

from __future__ import annotations

import hmac
import json
import socket
import threading
import time

from . import frames
from .auth import Session, new_nonce
from .errors import AuthenticationError, MetadataError, PeerDisconnectedError, TransferTimeoutError, XferError
from .frames import Kind, Reject
from .guard import loads

__all__ = ["ControlClient"]

_REPLY_PAYLOAD_MAX = 64 << 20


class ControlClient:
    """``identity``: (agent id, name) of this side; ``peer_id``: the agent id the peer's metadata
    names (the handshake fails with :class:`MetadataError` if another agent answers)."""

    def __init__(self, address: tuple[str, int], peer: str, connect_timeout: float, auth=None, *,
                 identity: tuple[str, str] = ("", "?"), peer_id: str | None = None, max_header: int = 1 << 20):
        self.address, self.peer, self._connect_timeout, self._auth = address, peer, connect_timeout, auth
        self._id, self._name = identity
        self._peer_id, self._max_header = peer_id, max_header
        self._sock: socket.socket | None = None
        self._session: Session | None = None
        self._proof = b""  # our PROOF, sent in front of the first request
        self._idle_s = float("inf")
        self._used = 0.0
        self._rest = b""  # bytes received past the part of a reply read so far
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        self._rest, self._session, self._proof = b"", None, b""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _where(self) -> str:
        return f"peer {self.peer!r} at {self.address[0]}:{self.address[1]}"

    def request(self, header: dict, payload: bytes = b"", *, deadline: float) -> tuple[dict, bytes]:
        """Send one frame and return the reply, by ``deadline`` (``time.monotonic`` seconds)."""
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeoutError(f"control channel to {self.peer!r} stayed busy until the deadline")
        try:
            if self._closed:
                raise PeerDisconnectedError(f"control channel to {self.peer!r} is closed")
            try:
                if self._sock is not None and time.monotonic() - self._used > self._idle_s:
                    self._reset()  # the server is about to close it as idle: start afresh
                if self._sock is None:
                    self._open(deadline)
                self._settimeout(deadline)
                h = json.dumps(header, separators=(",", ":")).encode()
                seq, mac = self._session.seal(Kind.REQUEST, h, payload)
                self._sock.sendall(self._proof + frames.frame(Kind.REQUEST, h, payload, seq, mac))
                self._proof = b""
                kind, hlen, plen, rseq, rmac = self._prefix(deadline)
                if kind != Kind.REPLY:
                    raise PeerDisconnectedError(f"{self._where()} sent a frame of kind {kind} for a reply")
                if hlen > self._max_header or plen > _REPLY_PAYLOAD_MAX:
                    raise PeerDisconnectedError(f"{self._where()} sent a reply of {hlen}+{plen} bytes")
                body = self._recv_exact(hlen + plen, deadline)
                rh, rp = body[:hlen], body[hlen:]
                self._session.open(rseq, Kind.REPLY, rh, rp, rmac)
                reply = loads(rh, max_bytes=self._max_header, what=f"reply header from {self.peer!r}")
                self._used = time.monotonic()
                return reply, rp
            except (AuthenticationError, MetadataError):
                self._reset()
                raise
            except (socket.timeout, TimeoutError):
                self._reset()  # a late reply would desynchronise the stream
                raise TransferTimeoutError(f"no reply from {self._where()} by the deadline") from None
            except (OSError, ValueError, ConnectionError, XferError) as exc:
                self._reset()
                if isinstance(exc, PeerDisconnectedError):
                    raise
                raise PeerDisconnectedError(f"control channel to {self._where()} failed: {exc}") from None
        finally:
            self._lock.release()

    # ---- the handshake -----------------------------------------------------------------------
    def _open(self, deadline: float) -> None:
        left = min(self._connect_timeout, deadline - time.monotonic())
        if left <= 0:
            raise socket.timeout()
        self._sock = socket.create_connection(self.address, timeout=left)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._settimeout(deadline)
        hello = frames.parse_hello(frames.hello_body(self._id, self._name, self._peer_id, self._auth is not None,
                                                     new_nonce()))
        self._sock.sendall(frames.frame(Kind.HELLO, hello.body))
        kind, hlen, plen, _, _ = self._prefix(deadline)
        if kind not in (Kind.WELCOME, Kind.REJECT) or plen or hlen > frames.WELCOME_MAX:
            raise PeerDisconnectedError(f"{self._where()} is not an xfer control server of this version (answered "
                                        f"a hello with kind {kind}, {hlen}+{plen} bytes)")
        welcome = frames.parse_welcome(self._recv_exact(hlen, deadline))
        if welcome.agent_id != self._peer_id and self._peer_id:
            raise MetadataError(f"stale metadata for {self.peer!r}: {self.address[0]}:{self.address[1]} is served by "
                                f"agent {welcome.agent_id!r}, the metadata names {self._peer_id!r}")
        frames.check_secret_match(self._auth is not None, welcome.has_secret, self.peer)
        key = frames.session_key(self._auth, hello, welcome.agent_id, welcome.nonce)
        transcript = welcome.transcript(hello.body)
        if key is not None and not hmac.compare_digest(welcome.proof, frames.server_proof(key, transcript)):
            raise AuthenticationError(f"{self._where()} does not prove the shared secret (wrong secret, or not the "
                                      f"agent its metadata names)")
        self._session = Session(key, outgoing=True)
        self._proof = frames.frame(Kind.PROOF, frames.client_proof(key, transcript, welcome.proof))
        self._idle_s = max(welcome.idle_s - 1.0, welcome.idle_s * 0.5)

    def _prefix(self, deadline: float) -> tuple[int, int, int, int, bytes]:
        """The next frame's (kind, header length, payload length, seq, MAC); a REJECT is raised."""
        kind, _, _, hlen, plen, seq, mac = frames.PREFIX.unpack(self._recv_exact(frames.PREFIX.size, deadline))
        if kind == Kind.REJECT:
            code, why = frames.parse_reject(self._recv_exact(min(hlen, frames.REJECT_MAX), deadline))
            cls = AuthenticationError if code == Reject.AUTH else PeerDisconnectedError
            if code == Reject.AUTH and "stale metadata" in why:
                cls = MetadataError
            raise cls(f"peer {self.peer!r} refused: {why}")
        return kind, hlen, plen, seq, mac

    # ---- the socket --------------------------------------------------------------------------
    def _settimeout(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout()
        self._sock.settimeout(left)

    def _recv_exact(self, n: int, deadline: float) -> bytes:
        """``n`` bytes of the reply stream. Reads take what has arrived (a small reply's frame and
        body in one call); bytes past ``n`` wait in ``_rest`` for the next read of this reply."""
        chunks, got = [], 0
        if self._rest:
            head, self._rest = self._rest[:n], self._rest[n:]
            chunks.append(head)
            got = len(head)
        while got < n:
            self._settimeout(deadline)
            data = self._sock.recv(min(max(n - got, 1 << 16), 1 << 20))  # no n-byte buffer per call
            if not data:
                raise ConnectionError("connection closed by peer")
            if got + len(data) > n:
                data, self._rest = data[:n - got], data[n - got:]
            chunks.append(data)
            got += len(data)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
