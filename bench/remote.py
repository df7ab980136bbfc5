"""How the two xfer-bench processes find and drive each other.

The target hosts (or joins) a metadata store; both agents publish there, and the initiator drives
the target with commands through the same store: it sets ``bench/cmd/N`` (JSON), the target
answers ``bench/reply/N``. Three ways to start the pair:

- local (no flags): this process hosts a store on loopback and spawns the target as a child;
- ``--role target --listen HOST:PORT`` / ``--role initiator --peer HOST:PORT`` on two nodes;
- torchrun or Slurm: rank 0 is the target, rank 1 the initiator, the store at MASTER_ADDR:MASTER_PORT.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from .errors import BenchError, Exit

__all__ = ["Channel", "DistEnv", "dist_env", "parse_hostport", "local_addr_toward", "LocalTarget", "store_url", "wait_key"]

TARGET_KEY = "bench/target"  # the target's description (JSON), set once it serves
CLAIM_KEY = "bench/initiators"  # counter: the first initiator to add 1 owns the target


def parse_hostport(text: str, flag: str, allow_zero: bool = False) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port); raises ValueError naming ``flag``."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\[\]\s]+):(\d+)", text or "")
    if not m:
        raise ValueError(f"{flag} must be HOST:PORT (or [IPv6]:PORT), got {text!r}")
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    if not (0 if allow_zero else 1) <= int(port) < 65536:
        raise ValueError(f"{flag} port must be in 1..65535, got {port}")
    return host, int(port)


def store_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def local_addr_toward(host: str) -> str:
    """An address of this host that ``host`` can reach: ``host`` itself when it is local, else the
    source address the kernel would use to reach it (a UDP connect sends nothing)."""
    try:
        ip = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise BenchError(f"cannot resolve {host!r}: {e}", Exit.UNREACHABLE) from None
    if ipaddress.ip_address(ip).is_loopback:
        return ip
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:  # local when it can be bound
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return ip
    except OSError:
        pass
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
            return s.getsockname()[0]
        except OSError as e:
            raise BenchError(f"no route from this host to {host} ({ip}): {e}", Exit.UNREACHABLE) from None


@dataclass(frozen=True)
class DistEnv:
    """Rank, world size and store address read from a launcher's environment."""

    source: str  # "torchrun" or "slurm"
    rank: int
    world_size: int
    host: str
    port: int
    agent_store: bool  # torchrun's agent already hosts a TCPStore at host:port
    prefix: str  # store key prefix: one per job (and restart), so reruns never read stale keys


def _first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[03-05,07],cpu1' -> 'gpu03'."""
    m = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist.strip())
    if not m:
        raise BenchError(f"cannot read a host from SLURM node list {nodelist!r}; set MASTER_ADDR", Exit.USAGE)
    return m.group(1) + (m.group(2) or "")


def dist_env(env=os.environ) -> DistEnv | None:
    """The launcher's view of this process, or None when not started by torchrun/Slurm with 2+ ranks."""
    if "RANK" in env and "WORLD_SIZE" in env:
        source, rank, world = "torchrun", env["RANK"], env["WORLD_SIZE"]
        job = env.get("TORCHELASTIC_RUN_ID", "job") + "-" + env.get("TORCHELASTIC_RESTART_COUNT", "0")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        source, rank, world = "slurm", env["SLURM_PROCID"], env["SLURM_NTASKS"]
        job = env.get("SLURM_JOB_ID", "job") + "-" + env.get("SLURM_STEP_ID", "0")
    else:
        return None
    try:
        rank, world = int(rank), int(world)
    except ValueError:
        raise BenchError(f"{source} rank/world size are not integers: {rank!r}/{world!r}", Exit.USAGE) from None
    if world < 2:
        return None
    host = env.get("MASTER_ADDR")
    if host is None:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise BenchError(f"{source}: MASTER_ADDR is not set (and no SLURM node list): cannot find rank 0",
                             Exit.USAGE)
        host = _first_host(nodes)
    try:
        port = int(env.get("MASTER_PORT", "29500"))
    except ValueError:
        raise BenchError(f"MASTER_PORT must be a port number, got {env['MASTER_PORT']!r}", Exit.USAGE) from None
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return DistEnv(source, rank, world, host, port, agent_store, f"xfer-bench/{job}/")


def wait_key(store, key: str, timeout: float, alive: Callable[[], str | None] | None, doing: str) -> bytes:
    """``store.get(key)``; with ``alive``, polled (no long blocking wait) so a dead local target is
    reported at once. Raises BenchError (UNREACHABLE) on timeout or death."""
    from xfer.errors import StoreTimeoutError

    if alive is None:
        try:
            return store.get(key, timeout)
        except StoreTimeoutError:
            raise BenchError(f"the xfer-bench target did not answer within {timeout:g} s ({doing})",
                             Exit.UNREACHABLE) from None
    deadline, nap, checked = time.monotonic() + timeout, 0.001, time.monotonic()
    while (raw := store.try_get(key)) is None:
        now = time.monotonic()
        if now - checked > 0.5:
            checked = now
            why = alive()
            if why:
                raise BenchError(f"the xfer-bench target {why} ({doing})", Exit.UNREACHABLE)
        if now > deadline:
            raise BenchError(f"the xfer-bench target did not answer within {timeout:g} s ({doing})", Exit.UNREACHABLE)
        time.sleep(nap)
        nap = min(2 * nap, 0.02)
    return raw


class Channel:
    """The initiator's end of the command channel.

    ``alive()`` (optional) returns None while the target lives, else why it does not: waits are
    cut into slices so a dead local target is reported at once instead of at the timeout.
    """

    def __init__(self, store, alive: Callable[[], str | None] | None = None):
        self.store, self.alive, self._n = store, alive, 0

    def call(self, op: str, timeout: float, **args) -> dict:
        from xfer.errors import StoreError

        n, self._n = self._n, self._n + 1
        key = f"bench/reply/{n}"
        try:
            self.store.set(f"bench/cmd/{n}", json.dumps({"op": op, **args}).encode())
            raw = wait_key(self.store, key, timeout, self.alive, f"while answering {op!r}")
            self.store.delete(key)
        except StoreError as e:  # the target hosts the store: a dead target breaks the connection
            raise BenchError(f"lost the xfer-bench target's store during {op!r}: {e}", Exit.UNREACHABLE) from None
        reply = json.loads(raw)
        if not reply.get("ok"):
            raise BenchError(f"the xfer-bench target failed {op!r}: {reply.get('error')}: {reply.get('message')}",
                             Exit(reply.get("code", Exit.ERROR)))
        return reply


class LocalTarget:
    """The target as a child process of this one (``--role target --store URL``), for local runs."""

    def __init__(self, store_url_: str, device: str, env_extra: dict, timeout: float):
        self._err = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, "-m", "xfer.bench.cli", "--role", "target", "--store", store_url_,
               "--device", device, "--bind", "127.0.0.1", "--idle-timeout", str(int(timeout)), "--quiet"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._err,
                                     env={**os.environ, **env_extra})

    def why_dead(self) -> str | None:
        rc = self.proc.poll()
        if rc is None:
            return None
        self._err.seek(0)
        tail = self._err.read()[-2000:].strip()
        return f"process exited with status {rc}" + (f"; its stderr ends with:\n{tail}" if tail else "")

    def close(self, timeout: float = 15.0) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._err.close()
