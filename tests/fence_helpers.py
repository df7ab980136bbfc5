"""Helpers of the fence tests (issue 29): agents in child processes whose KV caches live in
shared memory, so that the test process watches (and refills) both sides' blocks directly, and a
fixture that keeps every core busy.

Every side is a :class:`Side`: a spawned child (optionally inside a network namespace) running
one agent (``local`` or ``ucx`` pinned) with region ``kv`` in ``xfer.shared_empty`` memory, driven
over a pipe. ``Side.mem`` maps its base tensors (uint8) in this process. A destination is checked
with :func:`watch`: nothing may change in it for ``FENCE_WATCH_S`` seconds after the stop returned.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
import torch

from helpers import ChildProcess

FENCE_WATCH_S = 2.0  # every fence test watches its blocks this long after the stop returned
REFILL = 0x11  # what a destination is refilled with once its transfer ended
REPORT = os.environ.get("XFER_FENCE_REPORT")  # a JSON-lines file the tests append their figures to


def record(**fields) -> None:
    """One line of figures (case, transport, bytes checked, fence time and bound) for the report."""
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(fields) + "\n")


# ---- busy cores -------------------------------------------------------------------------------------
def _spin(stop):
    x = 0
    while not stop.is_set():
        x += 1


@pytest.fixture
def busy_cores():
    """One spinning process per core for the test's duration (fences must hold on a loaded host)."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 1)]
    for p in procs:
        p.start()
    yield len(procs)
    stop.set()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


# ---- a side: one agent in a child process --------------------------------------------------------------
def _slow(delay: float) -> None:
    """Every copy chunk of this process takes ``delay`` s more (one-sided copies and UCX staging):
    a transfer is surely still running when the test stops it (fault injection only)."""
    from xfer.kernels import BoundCopy

    real = BoundCopy.copy

    def slowed(self, *args, **kw):
        time.sleep(delay)
        return real(self, *args, **kw)
    BoundCopy.copy = slowed
    from ucx_helpers import _slow_copies

    _slow_copies(delay)


def local_transports() -> list[str]:
    """The transports two agents of this host can test here: ``local``, and ``ucx`` where ucxx imports."""
    out = ["local"]
    try:
        import ucxx  # noqa: F401

        out.append("ucx")
    except ImportError:
        pass
    return out


