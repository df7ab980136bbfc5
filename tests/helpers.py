"""Shared test helpers: random KV data, poison, byte-exact block checks, a peer process."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import torch

from xfer import Agent, AgentConfig, LayoutKind, make_kv_cache, shared_empty

POISON = 0xA5
MLA_DIM = {LayoutKind.MLA: 576, LayoutKind.MLA_FP8: 656}


def small_dims(kind, *, layers=3, blocks=8, bs=4, heads=2, hd=8):
    kind = LayoutKind(kind)
    return dict(num_layers=layers, num_blocks=blocks, block_size=bs, num_heads=heads,
                head_dim=MLA_DIM.get(kind, hd))


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def fill_random(tensors, seed: int) -> None:
    """Random bytes (every bit pattern, NaNs included for float dtypes)."""
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        b = byte_view(t)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen).to(b.device))


def poison(tensors) -> None:
    for t in tensors:
        byte_view(t).fill_(POISON)


def block_bytes(layout, tensors, ids) -> list[np.ndarray]:
    """Per slot, the bytes of blocks ``ids`` in logical (n, h, c) order."""
    out = []
    for v in layout.views(tensors):
        sel = v[torch.as_tensor(np.asarray(ids, dtype=np.int64))].contiguous()
        out.append(sel.view(-1).view(torch.uint8).cpu().numpy().copy())
    return out


def assert_blocks_equal(src_layout, src, src_ids, dst_layout, dst, dst_ids) -> None:
    for s, (a, b) in enumerate(zip(block_bytes(src_layout, src, src_ids), block_bytes(dst_layout, dst, dst_ids))):
        assert np.array_equal(a, b), f"slot {s}: destination blocks differ from the source"


def assert_untouched(layout, tensors, written_ids) -> None:
    """Every block not in ``written_ids`` still holds the poison, in every slot."""
    rest = sorted(set(range(layout.num_blocks)) - {int(i) for i in written_ids})
    if rest:
        for s, b in enumerate(block_bytes(layout, tensors, rest)):
            assert (b == POISON).all(), f"slot {s}: a block outside the transfer was modified"


# ---- a peer agent in another process -------------------------------------------------------------
def _peer_main(conn, name, kind, dims, seed, config, device="cpu", empty=None):
    if empty is None:
        empty = shared_empty if device == "cpu" else torch.empty
    tensors, layout = make_kv_cache(kind, empty=empty, device=device, **dims)
    if seed is None:
        poison(tensors)
    else:
        fill_random(tensors, seed)
    agent = Agent(name, config)
    agent.register("kv", tensors, layout)
    conn.send(agent.metadata())
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            agent.close()
            conn.send("bye")
            return
        if cmd == "bytes":
            conn.send([byte_view(t).cpu().numpy().copy() for t in tensors])
        elif cmd == "digests":
            from xfer.bench.target import block_digests, untouched
            conn.send((block_digests(layout, tensors, arg), untouched(layout, tensors, arg)))
        elif cmd == "notification":
            try:
                n = agent.wait_notification(arg)
                conn.send(("ok", n.peer, n.op.value, n.blocks.tolist(), n.payload))
            except Exception as exc:  # sent back to the test as data
                conn.send(("error", type(exc).__name__, str(exc)))
        elif cmd == "drain":
            conn.send([(n.transfer_id, n.peer, n.op.value, n.blocks.tolist()) for n in agent.notifications()])
        elif cmd == "connect":
            conn.send(agent.connect(arg))
        elif cmd == "grant":  # (peer, blocks) -> the token of a grant issued ahead (xfer.ahead)
            conn.send(agent.grant(*arg))
        elif cmd == "revoke":  # blocks of region kv -> how many holds were revoked
            conn.send(agent.revoke(arg, region="kv", timeout=5))
        elif cmd == "write":
            peer, src, dst, timeout = arg
            try:
                agent.write(peer, src, dst, timeout=timeout).wait()
                conn.send(("ok",))
            except Exception as exc:
                conn.send(("error", type(exc).__name__, str(exc)))


class ChildProcess:
    """A spawned child (``proc``) driven over a pipe (``conn``): stop it politely, or kill it."""

    def kill(self):
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self):
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)  # a frozen child hears "stop" too
                self.conn.send(("stop", None))
                self.conn.poll(10)
            except (OSError, EOFError, BrokenPipeError):
                pass
        self.kill()


class PeerProcess(ChildProcess):
    """An agent named ``name`` in a child process with a KV region ``kv``: host memory shared
    (``xfer.shared_empty``) unless ``empty`` names another allocator (e.g. ``torch.zeros``)."""

    def __init__(self, name, kind, dims, *, seed=None, config=None, device="cpu", empty=None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, name, kind, dims, seed, config, device, empty),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            self.kill()
            raise RuntimeError("peer process did not start within 60 s")
        self.metadata = self.conn.recv()
        self.tensors_layout = make_kv_cache(kind, device="meta", **dims)[1]

    def call(self, cmd, arg=None, timeout=30):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer process did not answer {cmd!r} within {timeout} s")
        return self.conn.recv()

    def tensors(self):
        """A copy of the peer's base tensors (as the layout's dtype)."""
        layout = self.tensors_layout
        return [torch.from_numpy(b).view(layout.dtype) for b in self.call("bytes")]

    def stop_signal(self):
        os.kill(self.proc.pid, signal.SIGSTOP)



def local_config(**kw) -> AgentConfig:
    return AgentConfig(**kw)


def one_torch_thread(request) -> None:
    """Run a test module on one intra-op thread, restoring the count after it (a fixture body).

    The engine's tiny models do microsecond matmuls: on a small, shared CI machine a second
    OpenMP thread makes each one wait on a busy core (measured 17x slower on 2 loaded cores).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))


