"""The control channel: small framed request/reply messages between agents over TCP.

Frame: ``!II`` (header length, payload length) · JSON header · raw payload bytes.
Each agent runs one :class:`ControlServer` thread (a selector loop, no busy polling) and opens one
:class:`ControlClient` connection per peer for its own requests. Transports use it for
notifications and acknowledgements; bulk data never goes through it.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import struct
import threading
import time
from typing import Callable

from .error_codec import error_reply
from .errors import AuthenticationError, MetadataError, PeerDisconnectedError, TransferTimeoutError, XferError

__all__ = ["ControlServer", "ControlClient", "Handler"]

log = logging.getLogger("xfer.control")
_FRAME = struct.Struct("!II")
MAX_HEADER = 1 << 20

# handler(header, payload) -> (reply_header, reply_payload)
Handler = Callable[[dict, bytes], "tuple[dict, bytes]"]


def _pack(header: dict, payload: bytes = b"") -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    return _FRAME.pack(len(h), len(payload)) + h + payload


class ControlServer:
    """Accepts peers' connections and answers each request frame with ``handler``'s reply."""

    def __init__(self, host: str, port: int, handler: Handler, *, max_payload: int, auth=None):
        self._handler, self._max_payload, self._auth = handler, max_payload, auth
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._bufs: dict[socket.socket, bytearray] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"xfer-control-{self.address[1]}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        for conn in list(self._bufs):
            conn.close()
        for s in (self._sock, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    def _loop(self) -> None:
        while not self._closed:
            for key, _ in self._sel.select(timeout=1.0):
                if key.data == "wake":
                    return
                if key.fileobj is self._sock:
                    self._accept()
                else:
                    self._read(key.fileobj)

    def _accept(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._bufs[conn] = bytearray()
        self._sel.register(conn, selectors.EVENT_READ, "conn")

    def _drop(self, conn: socket.socket) -> None:
        self._bufs.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        buf = self._bufs[conn]
        buf += data
        while len(buf) >= _FRAME.size:
            hlen, plen = _FRAME.unpack_from(buf)
            if hlen > MAX_HEADER or plen > self._max_payload:
                log.warning("control: dropping a peer that sent a frame of %d+%d bytes (limits %d+%d)",
                            hlen, plen, MAX_HEADER, self._max_payload)
                self._drop(conn)
                return
            end = _FRAME.size + hlen + plen
            if len(buf) < end:
                return
            try:
                header = json.loads(bytes(buf[_FRAME.size:_FRAME.size + hlen]))
                if not isinstance(header, dict):
                    raise MetadataError("control header is not an object")
            except (ValueError, MetadataError) as exc:
                log.warning("control: dropping a peer that sent a malformed header: %s", exc)
                self._drop(conn)
                return
            payload = bytes(buf[_FRAME.size + hlen:end])
            del buf[:end]
            if self._auth is not None:
                try:
                    self._auth.check(header, payload)
                except AuthenticationError as exc:
                    peer = conn.getpeername() if conn.fileno() >= 0 else "?"
                    log.warning("control: rejected peer %s (%r): %s", peer, header.get("from"), exc)
                    self._reply(conn, error_reply(exc), b"")
                    self._drop(conn)
                    return
            try:
                reply, rpayload = self._handler(header, payload)
            except XferError as exc:
                reply, rpayload = error_reply(exc), b""
            except Exception as exc:  # a handler bug must not kill the server thread
                log.exception("control: handler failed on %s", header.get("type"))
                reply, rpayload = error_reply(exc), b""
            if self._auth is not None:
                reply = self._auth.stamp(reply, rpayload)
            if not self._reply(conn, reply, rpayload):
                return

    def _reply(self, conn: socket.socket, reply: dict, payload: bytes) -> bool:
        try:
            conn.setblocking(True)
            conn.settimeout(5.0)
            conn.sendall(_pack(reply, payload))
            conn.setblocking(False)
            return True
        except OSError:
            self._drop(conn)
            return False


class ControlClient:
    """One connection to a peer's control server; one request in flight at a time."""

    def __init__(self, address: tuple[str, int], peer: str, connect_timeout: float, auth=None):
        self.address, self.peer, self._connect_timeout, self._auth = address, peer, connect_timeout, auth
        self._sock: socket.socket | None = None
        self._rest = b""  # bytes received past the part of a reply read so far
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        self._rest = b""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(self, header: dict, payload: bytes = b"", *, deadline: float) -> tuple[dict, bytes]:
        """Send one frame and return the reply, by ``deadline`` (``time.monotonic`` seconds)."""
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeoutError(f"control channel to {self.peer!r} stayed busy until the deadline")
        try:
            if self._closed:
                raise PeerDisconnectedError(f"control channel to {self.peer!r} is closed")
            try:
                if self._sock is None:
                    left = min(self._connect_timeout, deadline - time.monotonic())
                    if left <= 0:
                        raise socket.timeout()
                    self._sock = socket.create_connection(self.address, timeout=left)
                    self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._settimeout(deadline)
                if self._auth is not None:
                    header = self._auth.stamp(header, payload)
                self._sock.sendall(_pack(header, payload))
                hlen, plen = _FRAME.unpack(self._recv_exact(_FRAME.size, deadline))
                if hlen > MAX_HEADER:
                    raise PeerDisconnectedError(f"peer {self.peer!r} sent a {hlen}-byte control header")
                body = self._recv_exact(hlen + plen, deadline)
                reply, rpayload = json.loads(body[:hlen]), body[hlen:]
                if self._auth is not None:
                    if reply.get("error") == "AuthenticationError" and "mac" not in reply:
                        raise AuthenticationError(f"peer {self.peer!r} rejected us: {reply.get('message')}")
                    self._auth.check(reply, rpayload)
                return reply, rpayload
            except AuthenticationError:
                self._reset()
                raise
            except (socket.timeout, TimeoutError):
                self._reset()  # a late reply would desynchronise the stream
                raise TransferTimeoutError(
                    f"no reply from peer {self.peer!r} at {self.address[0]}:{self.address[1]} by the deadline") from None
            except (OSError, ValueError, ConnectionError) as exc:
                self._reset()
                raise PeerDisconnectedError(
                    f"control channel to peer {self.peer!r} at {self.address[0]}:{self.address[1]} failed: {exc}") from None
        finally:
            self._lock.release()

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
