"""Helpers of the UCX transport tests: an agent in a spawned child process (optionally inside a
network namespace), driven over a pipe, and the namespace pair of ci/netns.sh."""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import signal
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import ChildProcess, byte_view, fill_random, poison

ROOT = Path(__file__).resolve().parent.parent
CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
MS_REC, MS_PRIVATE, MNT_DETACH = 0x4000, 0x40000, 2


def ucx_env(device: str = "lo") -> dict:
    """UCX settings of every test process: TCP on one named interface only (loopback or veth)."""
    return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": device, "UCX_WARN_UNUSED_ENV_VARS": "n"}


def _enter_netns(name: str) -> None:
    """What ``ip netns exec`` does: join the namespace, then remount /sys so that UCX (which lists
    network devices in /sys/class/net) sees this namespace's interfaces."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc, what):
        if rc != 0:
            raise OSError(ctypes.get_errno(), f"{what} failed")
    with open(f"/var/run/netns/{name}") as f:
        check(libc.setns(f.fileno(), CLONE_NEWNET), f"setns into {name}")
    check(libc.unshare(CLONE_NEWNS), "unshare of the mount namespace")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "making / private")
    libc.umount2(b"/sys", MNT_DETACH)
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mounting sysfs")


CHUNK_DELAY = "XFER_TEST_CHUNK_DELAY_S"  # a peer's env: sleep this long per staged chunk (a slow host)


def _slow_copies(delay: float) -> None:
    """Make this process's UCX staging copies take ``delay`` s a chunk more, so a test's transfer is
    surely still running when it injects a fault, however fast the machine (fault injection only)."""
    from xfer.transports.ucx import staging as ucx_stage

    cls = ucx_stage.BlockCopier
    # iov: a chunk sent from or received into the blocks; *_async: a CUDA region's launches
    for name in ("gather", "scatter", "iov", "gather_async", "scatter_async"):
        def slowed(self, *args, _fn=getattr(cls, name), **kw):
            time.sleep(delay)
            return _fn(self, *args, **kw)
        setattr(cls, name, slowed)


def _peer_main(conn, name, kind, dims, seed, netns, env, bind, timeout):
    try:
        if netns:
            _enter_netns(netns)  # before any thread exists: the whole process moves
        os.environ.update(env)
        if float(os.environ.get(CHUNK_DELAY, 0)):
            _slow_copies(float(os.environ[CHUNK_DELAY]))
        from xfer import Agent, AgentConfig, make_kv_cache

        tensors, layout = make_kv_cache(kind, **dims)
        poison(tensors) if seed is None else fill_random(tensors, seed)
        agent = Agent(name, AgentConfig(transport="ucx", listen_host=bind, default_timeout_s=timeout))
        agent.register("kv", tensors, layout)
    except Exception as exc:
        conn.send(("error", type(exc).__name__, str(exc)))
        return
    conn.send(agent.metadata())
    posted = []
    regions = {"kv": tensors}
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "stop":
                agent.close()
                conn.send("bye")
                return
            if cmd == "bytes":  # the bytes of region ``arg`` (default kv)
                conn.send([byte_view(t).cpu().numpy().copy() for t in regions[arg or "kv"]])
            elif cmd == "region":  # another region (name, seed or None for the poison), same kind and dims
                rname, rseed = arg
                extra, extra_layout = make_kv_cache(kind, **dims)
                poison(extra) if rseed is None else fill_random(extra, rseed)
                agent.register(rname, extra, extra_layout)
                regions[rname] = extra
                conn.send(agent.metadata())  # the peer's new metadata names the region
            elif cmd == "connect":
                conn.send(agent.connect(arg))
            elif cmd == "notification":
                n = agent.wait_notification(arg)
                conn.send(("ok", n.peer, n.op.value, n.blocks.tolist(), n.payload))
            elif cmd == "notifications":
                conn.send([(n.peer, n.op.value, n.blocks.tolist(), n.payload) for n in agent.notifications()])
            elif cmd == "post":  # [(op, peer, src, dst, timeout, notify[, peer region[, region]])] -> count posted
                for op, peer, src, dst, tmo, note, *where in arg:
                    fn = agent.write if op == "write" else agent.read
                    where = where + [None] * (2 - len(where))
                    posted.append(fn(peer, src, dst, timeout=tmo, notify=note, peer_region=where[0], region=where[1]))
                conn.send(len(posted))
            elif cmd == "states":
                conn.send([t.poll().name for t in posted])
            elif cmd == "wait":  # every posted transfer's outcome, then forget them
                out = []
                for t in posted:
                    try:
                        t.wait()
                        out.append(("ok", t.path))
                    except Exception as exc:
                        out.append(("error", type(exc).__name__, str(exc)))
                posted.clear()
                conn.send(out)
            elif cmd == "reset":  # a fresh region kv of the first kind and dims: poison or seed ``arg``
                if "kv" in agent._regions:
                    agent.deregister("kv")
                tensors, layout = make_kv_cache(kind, **dims)
                poison(tensors) if arg is None else fill_random(tensors, arg)
                agent.register("kv", tensors, layout)
                regions["kv"] = tensors
                agent.notifications()
                conn.send("ok")
            elif cmd == "reregister":  # replace region kv with another cache (stale metadata on the peer)
                agent.deregister("kv")
                if arg is not None:
                    tensors, layout = make_kv_cache(arg[0], **arg[1])
                    poison(tensors)
                    agent.register("kv", tensors, layout)
                    regions["kv"] = tensors
                conn.send("ok")
        except Exception as exc:  # sent back to the test as data
            conn.send(("error", type(exc).__name__, str(exc)))


class UcxPeer(ChildProcess):
    """An agent named ``name`` (UCX pinned) in a spawned child, optionally in network namespace
    ``netns``; its KV region ``kv`` holds random bytes (``seed``) or the poison."""

    def __init__(self, name, kind, dims, *, seed=None, netns=None, device="lo", bind="127.0.0.1", env=None,
                 timeout=30.0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        full_env = {**ucx_env(device), **(env or {})}
        self.proc = ctx.Process(target=_peer_main, daemon=True,
                                args=(child, name, kind, dims, seed, netns, full_env, bind, timeout))
        self.proc.start()
        end = time.monotonic() + 60
        while not self.conn.poll(0.1):
            if not self.proc.is_alive() or time.monotonic() > end:
                self.kill()
                raise RuntimeError(f"peer process did not start (exit code {self.proc.exitcode})")
        self.metadata = self.conn.recv()
        if isinstance(self.metadata, tuple):
            self.kill()
            raise RuntimeError(f"peer process failed to start: {self.metadata}")
        self.name = name
        from xfer import make_kv_cache

        self.layout = make_kv_cache(kind, **{**dims, "device": "meta"})[1]

    def call(self, cmd, arg=None, timeout=30):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer process did not answer {cmd!r} within {timeout} s")
        return self.conn.recv()

    def tensors(self, region=None):
        return [torch.from_numpy(b).view(self.layout.dtype) for b in self.call("bytes", region)]

    def signal(self, sig) -> None:
        os.kill(self.proc.pid, sig)


def wait_until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.01)


# ---- two hosts: a namespace pair -----------------------------------------------------------------
def netns_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip() or probe.returncode}"
    return None


class NetnsPair:
    """Namespaces A and B joined by a veth pair (ci/netns.sh); deleted by ``close``."""

    def __init__(self):
        self.id = f"{int.from_bytes(os.urandom(3), 'big'):06x}"
        out = subprocess.run(["bash", str(ROOT / "ci" / "netns.sh"), "up", self.id], capture_output=True, text=True)
        if out.returncode != 0:
            pytest.skip(f"cannot create network namespaces here: {out.stderr.strip()}")
        self.info = json.loads(out.stdout)

    def __getitem__(self, key):
        return self.info[key]

    def link(self, state: str) -> None:
        subprocess.run(["bash", str(ROOT / "ci" / "netns.sh"), "link", self.id, state], check=True)

    def rate(self, rate: str) -> None:
        """Shape A's outgoing traffic (``"40mbit"``, or ``"off"``); skips the test where ``tc`` is missing."""
        if shutil.which("tc") is None:
            pytest.skip("the `tc` tool (iproute2) is not installed: cannot slow the link down")
        subprocess.run(["bash", str(ROOT / "ci" / "netns.sh"), "rate", self.id, rate], check=True)

    def close(self) -> None:
        subprocess.run(["bash", str(ROOT / "ci" / "netns.sh"), "down", self.id], check=False)


def expected_blocks(kind, dims, seed, ids):
    """Bytes of blocks ``ids`` of a cache filled with ``seed`` (what a peer of that seed holds)."""
    from helpers import block_bytes
    from xfer import make_kv_cache

    tensors, layout = make_kv_cache(kind, **dims)
    fill_random(tensors, seed)
    return block_bytes(layout, tensors, ids)


def assert_peer_blocks(peer: UcxPeer, ids, expected) -> None:
    from helpers import block_bytes

    got = block_bytes(peer.layout, peer.tensors(), ids)
    for s, (a, b) in enumerate(zip(expected, got)):
        assert np.array_equal(a, b), f"slot {s}: the peer's blocks differ from the source"
