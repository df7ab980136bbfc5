"""Kernel vs copy engines, per slice size and direction, and the ``auto`` table they imply.

    python -m xfer.bench.copy_calibrate [--out copy_table.json] [--sizes 512,4096,32768] [--quick]

For each slice size (seed-case shape: 64 layers x K/V x 128 of 256 blocks, vLLM NHD, bf16;
512 B / 4 KiB / 32 KiB slices are 1 x 16, 1 x 128 and 8 x 128 heads x dims of 16 tokens) and
each direction (device->device in-process, device->pinned host, pinned host->device) it times
the four ways to move the blocks, after checking each one's bytes: the Triton kernel
(``kernel``), ``cudaMemcpyBatchAsync`` (``batch``), ``cudaMemcpy2DAsync`` over uniform-stride
runs (``2d``) and one ``cudaMemcpyAsync`` per run (``runs``), beside the same-bytes contiguous
copy (device copy; pinned host <-> device copy) measured in the same run. Wall time from the
call to the end of the copy (host enqueue cost included: it is most of a copy engine's cost at
small slices), median of at least 3 runs within a time budget, on a side stream.

The output's ``table`` is what ``XFER_COPY_TABLE`` (or ``xfer.kernels.set_copy_table``) takes:
per direction, the path to use from each measured size up. A copy-engine path replaces the
kernel only where it is faster by ``--margin`` (default 5 %); sizes between two measured ones
keep the smaller one's choice.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import traceback

import numpy as np
import torch

from xfer.bench.measure import fill_pattern, timed

POISON = 0xA5
PATHS = ("kernel", "batch", "2d", "runs")  # runs: a baseline, not a dispatch choice
HEADS_DIMS = {512: (1, 16), 4096: (1, 128), 32768: (8, 128)}  # bf16, 16 tokens a block


def seed_dims(slice_bytes: int, *, layers: int = 64, blocks: int = 256) -> dict:
    if slice_bytes not in HEADS_DIMS:
        raise SystemExit(f"slice size {slice_bytes} not in {sorted(HEADS_DIMS)}")
    heads, head_dim = HEADS_DIMS[slice_bytes]
    return dict(num_layers=layers, num_blocks=blocks, block_size=16, num_heads=heads, head_dim=head_dim)


def raw(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def poison(tensors) -> None:
    for t in tensors:
        raw(t).fill_(POISON)


def same_blocks(sl, src, s_ids, dl, dst, d_ids) -> bool:
    """Destination blocks ``d_ids`` hold the bytes of source blocks ``s_ids`` in every slot."""
    from xfer.kernels.reference import byte_views
    s_idx = torch.as_tensor(np.asarray(s_ids, dtype=np.int64))
    d_idx = torch.as_tensor(np.asarray(d_ids, dtype=np.int64))
    for sv, dv in zip(byte_views(sl, src), byte_views(dl, dst)):
        if not torch.equal(dv[d_idx.to(dv.device)].to(sv.device), sv[s_idx.to(sv.device)]):
            return False
    return True


def _runner(path: str, sl, src, s_ids, dl, dst, d_ids, stream: torch.cuda.Stream):
    """(fn, CUDA API calls a copy makes) for one path; run under ``torch.cuda.stream(stream)``."""
    from xfer.kernels import copy_blocks
    from xfer.kernels import copy_engine as ce
    if path == "kernel":
        return (lambda: copy_blocks(sl, src, s_ids, dl, dst, d_ids, path="kernel")), 1
    plan = ce.plan_for(sl, [t.data_ptr() for t in src], np.asarray(s_ids), dl, [t.data_ptr() for t in dst],
                       np.asarray(d_ids), stream.device.index)
    if path == "runs":
        return (lambda: plan.launch("runs", stream.cuda_stream)), plan.num_calls("runs")
    return (lambda: copy_blocks(sl, src, s_ids, dl, dst, d_ids, path=path)), plan.num_calls(path)


def compare_paths(scenario: str, sl, src, s_ids, dl, dst, d_ids, *, ceiling_s: float, ceiling: str,
                  iters: int = 20, budget_s: float = 0.5, paths=PATHS) -> dict:
    """Check, then time, every path of one copy; rows relative to ``ceiling_s`` (same bytes)."""
    from xfer.kernels import copy_engine as ce
    nbytes = len(s_ids) * sl.bytes_per_block
    out = {"scenario": scenario, "slice_bytes": sl.block_nbytes, "slices": len(s_ids) * sl.num_slots,
           "bytes": nbytes, "ceiling": ceiling, "ceiling_ms": 1e3 * ceiling_s,
           "ceiling_gb_per_s": nbytes / ceiling_s / 1e9, "rows": []}
    side = torch.cuda.Stream()
    for path in paths:
        row = {"path": path}
        out["rows"].append(row)
        reason = None if path == "kernel" else ce.available({"batch": "batch", "2d": "2d"}.get(path, "runs"))
        if reason:
            row["skipped"] = reason
            continue
        try:
            with torch.cuda.device(side.device), torch.cuda.stream(side):
                fn, calls = _runner(path, sl, src, s_ids, dl, dst, d_ids, side)
                poison(dst)
                torch.cuda.synchronize()
                fn()
                torch.cuda.synchronize()
                row["verified"] = same_blocks(sl, src, s_ids, dl, dst, d_ids)
                if not row["verified"]:
                    continue  # never time a copy that moved the wrong bytes
                times = timed(fn, iters=iters, budget_s=budget_s, sync=torch.cuda.synchronize)
        except Exception as exc:  # noqa: BLE001 - one failing path must not cost the others' numbers
            row["error"] = f"{type(exc).__name__}: {exc}"
            continue
        med = statistics.median(times)
        row.update(n=len(times), ms=1e3 * med, p99_ms=1e3 * float(np.percentile(times, 99)),
                   gb_per_s=nbytes / med / 1e9, ratio_to_ceiling=ceiling_s / med, calls=calls)
    timed_rows = [r for r in out["rows"] if "ms" in r]
    if timed_rows:
        out["fastest"] = min(timed_rows, key=lambda r: r["ms"])["path"]
    return out


def contiguous_s(nbytes: int, src_dev: str, dst_dev: str, *, iters: int = 20, budget_s: float = 0.5) -> float:
    """Median seconds of one contiguous ``copy_`` of ``nbytes`` (pinned when on the host)."""
    def alloc(dev):
        if dev == "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return torch.empty(nbytes, dtype=torch.uint8, device=dev)
    a, b = alloc(src_dev), alloc(dst_dev)
    fill_pattern([a], 7)
    return statistics.median(timed(lambda: b.copy_(a, non_blocking=True), iters=iters, budget_s=budget_s,
                                   sync=torch.cuda.synchronize))


def derive_table(cases: list[dict], margin: float = 1.05) -> dict[str, list[list]]:
    """The ``auto`` table the measurements imply: per direction, ``[[min_slice_bytes, path], ...]``.

    At each measured size the kernel stays unless a copy-engine path (batch or 2d) is at least
    ``margin`` times faster; a new row starts where the choice changes.
    """
    by_dir: dict[str, dict[int, str]] = {}
    for c in cases:
        if c.get("scenario") not in ("d2d", "d2h", "h2d"):
            continue
        rows = {r["path"]: r["ms"] for r in c.get("rows", []) if "ms" in r and r["path"] in ("kernel", "batch", "2d")}
        if "kernel" not in rows:
            continue
        engines = {p: ms for p, ms in rows.items() if p != "kernel"}
        best = min(engines, key=engines.get) if engines else None
        choice = best if best is not None and engines[best] * margin <= rows["kernel"] else "kernel"
        by_dir.setdefault(c["scenario"], {})[c["slice_bytes"]] = choice
    table = {}
    for direction, choices in by_dir.items():
        rows_: list[list] = []
        for i, (size, path) in enumerate(sorted(choices.items())):
            if not rows_ or rows_[-1][1] != path:
                rows_.append([0 if i == 0 else size, path])
        table[direction] = rows_
    return table


def print_case(c: dict) -> None:
    if "error" in c and "rows" not in c:
        print(f"\n{c.get('scenario')} {c.get('slice_bytes')} B: FAILED\n{c['error']}")
        return
    print(f"\n{c['scenario']}: {c['slices']} slices x {c['slice_bytes']} B = {c['bytes'] / 2**20:.1f} MiB; "
          f"ceiling ({c['ceiling']}) {c['ceiling_gb_per_s']:.1f} GB/s")
    print(f"  {'path':<8}{'ms':>10}{'GB/s':>9}{'x ceil':>8}{'calls':>8}  note")
    for r in c["rows"]:
        if "ms" in r:
            calls = "-" if r.get("calls") is None else str(r["calls"])
            print(f"  {r['path']:<8}{r['ms']:>10.3f}{r['gb_per_s']:>9.1f}{r['ratio_to_ceiling']:>8.3f}{calls:>8}"
                  f"  {'fastest' if c.get('fastest') == r['path'] else ''}")
        else:
            note = r.get("skipped") or r.get("error") or ("WRONG BYTES (not timed)" if r.get("verified") is False
                                                          else "?")
            print(f"  {r['path']:<8}{'-':>10}{'':>9}{'':>8}{'':>8}  {note}")


def in_process_cases(slice_bytes: int, *, directions=("d2d", "d2h", "h2d"), layers: int = 64, iters: int = 20,
                     budget_s: float = 0.5, device: int = 0) -> list[dict]:
    """The device->device and pinned-host cases of one slice size (seed-case ids)."""
    from xfer import LayoutKind, make_kv_cache
    dims = seed_dims(slice_bytes, layers=layers)
    dev = f"cuda:{device}"
    kind = LayoutKind.VLLM_FLASH_ATTN_NHD
    src_ids = np.arange(0, 256, 2)
    dst_ids = np.arange(128, 256)[::-1].copy()
    src, sl = make_kv_cache(kind, device=dev, **dims)
    fill_pattern(src, 11)
    nbytes = len(src_ids) * sl.bytes_per_block
    cases = []
    if "d2d" in directions:
        dst, dl = make_kv_cache(kind, device=dev, **dims)
        ceil = contiguous_s(nbytes, dev, dev, iters=iters, budget_s=budget_s)
        cases.append(compare_paths("d2d", sl, src, src_ids, dl, dst, dst_ids, ceiling_s=ceil,
                                   ceiling="contiguous device copy", iters=iters, budget_s=budget_s))
        del dst
    if "d2h" in directions or "h2d" in directions:
        def pinned(shape, dtype, device=None):
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        host, hl = make_kv_cache(kind, empty=pinned, **{**dims, "num_blocks": len(src_ids)})
        host_ids = np.random.default_rng(0).permutation(len(src_ids))
        if "d2h" in directions:
            ceil = contiguous_s(nbytes, dev, "cpu", iters=iters, budget_s=budget_s)
            cases.append(compare_paths("d2h", sl, src, src_ids, hl, host, host_ids, ceiling_s=ceil,
                                       ceiling="contiguous device->pinned host copy", iters=iters, budget_s=budget_s))
        if "h2d" in directions:
            fill_pattern(host, 12)
            back, bl = make_kv_cache(kind, device=dev, **dims)
            ceil = contiguous_s(nbytes, "cpu", dev, iters=iters, budget_s=budget_s)
            cases.append(compare_paths("h2d", hl, host, host_ids, bl, back, dst_ids, ceiling_s=ceil,
                                       ceiling="contiguous pinned host->device copy", iters=iters, budget_s=budget_s))
    return cases


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON file to write (XFER_COPY_TABLE takes it)")
    p.add_argument("--sizes", default="512,4096,32768", help="slice sizes in bytes (from 512, 4096, 32768)")
    p.add_argument("--directions", default="d2d,d2h,h2d")
    p.add_argument("--margin", type=float, default=1.05, help="how much faster a copy engine must be")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=0.5, help="time budget of one measurement")
    p.add_argument("--quick", action="store_true", help="8 layers instead of 64 (a smoke run)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("copy_calibrate needs a CUDA GPU")
    from xfer.kernels import copy_engine as ce
    sizes = [int(x) for x in args.sizes.split(",") if x]
    directions = tuple(x for x in args.directions.split(",") if x)
    res = {"bench": "copy_calibrate", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
           "runtime": ce.runtime_info(), "margin": args.margin, "cases": []}
    print(f"copy paths on {res['device']}; runtime {res['runtime']}")
    for size in sizes:
        try:
            cases = in_process_cases(size, directions=directions, layers=8 if args.quick else 64, iters=args.iters,
                                     budget_s=args.budget_s)
        except Exception:  # noqa: BLE001
            cases = [{"scenario": ",".join(directions), "slice_bytes": size, "error": traceback.format_exc()}]
        for c in cases:
            print_case(c)
        res["cases"] += cases
        torch.cuda.empty_cache()
    res["table"] = derive_table(res["cases"], args.margin)
    print(f"\nauto table (margin {args.margin}): {json.dumps(res['table'])}")
    print("use it with XFER_COPY_TABLE=<this file> or xfer.kernels.set_copy_table(table)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"wrote {os.path.abspath(args.out)}")
    return res


if __name__ == "__main__":
    main()
