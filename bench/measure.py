"""Timers and the measurements xfer-bench reports: the xfer write, the ceilings (same-bytes
contiguous copy, single contiguous TCP send, torch.distributed send/recv) and the engine baselines
(per-slice copy loop, per-layer torch indexing).

Every timer syncs the devices before starting and before stopping the clock, discards one
warm-up round, and stops early (after ``min_iters``) once ``budget_s`` is spent.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Callable

import numpy as np
import torch

__all__ = ["PATTERN", "fill_pattern", "syncer", "timed", "row", "time_xfer", "copy_contiguous", "per_layer_indexing",
           "per_slice_loop", "tcp_send", "dist_send"]

PATTERN = 65_537  # bytes: a prime period, so no two slices of a power-of-two size hold the same bytes


def fill_pattern(tensors, seed: int) -> None:
    """Fill each base tensor with a random 65,537-byte pattern, tiled (fast: no per-byte RNG)."""
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        flat = t.view(-1).view(torch.uint8)
        pat = torch.randint(0, 256, (PATTERN,), dtype=torch.uint8, generator=gen).to(flat.device)
        whole = flat.numel() // PATTERN * PATTERN
        if whole:
            flat[:whole].view(-1, PATTERN).copy_(pat.expand(whole // PATTERN, PATTERN))
        flat[whole:].copy_(pat[: flat.numel() - whole])


def syncer(*devices: torch.device) -> Callable[[], None]:
    """A function that waits for all queued work on the CUDA ones among ``devices``."""
    cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)

    def sync() -> None:
        for d in cuda:
            torch.cuda.synchronize(d)

    return sync


def timed(fn: Callable[[], None], *, iters: int, budget_s: float, sync: Callable[[], None],
          warmup: int = 1, min_iters: int = 3) -> list[float]:
    """Seconds per call of ``fn`` (devices synced around each call), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync()
    out: list[float] = []
    start = time.perf_counter()
    while len(out) < iters and (len(out) < min_iters or time.perf_counter() - start < budget_s):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def row(name: str, kind: str, times: list[float], nbytes: int, slices: int, *, post: list[float] | None = None,
        post_cpu: list[float] | None = None, **extra) -> dict:
    """One result: ``kind`` is "xfer", "ceiling" or "baseline"; latencies in ms, post times in µs."""
    med = statistics.median(times)
    return {
        "name": name, "kind": kind, **extra, "n": len(times), "median_s": med, "gb_per_s": nbytes / med / 1e9,
        "slices_per_s": slices / med, "p50_ms": 1e3 * float(np.percentile(times, 50)),
        "p99_ms": 1e3 * float(np.percentile(times, 99)), "ratio_to_ceiling": None, "ceiling": None,
        "post_us": None if not post else 1e6 * statistics.median(post),
        "post_cpu_us": None if not post_cpu else 1e6 * statistics.median(post_cpu),
    }


def time_xfer(agent, peer: str, src: np.ndarray, dst: np.ndarray, *, iters: int, budget_s: float,
              sync: Callable[[], None]) -> tuple[list[float], list[float], list[float]]:
    """End-to-end seconds of ``agent.write(...).wait()``, and the wall / thread-CPU seconds of the
    ``write`` call alone (the host cost of posting a transfer)."""
    post: list[float] = []
    post_cpu: list[float] = []

    def one() -> None:
        c0, t0 = time.thread_time(), time.perf_counter()
        t = agent.write(peer, src, dst)
        t1, c1 = time.perf_counter(), time.thread_time()
        post.append(t1 - t0)
        post_cpu.append(c1 - c0)
        t.wait()

    times = timed(one, iters=iters, budget_s=budget_s, sync=sync)
    return times, post[1:], post_cpu[1:]


def copy_contiguous(nbytes: int, src_dev: torch.device, dst_dev: torch.device, *, iters: int, budget_s: float,
                    dst_empty=torch.empty) -> list[float]:
    """One ``copy_`` of ``nbytes`` contiguous bytes from ``src_dev`` into ``dst_dev`` memory."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
    fill_pattern([a], 7)
    b = dst_empty((nbytes,), dtype=torch.uint8, device=dst_dev)
    return timed(lambda: b.copy_(a), iters=iters, budget_s=budget_s, sync=syncer(src_dev, dst_dev))


def per_layer_indexing(src_views, dst_views, src_ids, dst_ids, *, iters: int, budget_s: float,
                       sync) -> list[float]:
    """``dst[dst_ids] = src[src_ids]`` per (layer, K/V) view: one advanced-indexing copy each."""
    si = torch.as_tensor(np.asarray(src_ids), device=src_views[0].device)
    di = torch.as_tensor(np.asarray(dst_ids), device=dst_views[0].device)

    def run() -> None:
        for s, d in zip(src_views, dst_views):
            rows = s[si]  # a gather, then a scatter on the destination's device
            d[di] = rows if rows.device == d.device else rows.to(d.device)

    return timed(run, iters=iters, budget_s=budget_s, sync=sync)


def per_slice_loop(src_views, dst_views, src_ids, dst_ids, *, iters: int, budget_s: float, sync) -> list[float]:
    """The seed's loop: one ``copy_`` per slice (layer, K/V, block)."""
    pairs = list(zip(np.asarray(src_ids).tolist(), np.asarray(dst_ids).tolist()))

    def run() -> None:
        for s, d in zip(src_views, dst_views):
            for i, j in pairs:
                d[j].copy_(s[i])

    return timed(run, iters=iters, budget_s=budget_s, sync=sync, min_iters=2)


def tcp_send(host: str, port: int, nbytes: int, *, iters: int, budget_s: float, timeout_s: float) -> list[float]:
    """Single contiguous send of ``nbytes`` host bytes over one TCP connection + a 1-byte ack."""
    data = np.full(nbytes, 0x5A, dtype=np.uint8)  # touched pages: the send copies real memory
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(int(nbytes).to_bytes(8, "little"))
        mv = memoryview(data)

        def one() -> None:
            sock.sendall(mv)
            if sock.recv(1) != b"k":
                raise ConnectionError("the target closed the TCP baseline connection")

        return timed(one, iters=iters, budget_s=budget_s, sync=lambda: None)


def dist_send(backend: str, device: torch.device, host: str, port: int | None, nbytes: int, *, iters: int,
              budget_s: float, timeout_s: float) -> list[float]:
    """Rank 1 of the target's two-rank group: per round a flag, the payload, the target's ack.
    Times payload send + ack (the flag is outside the clock). Joins the group on first use."""
    import datetime as dt

    import torch.distributed as dist

    dev = device if backend == "nccl" else torch.device("cpu")
    if not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        store = dist.TCPStore(host, port, 2, False, dt.timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=1, world_size=2, timeout=dt.timedelta(seconds=timeout_s))
    one_flag, zero_flag = (torch.full((1,), v, dtype=torch.int64, device=dev) for v in (1, 0))
    ack = torch.empty(1, dtype=torch.int64, device=dev)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    fill_pattern([buf], 3)
    sync = syncer(dev)

    def one() -> None:
        dist.send(buf, dst=0)
        dist.recv(ack, src=0)

    out: list[float] = []
    try:
        for i in range(1 + iters):  # round 0 is the warm-up
            dist.send(one_flag, dst=0)
            sync()
            t0 = time.perf_counter()
            one()
            sync()
            out.append(time.perf_counter() - t0)
            if i >= 3 and sum(out[1:]) > budget_s:
                break
    finally:
        dist.send(zero_flag, dst=0)
        sync()
    return out[1:]
