"""CUDA IPC transport benchmark: two processes on one GPU (or across GPUs), the seed case.

    python -m xfer.bench.ipc_bench [--out results.json] [--peer-device 0]

Migrates 64 layers x K/V x 128 of 256 blocks x 32 KiB through the xfer API (call -> bytes in the
decode process's blocks -> notification delivered -> acknowledged), after verifying the bytes,
beside the same-bytes contiguous device copy measured in the same run. Also: back-to-back
transfers (throughput with completion round trips overlapped; request i lands in the i-th of 8
block sets of the prefill cache into the i-th of 8 free sets of the decode cache, in turn, as
engines place a stream of requests; verified once before timing), pull, and the latency of a
1-block request across all layers.

Across two GPUs (``--peer-device``), ``--peer-ceiling`` adds, after every xfer row (so nothing
it enables runs before the transport's own mapping), the NVLink ceiling: ``cudaMemcpyPeerAsync``
of the same bytes, contiguous, both ways, peer access enabled (``bench/peer_copy.py``;
``peer_ceiling`` in the JSON, ``ratio_to_peer_ceiling`` on each row, reads against the pull).
``--pull-burst`` adds reads back to back (8 and 128, each request pulling the peer's copy of
the i-th set back into this cache, verified once on poison). Neither runs by default.

Then (``copy_paths`` in the JSON; ``--no-copy-paths`` skips it) the Triton kernel against the
copy engines (``cudaMemcpyBatchAsync``, ``cudaMemcpy2DAsync``, one ``cudaMemcpyAsync`` per run)
for 512 B, 4 KiB and 32 KiB slices of the same shape: device->device in-process, device->pinned
host, pinned host->device, the copy alone into the peer's CUDA-IPC-mapped blocks (push), and the
xfer write end to end per path; each path's bytes checked before it is timed, each beside the
same-bytes contiguous copy measured in the same run, and the ``auto`` table these numbers imply
(see ``python -m xfer.bench.copy_calibrate``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np
import torch


def median_ms(fn, iters: int, warmup: int = 3, sync=None) -> tuple[float, float]:
    """(median, p99) milliseconds of ``fn``, synchronised around each call (``sync``: default
    ``torch.cuda.synchronize``; a no-op for CPU dry runs)."""
    sync = sync or torch.cuda.synchronize
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), float(np.percentile(times, 99))


def ipc_copy_cases(slice_bytes: int, args) -> list[dict]:
    """Push into the peer's mapped blocks by every path (copy alone), then the xfer write end to end per path."""
    from xfer import Agent, AgentConfig, LayoutKind, TransportKind, make_kv_cache
    from xfer.bench.copy_calibrate import compare_paths, contiguous_s, poison, seed_dims
    from xfer.bench.measure import fill_pattern, timed
    from xfer.bench.target import Target, block_digests
    from xfer import settings
    from xfer.kernels import copy_engine as ce

    kind = LayoutKind.VLLM_FLASH_ATTN_NHD
    dims = seed_dims(slice_bytes)
    dev, peer_dev = f"cuda:{args.device}", f"cuda:{args.peer_device}"
    src, dst = np.arange(0, 256, 2), np.arange(128, 256)[::-1].copy()
    target = Target(kind.value, dims, peer_dev)
    cases = []
    saved = os.environ.get("XFER_COPY_PATH")
    try:
        tensors, layout = make_kv_cache(kind, device=dev, **dims)
        fill_pattern(tensors, 21)
        torch.cuda.synchronize()
        nbytes = len(src) * layout.bytes_per_block
        ceil = contiguous_s(nbytes, dev, peer_dev, iters=args.copy_iters, budget_s=args.copy_budget_s)
        with Agent("bench-copy-paths", AgentConfig(transport="ipc")) as agent:
            agent.register("kv", tensors, layout)
            peer = agent.connect(target.metadata)
            agent.write(peer, src, dst).wait()  # maps the peer's blocks into this process
            mapped = next(iter(agent.transports[TransportKind.IPC]._mapped.values()))
            peer_layout = make_kv_cache(kind, device="meta", **dims)[1]
            cases.append(compare_paths("ipc_push", layout, tensors, src, peer_layout, mapped, dst, ceiling_s=ceil,
                                       ceiling="contiguous device copy", iters=args.copy_iters,
                                       budget_s=args.copy_budget_s))
            e2e = {"scenario": "ipc_write_e2e", "slice_bytes": layout.block_nbytes,
                   "slices": len(src) * layout.num_slots, "bytes": nbytes, "ceiling": "contiguous device copy",
                   "ceiling_ms": 1e3 * ceil, "ceiling_gb_per_s": nbytes / ceil / 1e9, "rows": []}
            cases.append(e2e)
            for path in ("kernel", "batch", "2d"):
                row = {"path": path}
                e2e["rows"].append(row)
                reason = None if path == "kernel" else ce.available(path)
                if reason:
                    row["skipped"] = reason
                    continue
                os.environ["XFER_COPY_PATH"] = path
                settings.reload()  # the kernels' default path (the agent's config names none) is read again
                poison(mapped)
                torch.cuda.synchronize()
                t = agent.write(peer, src, dst)
                t.wait()
                digests, clean = target.call("check", dst.tolist())
                row.update(verified=bool(clean and digests == block_digests(layout, tensors, src)),
                           transfer_path=t.path, copy_path=t.copy_path)
                if not row["verified"]:
                    continue
                times = timed(lambda: agent.write(peer, src, dst).wait(), iters=args.copy_iters,
                              budget_s=args.copy_budget_s, sync=torch.cuda.synchronize)
                med = statistics.median(times)
                row.update(n=len(times), ms=1e3 * med, p99_ms=1e3 * float(np.percentile(times, 99)),
                           gb_per_s=nbytes / med / 1e9, ratio_to_ceiling=ceil / med, calls=None)
                target.call("drain")
            timed_rows = [r for r in e2e["rows"] if "ms" in r]
            if timed_rows:
                e2e["fastest"] = min(timed_rows, key=lambda r: r["ms"])["path"]
    finally:
        if saved is None:
            os.environ.pop("XFER_COPY_PATH", None)
        else:
            os.environ["XFER_COPY_PATH"] = saved
        settings.reload()
        target.close()
    return cases