DIMS_TINY = dict(num_layers=2, num_blocks=16, block_size=4, num_heads=1, head_dim=16)


def local_pair(prefix: str, seed: int, dims=DIMS_TINY):
    """Two in-process agents on ``local`` over shared-memory caches (a generator for a fixture):
    yields (a, b, a's peer handle of b, (a's tensors, layout), (b's tensors, layout)); a's cache
    random, b's poisoned; both closed after."""
    ta, la = make_kv_cache("vllm_flash_attn_nhd", empty=shared_empty, **dims)
    tb, lb = make_kv_cache("vllm_flash_attn_nhd", empty=shared_empty, **dims)
    fill_random(ta, seed=seed)
    poison(tb)
    a = Agent(f"{prefix}-a", AgentConfig(enable=("local",), default_timeout_s=5))
    b = Agent(f"{prefix}-b", AgentConfig(enable=("local",), default_timeout_s=5))
    try:
        a.register("kv", ta, la)
        b.register("kv", tb, lb)
        yield a, b, a.connect(b.metadata()), (ta, la), (tb, lb)
    finally:
        a.close()
        b.close()


def slowed(agent, delay: float, before=None):
    """The agent's one-sided host copies start ``delay`` seconds late (``before(job)`` runs first)."""
    tr = next(iter(agent.transports.values()))
    real = tr._launch

    def launch(job, prep=None):
        if before is not None:
            before(job)
        time.sleep(delay)
        return real(job, prep)
    tr._launch = launch
    return tr


class _Queued:
    """A stream launch's event, for a host copy run on a thread: the launch returns at once."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread

    def query(self) -> bool:
        return not self.thread.is_alive()

    def synchronize(self) -> None:
        self.thread.join()


def queued(agent, delay: float = 0.002):
    """The agent's copies launch as a stream copy does (ipc on a GPU): the launch returns an event
    at once, the bytes land ``delay`` seconds later, and the notice of a lone WRITE leaves after the launch."""
    tr = next(iter(agent.transports.values()))
    real = tr._launch

    def launch(job, prep=None):
        th = threading.Thread(target=lambda: (time.sleep(delay), real(job, prep)))
        th.start()
        return _Queued(th)
    tr._launch, tr._launches_async, tr.spin_wait = launch, (lambda job: True), True
    return tr
