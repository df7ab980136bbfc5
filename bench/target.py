"""The passive side of xfer-bench: an agent in a child process that owns the destination KV cache."""

from __future__ import annotations

import hashlib
import multiprocessing as mp

import numpy as np
import torch

POISON = 0xA5


def block_digests(layout, tensors, ids) -> list[str]:
    """Per slot, a BLAKE2b digest of blocks ``ids`` in logical order (compares across layouts)."""
    idx = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    out = []
    for v in layout.views(tensors):
        data = v[idx.to(v.device)].contiguous().view(-1).view(torch.uint8).cpu().numpy()
        out.append(hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest())
    return out


def untouched(layout, tensors, written) -> bool:
    rest = sorted(set(range(layout.num_blocks)) - {int(i) for i in written})
    if not rest:
        return True
    idx = torch.as_tensor(rest)
    return all(bool((v[idx.to(v.device)].contiguous().view(-1).view(torch.uint8) == POISON).all())
               for v in layout.views(tensors))


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