def copy_paths_section(args) -> dict:
    """Kernel vs copy engines for each slice size: in-process, pinned host, IPC push, IPC end to end."""
    from xfer.bench.copy_calibrate import derive_table, in_process_cases, print_case
    from xfer.kernels import copy_engine as ce

    out = {"runtime": ce.runtime_info(), "cases": []}
    print(f"\ncopy paths (kernel vs copy engines); runtime: {out['runtime']}")
    for size in [int(x) for x in args.copy_sizes.split(",") if x]:
        for what, fn in (("in-process", lambda: in_process_cases(size, iters=args.copy_iters,
                                                                 budget_s=args.copy_budget_s, device=args.device)),
                         ("ipc", lambda: ipc_copy_cases(size, args))):
            try:
                cases = fn()
            except Exception:  # noqa: BLE001 - one failing case must not cost the others' numbers
                cases = [{"scenario": what, "slice_bytes": size, "error": traceback.format_exc()}]
            for c in cases:
                print_case(c)
            out["cases"] += cases
            torch.cuda.empty_cache()
    out["table"] = derive_table(out["cases"])
    print(f"\nauto table these numbers imply: {json.dumps(out['table'])}")
    return out


def windowed(post, k: int, window: int) -> None:
    """Post ``post(i)`` for i < k and wait for all; with ``window`` > 0 at most that many in flight
    (request i waits for request i - window first: with 8 block sets, no two unfenced transfers
    share a block); 0: all at once. One initiator's overlapping writes are granted (the grants'
    owner rule since c6dc9c6: its own transfers are its own order to keep, and a burst's copies
    launch in posting order), so no window is needed; it remains to compare with runs that used
    one (ci/gpu.sh's ``--window 8``)."""
    ts = []
    for i in range(k):
        if window and i >= window:
            ts[i - window].wait()
        ts.append(post(i))
    for t in ts:
        t.wait()


