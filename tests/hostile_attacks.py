"""Attackers of the hostile-peer tests (issue 30), each run in its own process (spawned: these are
plain functions of an importable module). Loopback only. Each returns a summary of what it did
(or, for the long-lived ones, reports on its pipe and waits for "stop")."""

from __future__ import annotations

import errno
import resource
import socket
import time

from hostile_helpers import RawControl, Refused
from xfer import frames
from xfer.frames import Kind


def _raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# ---- case 1: a deep-JSON control header -------------------------------------------------------------
def deep_json_header(address, depth: int, secret_free_server: bool) -> dict:
    """200,000 '[' as a control header: through a finished handshake where the server has no
    secret, else as the body of a hello (all a peer without the secret may send)."""
    deep = b"[" * depth
    out = {}
    with RawControl(address) as c:
        if secret_free_server:
            c.handshake()
            c.send_raw(c.frame(deep))
        else:
            c.send_raw(frames.frame(Kind.HELLO, deep))
        try:
            c.read_frame()
            out["answer"] = "a frame"
        except Refused as exc:
            out["answer"] = exc.reason
    return out


# ---- case 4: tens of thousands of idle connections --------------------------------------------------
def idle_flood(conn, address, count: int) -> None:
    """Open ``count`` TCP connections to the control port (non-blocking, as fast as the kernel
    takes them), hold them idle, report how many opened, wait for "stop", close them all."""
    _raise_nofile()
    socks, failed, t0 = [], 0, time.monotonic()
    while len(socks) + failed < count and time.monotonic() - t0 < 60:
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(tuple(address))
        except BlockingIOError:
            pass
        except OSError as exc:
            s.close()
            failed += 1
            if exc.errno == errno.EMFILE:
                break
            continue
        socks.append(s)
    time.sleep(1.0)  # let the last ones be accepted (or evicted)
    conn.send({"opened": len(socks), "failed": failed, "seconds": time.monotonic() - t0})
    conn.recv()
    for s in socks:
        s.close()
    conn.send("closed")


