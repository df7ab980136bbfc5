"""The control channel's server: small framed request/reply messages from peer agents over TCP.

Frames and the handshake are in :mod:`xfer.frames`; the client is :class:`ControlClient`
(xfer.control_client). Each agent runs one :class:`ControlServer` thread (a selector loop, no busy
polling). Transports use it for notifications and acknowledgements; bulk data never goes through it.

A peer's connection goes HELLO (its id, name and nonce) -> WELCOME (ours, and our proof of the
session key) -> PROOF -> requests, each answered before the next is read. Until its proof
verifies, a connection may hold at most ``frames.PREAUTH_MAX`` bytes here and nothing of it is
parsed but fixed binary fields; then a request's header is parsed only after its MAC and sequence
number verified (xfer.auth.Session) and its length is within ``max_header``.

Limits (``AgentConfig.settings.control``, docs/security.md): connections in total, per peer
address and still in their handshake (a new one past that closes the oldest of those), the
handshake's deadline, a frame's deadline from its first byte (and a reply's, to be read), an
idle timeout, the bytes of unfinished frames over all connections. When ``accept`` runs out of
file descriptors the server closes its oldest handshaking connection and stops accepting for a
moment. Nothing a peer sends ends the loop: every failure drops that one connection, logged with
its reason (rate-limited: xfer.guard.Rejections).
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import resource
import secrets
import selectors
import socket
import sys
import threading
import time
from typing import Callable

from . import frames
from .auth import Session, new_nonce
from .control_client import ControlClient
from .error_codec import error_reply
from .errors import AuthenticationError, XferError
from .frames import Kind, Later, Reject
from .guard import Rejections, loads
from .settings import ControlSettings

__all__ = ["ControlServer", "ControlClient", "Handler", "Later"]

log = logging.getLogger("xfer.control")

# handler(header, payload) -> (reply_header, reply_payload) or a Later; header["from"] is the
# authenticated peer's name
Handler = Callable[[dict, bytes], "tuple[dict, bytes] | Later"]


_HELLO, _PROOF, _READY = 0, 1, 2
_READ_BYTES = 256 << 10
_ACCEPT_PAUSE_S = 0.2
_FD_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
UNIX_HOST = "unix"  # the peer address its connections count under (max_conns_per_host)


class _Peer:
    """One accepted connection and what the server holds for it."""

    __slots__ = ("sock", "host", "state", "buf", "out", "opened", "active", "frame_at", "out_at", "session",
                 "hello", "name", "welcome", "proof", "later")

    def __init__(self, sock: socket.socket, host: str, now: float):
        self.sock, self.host, self.state = sock, host, _HELLO
        self.buf, self.out = bytearray(), b""
        self.opened = self.active = now
        self.frame_at = self.out_at = None  # first byte of an unfinished frame; a reply not yet sent whole
        self.session = self.hello = self.welcome = self.proof = None
        self.later: Later | None = None  # a request's reply still to come (its handler's Later)
        self.name = "?"

    def __repr__(self) -> str:
        return f"{self.host} ({self.name})" if self.state == _READY else self.host


class ControlServer:
    """Accepts peers' connections and answers each request frame with ``handler``'s reply.

    ``identity``: (agent id, agent name) of this side; ``auth``: the deployment's Authenticator or
    None; ``limits``: :class:`xfer.settings.ControlSettings`."""

    def __init__(self, host: str, port: int, handler: Handler, *, max_payload: int, auth=None,
                 identity: tuple[str, str] = ("", "?"), limits: ControlSettings | None = None):
        self._handler, self._max_payload, self._auth = handler, max_payload, auth
        self._id, self._name = identity
        self.limits = limits or ControlSettings()
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_conns = min(self.limits.max_conns, max(soft // 4, 8)) if soft > 0 else self.limits.max_conns
        self.rejections = Rejections(log, f"control port of {self._name!r}")
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        # peers on this host: an abstract Unix socket of a random name (published in the metadata; a
        # raw round trip ~half loopback TCP's). Another network namespace cannot reach it: those use TCP
        self._unix, self.unix_name = self._bind_unix() if self.limits.unix else (None, None)
        self._listeners = [(self._sock, "listen")] + ([(self._unix, "listen-unix")] if self._unix else [])
        for lsock, data in self._listeners:
            self._sel.register(lsock, selectors.EVENT_READ, data)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._peers: dict[_Peer, None] = {}
        self._pending: dict[_Peer, None] = {}  # still in their handshake, oldest first
        self._later: dict[_Peer, None] = {}  # connections whose current request's reply comes later
        self._per_host: dict[str, int] = {}
        self._buffered = 0  # bytes of unfinished frames, all peers
        self._accept_paused_until = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"xfer-control-{self.address[1]}", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind_unix() -> tuple[socket.socket | None, str | None]:
        """(a listening abstract Unix socket, its name), or (None, None) where there is none (not
        Linux, or refused: then peers use TCP alone)."""
        if not sys.platform.startswith("linux"):
            return None, None
        name = f"xfer-ctl-{secrets.token_hex(12)}"  # (xfer.metadata.UNIX_NAME)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + name)
            sock.listen(128)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            log.debug("no Unix control socket (%s): peers on this host use TCP", exc)
            return None, None
        return sock, name

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        for p in list(self._peers):
            p.sock.close()
        for s in (self._sock, self._unix, self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        self._sel.close()

    @property
    def connections(self) -> int:
        return len(self._peers)

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        next_check = 0.0
        spin, busy = self.limits.spin_us * 1e-6, 0.0  # busy: when the loop last served a request
        while not self._closed:
            try:
                now = time.monotonic()
                timeout = 1.0 if not self._peers else 0.25
                if spin and now - busy < spin:  # (XFER_CONTROL_SPIN_US) poll: the next request comes soon
                    timeout = 0.0
                if self._later:  # replies to come: polled (no sleep while one is fresh, then every ms)
                    fresh = any(now - p.later.since < p.later.spin_s for p in self._later)
                    timeout = 0.0 if fresh else min(timeout, 0.001)
                if self._accept_paused_until:
                    timeout = min(timeout, max(self._accept_paused_until - now, 0.0))
                for key, mask in self._sel.select(timeout=timeout):
                    if key.data == "wake":
                        return
                    if key.data == "listen":
                        self._accept(self._sock, None)
                    elif key.data == "listen-unix":
                        self._accept(self._unix, UNIX_HOST)
                    elif key.data in self._peers:
                        self._serve(key.data, mask)
                        busy = time.monotonic()
                if self._later:
                    self._poll_later()
                now = time.monotonic()
                if self._accept_paused_until and now >= self._accept_paused_until:
                    self._accept_paused_until = 0.0
                    for lsock, data in self._listeners:
                        self._sel.register(lsock, selectors.EVENT_READ, data)
                if now >= next_check:
                    next_check = now + 0.1
                    self._expire(now)
            except Exception as exc:  # a bug here must not end the server: log it, keep serving
                self.rejections("bug", "server loop error (serving on): %r", exc)
                time.sleep(0.01)

    def _serve(self, p: _Peer, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(p)
            if mask & selectors.EVENT_READ and p in self._peers and not p.out:
                self._read(p)
        except Exception as exc:  # anything a peer's bytes make happen ends that peer only
            self._drop(p, "error", f"error while serving it: {exc!r}"[:300])

    # ---- connections -------------------------------------------------------------------------
    def _accept(self, lsock: socket.socket, host: str | None) -> None:
        """Accept what waits on ``lsock``; ``host``: the address its peers count under (None: theirs)."""
        for _ in range(64):  # a burst at a time: the established peers are served in between
            try:
                sock, addr = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _FD_ERRORS:  # out of descriptors: free one, stop accepting for a moment
                    self.rejections("fds", "cannot accept (%s); closing the oldest unauthenticated connection and "
                                    "pausing accepts for %.1f s", exc.strerror, _ACCEPT_PAUSE_S)
                    self._evict_pending(None)
                    self._pause_accepts()
                return  # ECONNABORTED and the like: that one is gone
            self._admit(sock, host if host is not None else addr[0] if isinstance(addr, tuple) else str(addr))

    def _admit(self, sock: socket.socket, host: str) -> None:
        lim = self.limits
        if len(self._pending) >= lim.max_pending:
            self._evict_pending(None)
        if self._per_host.get(host, 0) >= lim.max_conns_per_host and not self._evict_pending(host):
            self.rejections("per-host", "refused a connection from %s: it holds %d (max_conns_per_host)",
                            host, self._per_host[host])
            sock.close()
            return
        if len(self._peers) >= self.max_conns and not self._evict_pending(None):
            self.rejections("conns", "refused a connection from %s: %d connections open (max_conns)", host,
                            len(self._peers))
            sock.close()
            return
        sock.setblocking(False)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        p = _Peer(sock, host, time.monotonic())
        self._peers[p] = None
        self._pending[p] = None
        self._per_host[host] = self._per_host.get(host, 0) + 1
        self._sel.register(sock, selectors.EVENT_READ, p)

    def _evict_pending(self, host: str | None) -> bool:
        """Close the oldest connection still in its handshake (from ``host``, or any): True if one was."""
        for p in self._pending:
            if host is None or p.host == host:
                self._drop(p, "evicted", "closed unauthenticated after %.1f s: newer connections need the room"
                           % (time.monotonic() - p.opened))
                return True
        return False

    def _pause_accepts(self) -> None:
        if not self._accept_paused_until:
            for lsock, _ in self._listeners:
                self._sel.unregister(lsock)
        self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE_S

    def _drop(self, p: _Peer, reason: str | None, why: str = "") -> None:
        """Close ``p``; ``reason``: the rejection's key (None: a normal close, not logged)."""
        if p not in self._peers:
            return
        if reason is not None:
            self.rejections(reason, "dropped peer %r: %s", p, why)
        del self._peers[p]
        self._pending.pop(p, None)
        n = self._per_host.get(p.host, 1) - 1
        if n:
            self._per_host[p.host] = n
        else:
            self._per_host.pop(p.host, None)
        self._buffered -= len(p.buf)
        p.buf = bytearray()
        self._later.pop(p, None)  # its reply to come goes nowhere now
        p.later = None
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        p.sock.close()

    def _expire(self, now: float) -> None:
        lim = self.limits
        for p in list(self._peers):
            if p.state != _READY and now - p.opened > lim.handshake_s:
                self._drop(p, "handshake", f"no handshake within {lim.handshake_s:g} s (handshake_s)")
            elif p.frame_at is not None and p.later is None and now - p.frame_at > lim.frame_s:
                self._drop(p, "slow", f"a frame of {len(p.buf)} bytes so far took over {lim.frame_s:g} s (frame_s)")
            elif p.out_at is not None and now - p.out_at > lim.frame_s:
                self._drop(p, "slow", f"its reply was not read within {lim.frame_s:g} s (frame_s)")
            elif p.state == _READY and now - p.active > lim.idle_s:
                self._drop(p, None)  # idle: the client knows the timeout and reconnects

    # ---- reading -----------------------------------------------------------------------------
    def _read(self, p: _Peer) -> None:
        want = frames.PREAUTH_MAX - len(p.buf) if p.state != _READY else _READ_BYTES
        try:
            data = p.sock.recv(max(want, 1))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(p, None)
            return
        now = time.monotonic()
        p.buf += data
        self._buffered += len(data)
        p.active = now
        if p.frame_at is None:
            p.frame_at = now
        self._frames(p)
        if self._buffered > self.limits.buffer_bytes:
            big = max(self._peers, key=lambda q: len(q.buf))
            self._drop(big, "memory", f"holds {len(big.buf)} bytes of unfinished frames while all peers hold over "
                                      f"{self.limits.buffer_bytes} (buffer_bytes)")

    def _frames(self, p: _Peer) -> None:
        """Handle every whole frame in ``p``'s buffer (none while a reply waits to be sent)."""
        size = frames.PREFIX.size
        while p in self._peers and not p.out and p.later is None and len(p.buf) >= size:
            kind, _, _, hlen, plen, seq, mac = frames.PREFIX.unpack_from(p.buf)
            problem = self._admissible(p, kind, hlen, plen)
            if problem is not None:
                self._refuse(p, Reject.PROTOCOL, "protocol", problem)
                return
            end = size + hlen + plen
            if len(p.buf) < end:
                return
            header, payload = bytes(p.buf[size:size + hlen]), bytes(p.buf[size + hlen:end])
            del p.buf[:end]
            self._buffered -= end
            p.frame_at = time.monotonic() if p.buf else None
            if p.state == _HELLO:
                self._on_hello(p, header)
            elif p.state == _PROOF:
                self._on_proof(p, header)
            else:
                self._on_request(p, seq, header, payload, mac)

    def _admissible(self, p: _Peer, kind: int, hlen: int, plen: int) -> str | None:
        """Why a frame of this kind and size is not taken in ``p``'s state (None: it is)."""
        if p.state == _HELLO:
            if kind != Kind.HELLO or plen or not 0 < hlen <= frames.HELLO_MAX:
                return f"expected a hello of at most {frames.HELLO_MAX} bytes, got kind {kind} of {hlen}+{plen}"
        elif p.state == _PROOF:
            if kind != Kind.PROOF or plen or hlen != 32:
                return f"expected a 32-byte proof, got kind {kind} of {hlen}+{plen}"
        elif kind != Kind.REQUEST or hlen > self.limits.max_header or plen > self._max_payload:
            return (f"frame of kind {kind} with {hlen}+{plen} bytes (a request's limits: {self.limits.max_header} "
                    f"header bytes, max_header; {self._max_payload} payload bytes, max_notify_bytes)")
        return None

    # ---- the handshake -----------------------------------------------------------------------
    def _on_hello(self, p: _Peer, body: bytes) -> None:
        try:
            hello = frames.parse_hello(body)
        except XferError as exc:
            return self._refuse(p, Reject.PROTOCOL, "protocol", str(exc))
        p.hello, p.name = hello, hello.name[:64]
        if self._auth is not None and not hello.has_secret:
            return self._refuse(p, Reject.AUTH, "auth", "it has no shared secret; this agent requires the "
                                                        "deployment's secret")
        if self._auth is None and hello.has_secret:
            return self._refuse(p, Reject.AUTH, "auth", "it requires a shared secret; this agent has none")
        if hello.expected and hello.expected != self._id:
            return self._refuse(p, Reject.AUTH, "stale", f"it expects agent {hello.expected!r}, this is "
                                                         f"{self._id!r} (stale metadata)")
        nonce = new_nonce()
        key = frames.session_key(self._auth, hello, self._id, nonce)
        lim = self.limits
        draft = frames.parse_welcome(frames.welcome_body(self._id, self._name, self._auth is not None, nonce,
                                                         lim.idle_s, lim.max_header, self._max_payload))
        transcript = draft.transcript(hello.body)
        prf = frames.server_proof(key, transcript)
        body = frames.welcome_body(self._id, self._name, self._auth is not None, nonce, lim.idle_s, lim.max_header,
                                   self._max_payload, prf)
        p.session, p.welcome, p.proof = Session(key, outgoing=False), transcript + prf, None
        p.state = _PROOF
        self._send(p, frames.frame(Kind.WELCOME, body))

    def _on_proof(self, p: _Peer, body: bytes) -> None:
        expected = frames.client_proof(p.session.key, p.welcome, b"")
        if p.session.key is not None and not hmac.compare_digest(body, expected):
            return self._refuse(p, Reject.AUTH, "auth", "its proof of the session key does not verify (wrong "
                                                        "secret?)")
        p.state, p.welcome = _READY, None
        self._pending.pop(p, None)

    # ---- requests ----------------------------------------------------------------------------
    def _on_request(self, p: _Peer, seq: int, header: bytes, payload: bytes, mac: bytes) -> None:
        try:
            p.session.open(seq, Kind.REQUEST, header, payload, mac)
        except AuthenticationError as exc:
            return self._refuse(p, Reject.AUTH, "auth", str(exc))
        try:
            request = loads(header, max_bytes=self.limits.max_header, what="control header")
        except XferError as exc:
            return self._refuse(p, Reject.PROTOCOL, "malformed", str(exc))
        request["from"] = p.hello.name  # who the handshake says sent it, whatever the header claims
        try:
            result = self._handler(request, payload)
        except XferError as exc:
            result = error_reply(exc), b""
        except Exception as exc:  # a handler bug must not end the server
            log.exception("control: handler failed on %s", str(request.get("type"))[:64])
            result = error_reply(exc), b""
        if isinstance(result, Later):  # its reply comes later; no further request of p is read meanwhile
            result.since, p.later = time.monotonic(), result
            self._later[p] = None
            return
        self._reply(p, *result)

    def _reply(self, p: _Peer, reply: dict, rpayload: bytes) -> None:
        rheader = json.dumps(reply, separators=(",", ":")).encode()
        rseq, rmac = p.session.seal(Kind.REPLY, rheader, rpayload)
        self._send(p, frames.frame(Kind.REPLY, rheader, rpayload, rseq, rmac))

    def _poll_later(self) -> None:
        """Send the replies that came (``Later.poll``), then read on those connections' requests."""
        now = time.monotonic()
        for p in list(self._later):
            try:
                got = p.later.poll(now)
            except XferError as exc:
                got = error_reply(exc), b""
            except Exception as exc:  # a handler bug must not end the server
                log.exception("control: a deferred reply failed")
                got = error_reply(exc), b""
            if got is None:
                continue
            del self._later[p]
            p.later = None
            self._reply(p, *got)
            self._frames(p)

    def _refuse(self, p: _Peer, code: Reject, reason: str, why: str) -> None:
        """Drop ``p``, logged, telling it why first (one REJECT frame, best effort)."""
        self.rejections(reason, "dropped peer %r: %s", p, why)
        try:
            p.sock.send(frames.frame(Kind.REJECT, frames.reject_body(code, why)))
        except OSError:
            pass
        self._drop(p, None)

    # ---- writing -----------------------------------------------------------------------------
    def _send(self, p: _Peer, data: bytes) -> None:
        try:
            n = p.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self._drop(p, None)
            return
        if n < len(data):  # the rest goes as the socket drains; no frame of p is read meanwhile
            p.out, p.out_at = memoryview(data)[n:], time.monotonic()
            self._sel.modify(p.sock, selectors.EVENT_WRITE, p)

    def _flush(self, p: _Peer) -> None:
        try:
            n = p.sock.send(p.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(p, None)
            return
        p.out = p.out[n:]
        if not len(p.out):
            p.out, p.out_at = b"", None
            self._sel.modify(p.sock, selectors.EVENT_READ, p)
            self._frames(p)
