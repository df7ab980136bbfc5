"""NVSHMEM test helpers.

``FakeFabric``: PEs of one NVSHMEM group inside one process, on the CPU, for the protocol tests
that need no GPU. It implements the runtime interface the lanes use (see
``xfer.transports.nvshmem.runtime``): symmetric areas and signal words as CPU tensors, and CUDA
streams emulated by threads that run their operations in order, an on-stream wait retrying until
it holds. ``pause()`` stalls every stream of a PE (a GPU stuck behind other work).

``PeProcess``: one real NVSHMEM PE in a spawned process whose agents take commands, for the GPU
tests; a failed command comes back with its traceback, the NVSHMEM versions and init status, and a
command that hangs makes the process print every thread's stack (faulthandler) before the test
gives up. ``PeThread``: the same command loop on a thread, for dry runs on a shared FakeFabric.
"""

from __future__ import annotations

import collections
import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch

from xfer.errors import TransportError
from xfer.transports.nvshmem import runtime as nvshmem_runtime
from xfer.transports.nvshmem.lanes import Lanes
from xfer.transports.nvshmem.proto import StagingPlan

_BIG = 1 << 40


# ---- the CPU stand-in ----------------------------------------------------------------------------
class FakeEvent:
    def __init__(self, stream):
        self.stream, self.flag = stream, threading.Event()

    def query(self) -> bool:
        if self.stream.error is not None:
            raise RuntimeError(f"fake stream failed: {self.stream.error!r}")
        return self.flag.is_set()


class FakeStream:
    """Operations run in order on a thread; an operation returning False is retried (a wait)."""

    def __init__(self, pe):
        self.pe, self.error = pe, None
        self.ops: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"fake-stream-pe{pe.pe}")
        self.thread.start()

    def put(self, op) -> None:
        with self.cond:
            self.ops.append(op)
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.ops and not self.pe.stopped:
                    self.cond.wait(0.1)
                if self.pe.stopped:
                    return
                op = self.ops[0]
            if self.pe.paused.is_set():
                time.sleep(1e-3)
                continue
            try:
                done = op() is not False
            except BaseException as exc:  # noqa: BLE001 - surfaced through every event
                self.error, done = exc, True
                traceback.print_exc()
            if done:
                with self.cond:
                    self.ops.popleft()
            else:
                time.sleep(50e-6)


