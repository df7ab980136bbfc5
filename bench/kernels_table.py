"""Block-copy kernels against the same-bytes contiguous copy measured in the same run.

    python -m xfer.bench.kernels_table --out results.json [--no-sweep] [--quick]

For each case: check correctness against the torch reference first, then time (median of
``triton.testing.do_bench``, which flushes L2 before every run) gather, scatter and copy_blocks
twice: the whole call ("call": checks, tables, launch; when its host work outlasts do_bench's
L2 flush, this measures the host; up to the flush's duration of host work is hidden from it) and a
prepared plan's launch alone ("kern"), and the host time of one call ("host us", calls queued back to
back). "queued" is the rate of those queued calls, to the last one's end on the GPU: what a stream of
calls gets, host work included (issue 32's "whole call"). Ceilings: a contiguous device copy of
the same bytes (for swap: a contiguous pinned host <-> device copy). Baselines: one ``copy_``
per slice (a subset timed, extrapolated, as the table says) and per-layer torch indexing.
Targets (H200): gather/scatter >= 95 % of the ceiling for 32 KiB and 4 KiB slices, >= 80 % for
512 B, swap >= 97 %, conversion >= 85 %. Every op runs with ``path="kernel"`` (``auto`` would take
the copy engines for swaps); ``python -m xfer.bench.copy_calibrate`` compares the two.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch

from xfer.kernels import copy_blocks, gather, scatter, swap_in, swap_out
from xfer.kernels.reference import copy_blocks_ref, slot_addresses, validate_copy
from xfer.layout import LayoutKind, make_kv_cache

NHD, HND = LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.VLLM_FLASH_ATTN_HND
SLICE_LOOP_SUBSET = 2048  # slices timed for the per-slice copy_ baseline, then extrapolated
REPEATS = 3  # a median of an 8 MiB copy (~9 us) still swings by 2x between runs on an H200
HOST_CALLS = 20  # calls timed on the host clock (no sync between them) for the host cost of one call


@dataclass(frozen=True)
class Case:
    name: str
    block_size: int
    heads: int
    head_dim: int
    target: float  # fraction of the ceiling to reach
    dst_kind: LayoutKind = NHD
    swap: bool = False
    layers: int = 64
    blocks: int = 256
    moved: int = 128


CASES = [
    Case("seed 32 KiB", 16, 8, 128, 0.95),
    Case("4 KiB slices", 16, 1, 128, 0.95),
    Case("512 B slices", 16, 1, 16, 0.80),
    Case("NHD->HND 32 KiB", 16, 8, 128, 0.85, dst_kind=HND),
    Case("swap 32 KiB", 16, 8, 128, 0.97, swap=True),
]


def raw(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def bench(fn) -> float:
    """Best of ``REPEATS`` medians of ``fn`` in milliseconds (do_bench syncs, discards warm-up and
    flushes L2 before every run); ceilings get the same treatment, so ratios stay fair."""
    import triton.testing
    return min(float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) for _ in range(REPEATS))


def cache(case: Case, kind: LayoutKind, *, pinned: bool = False, fill: bool = True):
    empty = (lambda *s, **kw: torch.empty(*s, **{**kw, "device": "cpu"}, pin_memory=True)) if pinned else torch.empty
    ts, layout = make_kv_cache(kind, num_layers=case.layers, num_blocks=case.blocks, block_size=case.block_size,
                               num_heads=case.heads, head_dim=case.head_dim, device="cuda", empty=empty)
    for t in ts:
        if fill:
            raw(t).random_(0, 256)
        else:
            raw(t).fill_(0xA5)
    return ts, layout


def same_bytes(a, b) -> bool:
    return all(torch.equal(raw(x).cuda(), raw(y).cuda()) for x, y in zip(a, b))


def plan_of(src_layout, src, s_ids, dst_layout, dst, d_ids):
    from xfer.kernels import copy as kcopy
    src, s_ids, dst, d_ids = validate_copy(src_layout, src, s_ids, dst_layout, dst, d_ids)
    s_addr, d_addr = slot_addresses(src_layout, src), slot_addresses(dst_layout, dst)
    return kcopy.prepare(src_layout, s_addr, s_ids, dst_layout, d_addr, d_ids, torch.device("cuda"))


def run_case(case: Case, sweep: bool) -> dict:
    torch.manual_seed(0)
    src, sl = cache(case, NHD)
    if case.swap:
        host, hl = cache(case, NHD, pinned=True, fill=False)
    dst, dl = cache(case, case.dst_kind, fill=False)
    s_ids = torch.randperm(case.blocks)[:case.moved].numpy()
    d_ids = torch.randperm(case.blocks)[:case.moved].numpy()
    nbytes = case.moved * sl.bytes_per_block
    out = {"case": case.name, "slice_bytes": sl.block_nbytes, "slices": sl.num_slots * case.moved,
           "bytes": nbytes, "target": case.target, "ops": [], "baselines": [], "sweep": []}

    # ceilings, same bytes
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    b = torch.empty_like(a)
    ceil_ms = bench(lambda: b.copy_(a))
    out["ceiling"] = {"what": "contiguous device copy", "ms": ceil_ms, "GBps": nbytes / ceil_ms / 1e6}
    staging = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    if case.swap:
        hbuf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        d2h = bench(lambda: hbuf.copy_(a, non_blocking=True))
        h2d = bench(lambda: a.copy_(hbuf, non_blocking=True))
        out["ceiling_d2h"] = {"what": "contiguous device->pinned host", "ms": d2h, "GBps": nbytes / d2h / 1e6}
        out["ceiling_h2d"] = {"what": "contiguous pinned host->device", "ms": h2d, "GBps": nbytes / h2d / 1e6}
        ops = {
            "swap_out": (lambda: swap_out(sl, src, s_ids, hl, host, d_ids, path="kernel"),
                         (sl, src, s_ids, hl, host, d_ids), d2h),
            "swap_in": (lambda: swap_in(sl, dst, d_ids, hl, host, d_ids, path="kernel"),
                        (hl, host, d_ids, dl, dst, d_ids), h2d),
        }
    else:
        stg = sl.staging(case.moved)
        stg_t = [staging.view(sl.dtype)]
        ops = {
            "gather": (lambda: gather(sl, src, s_ids, staging, path="kernel"),
                       (sl, src, s_ids, stg, stg_t, np.arange(case.moved)),
                       ceil_ms),
            "scatter": (lambda: scatter(staging, dl, dst, d_ids, staging_layout=stg, path="kernel"),
                        (stg, stg_t, np.arange(case.moved), dl, dst, d_ids), ceil_ms),
            "copy_blocks": (lambda: copy_blocks(sl, src, s_ids, dl, dst, d_ids, path="kernel"),
                            (sl, src, s_ids, dl, dst, d_ids),
                            ceil_ms),
        }
    for name, (fn, args, ceiling) in ops.items():
        out["ops"].append(time_op(name, fn, args, ceiling, nbytes, case.target))
    if not case.swap:
        out["baselines"] = baselines(sl, src, s_ids, staging, ceil_ms, nbytes)
    if sweep:  # bare kernel, tile size x warps, on the first op (and both swap directions)
        for name in ("swap_out", "swap_in") if case.swap else ("gather",):
            _, args, ceiling = ops[name]
            plan = plan_of(*args)
            for tile in (8 << 10, 16 << 10, 32 << 10, 64 << 10):
                for warps in (4, 8, 16):
                    ms = bench(lambda p=plan, t=tile, w=warps: p.launch(tile_bytes=t, num_warps=w))
                    out["sweep"].append({"op": name, "tile_bytes": tile, "num_warps": warps, "ms": ms,
                                         "of_ceiling": ceiling / ms})
    return out


def time_op(name, fn, args, ceiling_ms, nbytes, target) -> dict:
    """Check the op's bytes against the reference, then time the API call and the bare kernel."""
    src_layout, src, s_ids, dst_layout, dst, d_ids = args
    for t in dst:
        raw(t).fill_(0xA5)
    fn()
    torch.cuda.synchronize()
    expect = [torch.empty_like(t) for t in dst]  # same strides as dst
    for t in expect:
        raw(t).fill_(0xA5)
    copy_blocks_ref(src_layout, src, s_ids, dst_layout, expect, d_ids)
    torch.cuda.synchronize()
    correct = same_bytes(dst, expect)
    del expect
    row = {"op": name, "correct": correct}
    if not correct:
        return row
    plan = plan_of(*args)
    api, kernel = bench(fn), bench(plan.launch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    host_us = (time.perf_counter() - t0) / HOST_CALLS * 1e6
    torch.cuda.synchronize()
    queued = (time.perf_counter() - t0) * 1e3 / HOST_CALLS  # ms a call, to the last one's end
    row.update(api_ms=api, kernel_ms=kernel, api_GBps=nbytes / api / 1e6, kernel_GBps=nbytes / kernel / 1e6,
               api_of_ceiling=ceiling_ms / api, kernel_of_ceiling=ceiling_ms / kernel, host_us_per_call=host_us,
               queued_ms=queued, queued_of_ceiling=ceiling_ms / queued,
               meets_target=ceiling_ms / kernel >= target, plan=repr(plan), tiling=plan.tiling())
    return row


def baselines(sl, src, s_ids, staging, ceil_ms, nbytes) -> list[dict]:
    """Per-slice copy_ loop (subset, extrapolated) and per-layer index_select, gathering."""
    n = len(s_ids)
    views = sl.views(src)  # per slot [B, N, H, C]
    stg = sl.staging(n).views([staging.view(sl.dtype)])
    slices = [(s, k) for s in range(sl.num_slots) for k in range(n)]
    subset = slices[:SLICE_LOOP_SUBSET]

    def slice_loop():
        for s, k in subset:
            stg[s][k].copy_(views[s][int(s_ids[k])])
    ms = bench(slice_loop) * len(slices) / len(subset)
    rows = [{"baseline": f"copy_ per slice ({len(subset)} of {len(slices)} timed, extrapolated)", "ms": ms,
             "GBps": nbytes / ms / 1e6, "of_ceiling": ceil_ms / ms}]
    idx = torch.as_tensor(s_ids, device="cuda")
    per_layer = staging.view(sl.dtype).view(sl.num_layers, sl.num_kv, n, *stg[0].shape[1:])

    def index_select():
        for layer, t in enumerate(src):  # vLLM per-layer (2, B, N, H, C): K and V in one call
            torch.index_select(t, 1, idx, out=per_layer[layer])
    ms = bench(index_select)
    rows.append({"baseline": f"torch index_select per layer ({len(src)} launches)", "ms": ms,
                 "GBps": nbytes / ms / 1e6, "of_ceiling": ceil_ms / ms})
    return rows


def print_case(c: dict) -> None:
    if "error" in c:
        print(f"\n{c['case']}: FAILED\n{c['error']}")
        return
    print(f"\n{c['case']}: {c['slices']} slices x {c['slice_bytes']} B = {c['bytes'] / 2**20:.0f} MiB; "
          f"ceiling {c['ceiling']['what']} {c['ceiling']['GBps']:.0f} GB/s"
          + (f"; D2H {c['ceiling_d2h']['GBps']:.1f}, H2D {c['ceiling_h2d']['GBps']:.1f} GB/s" if "ceiling_d2h" in c
             else ""))
    print(f"  {'op':<12} {'call GB/s':>9} {'call/ceil':>9} {'queued/ceil':>11} {'host us':>8} {'kern GB/s':>10} "
          f"{'kern/ceil':>10} {'target':>7}  ok")
    for r in c["ops"]:
        if not r["correct"]:
            print(f"  {r['op']:<12} WRONG BYTES (not timed)")
            continue
        print(f"  {r['op']:<12} {r['api_GBps']:9.0f} {r['api_of_ceiling']:9.1%} {r['queued_of_ceiling']:11.1%} "
              f"{r['host_us_per_call']:8.0f} "
              f"{r['kernel_GBps']:10.0f} "
              f"{r['kernel_of_ceiling']:10.1%} {c['target']:7.0%}  {'yes' if r['meets_target'] else 'NO'}")
    for r in c["baselines"]:
        print(f"  baseline {r['baseline']}: {r['GBps']:.1f} GB/s = {r['of_ceiling']:.1%} of ceiling")
    for op in sorted({r["op"] for r in c["sweep"]}):
        rows = [r for r in c["sweep"] if r["op"] == op]
        best, worst = max(rows, key=lambda r: r["of_ceiling"]), min(r["of_ceiling"] for r in rows)
        print(f"  sweep {op}: best tile {best['tile_bytes']} B x {best['num_warps']} warps = {best['of_ceiling']:.1%} "
              f"of ceiling (worst {worst:.1%})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="kernels_results.json", help="JSON file to write")
    p.add_argument("--no-sweep", action="store_true", help="skip the tile/warps sweep of the kernel")
    p.add_argument("--quick", action="store_true", help="8 layers instead of 64 (a smoke run)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernels_table needs a CUDA GPU")
    import triton

    from xfer.kernels.copy import native_launch
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "cuda": torch.version.cuda, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "native_launch": native_launch(torch.device("cuda", torch.cuda.current_device())), "cases": []}
    print(f"{results['device']}  torch {results['torch']}  triton {results['triton']}  {results['date']}  "
          f"native launch {'on' if results['native_launch'] else 'off'}")
    for case in CASES:
        if args.quick:
            case = Case(**{**case.__dict__, "layers": 8})
        try:
            c = run_case(case, sweep=not args.no_sweep)
        except Exception:  # one broken case must not cost the others' numbers
            c = {"case": case.name, "error": traceback.format_exc()}
        torch.cuda.empty_cache()
        results["cases"].append(c)
        print_case(c)
        with open(args.out, "w") as f:  # after every case: a later crash keeps what ran
            json.dump(results, f, indent=1, default=str)
    print(f"\nwrote {args.out}")
    return 0 if all("error" not in c and all(r["correct"] for r in c["ops"]) for c in results["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
