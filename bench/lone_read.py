"""A lone small READ's latency between two processes on this host (``local``: the target's cache in
shared memory), call to ``wait()`` returning, idling ``--gap-ms`` between reads so each is alone.

The target runs in a spawned child (``bench/lone_write.py``'s); the reader's bytes are checked
against the target's once before timing. Run it against two trees, alternated, with ``PYTHONPATH``
naming each (the READ's own check, issue 32: ``bench/results/2026-12-07-cpu-lone-read.md``).
``self_checked`` counts the timed reads that ended on their own check of the target's busy counts
(their timeline says ``checked``) rather than on the target's answer (``acked``).

``--burst K`` times K reads posted back to back instead (per read; each its own blocks, checked after).

    python bench/lone_read.py [--blocks 1] [--reads 400] [--gap-ms 2] [--burst K] [--json out]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import numpy as np

DIMS = dict(num_layers=4, num_blocks=64, block_size=16, num_heads=1, head_dim=64)  # 8 KiB a slice
KIND = "vllm_flash_attn_nhd"


def _check(conn, tensors, layout, pairs) -> None:
    """Our blocks ``d`` hold the target's blocks ``s`` for every (s, d) of ``pairs`` (the target's
    cache fetched over the bench's pipe)."""
    import torch

    conn.send("digest")
    theirs = [torch.frombuffer(bytearray(r), dtype=torch.uint8).view(t.dtype).view(t.shape)
              for r, t in zip(conn.recv(), tensors)]
    for mine, other in zip(layout.views(tensors), layout.views(theirs)):
        for s, d in pairs:
            assert torch.equal(mine[d].contiguous().view(-1).view(torch.uint8),
                               other[s].contiguous().view(-1).view(torch.uint8)), f"read bytes differ ({s} -> {d})"


def run(blocks: int, reads: int, gap: float, burst: int = 0) -> dict:
    import torch

    from xfer import Agent, AgentConfig, make_kv_cache, shared_empty
    from xfer.bench.lone_write import _target

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, "local", None, DIMS), daemon=True)
    proc.start()
    md = conn.recv()
    tensors, layout = make_kv_cache(KIND, empty=shared_empty, **DIMS)
    for t in tensors:
        t.view(-1).view(torch.uint8).fill_(0xA5)
    src, dst = list(range(blocks)), list(range(32, 32 + blocks))
    try:
        with Agent("lone-reader", AgentConfig(enable=("local",), default_timeout_s=30)) as a:
            a.register("kv", tensors, layout)
            peer = a.connect(md)
            a.read(peer, src, dst).wait()  # checked once: our blocks dst hold the target's blocks src
            _check(conn, tensors, layout, [(src, dst)])
            for _ in range(50):
                a.read(peer, src, dst).wait()
            lat, checked = [], 0
            base = 32 - blocks * burst  # --burst: read i moves its own blocks into its own free blocks
            sets = [(list(range(i * blocks, (i + 1) * blocks)), list(range(base + i * blocks, base + (i + 1) * blocks)))
                    for i in range(burst)]
            for _ in range(reads):
                time.sleep(gap)
                t0 = time.perf_counter()
                if burst:
                    ts = [a.read(peer, s, d) for s, d in sets]
                    for t in ts:
                        t.wait()
                    lat.append((time.perf_counter() - t0) / burst)
                    checked += sum("checked" in t.timeline() for t in ts)
                    continue
                t = a.read(peer, src, dst)
                t.wait()
                lat.append(time.perf_counter() - t0)
                checked += "checked" in t.timeline()
            if burst:  # every burst's blocks are the target's (checked after the timing: it reads the target)
                _check(conn, tensors, layout, sets)
            conn.send("handled")  # (drains the target's notifications)
            conn.recv()
    finally:
        conn.send("stop")
        conn.poll(10)
        proc.join(10)
    lat.sort()
    return {"blocks": blocks, "bytes": blocks * layout.bytes_per_block, "reads": reads, "burst": burst,
            "median_us": 1e6 * statistics.median(lat), "p90_us": 1e6 * lat[int(0.9 * len(lat))],
            "self_checked": checked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--reads", type=int, default=400)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--burst", type=int, default=0,
                    help="time bursts of this many reads posted back to back (each its own blocks), per read, "
                         "--reads bursts; the blocks are checked after")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.burst * args.blocks > 32:
        ap.error("--burst x --blocks must be <= 32 (the target's first 32 blocks, into the reader's 0..31)")
    out = run(args.blocks, args.reads, args.gap_ms / 1e3, args.burst)
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
