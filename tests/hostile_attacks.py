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
