"""The passive side of xfer-bench: an agent that owns the destination KV cache.

``serve`` runs the target role: it answers the initiator's commands (see ``bench.remote``) until
told to stop — prepare a cache for a workload and publish the agent, check the written bytes,
receive the baselines' contiguous TCP and torch.distributed sends. ``Target`` is the older
pipe-driven child process the per-transport benchmarks (bench/ipc_bench.py) still use.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import multiprocessing as mp
import os
import platform
import socket
import threading
import time
import traceback

import numpy as np
import torch

POISON = 0xA5
ALIGN = 4096  # base tensors carved out of the shared arena start on page boundaries


def _slot_digest(view: torch.Tensor, idx: torch.Tensor) -> str:
    data = view[idx.to(view.device)].contiguous().view(-1).view(torch.uint8).cpu().numpy()
    return hashlib.blake2b(data, digest_size=16).hexdigest()  # (hashes the array's buffer: no bytes copy)


def block_digests(layout, tensors, ids) -> list[str]:
    """Per slot, a BLAKE2b digest of blocks ``ids`` in logical order (compares across layouts).

    Large checks hash their slots on a few threads (hashlib releases the GIL, and each slot's copy
    to the host overlaps the others' hashing): checking 512 MiB slot by slot on one thread took
    ~1 s a call on the GPU host, ~20 s of each ipc_bench run's burst checks."""
    idx = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    views = layout.views(tensors)
    workers = min(8, os.cpu_count() or 1, len(views))
    if workers < 2 or len(idx) * layout.bytes_per_block < (8 << 20):
        return [_slot_digest(v, idx) for v in views]
    for device in {v.device for v in views if v.is_cuda}:  # the threads read on their default streams:
        torch.cuda.synchronize(device)  # what the caller's current stream still writes lands first
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="xfer-bench-digest") as pool:
        return list(pool.map(_slot_digest, views, [idx] * len(views)))


def untouched(layout, tensors, written) -> bool:
    rest = sorted(set(range(layout.num_blocks)) - {int(i) for i in written})
    if not rest:
        return True
    idx = torch.as_tensor(rest)
    return all(bool((v[idx.to(v.device)].contiguous().view(-1).view(torch.uint8) == POISON).all())
               for v in layout.views(tensors))


def describe_device(device: torch.device) -> dict:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"device": str(device), "device_name": p.name, "device_uuid": str(p.uuid)}
    return {"device": "cpu", "device_name": platform.processor() or platform.machine(), "device_uuid": None}