class FakeRuntime:
    """One PE of a FakeFabric."""

    def __init__(self, fabric, group, host_id):
        self.fabric, self.group, self.host_id = fabric, group, host_id
        self.pe, self.size = group.rank, group.size
        self.device, self.status, self.session = torch.device("cpu"), "FAKE", fabric.session
        self.heap = "fake"
        self.preloaded: list[tuple[str, int]] = []
        self.plan = StagingPlan(group.size, group.staging_bytes)
        self.recv = torch.zeros(self.plan.area_bytes, dtype=torch.uint8)
        self.send = torch.zeros(self.plan.area_bytes, dtype=torch.uint8)
        self.data = np.zeros(self.plan.words, dtype=np.int64)
        self.credit = np.zeros(self.plan.words, dtype=np.int64)
        self.allocs: list[torch.Tensor] = []
        self.paused, self.stopped = threading.Event(), False
        self.streams: list[FakeStream] = []
        self.lanes = Lanes(self)
        self.closed = False
        self.teardown = "open"  # as the real Runtime: "open" until the last agent on this PE releases it

    def describe(self):
        return f"PE {self.pe}/{self.size} (fake): data words {self.data.tolist()}, credit words {self.credit.tolist()}"

    # streams
    def bind_thread(self):
        pass

    def new_stream(self):
        s = FakeStream(self)
        self.streams.append(s)
        return s

    def record(self, stream):
        ev = FakeEvent(stream)
        stream.put(lambda: ev.flag.set())
        return ev

    def pause(self):
        self.paused.set()

    def resume(self):
        self.paused.clear()

    # data
    def gather(self, stream, layout, tensors, ids, dst, role, seq, nbytes, bounds=None):
        from xfer.kernels import gather, staging_layout

        off = self.plan.position(dst, role, seq)
        if bounds is None:
            stream.put(lambda: gather(layout, tensors, ids, self.send[off:off + nbytes]))
            return
        # the real runtime's binding of a staging position, run when the fake stream gets there
        bound = bounds.gather(layout, tensors, staging_layout(layout, len(ids)), self.send[off:off + nbytes])
        stream.put(lambda: bound.copy(ids, np.arange(len(ids))))

    def scatter(self, stream, src, role, seq, nbytes, layout, tensors, ids, staging_layout, bounds=None):
        from xfer.kernels import scatter

        off = self.plan.position(src, role, seq)
        if bounds is None:
            stream.put(lambda: scatter(self.recv[off:off + nbytes], layout, tensors, ids,
                                       staging_layout=staging_layout))
            return
        bound = bounds.scatter(staging_layout, self.recv[off:off + nbytes], layout, tensors)
        stream.put(lambda: bound.copy(np.arange(len(ids)), ids))

    def preload(self, stream, sending, peer, role, seq, layout, tensors, n, bounds=None, sender_layout=None):
        self.preloaded.append(("gather" if sending else "scatter", n))  # host copies: no kernel to load

    def put_signal(self, stream, dst, role, seq, nbytes):
        peer, p = self.fabric.pes[dst], self.plan

        def op():
            d, s = p.position(self.pe, role, seq), p.position(dst, role, seq)
            peer.recv[d:d + nbytes].copy_(self.send[s:s + nbytes])
            peer.data[p.word(self.pe, role)] = seq
        stream.put(op)

    def wait_data(self, stream, src, role, value, check=None):
        stream.put(lambda: bool(self.data[self.plan.word(src, role)] >= value))

    def wait_credit(self, stream, dst, role, value, check=None):
        stream.put(lambda: bool(self.credit[self.plan.word(dst, role)] >= value))

    def send_credit(self, stream, src, role, value):
        peer = self.fabric.pes[src]
        stream.put(lambda: peer.credit.__setitem__(self.plan.word(self.pe, role), value))

    def set_own_credit(self, stream, dst, role, value):
        stream.put(lambda: self.credit.__setitem__(self.plan.word(dst, role), value))

    def set_own_data(self, stream, src, role, value):
        stream.put(lambda: self.data.__setitem__(self.plan.word(src, role), value))

    def quiet(self, stream):
        stream.put(lambda: None)

    # symmetric KV pools
    def symmetric_empty(self, shape, dtype=torch.float32, device=None):
        t = torch.empty(tuple(shape), dtype=dtype)
        self.allocs.append(t)
        return t

    def register_external(self, tensors):
        raise TransportError("nvshmem register_external_tensor failed: the fake fabric registers no memory")

    def symmetric_offsets(self, tensors, layout):
        out = []
        for t in tensors:
            for i, a in enumerate(self.allocs):
                base = a.data_ptr()
                if base <= t.data_ptr() < base + a.numel() * a.element_size():
                    out.append(i * _BIG + t.data_ptr() - base)
                    break
            else:
                return None
        return out

    def peer_views(self, offsets, layout, pe):
        peer, views = self.fabric.pes[pe], []
        for i, off in enumerate(offsets):
            a = peer.allocs[off // _BIG].reshape(-1).view(torch.uint8)
            start, need = off % _BIG, layout.tensor_numel[i] * layout.itemsize
            views.append(a[start:start + need].view(layout.dtype))
        return views

    def direct_stream(self):
        return None

    def close(self):
        if not self.closed:
            self.closed = True
            self.teardown = "finalized: fake" if self.lanes.close() else "skipped: a lane did not drain"
            self.stopped = True


class FakeFabric:
    """``size`` fake PEs; install with ``fabric.install(monkeypatch)``."""

    def __init__(self):
        self.session = "fake-session"
        self.pes: dict[int, FakeRuntime] = {}
        self._lock = threading.Lock()  # agents of one PE may start on several threads at once

    def acquire(self, group, host_id):
        with self._lock:
            if group.rank not in self.pes:
                self.pes[group.rank] = FakeRuntime(self, group, host_id)
            return self.pes[group.rank]

    def release(self, rt):
        rt.close()

    def install(self, monkeypatch=None):
        """Route NvshmemTransport to this fabric (through pytest's monkeypatch, or for good)."""
        from xfer.transports.nvshmem import NvshmemTransport

        if monkeypatch is None:
            class _Setter:
                setattr = staticmethod(setattr)
            monkeypatch = _Setter()

        monkeypatch.setattr(nvshmem_runtime, "acquire", self.acquire)
        monkeypatch.setattr(nvshmem_runtime, "release", self.release)
        monkeypatch.setattr(NvshmemTransport, "probe", classmethod(lambda cls: None))
        return self


# ---- one real PE in a spawned process (GPU tests) -------------------------------------------------------
def diagnostics() -> dict:
    """What a failure report needs: versions, NVSHMEM status, environment."""
    d = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
         "env": {k: v for k, v in os.environ.items() if k.startswith(("NVSHMEM_", "CUDA_", "PYTORCH_"))}}
    try:
        import nvshmem
        import nvshmem.core as nvc

        d["nvshmem4py"] = getattr(nvshmem, "__version__", "?")
        try:
            d["libnvshmem"] = nvc.get_version().libnvshmem_version
        except Exception as exc:  # noqa: BLE001 - part of the report
            d["libnvshmem"] = f"unknown: {exc!r}"
        try:
            d["init_status"] = nvc.InitStatus(int(nvc.init_status())).name
        except Exception as exc:  # noqa: BLE001
            d["init_status"] = f"unknown: {exc!r}"
    except ImportError as exc:
        d["nvshmem4py"] = f"not importable: {exc}"
    if torch.cuda.is_available():
        d["gpu"] = torch.cuda.get_device_name(0)
    return d


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _pe_main(conn, group_kw, config_kw):
    """Command loop of one PE process. Commands take a dict naming the ``agent`` they act on (agents of
    one process share its PE); replies are ("ok", value) or ("error", type, message, details)."""
    faulthandler.enable()
    if os.environ.get("XFER_TEST_FAKE_NVSHMEM") == "1":  # the CPU check of this harness
        FakeFabric().install()
    from helpers import byte_view, fill_random, poison
    from xfer import Agent, AgentConfig, TransportKind, make_kv_cache
    from xfer.config import NvshmemGroup

    agents, caches = {}, {}  # name -> Agent; (agent, region) -> (tensors, layout)

    def handle(cmd, a):
        if cmd == "diagnostics":
            return diagnostics()
        if cmd == "init":
            group = NvshmemGroup(**group_kw)
            agent = agents[a["agent"]] = Agent(a["agent"], AgentConfig(transport="nvshmem", nvshmem=group,
                                                                       **config_kw))
            if TransportKind.NVSHMEM not in agent.transports:
                raise RuntimeError(f"nvshmem unavailable: {agent.unavailable.get(TransportKind.NVSHMEM)}")
            return agent.transports[TransportKind.NVSHMEM].info()
        agent = agents[a["agent"]]
        tr = agent.transports.get(TransportKind.NVSHMEM)
        if cmd == "region":  # memory: "torch" | "symmetric" (collective) | "registered" (collective)
            empty = tr.symmetric_empty if a["memory"] == "symmetric" else torch.empty
            tensors, layout = make_kv_cache(a["kind"], device=tr.rt.device, empty=empty, **a["dims"])
            if a["memory"] == "registered":
                tr.register_symmetric(tensors)
            fill_random(tensors, a["seed"]) if a.get("seed") is not None else poison(tensors)
            _sync()
            caches[a["agent"], a["region"]] = tensors, layout
            agent.register(a["region"], tensors, layout)
            return {"symmetric": tr.rt.symmetric_offsets(tensors, layout) is not None}
        if cmd == "metadata":
            return agent.metadata()
        if cmd == "connect":
            return agent.connect(a["metadata"])
        if cmd == "grant":  # peer, blocks -> the token of a grant issued ahead (xfer.ahead)
            return agent.grant(a["peer"], a["blocks"])
        if cmd == "transfer":  # op, peer, src, dst, region, peer_region, timeout, notify[, grant: a write's token]
            t = getattr(agent, a["op"])(a["peer"], a["src"], a["dst"], region=a.get("region"),
                                        peer_region=a.get("peer_region"), notify=a.get("notify", b""),
                                        timeout=a.get("timeout", 60.0), **({"grant": a["grant"]} if "grant" in a else {}))
            try:
                t.wait()
                return {"state": t.poll().name, "id": t.id, "ms": 1e3 * t.elapsed}
            except Exception as exc:  # noqa: BLE001 - reported as data
                from xfer.bench.nvshmem_probe import _host, thread_stacks  # a report must not hang

                words, err, _ = _host(tr.rt.describe, 5.0)
                return {"state": t.poll().name, "id": t.id, "ms": 1e3 * t.elapsed, "error": type(exc).__name__,
                        "message": str(exc), "words": err or words, "threads": thread_stacks(),
                        "lanes": repr(getattr(tr.rt, "lanes", None))}
        if cmd == "bytes":
            _sync()
            return [byte_view(t).cpu().numpy().copy() for t in caches[a["agent"], a["region"]][0]]
        if cmd == "poison":
            poison(caches[a["agent"], a["region"]][0])
            _sync()
            return True
        if cmd == "notifications":
            return [(n.peer, n.transfer_id, n.op.value, n.blocks.tolist(), n.payload) for n in agent.notifications()]
        if cmd == "wait_notification":
            n = agent.wait_notification(a["timeout"])
            return (n.peer, n.transfer_id, n.op.value, n.blocks.tolist(), n.payload)
        if cmd == "stats":
            return dict(tr.stats)
        if cmd == "close":  # every agent of the process; reports how the PE was torn down
            start = time.monotonic()
            rts = [x.transports[TransportKind.NVSHMEM].rt for x in agents.values()
                   if TransportKind.NVSHMEM in x.transports]
            for other in list(agents.values()):
                other.close()
            return {"close_s": time.monotonic() - start, "teardown": sorted({rt.teardown for rt in rts})}
        raise ValueError(f"unknown command {cmd!r}")

    while True:
        try:
            cmd, arg, limit = conn.recv()
        except EOFError:
            return
        faulthandler.dump_traceback_later(limit, exit=False)  # a hang prints every thread's stack
        try:
            conn.send(("ok", handle(cmd, arg or {})))
        except BaseException as exc:  # noqa: BLE001 - the test prints it
            conn.send(("error", type(exc).__name__, str(exc), {"traceback": traceback.format_exc(),
                                                               **diagnostics()}))
        finally:
            faulthandler.cancel_dump_traceback_later()
        if cmd == "close":
            return