def pull_bursts(agent, peer, target, layout, tensors, srcs, sets, iters: int, window: int = 0) -> list[dict]:
    """Reads back to back: request i pulls the peer's i-th set (``sets[i % 8]``) into this cache's
    ``srcs[i % 8]``. Verified once first: this whole cache poisoned, 16 pulls, every set then
    holding the peer's bytes."""
    from xfer.bench.target import POISON, block_digests

    def burst(k):
        windowed(lambda i: agent.read(peer, sets[i % 8], srcs[i % 8]), k, window)

    want = [target.call("check", d.tolist())[0] for d in sets]
    for t in tensors:
        t.view(-1).view(torch.uint8).fill_(POISON)
    torch.cuda.synchronize()
    burst(16)
    torch.cuda.synchronize()
    if any(block_digests(layout, tensors, s) != w for s, w in zip(srcs, want)):
        raise SystemExit("ipc bench: a back-to-back pull burst left bytes that differ from the peer's")
    rows = []
    for k, n in ((8, max(3, iters // 4)), (128, max(3, iters // 10))):
        ms, p99 = median_ms(lambda k=k: burst(k), n)
        rows.append({"name": f"xfer read (pull), {k} back to back (per request)", "ms": ms / k, "p99_ms": p99 / k})
    return rows


def _burst_timeline(post, k: int, copy_ms: float) -> dict:
    """Post ``k`` writes back to back, wait, and print when each reached each phase (ms from the
    first post) for every 8th one, and the copies' gaps: the time between one copy's end and the
    next one's, beyond a copy's own ``copy_ms``. Returns the summary."""
    torch.cuda.synchronize()
    t0, c0 = time.monotonic(), time.thread_time()
    ts, each = [], []
    for i in range(k):
        a = time.perf_counter()
        ts.append(post(i))
        each.append(time.perf_counter() - a)
    posted, posted_cpu = time.monotonic() - t0, time.thread_time() - c0
    for t in ts:
        t.wait()
    lines = []
    for i, t in enumerate(ts):
        tl = {name: 1e3 * (at - t0) for name, at in t.marks}
        tl["created"] = 1e3 * (t.created - t0)
        lines.append(tl)
    keys = ["created", "asked", "granted", "launched", "copied", "acked"]
    print(f"burst of {k}: posted in {1e3 * posted:.2f} ms; ms from the first post (every 8th write):")
    print("  i  " + "  ".join(f"{k:>8}" for k in keys))
    for i in range(0, k, 8):
        print(f"{i:3d}  " + "  ".join(f"{lines[i].get(key, float('nan')):8.2f}" for key in keys))
    copied = [tl.get("copied", float("nan")) for tl in lines]
    gaps = [max(0.0, copied[i] - copied[i - 1] - copy_ms) for i in range(1, k)]
    each.sort()
    print(f"  each post: median {1e6 * each[k // 2]:.0f} us, p90 {1e6 * each[int(0.9 * k)]:.0f} us, max "
          f"{1e6 * each[-1]:.0f} us; the posting thread ran {1e3 * posted_cpu:.2f} ms of CPU in the {1e3 * posted:.2f} ms "
          f"(the rest: waiting, e.g. for the GIL)")
    out = {"posted_ms": 1e3 * posted, "posted_cpu_ms": 1e3 * posted_cpu, "post_median_us": 1e6 * each[k // 2],
           "first_launch_ms": lines[0].get("launched"), "last_copied_ms": copied[-1],
           "gaps_over_copy_ms": sum(gaps), "largest_gap_ms": max(gaps)}
    print("  " + ", ".join(f"{key} {v:.2f}" for key, v in out.items()))
    return out


def _profile_writes(write, prep, grant, n: int = 40) -> None:
    """cProfile of ``n`` granted writes' ``write(token)`` calls alone, each waited for outside it."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(n):
        torch.cuda.synchronize()
        prep()
        token = grant()
        prof.enable()
        t = write(token)
        prof.disable()
        t.wait()
    print(f"where {n} granted write() calls spend their time (the launch runs in them):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


class _Rows(list):
    """The table's rows; each one also goes to stderr as it is measured, with the seconds since the
    bench started, so that a run stopped part way (a time limit) shows how far it came."""

    def __init__(self) -> None:
        super().__init__()
        self.t0 = time.monotonic()

    def say(self, what: str) -> None:
        print(f"[ipc_bench +{time.monotonic() - self.t0:6.1f} s] {what}", file=sys.stderr, flush=True)

    def append(self, row: dict) -> None:
        super().append(row)
        self.say(f"{row['name']}: {row['ms']:.3f} ms")

    def __iadd__(self, rows):
        for row in rows:
            self.append(row)
        return self


def main(argv=None) -> dict:
    from xfer import Agent, AgentConfig, LayoutKind, make_kv_cache
    from xfer.bench.target import Target, block_digests

    p = argparse.ArgumentParser(prog="xfer-ipc-bench")
    p.add_argument("--out", default=None)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--lone-iters", type=int, default=None,
                   help="timed iterations of the lone write and read rows (default: --iters); each row's median "
                        "then covers a longer stretch of requests one after another, as a serving process runs them")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--peer-device", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="print where copy_blocks spends its host time")
    p.add_argument("--no-copy-paths", action="store_true", help="skip the kernel vs copy-engine comparison")
    p.add_argument("--copy-sizes", default="512,4096,32768", help="slice sizes of the copy-path comparison")
    p.add_argument("--copy-iters", type=int, default=10)
    p.add_argument("--copy-budget-s", type=float, default=0.4, help="time budget of one copy-path measurement")
    p.add_argument("--peer-ceiling", action="store_true",
                   help="after the xfer rows, time cudaMemcpyPeerAsync of the same bytes, device <-> peer device")
    p.add_argument("--pull-burst", action="store_true", help="also time 8 and 128 reads (pulls) back to back")
    p.add_argument("--window", type=int, default=0,
                   help="back to back: at most this many requests in flight (8: one per block set; 0, the default: "
                        "a whole burst at once, which the grants allow: one initiator's overlapping writes are its "
                        "own order to keep)")
    p.add_argument("--ask-inline", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                   help="a lone write's grant request sent by the posting thread (XFER_ASK_INLINE; auto, the "
                        "default: the library's, on for ipc; a bare --ask-inline: on)")
    p.add_argument("--notice-early", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                   help="a lone write's notice sent at its copy's launch, naming a landing slot (XFER_NOTICE_EARLY; "
                        "auto, the default: the library's, on for ipc; a bare --notice-early: on)")
    p.add_argument("--ahead", action="store_true",
                   help="also time one request under a grant the target issued ahead (Agent.grant; the token "
                        "passed over the bench's pipe before the clock starts), beside the same write after the "
                        "same pipe exchange without one")
    p.add_argument("--burst-timeline", action="store_true",
                   help="after the 128 burst, one more with every transfer's phases (asked, granted, launched, "
                        "copied, acked) from the first post, and the stream's idle time between copies")
    p.add_argument("--no-stage-ids", action="store_true",
                   help="upload a copy's block ids at its launch, after the grant, not while the grant request "
                        "travels (XFER_STAGE_IDS=0: the launch as before issue 32)")
    p.add_argument("--switch-interval-ms", type=float, default=0.0,
                   help="experiment: this process's GIL switch interval (sys.setswitchinterval; Python's default 5 ms)")
    p.add_argument("--ramp", type=int, default=0,
                   help="experiment: the first grant request of a burst asks for this many WRITEs (0: the library's)")
    args = p.parse_args(argv)
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if args.ramp:
        from xfer.transports.onesided import transport as onesided

        onesided.RAMP_FIRST = args.ramp
    # the settings (XFER_ASK_INLINE, XFER_NOTICE_EARLY, XFER_STAGE_IDS) every agent of this run reads, the
    # target's included
    for var, choice in (("XFER_ASK_INLINE", args.ask_inline), ("XFER_NOTICE_EARLY", args.notice_early)):
        if choice == "auto":
            os.environ.pop(var, None)
        else:
            os.environ[var] = "1" if choice == "on" else "0"
    os.environ["XFER_STAGE_IDS"] = "0" if args.no_stage_ids else "1"
    kind = LayoutKind.VLLM_FLASH_ATTN_NHD.value
    dims = dict(num_layers=64, num_blocks=256, block_size=16, num_heads=8, head_dim=128)
    dev = f"cuda:{args.device}"
    torch.cuda.set_device(args.device)
    # both caches hold 8 requests' worth of blocks: in a stream, request i moves its own blocks
    # (the i-th of 8 sets) into its own free blocks, as engines place them
    cache = {**dims, "num_blocks": 8 * 128}
    rows = _Rows()
    target = Target(kind, cache, f"cuda:{args.peer_device}")
    rows.say("target started")
    try:
        tensors, layout = make_kv_cache(kind, device=dev, **cache)
        gen = torch.Generator(device=dev).manual_seed(0)
        for t in tensors:
            t.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8,
                                                             device=dev, generator=gen))
        src = np.arange(0, 256, 2)
        dst = np.arange(128, 256)[::-1].copy()
        nbytes = len(src) * layout.bytes_per_block
        with Agent("bench-prefill", AgentConfig(transport="ipc")) as agent:
            agent.register("kv", tensors, layout)
            peer = agent.connect(target.metadata)
            route = agent.route(peer)
            first = agent.write(peer, src, dst)
            first.wait()
            transfer_path = first.path
            digests, clean = target.call("check", dst.tolist())
            verified = clean and digests == block_digests(layout, tensors, src)
            if not verified:
                raise SystemExit("ipc bench: destination bytes differ from the source; refusing to time")
            rows.say("first write verified")
            a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            b = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            ceil_ms, _ = median_ms(lambda: b.copy_(a), args.iters)
            rows.append({"name": "contiguous device copy (ceiling)", "ms": ceil_ms, "p99_ms": ceil_ms})

            from xfer.kernels import copy_blocks

            local2, _ = make_kv_cache(kind, device=dev, **cache)
            ms, p99 = median_ms(lambda: copy_blocks(layout, tensors, src, layout, local2, dst), args.iters)
            rows.append({"name": "copy_blocks in one process (the kernel + its host call)", "ms": ms, "p99_ms": p99})
            t0 = time.perf_counter()
            for _ in range(args.iters):
                copy_blocks(layout, tensors, src, layout, local2, dst)
            host_us = 1e6 * (time.perf_counter() - t0) / args.iters
            torch.cuda.synchronize()
            print(f"copy_blocks host time per call (queued back to back): {host_us:.0f} us")
            if args.profile:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                for _ in range(50):
                    copy_blocks(layout, tensors, src, layout, local2, dst)
                prof.disable()
                torch.cuda.synchronize()
                pstats.Stats(prof).sort_stats("tottime").print_stats(14)
            del local2
            timelines, calls = [], {}

            def one():
                t0 = time.monotonic()
                t = agent.write(peer, src, dst)
                calls[t.id] = t0
                t.wait()
                timelines.append(t.timeline())

            srcs = [np.arange(128 * j, 128 * (j + 1)) for j in range(8)]
            sets = [s[::-1].copy() for s in srcs]

            def burst(k=8):  # request i moves the i-th of 8 block sets into the i-th free set, in turn
                windowed(lambda i: agent.write(peer, srcs[i % 8], sets[i % 8]), k, args.window)

            burst(16)  # verified once before it is timed: every set holds its source blocks
            got = [target.call("check", d.tolist()) for d in sets]
            if any(digest != block_digests(layout, tensors, s) for (digest, _), s in zip(got, srcs)):
                raise SystemExit("ipc bench: a back-to-back burst left bytes that differ from the source")

            read_tls = []

            def pull():
                t = agent.read(peer, dst, src)
                t.wait()
                read_tls.append(t.timeline())

            target.call("drain")
            lone_iters = args.lone_iters or args.iters
            ms, p99 = median_ms(one, lone_iters)
            rows.append({"name": "xfer write, one request end to end", "ms": ms, "p99_ms": p99})
            # the measure: call -> bytes in the decode blocks -> notification delivered there
            # (time.monotonic is one clock for the host's processes); the ack comes back after it
            arrived = target.call("received")
            delivered = sorted(1e3 * (arrived[i] - t0) for i, t0 in calls.items() if i in arrived)
            if delivered:
                rows.append({"name": "xfer write, one request, call to notification delivered",
                             "ms": statistics.median(delivered), "p99_ms": delivered[int(0.99 * (len(delivered) - 1))]})
            phases = {k: 1e3 * statistics.median(tl.get(k, float("nan")) for tl in timelines)
                      for k in timelines[-1]}
            rtt = [tl["granted"] - tl["asked"] for tl in timelines if "asked" in tl and "granted" in tl]
            if rtt:  # the grant's round trip, from its request leaving to its reply taken (issue 32)
                phases["grant round trip (asked to granted)"] = 1e3 * statistics.median(rtt)
            ahead_phases = {}
            if args.ahead:  # each write under a grant the target issued before it (xfer.ahead), untimed;
                # beside the same write after the same pipe exchange with the target, without a grant
                target.call("connect", agent.metadata())
                tokens = []
                for name, prep, grant in (("xfer write, one request, after a pipe exchange (no grant ahead)",
                                           lambda: target.call("ping"), lambda: None),
                                          ("xfer write granted ahead, one request end to end",
                                           lambda: tokens.append(target.call("grant", (agent.name, dst.tolist()))),
                                           lambda: tokens.pop())):
                    times, tls, posts, waits, syncs = [], [], [], [], []
                    for k in range(args.iters + 3):
                        torch.cuda.synchronize()
                        prep()
                        token = grant()
                        t0 = time.perf_counter()
                        t = agent.write(peer, src, dst, grant=token)
                        posted = time.perf_counter()
                        t.wait()
                        waited = time.perf_counter()
                        torch.cuda.synchronize()
                        if k >= 3:
                            end = time.perf_counter()
                            times.append(1e3 * (end - t0))
                            posts.append(1e3 * (posted - t0))
                            waits.append(1e3 * (waited - t0))
                            syncs.append(1e3 * (end - waited))
                            tls.append(t.timeline())
                    rows.append({"name": name, "ms": statistics.median(times), "p99_ms": float(np.percentile(times, 99))})
                    if "granted ahead" in name:
                        ahead_phases = {k: 1e3 * statistics.median(tl.get(k, float("nan")) for tl in tls)
                                        for k in tls[-1]}
                        ahead_phases["write() returned"] = statistics.median(posts)
                        ahead_phases["wait() returned"] = statistics.median(waits)
                        ahead_phases["then the device synchronised (ms after wait())"] = statistics.median(syncs)
                        if args.profile:  # where the posting thread's time goes (the launch runs in it)
                            _profile_writes(lambda tok: agent.write(peer, src, dst, grant=tok), prep, grant)
                target.call("drain")
            ms, p99 = median_ms(burst, max(3, args.iters // 4))
            rows.append({"name": "xfer write, 8 back to back (per request)", "ms": ms / 8, "p99_ms": p99 / 8})
            # a longer stream: the first request's latency (~3 copies' worth) weighs 1/32, not 1/8
            ms, p99 = median_ms(lambda: burst(32), max(3, args.iters // 6))
            rows.append({"name": "xfer write, 32 back to back (per request)", "ms": ms / 32, "p99_ms": p99 / 32})
            ms, p99 = median_ms(lambda: burst(128), max(3, args.iters // 10))
            rows.append({"name": "xfer write, 128 back to back (per request)", "ms": ms / 128, "p99_ms": p99 / 128})
            if args.burst_timeline:  # where a burst's time goes: each transfer's phases from the first post
                burst_phases = _burst_timeline(lambda i: agent.write(peer, srcs[i % 8], sets[i % 8]), 128,
                                               rows[0]["ms"])
            ms, p99 = median_ms(pull, lone_iters)
            rows.append({"name": "xfer read (pull), one request", "ms": ms, "p99_ms": p99})
            read_phases = {k: 1e3 * statistics.median(tl.get(k, float("nan")) for tl in read_tls[-lone_iters:])
                           for k in read_tls[-1]}
            target.call("drain")
            if args.pull_burst:
                rows += pull_bursts(agent, peer, target, layout, tensors, srcs, sets, args.iters, args.window)
            lat_ms, lat_p99 = median_ms(lambda: agent.write(peer, [5], [7]).wait(), args.iters)
            post = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                t = agent.write(peer, src, dst)
                post.append(1e6 * (time.perf_counter() - t0))
                t.wait()
            target.call("drain")
    finally:
        rows.say("closing the target")
        target.close()
        rows.say("target closed")
    for r in rows:
        r["gb_per_s"] = nbytes / (r["ms"] * 1e-3) / 1e9
        r["ratio_to_ceiling"] = ceil_ms / r["ms"]
    ceiling = None
    if args.peer_ceiling:
        from xfer.bench.peer_copy import add_peer_ratios, peer_ceiling

        ceiling = peer_ceiling(args.device, args.peer_device, nbytes, args.iters)
        add_peer_ratios(rows, ceiling)
    from xfer.kernels.copy import native_launch  # (imports triton)

    res = {
        "bench": "ipc", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(args.device), "peer_device": args.peer_device,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
        "native_launch": native_launch(torch.device("cuda", args.device)),
        "workload": {**dims, "cache_blocks": cache["num_blocks"], "layout": kind, "blocks_moved": len(src),
                     "slice_bytes": layout.block_nbytes, "payload_bytes": nbytes, "slices": len(src) * layout.num_slots},
        "route": str(route), "transfer_path": transfer_path, "verified": verified, "rows": rows,
        "one_block_request": {"slices": layout.num_slots, "bytes": layout.bytes_per_block,
                              "p50_ms": lat_ms, "p99_ms": lat_p99},
        "post_us_median": statistics.median(post),
        "switches": {"ask_inline": args.ask_inline, "stage_ids": not args.no_stage_ids,
                     "switch_interval_ms": args.switch_interval_ms or 5.0, "ramp": args.ramp or None,
                     "notice_early": args.notice_early, "lone_iters": args.lone_iters or args.iters},
        "write_timeline_ms": phases,
        "read_timeline_ms": read_phases,
        **({"ahead_write_timeline_ms": ahead_phases} if args.ahead else {}),
        **({"burst_timeline": burst_phases} if args.burst_timeline else {}),
        **({"peer_ceiling": ceiling} if ceiling is not None else {}),
    }
    print(f"ipc bench on {res['device']}: {res['workload']['slices']} slices, {nbytes / 2**20:.0f} MiB, route {route}")
    print(f"{'what':<44}{'ms':>9}{'p99 ms':>9}{'GB/s':>9}{'x ceiling':>11}")
    for r in rows:
        print(f"{r['name']:<44}{r['ms']:>9.3f}{r['p99_ms']:>9.3f}{r['gb_per_s']:>9.0f}{r['ratio_to_ceiling']:>11.3f}")
    print(f"1-block request across all layers ({layout.num_slots} slices): p50 {lat_ms:.3f} ms, p99 {lat_p99:.3f} ms")
    print(f"host time to post the 16,384-slice write: {res['post_us_median']:.0f} us (median)")
    print("one write, median ms from the call to each phase: "
          + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    if args.ahead:
        print("one write granted ahead, median ms from the call to each phase: "
              + ", ".join(f"{k} {v:.3f}" for k, v in ahead_phases.items()))
    print("one read, median ms from its creation to each phase: "
          + ", ".join(f"{k} {v:.3f}" for k, v in read_phases.items()))
    print(f"path of the verified write: {transfer_path}")
    if ceiling is not None:
        print(f"peer ceiling (peer access {ceiling.get('peer_access')}): " + ("; ".join(
            f"{r['name']} {r['ms']:.3f} ms {r['gb_per_s']:.0f} GB/s" for r in ceiling.get("rows", []))
            or ceiling.get("error", "")))
        print("x peer ceiling: " + ", ".join(f"{r['name']} {r['ratio_to_peer_ceiling']:.3f}"
                                             for r in rows if "ratio_to_peer_ceiling" in r))
    if not args.no_copy_paths:
        if args.out:  # what ran so far survives a crash below
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
        res["copy_paths"] = copy_paths_section(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
