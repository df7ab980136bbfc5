"""Demo: N prefill + M decode instances (one process each) on a synthetic request stream.

    python -m xfer.engine --prefill 2 --decode 2 --requests 16 --rate 8
    python -m xfer.engine --rates 4,8,16 --decode-blocks 24 --swap-blocks 64   # swap cost vs rate
    python -m xfer.engine --prefill 1 --prefill-tp 2 --decode 1 --check        # TP-sharded prefill ranks

Prints TTFT, TPOT and the KV-transfer share of TTFT (p50 / p99), and with --check verifies every
request's tokens against single-process ``model.generate``. ``--out FILE.json`` keeps the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

# the router and workers poll the store with short waits; c10d logs each expiry as a warning
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from .config import PRESETS, PoolSpec, WaitMode
from .metrics import summarize
from .protocol import Request


def _requests(n: int, vocab: int, prompt: tuple[int, int], max_new: int, seed: int, tag: str) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"{tag}-{i}", [rng.randrange(vocab) for _ in range(rng.randint(*prompt))], max_new)
            for i in range(n)]


def _check(spec, reqs: list[Request], results: list[dict], out) -> int:
    from .model import build_model, hf_generate

    model = build_model(spec)
    bad = [r.id for r, x in zip(reqs, results, strict=True)
           if x["tokens"] != hf_generate(model, r.prompt, r.max_new_tokens)]
    print(f"check: {len(reqs) - len(bad)}/{len(reqs)} requests equal single-process HF generate"
          + (f"; differ: {bad}" if bad else ""), file=out, flush=True)
    return len(bad)


def _row(label: str, s: dict) -> str:
    return (f"{label:>10} {s['requests']:>4} {1e3 * s['ttft_s_p50']:>9.1f} {1e3 * s['ttft_s_p99']:>9.1f} "
            f"{1e3 * s['tpot_s_p50']:>8.2f} {1e3 * s['transfer_s_p50']:>9.2f} {100 * s['transfer_share_p50']:>7.1f}% "
            f"{s['swaps']:>5} {s.get('swap_s', 0.0):>7.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xfer.engine", description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prefill", type=int, default=2, help="prefill instances (processes)")
    ap.add_argument("--decode", type=int, default=2, help="decode instances (processes)")
    ap.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel rank processes per prefill instance")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    ap.add_argument("--rates", default="", help="comma-separated rates: one run each (swap cost vs rate)")
    ap.add_argument("--prompt", default="16,96", help="prompt length range MIN,MAX")
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefill-blocks", type=int, default=128)
    ap.add_argument("--decode-blocks", type=int, default=128)
    ap.add_argument("--swap-blocks", type=int, default=0, help="host blocks per decode instance (0: no swap)")
    ap.add_argument("--wait", choices=[w.value for w in WaitMode], default="request")
    ap.add_argument("--check", action="store_true", help="verify tokens against single-process HF generate")
    ap.add_argument("--out", help="write the summary as JSON here")
    args = ap.parse_args(argv)
    from xfer._stdio import own_stdout

    # stdout carries the table alone: what libraries print there (Gloo's "[Gloo] Rank 1 is
    # connected to 1 peer ranks" in the TP ranks' processes) goes to stderr
    with own_stdout() as out:
        return _run(args, out)


def _run(args, out) -> int:
    from .router import Router

    if args.device == "cpu":
        import torch

        torch.set_num_threads(1)  # the --check reference: tiny matmuls only lose from a second thread

    spec = PRESETS[args.model]
    lo, hi = (int(x) for x in args.prompt.split(","))
    pool = dict(block_size=args.block_size, device=args.device)
    rates = [float(x) for x in args.rates.split(",") if x] or [args.rate]
    print(f"model {args.model} ({spec.num_layers} layers, {spec.num_kv_heads} kv heads), {args.prefill} prefill "
          f"(x{args.prefill_tp} TP ranks) + "
          f"{args.decode} decode instances, prompts {lo}-{hi} tokens, {args.max_new} new tokens each", file=out)
    print(f"{'rate/s':>10} {'reqs':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT ms':>8} {'xfer ms':>9} "
          f"{'xfer %':>8} {'swaps':>5} {'swap s':>7}", file=out, flush=True)
    report, failures = {"args": vars(args), "runs": []}, 0
    with Router(spec, num_prefill=args.prefill, num_decode=args.decode, wait=WaitMode(args.wait), prefill_tp=args.prefill_tp,
                prefill_pool=PoolSpec(num_blocks=args.prefill_blocks, **pool),
                decode_pool=PoolSpec(num_blocks=args.decode_blocks, **pool), swap_blocks=args.swap_blocks) as router:
        for i, rate in enumerate(rates):
            reqs = _requests(args.requests, spec.vocab_size, (lo, hi), args.max_new, seed=i, tag=f"run{i}")
            t0 = time.time()
            results = router.run(reqs, rate=rate)
            summary = {"rate": rate, "wall_s": time.time() - t0, **summarize(results)}
            report["runs"].append(summary)
            print(_row(f"{rate:g}", summary), file=out, flush=True)
            if args.check:
                failures += _check(spec, reqs, results, out)
        router.close()
        report["swap_stats"] = router.stats()
    print("per decode instance, whole session: " + ", ".join(
        f"{n}: {s.get('swaps', 0)} swaps, {s.get('swap_seconds', 0.0):.3f} s, {s.get('decode_steps', 0)} decode steps "
        f"of {s.get('mean_batch', 0.0):.1f} requests on average (max {s.get('max_batch', 0)})"
        for n, s in report["swap_stats"].items()), file=out)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
