"""Engine benchmark: what layer-wise KV streaming adds to TTFT for one long prompt, and what swap
costs as the request rate rises.

``--mode ttft`` (default). This process is a prefill instance; a decode instance runs in a child
process (same GPU: the ``ipc`` transport; CPU: shared memory), wired through the metadata store
exactly as the router wires them. First correctness: for each way of sending the first token,
twice, the decode instance's greedy tokens must equal single-process ``model.generate`` on the
same random model (on a mismatch the reference's top-2 logit gap at that step is reported: a gap
within bf16 rounding is a near-tie, not a transfer bug). Then timing, warm-up discarded, device
synced by ``.item()`` before each clock read. One iteration runs, in an order rotated every
iteration (so drift and periodic noise fall on all of them alike):

- ``alone``: the prefill forward alone on the paged cache (the first token known): TTFT without transfer;
- one streamed run per variant: forward + every layer's KV landed in the decode blocks + the first
  token delivered to the decode agent (each layer posted the moment it was computed).

Per variant: ``added`` = streamed - alone *of the same iteration* (paired), reported as median,
quartiles and range over iterations, and as a share of the median TTFT without transfer; it splits
into ``tail`` (forward end -> all landed, measured inside one run: the transfer not hidden behind
the forward, low noise) and ``forward slowdown`` (the streamed run's forward vs the alone one).

``--decode-device cuda:M`` puts the decode instance on another GPU than this prefill process's
``--device``: the transfer then crosses GPUs (``ipc`` over NVLink where they are peers); the
correctness check is unchanged (the decode process builds the same weights on its GPU).

``--mode swap``: a router with 1 prefill + 1 decode process, a decode pool too small for the load
and host swap space, run at each of ``--swap-rates``: TTFT, TPOT, swaps and swap seconds per rate,
each run bounded by ``--swap-timeout``.

    python -m xfer.bench.engine_bench --model 8b --prompt 4096 --device cuda --out bench/results/$(date +%F)-h200-engine.json
    python -m xfer.bench.engine_bench --mode swap --device cuda --out bench/results/$(date +%F)-h200-engine-swap.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

VARIANTS = {"token on last layer": True, "token message": False}  # name -> PrefillInstance.hold_last


def _round(router, inst, inbox, req):
    """One request through decode admission -> prefill (this process) -> decode; (PrefillResult, result)."""
    from xfer.engine.protocol import send

    send(router.store, "decode-0", {"type": "request", "id": req.id, "prompt": req.prompt,
                                    "max_new_tokens": req.max_new_tokens, "arrival": time.time(),
                                    "prefill": inst.name, "extra": {}})
    while (msg := inbox.get(timeout=1.0)) is None or msg["type"] != "prefill":
        router.check_alive()
    if msg["decode"] not in inst.agent.peers:
        inst.agent.connect_by_name(router.store, msg["decode"])
    res = inst.prefill(req.id, req.prompt, msg["decode"], msg["blocks"])
    inst.release(req.id)
    return res, router.result(req.id, timeout=300)


def _stats(xs: list[float]) -> dict:
    """Median, quartiles and range of ``xs`` (milliseconds in, milliseconds out)."""
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "min": min(xs), "max": max(xs), "n": len(xs)}


def ttft(args) -> dict:
    from xfer.engine.block_manager import blocks_for
    from xfer.engine.config import PRESETS, PoolSpec
    from xfer.engine.model import hf_generate_margins
    from xfer.engine.prefill import PrefillInstance
    from xfer.engine.protocol import Inbox, Request
    from xfer.engine.router import Router

    spec = PRESETS[args.model]
    nblk = blocks_for(args.prompt + args.new, args.block_size)
    pool = PoolSpec(num_blocks=nblk + 4, block_size=args.block_size, device=args.device)
    decode_pool = PoolSpec(num_blocks=2 * nblk + 4, block_size=args.block_size, device=args.decode_device or args.device)
    t0 = time.time()
    with Router(spec, num_prefill=0, num_decode=1, decode_pool=decode_pool, start_timeout_s=600) as router:
        inst = PrefillInstance("prefill-0", spec, pool, lease_s=60)
        inst.agent.publish(router.store)
        inbox = Inbox(router.store.endpoint, "prefill-0")
        kv = spec.kv_bytes_per_token() * args.prompt
        print(f"setup {time.time() - t0:.1f} s: {args.model} ({spec.num_layers} layers), prompt {args.prompt}, "
              f"prefill {args.device}, decode {decode_pool.device}, KV {kv / 2**20:.1f} MiB ({kv / spec.num_layers / 2**20:.2f} MiB per layer)", flush=True)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, spec.vocab_size, (args.prompt,), generator=gen).tolist()

        # ---- correctness first: each variant twice ----------------------------------------------
        ref, margins = hf_generate_margins(inst.model, prompt, args.new)
        checks = {}
        for name, hold in VARIANTS.items():
            inst.hold_last = hold
            runs = []
            for k in range(2):
                _, out = _round(router, inst, inbox, Request(f"check-{int(hold)}-{k}", prompt, args.new))
                got = out["tokens"]
                first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
                runs.append({"equal": got == ref, "tokens": got, "first_difference": first,
                             "reference_margin_there": None if first is None else margins[first]})
            checks[name] = {"equal": all(r["equal"] for r in runs), "runs": runs}
            bad = [r for r in runs if not r["equal"]]
            print(f"correctness ({name}): {2 - len(bad)}/2 runs' decode tokens == single-process HF generate "
                  f"({args.new} tokens)" + "".join(
                      f"; a run differs from token {r['first_difference']} on, where HF's top-2 logit gap is "
                      f"{r['reference_margin_there']:.4g}" for r in bad), flush=True)
        same = all(c["equal"] for c in checks.values())
        route = str(inst.agent.route("decode-0", region="kv.0"))

        # ---- timing, interleaved -------------------------------------------------------------------
        names = ["alone", *VARIANTS]
        runs = {n: [] for n in names}  # per iteration: (ttft, forward, tail) in seconds
        decode_ttft = {v: [] for v in VARIANTS}
        writes = {}
        for i in range(args.warmup + args.iters):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                if name == "alone":
                    r = inst.prefill(f"alone{i}", prompt, "decode-0", [], stream=False)
                    inst.release(r.req)
                else:
                    inst.hold_last = VARIANTS[name]
                    r, out = _round(router, inst, inbox, Request(f"timed{i}-{name[6]}", prompt, 2))
                if i < args.warmup:
                    continue  # warm-up (kernel selection, first mappings, caching allocators)
                runs[name].append((r.t_landed - r.t_start, r.t_forward - r.t_start, r.t_landed - r.t_forward))
                if name != "alone":
                    decode_ttft[name].append(out["ready"] - out["arrival"])
                    offset = time.time() - time.monotonic()
                    writes[name] = [(t.created + offset - r.t_forward, t.elapsed) for t in inst.last_streamer.transfers]
        inbox.close()
        inst.close()

    alone = [x[0] for x in runs["alone"]]
    base = statistics.median(alone)
    print(f"\n{args.iters} interleaved iterations; TTFT without transfer: median {1e3 * base:.2f} ms "
          f"(range {1e3 * min(alone):.2f}-{1e3 * max(alone):.2f})")
    print(f"{'variant':>20} {'TTFT w/ xfer':>13} {'added med':>10} {'[p25, p75]':>17} {'share':>7} "
          f"{'tail med':>9} {'fwd slowdown':>13}")
    rows = {}
    for name in VARIANTS:
        streamed = runs[name]
        added = [1e3 * (s[0] - a[0]) for s, a in zip(streamed, runs["alone"], strict=True)]
        slowdown = [1e3 * (s[1] - a[1]) for s, a in zip(streamed, runs["alone"], strict=True)]
        tail = [1e3 * s[2] for s in streamed]
        st = _stats(added)
        rows[name] = {
            "ttft_no_transfer_ms": 1e3 * base, "ttft_with_transfer_ms": 1e3 * statistics.median(s[0] for s in streamed),
            "added_ms": st, "transfer_share_pct": 100 * st["median"] / (1e3 * base),
            "transfer_share_pct_p25_p75": [100 * st["p25"] / (1e3 * base), 100 * st["p75"] / (1e3 * base)],
            "tail_ms": _stats(tail), "forward_slowdown_ms": _stats(slowdown),
            "decode_side_ttft_ms": 1e3 * statistics.median(decode_ttft[name]),
            "with_transfer_runs_ms": [1e3 * s[0] for s in streamed],
            "last_round_writes_ms": [{"posted_after_forward": 1e3 * p, "duration": 1e3 * d} for p, d in writes[name]]}
        r_ = rows[name]
        print(f"{name:>20} {r_['ttft_with_transfer_ms']:>10.2f} ms {st['median']:>7.2f} ms "
              f"[{st['p25']:>6.2f}, {st['p75']:>6.2f}] {r_['transfer_share_pct']:>6.2f}% "
              f"{r_['tail_ms']['median']:>6.2f} ms {r_['forward_slowdown_ms']['median']:>10.2f} ms")
    for name in VARIANTS:
        print(f"{name}: last round, last writes, post after forward end / duration (ms): " + ", ".join(
            f"{1e3 * p:+.2f}/{1e3 * d:.2f}" for p, d in writes[name][-3:]))
    print(f"route: {route}; correctness {'ok' if same else 'FAILED'}")
    return {"correct": same, "correct_by_variant": checks, "reference_margins": margins, "route": route,
            "variants": rows, "no_transfer_runs_ms": [1e3 * x for x in alone]}


def swap(args) -> dict:
    """Swap cost vs request rate: one router run per rate, each bounded by ``--swap-timeout``."""
    from xfer.engine.__main__ import _requests
    from xfer.engine.config import PRESETS, PoolSpec
    from xfer.engine.metrics import summarize
    from xfer.engine.router import Router

    spec = PRESETS[args.swap_model]
    lo, hi = (int(x) for x in args.swap_prompt.split(","))
    pool = dict(block_size=args.block_size, device=args.device)
    rates = [float(x) for x in args.swap_rates.split(",") if x]
    out, t0 = {"model": args.swap_model, "runs": []}, time.time()
    print(f"swap: {args.swap_model}, prompts {lo}-{hi}, {args.swap_new} new tokens, {args.swap_requests} requests "
          f"per rate, decode pool {args.swap_decode_blocks} blocks + {args.swap_host_blocks} host blocks", flush=True)
    print(f"{'rate/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT ms':>8} {'swaps':>6} {'swap s':>7} {'wall s':>7}")
    with Router(spec, num_prefill=1, num_decode=1, start_timeout_s=600, swap_blocks=args.swap_host_blocks,
                prefill_pool=PoolSpec(num_blocks=4 * args.swap_decode_blocks, **pool),
                decode_pool=PoolSpec(num_blocks=args.swap_decode_blocks, **pool)) as router:
        print(f"setup {time.time() - t0:.1f} s", flush=True)
        warm = _requests(2, spec.vocab_size, (lo, lo), 2, seed=99, tag="warm")
        router.run(warm, timeout=args.swap_timeout)
        for i, rate in enumerate(rates):
            reqs = _requests(args.swap_requests, spec.vocab_size, (lo, hi), args.swap_new, seed=i, tag=f"swap{i}")
            t = time.time()
            results = router.run(reqs, rate=rate, timeout=args.swap_timeout, total_timeout=args.swap_timeout)
            s = {"rate": rate, "wall_s": time.time() - t, **summarize(results)}
            out["runs"].append(s)
            print(f"{rate:>7g} {1e3 * s['ttft_s_p50']:>6.1f} ms {1e3 * s['ttft_s_p99']:>6.1f} ms "
                  f"{1e3 * s['tpot_s_p50']:>8.2f} {s['swaps']:>6} {s['swap_s']:>7.3f} {s['wall_s']:>7.1f}", flush=True)
        router.close()
        out["decode_stats"] = router.stats()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["ttft", "swap", "all"], default="ttft")
    ap.add_argument("--model", default="8b", help="a preset of xfer.engine.config.PRESETS")
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--new", type=int, default=16, help="tokens generated in the correctness check")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--decode-device", default=None,
                    help="--mode ttft: the decode instance's device (default: --device; cuda:M for another GPU)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=15, help="timed iterations (each: alone + every variant)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--swap-model", default=None, help="preset for --mode swap (default: 1b on cuda, tiny on cpu)")
    ap.add_argument("--swap-rates", default="2,8,32")
    ap.add_argument("--swap-requests", type=int, default=24)
    ap.add_argument("--swap-prompt", default=None, help="MIN,MAX prompt tokens (default: 256,1024 cuda; 16,64 cpu)")
    ap.add_argument("--swap-new", type=int, default=32)
    ap.add_argument("--swap-decode-blocks", type=int, default=None, help="default: 160 cuda, 24 cpu")
    ap.add_argument("--swap-host-blocks", type=int, default=None, help="default: 4x the decode blocks")
    ap.add_argument("--swap-timeout", type=float, default=60.0, help="seconds per rate's run (all its requests)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    gpu = args.device.startswith("cuda")
    if args.decode_device is not None:
        if not (gpu and args.decode_device.startswith("cuda")):
            ap.error(f"--decode-device takes cuda[:M] beside --device cuda[:N], got --device {args.device} "
                     f"--decode-device {args.decode_device}")
        try:
            torch.device(args.decode_device)
        except (RuntimeError, ValueError):
            ap.error(f"--decode-device must be cuda or cuda:M, got {args.decode_device!r}")
    if gpu and torch.device(args.device).index is not None:
        torch.cuda.set_device(torch.device(args.device))  # this process's work (prefill, reference) on that GPU
    if not gpu:
        torch.set_num_threads(1)  # like the instance processes: tiny CPU matmuls only lose from a second thread
    args.swap_model = args.swap_model or ("1b" if gpu else "tiny")
    args.swap_prompt = args.swap_prompt or ("256,1024" if gpu else "16,64")
    args.swap_decode_blocks = args.swap_decode_blocks or (160 if gpu else 24)
    args.swap_host_blocks = args.swap_host_blocks or 4 * args.swap_decode_blocks

    result = {"args": vars(args)}
    ok = True
    if args.mode in ("ttft", "all"):
        result.update(ttft(args))
        ok = result["correct"]
    if args.mode in ("swap", "all"):
        result["swap"] = swap(args)
    result["env"] = {"python": platform.python_version(), "torch": torch.__version__,
                     "device": torch.cuda.get_device_name() if gpu else platform.processor(),
                     "decode_device": args.decode_device or args.device,
                     "decode_device_name": torch.cuda.get_device_name(torch.device(args.decode_device)) if (
                         gpu and args.decode_device) else None,
                     "transformers": __import__("transformers").__version__}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