def _side_main(conn, name, transport, kind, dims, netns, env, bind, config):
    try:
        if netns:
            from ucx_helpers import _enter_netns

            _enter_netns(netns)  # before any thread exists
        os.environ.update(env)
        from xfer import Agent, AgentConfig, make_kv_cache, shared_empty
        from xfer.shm import lookup

        tensors, layout = make_kv_cache(kind, empty=shared_empty, **dims)
        for t in tensors:
            t.view(-1).view(torch.uint8).fill_(0)
        agent = Agent(name, AgentConfig(transport=transport, listen_host=bind, **config))
        agent.register("kv", tensors, layout)
        conn.send((agent.metadata(), [lookup(t) for t in tensors], [t.numel() * t.element_size() for t in tensors],
                   os.getpid()))
    except Exception as exc:  # sent back to the test as data
        conn.send(("error", type(exc).__name__, str(exc)))
        return
    posted = []
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "stop":
                agent.close()
                conn.send("bye")
                return
            if cmd == "connect":
                conn.send(agent.connect(arg))
            elif cmd == "slow":
                _slow(arg)
                conn.send("ok")
            elif cmd == "post":  # (op, peer, src, dst, timeout, notify) -> its index
                op, peer, src, dst, tmo, note = arg
                fn = agent.write if op == "write" else agent.read
                posted.append((fn(peer, src, dst, timeout=tmo, notify=note), dst))
                conn.send(len(posted) - 1)
            elif cmd == "post_unchecked":  # the same, with this side's checks of the ids patched out
                from xfer.layout import KVLayout

                real = KVLayout.check_block_ids
                KVLayout.check_block_ids = lambda self, ids, what="", unique=False: np.asarray(ids, dtype=np.int64)
                try:
                    op, peer, src, dst, tmo, note = arg
                    fn = agent.write if op == "write" else agent.read
                    posted.append((fn(peer, src, dst, timeout=tmo, notify=note), dst))
                finally:
                    KVLayout.check_block_ids = real
                conn.send(len(posted) - 1)
            elif cmd == "read_and_cancel":  # (peer, src, dst, timeout): cancel the moment dst[0] changes
                peer, src, dst, tmo = arg
                first = layout.views(tensors)[0][dst[0]]
                ref = first.clone()
                t = agent.read(peer, src, dst, timeout=tmo)
                posted.append((t, dst))
                while torch.equal(first, ref) and not t.poll().terminal:
                    pass
                conn.send((len(posted) - 1, t.cancel()))
            elif cmd == "state":
                conn.send(posted[arg][0].poll().name)
            elif cmd == "cancel":
                conn.send((posted[arg][0].cancel(), time.monotonic()))
            elif cmd == "wait":  # (index, refill: a byte value for the destination blocks, or None)
                i, refill = arg
                t, dst = posted[i]
                try:
                    t.wait()
                    out = ["ok", "DONE", ""]
                except Exception as exc:  # the outcome, as data
                    out = ["error", type(exc).__name__, str(exc)]
                ended = time.monotonic()
                if refill is not None and t.op.value == "read":  # this side's memory, the moment it ended:
                    for base in reversed(tensors):  # last layers first (a copy still running goes first to last)
                        base.view(-1).view(torch.uint8).fill_(refill)
                conn.send(out + [t.poll().name, getattr(t, "fence_time", None), ended, t.deadline,
                                 getattr(t, "stopped_at", None)])
            elif cmd == "post_many":  # [(op, peer, src, dst, timeout, notify)] -> the first index
                first = len(posted)
                for op, peer, src, dst, tmo, note in arg:
                    fn = agent.write if op == "write" else agent.read
                    posted.append((fn(peer, src, dst, timeout=tmo, notify=note), dst))
                conn.send(first)
            elif cmd == "cancel_some":  # indices -> how many stops this started
                conn.send(sum(posted[i][0].cancel() for i in arg))
            elif cmd == "outcomes":  # indices -> [(state, error name, fence s, end monotonic, id, deadline)]
                out = []
                for i in arg:
                    t = posted[i][0]
                    try:
                        t.wait()
                        err = ""
                    except Exception as exc:  # the outcome, as data
                        err = type(exc).__name__
                    out.append((t.poll().name, err, t.fence_time, t.finished, t.id, t.deadline))
                conn.send(out)
            elif cmd == "notes":
                conn.send([(n.transfer_id, n.peer, n.op.value, n.blocks.tolist()) for n in agent.notifications()])
            elif cmd == "revoke":
                blocks, tmo = arg
                t0 = time.monotonic()
                try:
                    n = agent.revoke(blocks, timeout=tmo)
                    conn.send(("ok", n, time.monotonic() - t0))
                except Exception as exc:
                    conn.send(("error", type(exc).__name__, str(exc), time.monotonic() - t0))
            elif cmd == "grant":  # (peer, blocks) -> ("ok", token) (xfer.ahead)
                conn.send(("ok", agent.grant(*arg)))
            elif cmd == "post_granted":  # (peer, src, dst, timeout, notify, token) -> its index
                peer, src, dst, tmo, note, token = arg
                posted.append((agent.write(peer, src, dst, timeout=tmo, notify=note, grant=token), dst))
                conn.send(len(posted) - 1)
            elif cmd == "timeline":
                conn.send(posted[arg][0].timeline())
            elif cmd == "holds":
                conn.send(len(getattr(agent, "_grants", ())))
        except Exception as exc:  # sent back to the test as data
            conn.send(("error", type(exc).__name__, str(exc)))


