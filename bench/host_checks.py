"""Host time of a block copy's checks before any CUDA work, with xfer's C helpers and without, in one
process (issue 32): the block-id checks of both sides (``check_ids``: a list of ints, an int64
array, an int32 array, a CPU tensor), the check that each cache is still the same tensors at the same addresses (``_side``), and
the whole of ``copy_blocks``' work before CUDA (ids, both sides, the overlap check, the path choice).

The seed case's shape on small tensors (only the checks run): 2 x 64 layer tensors a side, 128
ids. Each figure is the best of ``--repeat`` rounds of ``--number`` calls, the two modes alternated.
Runs on a CPU machine (the checks touch no GPU)::

    python -m xfer.bench.host_checks [--out host_checks.json] [--cuda]

``--cuda`` (a GPU host) adds the CUDA half of the same call, piece by piece, with the C launch
(``XFER_NATIVE_LAUNCH``) on and off alternated: the current stream's lookup, the cached pair's
lookup, the ids' upload + the launch + the event (a pair's ``launch``, an event recorded,
``release``), the event alone, and the whole ``copy_blocks`` call (calls queued, host clock only;
the copies are tiny, 16-byte slices, so the GPU never holds the host back), then a cProfile of
``--profile-calls`` whole calls: the functions with the most own time, which says where a call's
host time goes beyond the pieces.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import timeit

import numpy as np
import torch

import xfer.layout as layout_mod
from xfer.kernels import sides
from xfer.kernels._dispatch import _touching
from xfer.kernels.paths import _choose, slice_bytes
from xfer.kernels.reference import check_ids, check_overlap
from xfer.layout import KVLayout
from xfer.native import C


def _cases(layers: int, blocks: int, n: int) -> dict:
    def cache():
        return [torch.zeros(2, 2 * blocks, 1, 1, 8, dtype=torch.float16) for _ in range(layers)]

    a, b = cache(), cache()
    la, lb = KVLayout.vllm_flash_attn(a), KVLayout.vllm_flash_attn(b)
    rng = np.random.default_rng(0)
    s, d = rng.permutation(2 * blocks)[:n], rng.permutation(2 * blocks)[:n]
    sl, dl = s.tolist(), d.tolist()
    s32, d32 = s.astype(np.int32), d.astype(np.int32)
    s_t, d_t = torch.from_numpy(s.copy()), torch.from_numpy(d.copy())

    def before_cuda():
        s_ids, d_ids = check_ids(la, s, lb, d)
        src, dst = sides._side(la, a), sides._side(lb, b)
        check_overlap(la, src.tensors, s_ids, lb, dst.tensors, d_ids, spans=(src.spans, dst.spans),
                      touching=_touching(src, dst))
        _choose(src.where, dst.where, slice_bytes(la, lb), None)

    return {
        "check_ids, int64 arrays": lambda: check_ids(la, s, lb, d),
        "check_ids, lists of ints": lambda: check_ids(la, sl, lb, dl),
        "check_ids, int32 arrays": lambda: check_ids(la, s32, lb, d32),
        "check_ids, CPU int64 tensors": lambda: check_ids(la, s_t, lb, d_t),
        "both sides' checks (_side x 2)": lambda: (sides._side(la, a), sides._side(lb, b)),
        "copy_blocks before CUDA": before_cuda,
    }


def _mode(native: bool) -> None:
    """The C helpers in use or not (the launch path has its own knob, XFER_NATIVE_LAUNCH; these do not)."""
    layout_mod._native = C if native else None
    sides._native = C if native else None


def _cuda_pieces(layers: int, n: int, number: int, repeat: int, profile_calls: int) -> dict:
    """The CUDA half of ``copy_blocks`` between two cached caches, piece by piece (host us, best of
    ``repeat`` rounds of ``number`` calls), the C launch on and off alternated; then a cProfile."""
    import cProfile
    import pstats

    from xfer.kernels import copy as kc
    from xfer.kernels._dispatch import _current_stream, _KeepAliveEvent, copy_blocks

    if not torch.cuda.is_available():
        raise SystemExit("--cuda needs a GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    blocks = max(n, 256)

    def cache():
        return [torch.zeros(2, 2 * blocks, 1, 1, 8, dtype=torch.float16, device=dev) for _ in range(layers)]

    a, b = cache(), cache()
    for t in a:
        t.copy_(torch.randn(t.shape, dtype=t.dtype))
    for t in b:
        t.view(torch.int16).fill_(-23131)  # poison (0xA5A5)
    la, lb = KVLayout.vllm_flash_attn(a), KVLayout.vllm_flash_attn(b)
    rng = np.random.default_rng(0)
    s, d = rng.permutation(2 * blocks)[:n], rng.permutation(2 * blocks)[:n]
    copy_blocks(la, a, s, lb, b, d)  # the pair's tables, the kernel compiled
    torch.cuda.synchronize()
    si, di = torch.as_tensor(s, device=dev), torch.as_tensor(d, device=dev)
    rest = torch.ones(2 * blocks, dtype=torch.bool, device=dev)
    rest[di] = False
    for x, y in zip(a, b):  # correctness before timing: the blocks landed, the others still poisoned
        if not (torch.equal(y[:, di], x[:, si]) and bool((y[:, rest].view(torch.int16) == -23131).all())):
            raise SystemExit("copy_blocks moved the wrong bytes: no timing")
    src, dst = sides._side(la, a), sides._side(lb, b)
    s_ids, d_ids = check_ids(la, s, lb, d)
    stream = _current_stream()
    pair = sides._pair(kc, la, src, lb, dst, dev)

    def launch():
        entry, _ = pair.launch(s_ids, d_ids, stream)
        event = _KeepAliveEvent()
        event.record(stream)
        pair.release(entry, event)

    def event():
        _KeepAliveEvent().record(stream)

    pieces = {
        "current stream (_current_stream)": _current_stream,
        "cached pair lookup (_pair)": lambda: sides._pair(kc, la, src, lb, dst, dev),
        "ids upload + launch + event + release": launch,
        "event created + recorded": event,
        "copy_blocks, the whole call": lambda: copy_blocks(la, a, s, lb, b, d),
    }
    native_built = kc._C is not None and bool(kc._C.driver())

    def mode(on: bool) -> None:
        pair.native = {} if on else None  # (the launch spec rebuilt on the first call)
        pair._put = None  # the ids' filler chosen again

    rows = []
    modes = (True, False) if native_built else (False,)
    saved_native = pair.native
    try:
        for name, fn in pieces.items():
            best = {m: float("inf") for m in modes}
            for _ in range(repeat):
                for on in modes:
                    mode(on)  # (copy_blocks finds this same pair: its sides are cached)
                    fn()
                    torch.cuda.synchronize()
                    best[on] = min(best[on], timeit.timeit(fn, number=number) / number * 1e6)
                    torch.cuda.synchronize()
            rows.append({"what": name, "native_launch_us": best.get(True), "triton_launch_us": best[False]})
        mode(bool(native_built))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(profile_calls):
            copy_blocks(la, a, s, lb, b, d)
        prof.disable()
        torch.cuda.synchronize()
    finally:
        pair.native = saved_native
        pair._put = None
    st = pstats.Stats(prof)
    top = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:15]
    profile = [{"function": f"{fn[0].rsplit('/', 2)[-1]}:{fn[1]}({fn[2]})", "calls": v[1],
                "own_us_a_call": v[2] / profile_calls * 1e6, "cum_us_a_call": v[3] / profile_calls * 1e6}
               for fn, v in top]
    print(f"  CUDA half ({torch.cuda.get_device_name(dev)}), host us a call:")
    print(f"  {'what':<40} {'C launch':>9} {'Triton':>8}")
    for r in rows:
        on = "-" if r["native_launch_us"] is None else f"{r['native_launch_us']:.2f}"
        print(f"  {r['what']:<40} {on:>9} {r['triton_launch_us']:8.2f}")
    print(f"  cProfile of {profile_calls} whole calls (launch {'C' if native_built else 'Triton'}), most own time:")
    for r in profile:
        print(f"    {r['own_us_a_call']:7.2f} own {r['cum_us_a_call']:7.2f} cum us  {r['calls']:>6}  {r['function']}")
    return {"device": torch.cuda.get_device_name(dev), "number": number, "rows": rows,
            "profile_calls": profile_calls, "profile": profile}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--n", type=int, default=128, help="block ids a side")
    p.add_argument("--number", type=int, default=5000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--cuda", action="store_true", help="also the CUDA half of a copy, piece by piece (a GPU host)")
    p.add_argument("--profile-calls", type=int, default=2000, help="--cuda: whole calls under cProfile")
    args = p.parse_args(argv)
    if C is None:
        raise SystemExit("xfer._native is not built here: nothing to compare (see docs/install.md)")
    cases = _cases(args.layers, max(args.n, 256), args.n)
    rows = []
    try:
        for name, fn in cases.items():
            best = {True: float("inf"), False: float("inf")}
            for _ in range(args.repeat):
                for native in (True, False):
                    _mode(native)
                    fn()
                    best[native] = min(best[native], timeit.timeit(fn, number=args.number) / args.number * 1e6)
            rows.append({"what": name, "python_us": best[False], "native_us": best[True],
                         "python_over_native": best[False] / best[True]})
    finally:
        _mode(True)
    res = {"bench": "host_checks", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
           "workload": {"layers": args.layers, "tensors_a_side": args.layers, "ids": args.n,
                        "number": args.number, "repeat": args.repeat},
           "rows": rows}
    print(f"host_checks  python {res['python']}  torch {res['torch']}  {args.layers} tensors a side, {args.n} ids")
    print(f"  {'what':<34} {'python us':>10} {'C us':>8} {'ratio':>6}")
    for r in rows:
        print(f"  {r['what']:<34} {r['python_us']:10.2f} {r['native_us']:8.2f} {r['python_over_native']:6.1f}x")
    if args.cuda:
        res["cuda"] = _cuda_pieces(args.layers, args.n, args.number // 5, args.repeat, args.profile_calls)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