class _Arena:
    """Shared host memory reused from one workload to the next (xfer.shm frees segments only at exit)."""

    def __init__(self) -> None:
        self.flat: torch.Tensor | None = None
        self.used = 0

    def reset(self, need: int) -> None:
        from xfer import shared_empty

        if self.flat is None or self.flat.numel() < need:
            self.flat = None
            self.flat = shared_empty((need,), dtype=torch.uint8)
        self.used = 0

    def empty(self, shape, *, dtype, device=None) -> torch.Tensor:
        n = int(np.prod(shape)) * dtype.itemsize
        start = -(-self.used // ALIGN) * ALIGN
        if start + n > self.flat.numel():
            raise RuntimeError(f"shared arena of {self.flat.numel()} bytes cannot hold {n} more at {start}")
        self.used = start + n
        return self.flat[start:start + n].view(dtype).view(tuple(shape))


class TargetServer:
    """Answers one initiator's commands; every handler returns a JSON-able dict."""

    def __init__(self, store, device: torch.device, bind: str):
        self.store, self.device, self.bind = store, device, bind
        self.agents: dict[tuple, object] = {}  # (transport, chunk_bytes) -> Agent
        self.region = None  # (agent, tensors, layout, workload dict)
        self.arena = _Arena()
        self.jobs: dict[str, tuple[threading.Thread, dict]] = {}
        self.dist_ready = False

    # ---- commands ----------------------------------------------------------------------------
    def prepare(self, workload: dict, transport: str, chunk_bytes: int | None, timeout_s: float) -> dict:
        from xfer import make_kv_cache

        from .presets import Workload

        w = Workload.from_dict(workload)
        agent = self._agent(transport, chunk_bytes, timeout_s)
        if self.region is not None and self.region[0] is agent and self.region[3] == workload:
            tensors, layout = self.region[1], self.region[2]  # same cache: re-poison, keep the registration
        else:
            self._drop_region()
            empty = torch.empty
            if self.device.type == "cpu":  # shared memory: the local transport can reach it from another process
                self.arena.reset(w.num_blocks * w.num_layers * w.num_kv * w.slice_bytes + ALIGN * (2 * w.num_layers + 4))
                empty = self.arena.empty
            tensors, layout = make_kv_cache(w.layout, device=self.device, empty=empty, dtype=getattr(torch, w.dtype),
                                            **w.dims())
            agent.register("kv", tensors, layout)
            self.region = (agent, tensors, layout, workload)
        for t in tensors:
            t.view(-1).view(torch.uint8).fill_(POISON)
        if self.device.type == "cuda":  # the initiator writes from another process: the poison must land first
            torch.cuda.synchronize(self.device)
        agent.notifications()
        agent.publish(self.store)
        return {"name": agent.name, **describe_device(self.device)}

    def check(self, ids: list[int]) -> dict:
        agent, tensors, layout, _ = self.region
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        notes = agent.notifications()
        return {"digests": block_digests(layout, tensors, ids), "untouched": untouched(layout, tensors, ids),
                "notes": [n.payload.decode(errors="replace") for n in notes]}

    def tcp_listen(self) -> dict:
        """Accept one connection; receive messages of the given size, ack each with one byte, until EOF."""
        srv = socket.create_server((self.bind, 0), family=socket.AF_INET6 if ":" in self.bind else socket.AF_INET)
        srv.settimeout(60)

        def run(box: dict) -> None:
            with srv:
                conn, _ = srv.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                head = conn.recv(8, socket.MSG_WAITALL)
                nbytes = int.from_bytes(head, "little")
                buf = memoryview(bytearray(nbytes))
                while True:
                    got = 0
                    while got < nbytes:
                        k = conn.recv_into(buf[got:], nbytes - got)
                        if k == 0:
                            box["rounds"] = box.get("rounds", 0)
                            return
                        got += k
                    conn.sendall(b"k")
                    box["rounds"] = box.get("rounds", 0) + 1

        self._start("tcp", run)
        return {"port": srv.getsockname()[1]}

    def dist_start(self, backend: str, nbytes: int, timeout_s: float) -> dict:
        """Rank 0 of a two-rank torch.distributed group: per round, a flag (1: a payload follows,
        0: stop), the payload, a one-element ack back."""
        import datetime as dt

        import torch.distributed as dist

        port = None
        if not self.dist_ready:
            store = dist.TCPStore(self.bind, 0, 2, True, dt.timedelta(seconds=timeout_s), wait_for_workers=False)
            port = store.port

        def run(box: dict) -> None:
            dev = self.device if backend == "nccl" else torch.device("cpu")
            if not self.dist_ready:
                if dev.type == "cuda":
                    torch.cuda.set_device(dev)
                dist.init_process_group(backend, store=store, rank=0, world_size=2,
                                        timeout=dt.timedelta(seconds=timeout_s))
                self.dist_ready = True
            flag, buf, ack = (torch.zeros(1, dtype=torch.int64, device=dev), torch.empty(nbytes, dtype=torch.uint8, device=dev),
                              torch.ones(1, dtype=torch.int64, device=dev))
            rounds = 0
            while True:
                dist.recv(flag, src=1)
                if int(flag.item()) == 0:
                    break
                dist.recv(buf, src=1)
                dist.send(ack, dst=1)
                rounds += 1
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            box["rounds"] = rounds

        self._start("dist", run)
        return {"port": port}

    def wait(self, job: str, timeout_s: float) -> dict:
        th, box = self.jobs.pop(job)
        th.join(timeout_s)
        if th.is_alive():
            raise TimeoutError(f"{job} baseline still running after {timeout_s:g} s")
        if "error" in box:
            raise RuntimeError(f"{job} baseline failed on the target: {box['error']}")
        return {"rounds": box.get("rounds", 0)}

    # ---- helpers -----------------------------------------------------------------------------
    def _start(self, name: str, fn) -> None:
        box: dict = {}

        def body() -> None:
            try:
                fn(box)
            except Exception as e:  # reported by wait()
                box["error"] = f"{type(e).__name__}: {e}"

        th = threading.Thread(target=body, name=f"xfer-bench-{name}", daemon=True)
        th.start()
        self.jobs[name] = (th, box)

    def _agent(self, transport: str, chunk_bytes: int | None, timeout_s: float):
        from xfer import Agent

        from .agents import agent_config

        key = (transport, chunk_bytes)
        if key not in self.agents:
            self.agents[key] = Agent(f"xfer-bench-target-{len(self.agents)}",
                                     agent_config(transport, chunk_bytes, self.bind, timeout_s))
        return self.agents[key]

    def _drop_region(self) -> None:
        if self.region is not None:
            agent = self.region[0]
            agent.deregister("kv")
            self.region = None

    def close(self) -> None:
        self.region = None
        for agent in self.agents.values():
            agent.close()
        self.agents.clear()
        if self.dist_ready:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.dist_ready = False


def serve(store, device: torch.device, bind: str, idle_timeout: float, log) -> int:
    """Run the target role on ``store`` until the initiator says stop; returns an exit status."""
    from xfer.errors import StoreError, StoreTimeoutError, XferError

    from .errors import BenchError, Exit
    from .remote import TARGET_KEY

    from .agents import host_id

    server = TargetServer(store, device, bind)

    info = {"host": socket.gethostname(), "host_id": host_id(), "pid": os.getpid(), "bind": bind, "torch": torch.__version__,
            "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0, **describe_device(device)}
    store.set(TARGET_KEY, json.dumps(info).encode())
    log(f"xfer-bench target: serving on {store.endpoint} ({info['device']}); waiting for an initiator")
    handlers = {"prepare": server.prepare, "check": server.check, "tcp_listen": server.tcp_listen,
                "dist_start": server.dist_start, "wait": server.wait}
    n = 0
    try:
        while True:
            try:
                cmd = json.loads(store.get(f"bench/cmd/{n}", idle_timeout))
            except StoreTimeoutError:
                raise BenchError(f"no command from an initiator within {idle_timeout:g} s (--idle-timeout)",
                                 Exit.UNREACHABLE) from None
            except StoreError as e:
                raise BenchError(f"lost the store: {e}", Exit.UNREACHABLE) from None
            store.delete(f"bench/cmd/{n}")
            op = cmd.pop("op")
            if op == "stop":
                store.set(f"bench/reply/{n}", json.dumps({"ok": True}).encode())
                log(f"xfer-bench target: stopped by the initiator after {n} commands")
                end = time.monotonic() + 5  # the initiator deletes the reply once read: then the store may go
                while store.try_get(f"bench/reply/{n}") is not None and time.monotonic() < end:
                    time.sleep(0.05)
                return Exit.OK
            try:
                reply = {"ok": True, **handlers[op](**cmd)}
            except (XferError, BenchError, RuntimeError, OSError, TimeoutError, ValueError, KeyError, TypeError) as e:
                code = e.code if isinstance(e, BenchError) else Exit.ERROR
                reply = {"ok": False, "error": type(e).__name__, "message": str(e), "code": int(code)}
                log(f"xfer-bench target: {op} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            store.set(f"bench/reply/{n}", json.dumps(reply).encode())
            n += 1
    finally:
        server.close()


# ---- the pipe-driven child process of the per-transport benchmarks --------------------------------
def _main(conn, kind: str, dims: dict, device: str) -> None:
    from xfer import Agent, make_kv_cache, shared_empty

    empty = shared_empty if device == "cpu" else torch.empty
    tensors, layout = make_kv_cache(kind, device=device, empty=empty, **dims)
    for t in tensors:
        t.view(-1).view(torch.uint8).fill_(POISON)
    with Agent("xfer-bench-target") as agent:
        agent.register("kv", tensors, layout)
        conn.send(agent.metadata())
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                conn.send("bye")
                return
            if cmd == "check":
                ids = arg
                conn.send((block_digests(layout, tensors, ids), untouched(layout, tensors, ids)))
            elif cmd == "drain":
                conn.send(len(agent.notifications()))
            elif cmd == "received":  # transfer id -> when its notification arrived (time.monotonic, host-wide)
                conn.send({n.transfer_id: n.received for n in agent.notifications()})
            elif cmd == "connect":  # the initiator's metadata (to grant it blocks ahead)
                conn.send(agent.connect(arg))
            elif cmd == "grant":  # (peer, ids) -> the token of a grant issued ahead (xfer.ahead)
                conn.send(agent.grant(*arg))
            elif cmd == "ping":
                conn.send("pong")


class Target:
    """Start the target process; ``metadata`` is ready once the constructor returns."""

    def __init__(self, kind: str, dims: dict, device: str, timeout: float = 120.0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, kind, dims, device), daemon=True)
        self.proc.start()
        if not self.conn.poll(timeout):
            self.close()
            raise RuntimeError(f"xfer-bench target process did not start within {timeout:.0f} s")
        self.metadata = self.conn.recv()

    def call(self, cmd, arg=None, timeout: float = 300.0):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise RuntimeError(f"xfer-bench target did not answer {cmd!r} within {timeout:.0f} s")
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=10)
            except (RuntimeError, OSError, EOFError):
                pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
