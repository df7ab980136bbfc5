"""Helpers of the hostile-peer tests (issue 30): a raw control-channel client that speaks the
handshake by hand (to send what a real agent never would), a victim agent in its own process
that reports its RSS, open descriptors and the rejections it logged, and attackers run as separate
processes. Loopback only."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import socket
import time
import uuid

import numpy as np

from helpers import ChildProcess, byte_view, fill_random, poison
from xfer import frames
from xfer.auth import Authenticator, Session, new_nonce
from xfer.frames import Kind

SECRET = b"0123456789abcdef-deployment-7"


# ---- a raw control client ------------------------------------------------------------------------
class Refused(Exception):
    """The server sent a REJECT (``code``, ``reason``) or closed the connection (code 0)."""

    def __init__(self, code: int, reason: str):
        super().__init__(f"refused ({code}): {reason}")
        self.code, self.reason = code, reason


class RawControl:
    """One control connection driven by hand. ``handshake()`` runs HELLO/WELCOME/PROOF (with
    ``secret``, deriving the real session key); ``request`` sends a signed REQUEST and returns the
    reply's header; ``send_raw`` sends bytes as they are."""

    def __init__(self, address, *, secret: bytes | None = None, name: str = "mallory", agent_id: str | None = None,
                 expected: str | None = None, timeout: float = 5.0):
        self.sock = socket.create_connection(tuple(address), timeout=timeout)
        self.auth = Authenticator(secret) if secret else None
        self.name, self.agent_id, self.expected = name, agent_id or uuid.uuid4().hex, expected
        self.session: Session | None = None
        self.last_frame = b""

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def recv_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            try:
                data = self.sock.recv(n - len(out))
            except ConnectionResetError:
                data = b""
            if not data:
                raise Refused(0, "connection closed")
            out += data
        return out

    def read_frame(self):
        kind, _, _, hlen, plen, seq, mac = frames.PREFIX.unpack(self.recv_exact(frames.PREFIX.size))
        body = self.recv_exact(hlen + plen)
        if kind == Kind.REJECT:
            raise Refused(*frames.parse_reject(body[:hlen]))
        return kind, body[:hlen], body[hlen:], seq, mac

    def handshake(self, *, send_proof: bool = True, has_secret: bool | None = None) -> None:
        has = self.auth is not None if has_secret is None else has_secret
        hello = frames.parse_hello(frames.hello_body(self.agent_id, self.name, self.expected, has, new_nonce()))
        self.sock.sendall(frames.frame(Kind.HELLO, hello.body))
        kind, body, _, _, _ = self.read_frame()
        assert kind == Kind.WELCOME, kind
        welcome = frames.parse_welcome(body)
        key = frames.session_key(self.auth, hello, welcome.agent_id, welcome.nonce)
        transcript = welcome.transcript(hello.body)
        self.session = Session(key, outgoing=True)
        self.welcome = welcome
        if send_proof:
            self.sock.sendall(frames.frame(Kind.PROOF, frames.client_proof(key, transcript, welcome.proof)))

    def frame(self, header, payload: bytes = b"") -> bytes:
        h = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
        seq, mac = self.session.seal(Kind.REQUEST, h, payload)
        self.last_frame = frames.frame(Kind.REQUEST, h, payload, seq, mac)
        return self.last_frame

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> dict:
        kind, h, _, _, _ = self.read_frame()
        assert kind == Kind.REPLY, kind
        return json.loads(h)

    def request(self, header, payload: bytes = b"") -> dict:
        self.sock.sendall(self.frame(header, payload))
        return self.reply()


def hello_ok(address, *, secret=None, timeout=5.0) -> bool:
    """Whether the control server at ``address`` answers a hello request."""
    with RawControl(address, secret=secret, timeout=timeout) as c:
        c.handshake()
        reply = c.request({"type": "hello"})
        return reply.get("ok") is True


# ---- the victim: an agent in its own process -----------------------------------------------------
class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        if len(self.lines) < 10000:
            self.lines.append(f"{record.name}: {record.getMessage()}")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _victim_main(conn, name, kind, dims, secret, enable, env, settings_env, listen_host):
    os.environ.update(env)
    os.environ.update(settings_env)
    handler = _ListHandler()
    logging.getLogger("xfer").addHandler(handler)
    from xfer import Agent, AgentConfig, make_kv_cache, shared_empty
    from xfer.transports import TransportKind

    tensors, layout = make_kv_cache(kind, empty=shared_empty, **dims)
    poison(tensors)
    agent = Agent(name, AgentConfig(secret=secret, enable=enable, default_timeout_s=20, listen_host=listen_host))
    agent.register("kv", tensors, layout)
    conn.send(agent.metadata())
    held: list[int] = []
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "stop":
                agent.close()
                conn.send("bye")
                return
            if cmd == "bytes":
                conn.send([byte_view(t).cpu().numpy().copy() for t in tensors])
            elif cmd == "poison":
                poison(tensors)
                agent.notifications()
                conn.send("ok")
            elif cmd == "notifications":
                conn.send([(n.peer, n.op.value, n.blocks.tolist(), n.payload) for n in agent.notifications()])
            elif cmd == "logs":
                conn.send(list(handler.lines))
            elif cmd == "rejections":
                counts = dict(agent._server.rejections.counts)
                ucx = agent.transports.get(TransportKind.UCX)
                if ucx is not None:
                    counts.update({f"ucx:{k}": v for k, v in ucx._engine.proto.rejections.counts.items()})
                conn.send(counts)
            elif cmd == "threads":
                import threading

                conn.send(sorted(t.name for t in threading.enumerate()))
            elif cmd == "connections":
                conn.send(agent._server.connections)
            elif cmd == "connect":
                conn.send(agent.connect(arg))
            elif cmd == "exhaust_fds":  # hold every descriptor but ``arg`` (as other parts of a process might)
                while True:
                    try:
                        held.append(os.open("/dev/null", os.O_RDONLY))
                    except OSError:
                        break
                for _ in range(min(arg, len(held))):
                    os.close(held.pop())
                conn.send(len(held))
            elif cmd == "release_fds":
                while held:
                    os.close(held.pop())
                conn.send("ok")
            elif cmd == "write":  # (peer, src, dst, timeout)
                peer, src, dst, timeout = arg
                agent.write(peer, src, dst, timeout=timeout).wait()
                conn.send(("ok",))
        except Exception as exc:  # sent back to the test as data
            conn.send(("error", type(exc).__name__, str(exc)))


