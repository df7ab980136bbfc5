"""xfer-bench: move the seed workload between two local processes and compare with the ceiling.

With no arguments: a target process owns the destination KV cache, this process writes 128 of
256 blocks of a 64-layer K/V cache into it through the xfer API (the best transport the machine
has), verifies every byte, then times it beside the same-bytes contiguous copy (the ceiling) and
the two baselines engines use today (one copy per slice; per-layer torch indexing), all in this
run. Results are printed as a table and written as JSON into a results folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

PRESETS = {
    # name: (layers, blocks in cache, blocks moved, block_size, heads, head_dim)
    "seed": (64, 256, 128, 16, 2, 128),  # 8 KiB slices on CPU; the GPU seed uses 8 heads (32 KiB)
    "small": (8, 32, 16, 4, 2, 32),
}


def _progress(step: int, total: int, what: str) -> None:
    width = 24
    done = int(width * step / total)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} {what:<40}")
    if step == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _timed(fn, iters: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _row(name: str, times: list[float], nbytes: int, slices: int, ceiling_s: float | None, post=None) -> dict:
    med = statistics.median(times)
    return {
        "name": name, "median_s": med, "gb_per_s": nbytes / med / 1e9, "slices_per_s": slices / med,
        "p50_ms": 1e3 * float(np.percentile(times, 50)), "p99_ms": 1e3 * float(np.percentile(times, 99)),
        "ratio_to_ceiling": (ceiling_s / med) if ceiling_s else 1.0,
        "post_us": None if post is None else 1e6 * statistics.median(post),
    }


def run(args) -> dict:
    from xfer import Agent, AgentConfig, make_kv_cache, shared_empty
    from xfer.bench.target import Target, block_digests

    layers, nblocks, moved, bs, heads, hd = PRESETS[args.preset]
    dims = dict(num_layers=layers, num_blocks=nblocks, block_size=bs, num_heads=heads, head_dim=hd)
    device = "cpu"
    steps, step = 6, 0
    _progress(step, steps, "starting target process")
    target = Target(args.layout, dims, device)
    try:
        tensors, layout = make_kv_cache(args.layout, device=device, **dims)
        gen = torch.Generator().manual_seed(0)
        for t in tensors:
            b = t.view(-1).view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
        src = np.arange(0, 2 * moved, 2) % nblocks  # every other block: nothing merges
        dst = np.arange(nblocks - moved, nblocks)[::-1].copy()
        nbytes = moved * layout.bytes_per_block
        slices = moved * layout.num_slots
        with Agent("xfer-bench", AgentConfig(default_timeout_s=args.timeout)) as agent:
            agent.register("kv", tensors, layout)
            peer = agent.connect(target.metadata)
            route = agent.route(peer)
            step += 1
            _progress(step, steps, f"verifying ({route.kind.value})")
            agent.write(peer, src, dst).wait()
            digests, clean = target.call("check", dst.tolist())
            verified = digests == block_digests(layout, tensors, src) and clean
            if not verified:
                raise SystemExit("xfer-bench: destination bytes differ from the source; refusing to time")
            post: list[float] = []

            def xfer_write():
                t0 = time.perf_counter()
                t = agent.write(peer, src, dst)
                post.append(time.perf_counter() - t0)
                t.wait()

            step += 1
            _progress(step, steps, "timing contiguous copy (ceiling)")
            a = torch.empty(nbytes, dtype=torch.uint8)
            a.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
            b = shared_empty((nbytes,), dtype=torch.uint8)
            ceiling = _timed(lambda: b.copy_(a), args.iters)
            cs = statistics.median(ceiling)
            rows = [_row("contiguous copy (ceiling)", ceiling, nbytes, 1, cs)]
            step += 1
            _progress(step, steps, f"timing xfer write ({route.kind.value})")
            times = _timed(xfer_write, args.iters)
            rows.append(_row(f"xfer write [{route.kind.value}]", times, nbytes, slices, cs, post[1:]))
            target.call("drain")
            step += 1
            _progress(step, steps, "timing per-layer torch indexing")
            peer_t, peer_l = make_kv_cache(args.layout, device=device, **dims)
            sv, dv = layout.views(tensors), peer_l.views(peer_t)
            si, di = torch.as_tensor(src), torch.as_tensor(dst)

            def per_layer():
                for s_, d_ in zip(sv, dv):
                    d_[di] = s_[si]
            rows.append(_row("per-layer torch indexing", _timed(per_layer, args.iters), nbytes, slices, cs))
            step += 1
            _progress(step, steps, "timing per-slice copy_ loop")
            pairs = list(zip(src.tolist(), dst.tolist()))

            def per_slice():
                for s_, d_ in zip(sv, dv):
                    for i, j in pairs:
                        d_[j].copy_(s_[i])
            rows.append(_row("per-slice copy_ loop", _timed(per_slice, max(1, args.iters // 3)), nbytes, slices, cs))
            step += 1
            _progress(step, steps, "done")
    finally:
        target.close()
    return {
        "tool": "xfer-bench", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "device": device, "cpu_count": os.cpu_count(),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "workload": {"preset": args.preset, "layout": args.layout, **dims, "blocks_moved": moved,
                     "slice_bytes": layout.block_nbytes, "payload_bytes": nbytes, "slices": slices},
        "transport": {"kind": route.kind.value, "reason": route.reason, "rejected": route.rejected},
        "verified": verified, "iters": args.iters, "results": rows,
    }


def _table(res: dict) -> str:
    w = res["workload"]
    lines = [
        f"xfer-bench  {res['date']}  device={res['device']}  torch {res['versions']['torch']}",
        f"workload    {w['layout']}: {w['num_layers']} layers x K/V x {w['blocks_moved']} of {w['num_blocks']} blocks, "
        f"{w['slice_bytes'] / 1024:.1f} KiB slices ({w['slices']} slices, {w['payload_bytes'] / 2**20:.1f} MiB)",
        f"transport   {res['transport']['kind']}: {res['transport']['reason']}",
        f"verified    {'every destination byte matches the source; other blocks untouched' if res['verified'] else 'NO'}",
        "",
        f"{'what':<30}{'GB/s':>9}{'x ceiling':>11}{'slices/s':>12}{'p50 ms':>9}{'p99 ms':>9}{'post us':>9}",
    ]
    for r in res["results"]:
        post = "" if r["post_us"] is None else f"{r['post_us']:.0f}"
        lines.append(f"{r['name']:<30}{r['gb_per_s']:>9.2f}{r['ratio_to_ceiling']:>11.2f}{r['slices_per_s']:>12.3g}"
                     f"{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{post:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from xfer.layout import LayoutKind

    p = argparse.ArgumentParser(prog="xfer-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="seed")
    p.add_argument("--layout", choices=[k.value for k in LayoutKind if "mla" not in k.value],
                   default=LayoutKind.VLLM_FLASH_ATTN_NHD.value)
    p.add_argument("--iters", type=int, default=10, help="timed iterations per measurement (after one warm-up)")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of each transfer, seconds")
    p.add_argument("--out", default="xfer-bench-results", help="folder for results (a timestamped subfolder)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error(f"--iters must be >= 1, got {args.iters}")
    res = run(args)
    folder = Path(args.out) / res["date"].replace(":", "")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2) if args.json else _table(res))
    if not args.json:
        print(f"\nresults written to {folder}/results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
