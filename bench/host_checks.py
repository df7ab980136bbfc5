"""Host time of a block copy's checks before any CUDA work, with xfer's C helpers and without, in one
process (issue 32): the block-id checks of both sides (``check_ids``: a list of ints, an int64
array), the check that each cache is still the same tensors at the same addresses (``_side``), and
the whole of ``copy_blocks``' work before CUDA (ids, both sides, the overlap check, the path choice).

The seed case's shape on small tensors (only the checks run): 2 x 64 layer tensors a side, 128
ids. Each figure is the best of ``--repeat`` rounds of ``--number`` calls, the two modes alternated.
Runs on a CPU machine (the checks touch no GPU)::

    python -m xfer.bench.host_checks [--out host_checks.json]
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

    def before_cuda():
        s_ids, d_ids = check_ids(la, s, lb, d)
        src, dst = sides._side(la, a), sides._side(lb, b)
        check_overlap(la, src.tensors, s_ids, lb, dst.tensors, d_ids, spans=(src.spans, dst.spans),
                      touching=_touching(src, dst))
        _choose(src.where, dst.where, slice_bytes(la, lb), None)

    return {
        "check_ids, int64 arrays": lambda: check_ids(la, s, lb, d),
        "check_ids, lists of ints": lambda: check_ids(la, sl, lb, dl),
        "both sides' checks (_side x 2)": lambda: (sides._side(la, a), sides._side(lb, b)),
        "copy_blocks before CUDA": before_cuda,
    }


def _mode(native: bool) -> None:
    """The C helpers in use or not (the launch path has its own knob, XFER_NATIVE_LAUNCH; these do not)."""
    layout_mod._native = C if native else None
    sides._native = C if native else None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--n", type=int, default=128, help="block ids a side")
    p.add_argument("--number", type=int, default=5000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None)
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