class PeProcess:
    """A spawned process that is PE ``group_kw['rank']`` of an NVSHMEM group; its agents take commands."""

    def __init__(self, name, group_kw, config_kw=None):
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_pe_main, args=(child, group_kw, config_kw or {}), daemon=True)
        self.proc.start()

    def send(self, cmd, arg=None, limit=120.0):
        """Send a command without waiting (e.g. collectives that every PE must enter together)."""
        self.conn.send((cmd, {"agent": self.name, **(arg or {})}, limit))

    def reply(self, cmd="?", timeout=180.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"PE process {self.name!r} did not answer {cmd!r} within {timeout:.0f} s "
                               f"(alive: {self.proc.is_alive()}, exit code {self.proc.exitcode})")
        try:
            msg = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise AssertionError(f"PE process {self.name!r} died during {cmd!r} (exit code {self.proc.exitcode}); "
                                 f"its stderr above shows why") from None
        if msg[0] == "error":
            _, kind, message, details = msg
            report = "\n".join(f"  {k}: {v}" for k, v in details.items() if k != "traceback")
            raise AssertionError(f"PE {self.name!r} failed {cmd!r}: {kind}: {message}\n{details['traceback']}\n{report}")
        return msg[1]

    def call(self, cmd, arg=None, timeout=180.0):
        self.send(cmd, arg, limit=max(5.0, timeout - 5.0))
        return self.reply(cmd, timeout)

    def kill(self):
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self, timeout=25.0):
        """Close every agent of the process (see ``close_group`` to close PEs together)."""
        if self.proc.is_alive():
            try:
                self.call("close", timeout=timeout)
            except (AssertionError, TimeoutError, OSError, EOFError):
                pass
        self.proc.join(5)
        self.kill()


