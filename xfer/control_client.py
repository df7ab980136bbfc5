"""The control channel's client: one connection to a peer's control server, requests pipelined.

It connects lazily, runs the handshake (xfer.frames: HELLO, the server's WELCOME and proof, our
PROOF sent together with the first request), then sends MAC'd requests and checks each reply's
MAC and sequence number before parsing it. The server says in its WELCOME how long it keeps an
idle connection; the client opens a new one before reusing one idle for most of that.

Several requests may be in flight on the connection (the server answers them in order, each
before it reads the next): :meth:`ControlClient.submit` sends one and returns at once with its
:class:`Pending` reply, :meth:`ControlClient.result` waits for it (any thread; one reads the
socket at a time and hands each reply to the request it answers, in order). ``request`` is
both. A wait that reaches its deadline gives up its reply (dropped when it comes) without
closing the connection: replies are read into a buffer, never half a frame, so nothing
desynchronises; a broken stream (closed, a bad MAC or size, a reply that is not JSON) fails every
request in flight and the next one opens a new connection.
"""

from __future__ import annotations

import collections
import hmac
import json
import select
import socket
import threading
import time

from . import frames
from .auth import Session, new_nonce
from .errors import AuthenticationError, MetadataError, PeerDisconnectedError, TransferTimeoutError, XferError
from .frames import Kind, Reject
from .guard import loads

__all__ = ["ControlClient", "Pending"]

_REPLY_PAYLOAD_MAX = 64 << 20
_ABANDONED_MAX = 64  # requests in flight whose waiters gave up: past this the connection is started afresh
_SEND_FLOOR_S = 0.05  # the least time a request's send may take before the stream is given up


def _ready(sock: socket.socket, event: int, timeout: float) -> bool:
    """Whether ``sock`` is readable (POLLIN) or writable (POLLOUT) within ``timeout`` seconds (also
    True on an error or hang-up: the next call on it says which)."""
    poller = select.poll()
    poller.register(sock, event)
    return bool(poller.poll(max(0, int(timeout * 1000 + 0.999))))


def _spin_recv(sock: socket.socket, window: float) -> bytes | None:
    """What ``sock`` has within ``window`` seconds, polled without sleeping (each try a
    non-blocking recv, the GIL released in it); None: nothing came (the caller then sleeps in poll)."""
    end = time.monotonic() + window
    if sock.gettimeout() != 0.0:  # (the reading socket is kept non-blocking: no fcntl per call)
        sock.setblocking(False)
    while True:
        try:
            return sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            if time.monotonic() >= end:
                return None


class Pending:
    """One request sent and not answered yet: :meth:`ControlClient.result` waits for its reply."""

    __slots__ = ("reply", "error", "done", "abandoned", "sent")

    def __init__(self) -> None:
        self.reply = self.error = None
        self.done = self.abandoned = False
        self.sent = 0.0  # time.monotonic() once sent