class Victim(ChildProcess):
    """An agent in a spawned child with a shared-memory region ``kv`` holding the poison."""

    def __init__(self, name, kind, dims, *, secret=None, enable=("local",), env=None, settings_env=None,
                 listen_host="127.0.0.1"):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_victim_main, daemon=True,
                                args=(child, name, kind, dims, secret, enable, env or {}, settings_env or {},
                                      listen_host))
        self.proc.start()
        end = time.monotonic() + 60
        while not self.conn.poll(0.1):
            if not self.proc.is_alive() or time.monotonic() > end:
                self.kill()
                raise RuntimeError(f"victim process did not start (exit code {self.proc.exitcode})")
        self.metadata = self.conn.recv()
        from xfer import make_kv_cache

        self.layout = make_kv_cache(kind, device="meta", **dims)[1]
        self.name = name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, cmd, arg=None, timeout=60):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"victim did not answer {cmd!r} within {timeout} s")
        out = self.conn.recv()
        if isinstance(out, tuple) and out and out[0] == "error":
            raise RuntimeError(f"victim failed {cmd!r}: {out[1]}: {out[2]}")
        return out

    def tensors(self):
        import torch

        return [torch.from_numpy(b).view(self.layout.dtype) for b in self.call("bytes")]

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def fds(self) -> int:
        return open_fds(self.pid)

    def logged(self, *words) -> list[str]:
        """The victim's logged warnings containing every one of ``words``."""
        return [line for line in self.call("logs") if all(w in line for w in words)]


# ---- attackers: separate processes ---------------------------------------------------------------
def run_attacker(fn, *args, timeout: float = 120.0):
    """Run ``fn(*args)`` in a spawned process; return what it returned (via a pipe) or raise."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_attacker_main, args=(child, fn, args), daemon=True)
    proc.start()
    try:
        if not parent.poll(timeout):
            raise TimeoutError(f"attacker {fn.__name__} did not finish within {timeout} s")
        ok, value = parent.recv()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
    if not ok:
        raise RuntimeError(f"attacker {fn.__name__} failed: {value}")
    return value


def _attacker_main(conn, fn, args):
    try:
        conn.send((True, fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        conn.send((False, f"{exc!r}\n{traceback.format_exc()[-2000:]}"))


class Attacker:
    """An attacker process that keeps running (holding sockets) until ``stop``: ``fn(conn, *args)``
    reports through ``conn.send`` and waits for ``"stop"`` on it."""

    def __init__(self, fn, *args):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=fn, args=(child, *args), daemon=True)
        self.proc.start()

    def recv(self, timeout: float = 120.0):
        if not self.conn.poll(timeout):
            raise TimeoutError("attacker did not report in time")
        return self.conn.recv()

    def stop(self):
        try:
            self.conn.send("stop")
            self.conn.poll(30)
        except (OSError, BrokenPipeError):
            pass
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def legit_write(kind, dims, victim_md: bytes, *, secret=None, enable=("local",), src=(1, 2, 3), dst=(4, 5, 6),
                seed=5, timeout=20.0):
    """A legitimate peer (this process) writes blocks ``src`` onto the victim's ``dst``; returns
    (the bytes it wrote as the victim's layout sees them: list per slot, the agent closed)."""
    from helpers import block_bytes
    from xfer import Agent, AgentConfig, make_kv_cache

    tensors, layout = make_kv_cache(kind, **dims)
    fill_random(tensors, seed)
    with Agent("legit", AgentConfig(secret=secret, enable=enable, default_timeout_s=timeout)) as a:
        a.register("kv", tensors, layout)
        peer = a.connect(victim_md)
        a.write(peer, list(src), list(dst), notify=b"legit", timeout=timeout).wait()
    return block_bytes(layout, tensors, list(src))


def assert_victim_holds(victim: Victim, expected, dst) -> None:
    """The victim's blocks ``dst`` equal ``expected`` byte for byte, every other block still poisoned."""
    from helpers import assert_untouched, block_bytes

    got_tensors = victim.tensors()
    got = block_bytes(victim.layout, got_tensors, list(dst))
    for s, (a, b) in enumerate(zip(expected, got)):
        assert np.array_equal(a, b), f"slot {s}: the victim's block differs from what the legitimate peer wrote"
    assert_untouched(victim.layout, got_tensors, list(dst))


def report(victim: Victim, counts: dict, before: int | None = None) -> None:
    """Print what the victim rejected (and its RSS growth): ``pytest -s`` shows the figures."""
    rss = "" if before is None else f"; RSS {(victim.rss() - before) / (1 << 20):+.1f} MiB"
    print(f"\n[{victim.name}] rejections {counts}{rss}; descriptors {victim.fds()}")