class Side(ChildProcess):
    """An agent named ``name`` in a spawned child; ``mem``: its base tensors (uint8) mapped here,
    ``layout``: its layout; ``pid``: the child's."""

    def __init__(self, name, transport, kind, dims, *, netns=None, bind="127.0.0.1", env=None, config=None):
        from xfer import make_kv_cache
        from xfer.shm import open_segment

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_side_main, daemon=True, args=(child, name, transport, kind, dims, netns,
                                                                      dict(env or {}), bind, dict(config or {})))
        self.proc.start()
        end = time.monotonic() + 60
        while not self.conn.poll(0.1):
            if not self.proc.is_alive() or time.monotonic() > end:
                self.kill()
                raise RuntimeError(f"side {name} did not start (exit code {self.proc.exitcode})")
        got = self.conn.recv()
        if got[0] == "error":
            self.kill()
            raise RuntimeError(f"side {name} failed to start: {got}")
        self.metadata, segments, sizes, self.pid = got
        self.name = name
        self.mem = [open_segment(seg)[off:off + n] for (seg, off), n in zip(segments, sizes)]
        self.layout = make_kv_cache(kind, **{**dims, "device": "meta"})[1]

    def call(self, cmd, arg=None, timeout=60):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"side {self.name} did not answer {cmd!r} within {timeout} s")
        return self.conn.recv()

    def signal(self, sig) -> None:
        os.kill(self.proc.pid, sig)

    # ---- its memory, from here ------------------------------------------------------------------
    def views(self, ids):
        """Per slot, a view of blocks ``ids`` (uint8, in place)."""
        base = [m.view(self.layout.dtype) for m in self.mem]
        idx = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        return [(v, idx) for v in self.layout.views(base)]

    def blocks(self, ids) -> torch.Tensor:
        """The bytes of blocks ``ids``, every slot, one flat uint8 copy."""
        return torch.cat([v[idx].contiguous().view(-1).view(torch.uint8) for v, idx in self.views(ids)])

    def fill_blocks(self, ids, value: int) -> None:
        for v, idx in self.views(ids):
            v[idx] = _pattern(v.dtype, value)

    def fill_random(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for m in self.mem:
            m.copy_(torch.randint(0, 256, m.shape, dtype=torch.uint8, generator=gen))

    def poison(self, value: int = 0xA5) -> None:
        for m in self.mem:
            m.fill_(value)

    def snapshot(self) -> list[torch.Tensor]:
        return [m.clone() for m in self.mem]


def _pattern(dtype, value: int):
    """A tensor element whose every byte is ``value`` (to fill views of any dtype)."""
    raw = torch.full((torch.empty(0, dtype=dtype).element_size(),), value, dtype=torch.uint8)
    return raw.view(dtype)[0]


def watch(side: Side, seconds: float = FENCE_WATCH_S, *, expect=None, ids=None) -> int:
    """Watch ``side``'s memory for ``seconds``: the number of bytes that changed after this call
    began, plus, with ``expect``, the most bytes of blocks ``ids`` that differed from it at any
    look (what a refill right after the end put there: a byte landing between the end and this
    call shows there). 0 is the only passing answer."""
    ref = side.snapshot()
    checked, changed, worst, end = 0, 0, 0, time.monotonic() + seconds
    while True:
        if expect is not None:
            got = side.blocks(ids)
            worst = max(worst, int((got != expect).sum()))
            checked += got.numel()
        now = side.snapshot()
        for a, b in zip(ref, now):
            checked += a.numel()
            if not torch.equal(a, b):
                changed = max(changed, int((a != b).sum()))
        if time.monotonic() >= end:
            break
        time.sleep(0.1)
    watch.checked += checked
    return changed + worst


def refilled(side: Side, ids) -> torch.Tensor:
    """What blocks ``ids`` hold once refilled with REFILL (every byte)."""
    return torch.full_like(side.blocks(ids), REFILL)


watch.checked = 0


def wait_for(cond, timeout: float, what: str, step: float = 0.002):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(step)


def changed_any(side: Side, ids, ref: torch.Tensor) -> bool:
    return not torch.equal(side.blocks(ids), ref)


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped. A stop signal goes to one
    thread, which stops the others once it runs: on a busy host the rest ran on for milliseconds
    after kill() returned (a request sent then was still handled)."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:  # the thread ended meanwhile
                pass
        if all(s in ("T", "t") for s in states):
            return
        if time.monotonic() > end:
            raise AssertionError(f"process {pid} did not stop within {timeout} s (thread states {states})")
        time.sleep(0.001)


def kill(side: Side) -> None:
    os.kill(side.pid, signal.SIGKILL)
    side.proc.join(10)