class ControlClient:
    """``identity``: (agent id, name) of this side; ``peer_id``: the agent id the peer's metadata
    names (the handshake fails with :class:`MetadataError` if another agent answers); ``unix``: the
    name of the peer's abstract Unix socket (a peer on this host), tried before ``address``: where
    nothing listens on it (another network namespace) the client uses TCP from then on."""

    def __init__(self, address: tuple[str, int], peer: str, connect_timeout: float, auth=None, *,
                 identity: tuple[str, str] = ("", "?"), peer_id: str | None = None, max_header: int = 1 << 20,
                 spin_s: float = 0.0, unix: str | None = None):
        self.address, self.peer, self._connect_timeout, self._auth = address, peer, connect_timeout, auth
        self.unix = unix
        self._id, self._name = identity
        self._peer_id, self._max_header = peer_id, max_header
        self._spin_s = spin_s  # a reply is polled for this long before the reader sleeps in poll
        self._sock: socket.socket | None = None
        self._session: Session | None = None
        self._proof = b""  # our PROOF, sent in front of the first request
        self._idle_s = float("inf")
        self._used = 0.0
        self._lock = threading.Lock()  # the sending side: connect, handshake, seal and send, in order
        # the receiving side: requests in flight (in sending order), the reply bytes read so far, who reads
        self._cv = threading.Condition(threading.Lock())
        self._inflight: collections.deque[Pending] = collections.deque()
        self._abandoned = 0
        self._buf = bytearray()
        self._rest = b""  # (the handshake's) bytes received past the part read so far
        self._reading = False
        self._waiting = 0  # threads waiting on _cv for a reply another one reads
        self._rsock: socket.socket | None = None  # the connection's reading side (a dup: its own timeout)
        self._stale: list[socket.socket] = []  # reading sockets of closed connections, a reader maybe in them
        self._gen = 0  # the connection's number: a reader of an older one leaves the newer alone
        self._closed = False
        self._lane: ControlClient | None = None  # a second connection to the same peer (:meth:`lane`)
        self._lane_lock = threading.Lock()
        self._args = (address, peer, connect_timeout, auth, dict(identity=identity, peer_id=peer_id,
                                                                 max_header=max_header, spin_s=spin_s))

    def _args_now(self) -> tuple:
        address, peer, connect_timeout, auth, kw = self._args
        return address, peer, connect_timeout, auth, {**kw, "unix": self.unix}

    def lane(self) -> "ControlClient":
        """A second connection to the same peer, made once and closed with this one, for requests
        whose reply may wait long (the peer reads no further request of a connection before it
        answered the one it holds: a landing notice waits for its copy; see xfer.frames.Later).
        Opened by its first blocking request or by :meth:`open`."""
        with self._lane_lock:  # (not the sending lock: a send may wait for a connect)
            if self._lane is None:
                address, peer, connect_timeout, auth, kw = self._args_now()
                self._lane = ControlClient(address, peer, connect_timeout, auth, **kw)
                if self._closed:
                    self._lane.close()
            return self._lane

    @property
    def is_open(self) -> bool:
        """Whether a connection is open now (a request with ``block=False`` may be sent on it)."""
        return self._sock is not None

    def open(self, deadline: float) -> None:
        """Open the connection now (its handshake, proof included) unless it is open: a later
        ``submit(block=False)`` then sends at once. Raises as :meth:`submit` does."""
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeoutError(f"control channel to {self.peer!r} stayed busy until the deadline")
        try:
            if self._closed:
                raise PeerDisconnectedError(f"control channel to {self.peer!r} is closed")
            if self._sock is not None:
                return
            try:
                self._open(deadline)
                self._sock.settimeout(max(deadline - time.monotonic(), _SEND_FLOOR_S))
                self._sock.sendall(self._proof)
                self._proof = b""
                self._used = time.monotonic()
            except (OSError, ValueError, ConnectionError, XferError) as exc:  # (socket.timeout is an OSError)
                raise self._send_failed(exc) from None
        finally:
            self._lock.release()

    def _send_failed(self, exc: BaseException) -> XferError:
        """(caller holds ``_lock``) Connecting or sending failed with ``exc``: close the connection
        (a frame sent in part would desynchronise the stream; every request in flight fails) and
        return the typed error to raise."""
        if isinstance(exc, (AuthenticationError, MetadataError, PeerDisconnectedError)):
            error = exc
        elif isinstance(exc, (socket.timeout, TimeoutError)):
            error = TransferTimeoutError(f"no reply from {self._where()} by the deadline")
        else:
            error = PeerDisconnectedError(f"control channel to {self._where()} failed: {exc}")
        self._reset(error)
        return error

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._reset(PeerDisconnectedError(f"control channel to {self.peer!r} is closed"))
        with self._lane_lock:
            lane = self._lane
        if lane is not None:
            lane.close()

    def _reset(self, error: XferError) -> None:
        """Close the connection (caller holds ``_lock``): every request in flight fails with ``error``,
        but those whose replies have arrived already (read now, when no other thread reads)."""
        self._proof = b""
        self._salvage()
        with self._cv:
            self._gen += 1
            self._session, self._buf = None, bytearray()
            self._fail_all(error)
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes a reader waiting on it
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        with self._cv:  # a reader of it is woken by the shutdown; it finds its generation gone
            rsock, self._rsock = self._rsock, None
            if rsock is not None and not self._reading:
                rsock.close()
                rsock = None
        if rsock is not None:
            self._stale.append(rsock)  # closed once no reader may be in it (the next open)

    def _salvage(self) -> None:
        """Hand out the replies already received (a reset must not fail a request the peer answered)."""
        with self._cv:
            if self._rsock is None or not self._inflight or self._reading or self._session is None:
                return
            self._reading = True
            gen, sock = self._gen, self._rsock
        try:
            while True:
                self._take_frames(gen)
                if not _ready(sock, select.POLLIN, 0.0):
                    break
                data = sock.recv(1 << 16)  # (non-blocking: see _read_until)
                if not data:
                    break
                with self._cv:
                    self._buf += data
        except Exception:  # noqa: BLE001 - best effort: the connection is being closed anyway
            pass
        finally:
            with self._cv:
                self._reading = False
                self._cv.notify_all()

    def _fail_all(self, error: XferError) -> None:
        """(under ``_cv``) End every request in flight with ``error``."""
        while self._inflight:
            p = self._inflight.popleft()
            p.error, p.done = error, True
        self._abandoned = 0
        self._cv.notify_all()

    def _where(self) -> str:
        via = " (its Unix socket)" if self.unix is not None else ""
        return f"peer {self.peer!r} at {self.address[0]}:{self.address[1]}{via}"

    def request(self, header: dict, payload: bytes = b"", *, deadline: float) -> tuple[dict, bytes]:
        """Send one frame and return the reply, by ``deadline`` (``time.monotonic`` seconds)."""
        return self.result(self.submit(header, payload, deadline=deadline), deadline)

    def submit(self, header: dict, payload: bytes = b"", *, deadline: float, block: bool = True) -> Pending | None:
        """Send one frame; return its :class:`Pending` reply at once (wait for it with
        :meth:`result`). ``block`` False: None instead of waiting for anything (another thread
        sending, no connection open yet, the socket not writable now), nothing sent."""
        if deadline <= time.monotonic():  # nothing sent; the requests in flight are not this one's to fail
            raise TransferTimeoutError(f"no reply from {self._where()} by the deadline (it passed before the "
                                       f"request was sent)")
        if block:
            if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TransferTimeoutError(f"control channel to {self.peer!r} stayed busy until the deadline")
        elif not self._lock.acquire(blocking=False):
            return None
        try:
            if self._closed:
                raise PeerDisconnectedError(f"control channel to {self.peer!r} is closed")
            try:
                if self._sock is not None and not self._inflight and time.monotonic() - self._used > self._idle_s:
                    self._reset(PeerDisconnectedError(f"control channel to {self.peer!r} was idle"))  # the server
                    # is about to close it as idle: start afresh
                if not block and (self._sock is None or not _ready(self._sock, select.POLLOUT, 0.0)):
                    return None
                if self._abandoned > _ABANDONED_MAX:  # a peer that stopped answering: start afresh
                    self._reset(TransferTimeoutError(f"no reply from {self._where()} by the deadline"))
                if self._sock is None:
                    self._open(deadline)
                # a send that cannot finish by then (a peer that stopped reading) breaks the stream;
                # never less than a moment, so a deadline about to pass does not break it for the others
                self._sock.settimeout(max(deadline - time.monotonic(), _SEND_FLOOR_S))
                h = json.dumps(header, separators=(",", ":")).encode()
                seq, mac = self._session.seal(Kind.REQUEST, h, payload)
                p = Pending()
                with self._cv:
                    self._inflight.append(p)  # before it is sent: the reply may come at once
                p.sent = time.monotonic()
                self._sock.sendall(self._proof + frames.frame(Kind.REQUEST, h, payload, seq, mac))
                self._proof = b""
                return p
            except (OSError, ValueError, ConnectionError, XferError) as exc:  # (socket.timeout is an OSError)
                raise self._send_failed(exc) from None
        finally:
            self._lock.release()

    def result(self, p: Pending, deadline: float) -> tuple[dict, bytes]:
        """The reply to ``p`` (from :meth:`submit`), by ``deadline``; raises what failed it. At
        the deadline its reply is given up (dropped when it comes): TransferTimeoutError."""
        while True:
            with self._cv:
                while not p.done and self._reading:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return self._give_up(p)
                    self._waiting += 1
                    try:
                        self._cv.wait(left)
                    finally:
                        self._waiting -= 1
                if p.done:
                    break
                if deadline <= time.monotonic():
                    return self._give_up(p)
                self._reading = True
                gen, sock = self._gen, self._rsock
            try:
                self._read_until(p, gen, sock, deadline)
            finally:
                self._stop_reading()
        if p.error is not None:
            raise p.error
        return p.reply

    def poll_reply(self, p: Pending) -> bool:
        """Whether ``p``'s reply is in, after reading what the connection holds now (never waiting;
        nothing read where another thread reads it: that one hands ``p`` its reply)."""
        if p.done:
            return True
        with self._cv:
            if self._reading:
                return False
            self._reading = True
            gen, sock = self._gen, self._rsock
        try:
            if sock is not None:
                self._read_until(p, gen, sock, 0.0, wait=False)
        finally:
            self._stop_reading()
        return p.done

    def wait_reply(self, p: Pending, until: float) -> None:
        """Wait until ``p``'s reply is in, bytes of a reply wait on the connection, or ``until``
        (``time.monotonic``) passed; reads nothing, so that another thread may take the reply (the
        one-sided worker waits here, then takes its turn: ``OneSidedTransport._turn``). Looks again
        every ms (every 20 ms after the first 50): a reader that started meanwhile hands ``p`` its
        reply without a wake-up for this waiter."""
        begun = time.monotonic()
        while not p.done:
            now = time.monotonic()
            left = until - now
            if left <= 0:
                return
            step = 0.001 if now - begun < 0.05 else 0.02
            with self._cv:
                if self._reading:  # another thread reads: it hands the reply over and notifies
                    self._waiting += 1
                    try:
                        self._cv.wait(min(left, step))
                    finally:
                        self._waiting -= 1
                    continue
                sock = self._rsock
            if sock is None:  # (between connections: a reset fails or salvages every request)
                time.sleep(min(left, step))
                continue
            try:
                if _ready(sock, select.POLLIN, min(left, step)):
                    return
            except (OSError, ValueError):  # (closed meanwhile: the reader is told)
                return

    def _stop_reading(self) -> None:
        with self._cv:
            self._reading = False
            if self._waiting:
                self._cv.notify_all()
            stale, self._stale = self._stale, []
        for old in stale:  # closed connections' reading sockets: no reader is in them now
            old.close()

    def _give_up(self, p: Pending):
        """(under ``_cv``) ``p``'s waiter reached its deadline: its reply is dropped when it comes."""
        p.abandoned = True
        self._abandoned += 1
        raise TransferTimeoutError(f"no reply from {self._where()} by the deadline")

    def _read_until(self, p: Pending, gen: int, sock, deadline: float, wait: bool = True) -> None:
        """Read replies (handing each to its request) until ``p`` has one, the deadline passed
        (nothing lost: bytes read stay buffered) or the stream broke (every request fails).
        ``sock``: the connection's reading socket, non-blocking (a Python socket with a timeout
        polls for up to that long before any recv, MSG_DONTWAIT or not: a look that must not wait
        would wait): a wait polls for readiness until the deadline, then reads what came.
        ``wait`` False: only what the connection holds now (the deadline is not looked at)."""
        size = frames.PREFIX.size
        try:
            while not p.done:
                if len(self._buf) >= size and self._take_frames(gen):
                    continue
                if not wait:
                    try:
                        data = sock.recv(1 << 16)
                    except (BlockingIOError, InterruptedError):
                        return
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    if sock is None:  # (a reset between; its requests are failed)
                        time.sleep(min(left, 0.001))
                        return
                    data = _spin_recv(sock, min(self._spin_s, left)) if self._spin_s else None
                    if data is None:
                        if not _ready(sock, select.POLLIN, left):
                            continue  # the deadline (checked above)
                        try:
                            data = sock.recv(1 << 16)
                        except (BlockingIOError, InterruptedError):  # (readiness without bytes: polled again)
                            continue
                if not data:
                    raise ConnectionError("connection closed by peer")
                with self._cv:
                    if gen != self._gen:
                        return
                    self._buf += data
                    if len(self._buf) >= size:
                        self._take_frames_locked(gen)
        except (AuthenticationError, MetadataError) as exc:
            self._broken(gen, exc)
        except (OSError, ValueError, ConnectionError, XferError) as exc:
            if not isinstance(exc, PeerDisconnectedError):
                exc = PeerDisconnectedError(f"control channel to {self._where()} failed: {exc}")
            self._broken(gen, exc)

    def _take_frames(self, gen: int) -> bool:
        """Hand every whole reply frame buffered to its request; True if one was."""
        with self._cv:
            return self._take_frames_locked(gen)

    def _take_frames_locked(self, gen: int) -> bool:
        """:meth:`_take_frames` for a caller holding ``_cv``."""
        took = False
        while gen == self._gen:
            buf, size = self._buf, frames.PREFIX.size
            if len(buf) < size:
                break
            kind, _, _, hlen, plen, rseq, rmac = frames.PREFIX.unpack_from(buf)
            if kind == Kind.REJECT:
                if len(buf) < size + min(hlen, frames.REJECT_MAX):
                    break
                code, why = frames.parse_reject(bytes(buf[size:size + min(hlen, frames.REJECT_MAX)]))
                cls = AuthenticationError if code == Reject.AUTH else PeerDisconnectedError
                if code == Reject.AUTH and "stale metadata" in why:
                    cls = MetadataError
                raise cls(f"peer {self.peer!r} refused: {why}")
            if kind != Kind.REPLY:
                raise PeerDisconnectedError(f"{self._where()} sent a frame of kind {kind} for a reply")
            if hlen > self._max_header or plen > _REPLY_PAYLOAD_MAX:
                raise PeerDisconnectedError(f"{self._where()} sent a reply of {hlen}+{plen} bytes")
            end = size + hlen + plen
            if len(buf) < end:
                break
            rh, rp = bytes(buf[size:size + hlen]), bytes(buf[size + hlen:end])
            del buf[:end]
            if not self._inflight:
                raise PeerDisconnectedError(f"{self._where()} sent a reply to no request")
            self._session.open(rseq, Kind.REPLY, rh, rp, rmac)
            reply = loads(rh, max_bytes=self._max_header, what=f"reply header from {self.peer!r}")
            p = self._inflight.popleft()
            if p.abandoned:
                self._abandoned -= 1
            p.reply, p.done = (reply, rp), True
            self._used = time.monotonic()
            took = True
        if took and self._waiting:
            self._cv.notify_all()
        return took

    def _broken(self, gen: int, error: XferError) -> None:
        """The stream of connection ``gen`` broke: every request in flight fails with ``error``
        and the next one opens a new connection."""
        with self._lock:
            if gen == self._gen:
                self._reset(error)

    # ---- the handshake -----------------------------------------------------------------------
    def _open(self, deadline: float) -> None:
        self._rest = b""
        left = min(self._connect_timeout, deadline - time.monotonic())
        if left <= 0:
            raise socket.timeout()
        self._sock = self._connect_unix(left) if self.unix is not None else None
        if self._sock is None:
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
        with self._cv:
            stale = []
            if not self._reading:  # (else the reader closes them when it is done)
                stale, self._stale = self._stale, []
            self._rsock = self._sock.dup()
            self._rsock.setblocking(False)  # (a dup keeps the sender's timeout: see _read_until)
            self._session = Session(key, outgoing=True)
            self._buf += self._rest  # (nothing comes before the first reply; were it so, it is read as one)
            self._rest = b""
        for old in stale:
            old.close()
        self._proof = frames.frame(Kind.PROOF, frames.client_proof(key, transcript, welcome.proof))
        self._idle_s = max(welcome.idle_s - 1.0, welcome.idle_s * 0.5)

    def _connect_unix(self, timeout: float) -> socket.socket | None:
        """A connection to the peer's abstract Unix socket, or None where nothing listens there
        (another network namespace, a peer gone): then TCP, now and for later connections."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect("\0" + self.unix)
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            self.unix = None
            return None
        except BaseException:
            sock.close()
            raise

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
        """``n`` bytes of the handshake's reply stream. Reads take what has arrived (a small reply's frame and
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