# ---- case 5: slow big frames --------------------------------------------------------------------------
def slow_big_frames(conn, address, count: int, header_bytes: int, seconds: float) -> None:
    """``count`` connections that each finish the handshake (the server has no secret) and then
    announce a ``header_bytes`` request header and send it over ``seconds``, never finishing."""
    _raise_nofile()
    peers, refused = [], 0
    for _ in range(count):
        try:
            c = RawControl(address, timeout=5)
            c.handshake()
            c.sock.setblocking(False)
            prefix = frames.PREFIX.pack(int(Kind.REQUEST), 0, 0, header_bytes, 0, 1, bytes(16))
            c.sock.send(prefix)
            peers.append(c)
        except (Refused, OSError):
            refused += 1
    piece = max(header_bytes // 20, 1)
    sent = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for c in peers:
            try:
                sent += c.sock.send(b"[" + b" " * (piece - 1))
            except (BlockingIOError, OSError):
                pass
        time.sleep(seconds / 20)
    conn.send({"connected": len(peers), "refused": refused, "sent": sent})
    conn.recv()
    for c in peers:
        c.close()
    conn.send("closed")


# ---- case 7: a captured stream replayed ------------------------------------------------------------
def replay_stream(address, captured: bytes, any_server: bool = False) -> dict:
    """Send a legitimate agent's captured control stream (its hello, proof and requests) as it was,
    on a new connection: the server's nonce is new, so the key and the proof are not the same.
    ``any_server``: first blank the hello's "expected server" field (the hello is not signed)."""
    if any_server:
        at = frames.PREFIX.size + 4 + 1 + 1 + 32  # magic, version, flags, the client's id
        captured = captured[:at] + bytes(32) + captured[at + 32:]
    with socket.create_connection(tuple(address), timeout=5) as s:
        s.sendall(captured)
        data = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    kinds, at = [], 0
    while at + frames.PREFIX.size <= len(data):
        kind, _, _, hlen, plen, _, _ = frames.PREFIX.unpack_from(data, at)
        body = data[at + frames.PREFIX.size:at + frames.PREFIX.size + hlen]
        kinds.append((Kind(kind).name, frames.parse_reject(body)[1] if kind == Kind.REJECT else ""))
        at += frames.PREFIX.size + hlen + plen
    return {"frames": kinds}


def replay_request_frames(address, captured_requests: list[bytes]) -> dict:
    """The captured REQUEST frames alone, after a handshake of the attacker's own (no secret)."""
    out = []
    for frame in captured_requests:
        with RawControl(address) as c:
            try:
                c.handshake(has_secret=True)  # claim a secret it does not have: the proof it sends is zeros
                c.send_raw(frame)
                c.read_frame()
                out.append("accepted")
            except Refused as exc:
                out.append(exc.reason)
    return {"answers": out}


def garbage(address, blobs: list[bytes]) -> int:
    """Each blob on its own connection, then close: how many were sent."""
    n = 0
    for blob in blobs:
        try:
            with socket.create_connection(tuple(address), timeout=2) as s:
                s.sendall(blob)
                n += 1
        except OSError:
            pass
    return n


# ---- UCX ------------------------------------------------------------------------------------------
class UcxClient:
    """A hand-driven UCX endpoint to a victim's listener: the hello, then tagged messages of any
    shape. ``their_id``: the connection id the victim gave us (our tags carry it); ``session``:
    what we can derive of the session (no secret: the public tag key; with one, nothing)."""

    def __init__(self, host: str, port: int, name: str = "mallory"):
        import numpy as np
        import ucxx._lib.libucxx as u
        from ucxx._lib.arr import Array

        from xfer.transports.ucx import wire
        from xfer.transports.ucx.conn import Conn

        self.np, self.u, self.Array, self.wire = np, u, Array, wire
        self.ctx = u.UCXContext({"TLS": "tcp", "NET_DEVICES": "lo"},  # loopback only, whatever the environment
                                feature_flags=(u.Feature.TAG, u.Feature.WAKEUP, u.Feature.STREAM))
        self.w = u.UCXWorker(self.ctx)
        self.ep = u.UCXEndpoint.create(self.w, host, port, True)
        self.conn = Conn(self.ep, 1, outgoing=True, name="victim")
        hello = wire.hello(1, "m" * 32, name, self.conn.nonce)
        reqs = [self.ep.stream_send(Array(hello)), self.ep.stream_recv(Array(self.conn.hello_in))]
        self.wait(lambda: all(r.completed for r in reqs), 10, "the hello")
        self.conn.on_hello(None, "m" * 32)  # the key without a secret: all an outsider can derive
        self.their_id = self.conn.remote_id
        self.keep = []

    def wait(self, cond, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not cond():
            self.w.progress()
            if time.monotonic() > end:
                raise TimeoutError(f"{what} did not complete within {timeout} s")

    def progress(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.w.progress()
            time.sleep(0.001)

    def send(self, tag: int, data, wait: bool = True):
        buf = data if isinstance(data, self.np.ndarray) else self.np.frombuffer(bytearray(data), self.np.uint8)
        req = self.ep.tag_send(self.Array(buf), self.u.UCXXTag(tag))
        self.keep.append((req, buf))
        if wait:
            self.wait(lambda: req.completed, 30, "a send")
        return req

    def ctrl(self, conn_id: int | None = None) -> int:
        return self.wire.ctrl_tag(self.their_id if conn_id is None else conn_id)

    def message(self, kind, header: dict, ids=None, payload: bytes = b"") -> bytes:
        """A control message sealed with what we know of the session (no MAC without the secret)."""
        return bytes(self.wire.encode(kind, header, ids, payload, self.conn.session))

    def raw(self, kind: int, h: bytes, b: bytes = b"", seq: int = 2) -> bytes:
        return self.wire._MSG.pack(kind, len(h), len(b), seq, bytes(16)) + h + b

    def proof(self) -> None:
        self.send(self.ctrl(), self.message(self.wire.Kind.PROOF, {}))


def _req_fields(**kw) -> dict:
    h = {"k": 1, "op": "write", "region": "kv", "n": 1, "bpc": 1, "lpc": 4, "xid": 1, "ttl": 10.0, "sent": 0.0,
         "tid": "x", "from": "mallory", "order": "NHC", "lid": 1}
    h.update(kw)
    return h


def ucx_deep_json(host, port) -> dict:
    """Case 2: a REQ whose JSON part nests 200,000 deep, after a PROOF (no MAC: accepted only by
    a victim without a secret)."""
    c = UcxClient(host, port)
    c.proof()
    wire = c.wire
    fixed, nums, strs = wire._FIELDS[wire.Kind.REQ]
    h = _req_fields()
    head = fixed.pack(*[h[f] for f in nums]) + b"".join(wire._LEN.pack(len(str(h[f]))) + str(h[f]).encode()
                                                         for f in strs)
    c.send(c.ctrl(), c.raw(int(wire.Kind.REQ), head + b"[" * 200_000, b"\0" * 8, seq=2))
    c.progress(1.0)
    return {"sent": True}


def ucx_big_messages(host, port, sizes: list[int]) -> dict:
    """Cases 3 and 5: control messages claiming ``sizes`` bytes (the buffers are mapped, not
    touched: a 1 TiB one costs the attacker nothing either); each send is posted, not awaited."""
    import mmap

    c = UcxClient(host, port)
    c.proof()
    reqs = []
    for n in sizes:
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, prot=mmap.PROT_READ)  # NORESERVE
        buf = c.np.frombuffer(m, dtype=c.np.uint8)
        reqs.append(c.send(c.ctrl(), buf, wait=False))
    c.progress(3.0)
    return {"completed": sum(bool(r.completed) for r in reqs)}


def ucx_early_flood(host, port, count: int, nbytes: int) -> dict:
    """Case 5: ``count`` chunks of ``nbytes`` for transfers never requested (tags computed with the
    key an outsider can derive: valid only where the victim has no secret)."""
    c = UcxClient(host, port)
    c.proof()
    data = c.np.zeros(nbytes, dtype=c.np.uint8)
    for i in range(count):
        xid = 1 + i // 4
        tag = c.wire.ctrl_tag(c.their_id) | (xid & 0xFFFF) << 32 | c.conn.chunk_bits(xid, i % 4, True)
        c.send(tag, data, wait=False)
        if i % 256 == 255:
            c.progress(0.005)
    c.progress(2.0)
    return {"sent": count}


def ucx_malformed(host, port) -> dict:
    """Case 6: a PROOF, then control messages that lie about their lengths, name kind 99, or carry
    a string field running past the header."""
    c = UcxClient(host, port)
    c.proof()
    k = int(c.wire.Kind.REFUSE)
    for m in (c.raw(k, b"\0" * 8 + b"\xff\xff", seq=2), c.raw(99, b"x" * 8, seq=3),
              c.wire._MSG.pack(k, 9999, 0, 4, bytes(16)) + b"\0" * 8):
        c.send(c.ctrl(), m)
    c.progress(1.0)
    return {"sent": 3}


def ucx_replay(host, port, captured: list[tuple[int, bytes]], chunk: int, spoof_ids: list[int]) -> dict:
    """Case 8: a REQ captured from a legitimate peer's traffic (tag, bytes), sent on the
    attacker's own connection and with the legitimate connection's tag, then the attacker's own
    data chunk for that request (tags guessed), on both tags."""
    c = UcxClient(host, port)
    c.proof()
    for tag, msg in captured:
        c.send(c.ctrl(), msg)  # on its own connection (not authenticated: only a PROOF is taken)
        c.send(tag, msg)  # as the legitimate connection (its sequence number is used up)
        xid = int.from_bytes(msg[c.wire.PREFIX_BYTES + 8:c.wire.PREFIX_BYTES + 12], "big")
        for conn_id in [tag >> 48] + spoof_ids:
            for x in (xid, xid + 1):
                c.send(c.wire.ctrl_tag(conn_id) | (x & 0xFFFF) << 32 | 0x5EED5EED, b"\xee" * chunk)
    c.progress(1.0)
    return {"sent": len(captured)}


def ucx_forged_acks(conn, host, port, ids: list[int]) -> None:
    """Case 9: unsigned ACKs for keys 1..400 on every connection id in ``ids`` until "stop"."""
    c = UcxClient(host, port)
    sent = 0
    while not conn.poll(0):
        for conn_id in ids:
            for k in range(1, 400, 7):
                c.send(c.wire.ctrl_tag(conn_id), c.raw(int(c.wire.Kind.ACK), k.to_bytes(8, "big"), seq=sent + 2),
                       wait=False)
                sent += 1
        c.progress(0.01)
        c.keep = c.keep[-2000:]
    conn.recv()
    conn.send({"sent": sent})


def tcp_connect(host: str, port: int) -> str:
    """Case 10: can a TCP connection be made to (host, port)?"""
    try:
        with socket.create_connection((host, port), timeout=2):
            return "connected"
    except OSError as exc:
        return type(exc).__name__
