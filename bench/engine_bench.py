"""Engine benchmark: what layer-wise KV streaming adds to TTFT for one long prompt.

This process is a prefill instance; a decode instance runs in a child process (same GPU: the
``ipc`` transport; CPU: shared memory), wired through the metadata store exactly as the router
wires them. First correctness: the decode instance's greedy tokens must equal single-process
``model.generate`` on the same random model. Then timing, warm-up discarded, device synced by
``.item()`` before each clock read:

- TTFT without transfer: the prefill forward alone on the paged cache (the first token known);
- TTFT with transfer: forward + every layer's KV landed in the decode blocks + the first token
  delivered to the decode agent (each layer posted the moment it was computed);
- added = with - without, and its share of TTFT with transfer.

    python -m xfer.bench.engine_bench --model 8b --prompt 4096 --device cuda --out bench/results/$(date +%F)-h200-engine.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch


def _round(router, inst, inbox, req, stream: bool = True):
    """One request through decode admission -> prefill (this process) -> decode; the PrefillResult."""
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="8b", help="a preset of xfer.engine.config.PRESETS")
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--new", type=int, default=16, help="tokens generated in the correctness check")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)

    from xfer.engine.block_manager import blocks_for
    from xfer.engine.config import PRESETS, PoolSpec
    from xfer.engine.model import hf_generate
    from xfer.engine.prefill import PrefillInstance
    from xfer.engine.protocol import Inbox, Request
    from xfer.engine.router import Router

    spec = PRESETS[args.model]
    nblk = blocks_for(args.prompt + args.new, args.block_size)
    pool = PoolSpec(num_blocks=nblk + 4, block_size=args.block_size, device=args.device)
    t0 = time.time()
    with Router(spec, num_prefill=0, num_decode=1, decode_pool=pool.with_blocks(2 * nblk + 4),
                start_timeout_s=600) as router:
        inst = PrefillInstance("prefill-0", spec, pool, lease_s=60)
        inst.agent.publish(router.store)
        inbox = Inbox(router.store.endpoint, "prefill-0")
        print(f"setup {time.time() - t0:.1f} s: {args.model} ({spec.num_layers} layers), prompt {args.prompt}, "
              f"{args.device}, KV {spec.kv_bytes_per_token() * args.prompt / 2**20:.1f} MiB "
              f"({spec.kv_bytes_per_token() * args.prompt / spec.num_layers / 2**20:.2f} MiB per layer)", flush=True)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, spec.vocab_size, (args.prompt,), generator=gen).tolist()

        # ---- correctness first, for both ways of sending the first token ------------------------
        variants = {"token on last layer": True, "token message": False}
        ref = hf_generate(inst.model, prompt, args.new)
        checks = {}
        for name, hold in variants.items():
            inst.hold_last = hold
            _, out = _round(router, inst, inbox, Request(f"check-{int(hold)}", prompt, args.new))
            checks[name] = out["tokens"] == ref
            got = out["tokens"]
            print(f"correctness ({name}): decode tokens {'==' if checks[name] else '!='} single-process HF generate "
                  f"({args.new} tokens)" + ("" if checks[name] else f": {got} vs {ref}"), flush=True)
        same = all(checks.values())
        route = str(inst.agent.route("decode-0", region="kv.0"))

        # ---- timing: the forward alone, then streamed with the token riding on the held last
        # layer ("token on last layer") or sent at once as its own message ("token message") -----
        alone, streamed, decode_ttft, xfers = [], {v: [] for v in variants}, {v: [] for v in variants}, {}
        for i in range(args.iters + 1):
            r = inst.prefill(f"alone{i}", prompt, "decode-0", [], stream=False)
            inst.release(r.req)
            if i:
                alone.append(r.t_forward - r.t_start)
            for name, hold in variants.items():
                inst.hold_last = hold
                res, out = _round(router, inst, inbox, Request(f"timed{i}-{int(hold)}", prompt, 2))
                if i == 0:
                    continue  # warm-up (kernel compilation, first mappings)
                streamed[name].append(res.t_landed - res.t_start)
                decode_ttft[name].append(out["ready"] - out["arrival"])
                # where the added time goes: each write's post time after the forward ended
                # (negative: hidden behind it) and its duration (post -> decode agent's ack)
                offset = time.time() - time.monotonic()
                xfers[name] = [(t.created + offset - res.t_forward, t.elapsed) for t in inst.last_streamer.transfers]
        inbox.close()
        inst.close()

    a = statistics.median(alone)
    print(f"\n{'variant':>20} {'prompt':>7} {'TTFT no xfer':>13} {'TTFT w/ xfer':>13} {'added':>9} {'share':>7} "
          f"{'decode TTFT':>12}")
    rows = {}
    for name in variants:
        s_ = statistics.median(streamed[name])
        rows[name] = {"ttft_no_transfer_ms": 1e3 * a, "ttft_with_transfer_ms": 1e3 * s_, "added_ms": 1e3 * (s_ - a),
                      "transfer_share_pct": 100 * (s_ - a) / s_,
                      "decode_side_ttft_ms": 1e3 * statistics.median(decode_ttft[name]),
                      "with_transfer_runs_ms": [1e3 * x for x in streamed[name]],
                      "last_round_writes_ms": [{"posted_after_forward": 1e3 * p, "duration": 1e3 * d}
                                               for p, d in xfers[name]]}
        r_ = rows[name]
        print(f"{name:>20} {args.prompt:>7} {r_['ttft_no_transfer_ms']:>10.2f} ms "
              f"{r_['ttft_with_transfer_ms']:>10.2f} ms {r_['added_ms']:>6.2f} ms {r_['transfer_share_pct']:>6.2f}% "
              f"{r_['decode_side_ttft_ms']:>9.2f} ms")
    for name in variants:
        print(f"{name}: last round, last writes, post after forward end / duration (ms): " + ", ".join(
            f"{1e3 * p:+.2f}/{1e3 * d:.2f}" for p, d in xfers[name][-3:]))
    print(f"route: {route}; {args.iters} timed runs each, medians; correctness {'ok' if same else 'FAILED'}")
    result = {"args": vars(args), "correct": same, "correct_by_variant": checks, "route": route, "variants": rows,
              "no_transfer_runs_ms": [1e3 * x for x in alone],
              "env": {"python": platform.python_version(), "torch": torch.__version__,
                      "device": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                                 else platform.processor()),
                      "transformers": __import__("transformers").__version__}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