class _ThreadProc:
    def __init__(self, thread):
        self.thread, self.pid, self.exitcode = thread, os.getpid(), None

    def is_alive(self):
        return self.thread.is_alive()

    def join(self, timeout=None):
        self.thread.join(timeout)


class PeThread(PeProcess):
    """PeProcess's command loop on a thread of this process (CPU dry runs on one shared FakeFabric,
    installed by the caller); ``kill`` is not possible."""

    def __init__(self, name, group_kw, config_kw=None):
        self.name = name
        self.conn, child = mp.Pipe()
        thread = threading.Thread(target=_pe_main, args=(child, group_kw, config_kw or {}), daemon=True,
                                  name=f"pe-thread-{name}")
        self.proc = _ThreadProc(thread)
        thread.start()

    def kill(self):
        pass


def close_group(pes, timeout=25.0) -> list:
    """Close every live PE at once (teardown is collective); returns each close reply (or the error)."""
    live = [pe for pe in pes if pe.proc.is_alive()]
    for pe in live:
        pe.send("close", limit=timeout - 5)
    out = []
    for pe in live:
        try:
            out.append(pe.reply("close", timeout=timeout))
        except (AssertionError, TimeoutError, OSError, EOFError) as exc:
            out.append(exc)
    for pe in pes:
        pe.proc.join(5)
        pe.kill()
    return out
