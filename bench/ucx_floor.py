"""What UCX and this host's memory make of small scattered blocks by themselves, without xfer:
the floors under ``ucx_bench.py``'s small cases.

Two measurements per case (the ucx_bench cases: every other block of a cache twice as large):

- ``ucx_perftest`` (shipped in the libucx wheel), ``tag_lat``: the one-way time of one tag
  message of the case's bytes between two processes pinned apart (as ``ucx_bench --pin auto``),
  UCX tuned as the transport tunes it, for a contiguous buffer and for the same bytes as a
  scatter-gather list of the case's block size (every other block), on the sending side
  (``iov-contig``) or the receiving side (``contig-iov``). No Python in the timed path.
- the gather of the case's blocks into one contiguous buffer (``BlockCopier.gather``: one
  ``index_select``, what xfer does before a staged send), warm and after 64 MiB of other
  writes evicted the caches, beside a contiguous copy of the same bytes in the same two states.

    python bench/ucx_floor.py [--cases 32x64x512B,32x256x4KiB] [--iters 200] [--json out.json]

A sender must either gather (copy) the blocks or let UCX send them as a list; where the first costs
a large part of the contiguous send's own time and the second is slower still, no protocol on top
of UCX reaches the contiguous send's speed for those blocks on this host.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.ucx_bench import CASES, KIND, dims_of, ids_of, split_cpus  # noqa: E402


def perftest_binary() -> tuple[Path, Path]:
    """(ucx_perftest, its lib folder) from the libucx wheel ucxx runs on."""
    import libucx

    base = Path(libucx.__file__).resolve().parent
    exe = base / "bin" / "ucx_perftest"
    if not exe.exists():
        raise FileNotFoundError(f"no ucx_perftest in {base / 'bin'} (the libucx wheel ships it)")
    return exe, base / "lib"


def perftest_env(lib: Path) -> dict:
    from xfer.settings import TUNED_UCX

    env = dict(os.environ, UCX_TLS=os.environ.get("UCX_TLS", "tcp"),
               UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"), UCX_WARN_UNUSED_ENV_VARS="n")
    env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    for k, v in TUNED_UCX.items():
        env.setdefault(f"UCX_{k}", v)
    return env


_PORT = 13300 + os.getpid() % 500


def perftest(args: list[str], cpus, iters: int) -> float:
    """One-way latency in seconds (``tag_lat``: half the ping-pong round trip), median of 3 runs."""
    global _PORT
    exe, lib = perftest_binary()
    env = perftest_env(lib)
    out = []
    for _ in range(3):
        _PORT += 1
        common = ["-t", "tag_lat", "-n", str(iters), "-w", str(max(iters // 10, 2)), "-p", str(_PORT), *args]
        pin = (["taskset", "-c", ",".join(map(str, cpus[1]))], ["taskset", "-c", ",".join(map(str, cpus[0]))]) \
            if cpus else ([], [])
        server = subprocess.Popen(pin[0] + [str(exe), *common], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            for _ in range(50):  # until the server listens
                time.sleep(0.1)
                r = subprocess.run(pin[1] + [str(exe), "127.0.0.1", *common], env=env, capture_output=True,
                                   text=True, timeout=120)
                if "Final:" in r.stdout:
                    break
            else:
                raise RuntimeError(f"ucx_perftest {' '.join(args)} gave no result: {r.stdout[-400:]} {r.stderr[-400:]}")
        finally:
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        final = re.search(r"Final:\s+(\d+)\s+([\d.]+)\s+([\d.]+)", r.stdout)
        out.append(float(final.group(3)) * 1e-6)  # average latency, usec
    return statistics.median(out)


def flush() -> None:
    """Evict this core's caches: 64 MiB of other writes."""
    buf = getattr(flush, "buf", None)
    if buf is None:
        buf = flush.buf = np.empty(64 << 20, dtype=np.uint8)
    buf.fill(1)


def timed(fn, cold: bool, n: int = 31) -> float:
    ts = []
    for _ in range(n):
        if cold:
            flush()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run_case(case: str, cpus, iters: int) -> dict:
    from xfer import make_kv_cache
    from xfer.transports.ucx.staging import BlockCopier

    tensors, layout = make_kv_cache(KIND, **dims_of(case))
    for t in tensors:
        t.view(-1).view(torch.uint8).random_(0, 256)
    src = np.asarray(ids_of(case)[0], dtype=np.int64)
    nbytes = len(src) * layout.bytes_per_block
    block = layout.block_nbytes
    entries = nbytes // block
    sizes = ",".join([str(block)] * entries)
    n = max(20, min(iters, int(iters * (2 << 20) / nbytes)))  # fewer rounds for big messages
    lat = {
        "contig": perftest(["-s", str(nbytes)], cpus, n),
        "iov-contig": perftest(["-D", "iov,contig", "-s", sizes, "-i", str(block)], cpus, n),
        "contig-iov": perftest(["-D", "contig,iov", "-s", sizes, "-i", str(block)], cpus, n),
    }
    copier = BlockCopier(layout, tensors)
    out = torch.empty(nbytes, dtype=torch.uint8)
    flat = torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)
    gather = lambda: copier.gather(src, 0, layout.num_layers, out)  # noqa: E731
    copy = lambda: out.copy_(flat)  # noqa: E731
    copies = {"gather_warm": timed(gather, False), "gather_cold": timed(gather, True),
              "copy_warm": timed(copy, False), "copy_cold": timed(copy, True)}
    return {"case": case, "bytes": nbytes, "block_bytes": block, "entries": entries, "perftest_iters": n,
            "one_way_ms": {k: 1e3 * v for k, v in lat.items()},
            "copy_ms": {k: 1e3 * v for k, v in copies.items()},
            "iov_send_vs_contig": lat["contig"] / lat["iov-contig"],
            "iov_recv_vs_contig": lat["contig"] / lat["contig-iov"],
            "cold_gather_vs_contig_send": copies["gather_cold"] / lat["contig"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="32x64x512B,32x256x4KiB")
    ap.add_argument("--iters", type=int, default=200, help="ucx_perftest round trips for a 2 MiB message "
                    "(scaled down for bigger ones)")
    ap.add_argument("--pin", choices=("auto", "off"), default="auto")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown case(s) {unknown}; known: {','.join(CASES)}")
    torch.set_num_threads(1)
    cpus = split_cpus(args.pin)
    if cpus:
        os.sched_setaffinity(0, cpus[0])  # the gathers run on the client's CPUs, as in ucx_bench
    results = [run_case(c, cpus, args.iters) for c in args.cases.split(",")]
    import ucxx

    print(f"\nUCX and memory floors, {platform.node()}, {os.cpu_count()} cores, UCX "
          f"{'.'.join(map(str, ucxx.get_ucx_version()))}, UCX_TLS={perftest_env(Path('.'))['UCX_TLS']}, "
          f"CPUs {cpus if cpus else 'not pinned'}")
    print(f"{'case':<14} {'MiB':>5} {'block':>6} | one-way ms: {'contig':>7} {'iov send':>8} {'iov recv':>8} | "
          f"gather ms: {'warm':>6} {'cold':>6} | same-bytes copy: {'warm':>6} {'cold':>6} | cold gather / send")
    for r in results:
        o, c = r["one_way_ms"], r["copy_ms"]
        print(f"{r['case']:<14} {r['bytes'] / 2**20:5.0f} {r['block_bytes']:6d} | {'':11} {o['contig']:7.3f} "
              f"{o['iov-contig']:8.3f} {o['contig-iov']:8.3f} | {'':10} {c['gather_warm']:6.3f} {c['gather_cold']:6.3f} | "
              f"{'':16} {c['copy_warm']:6.3f} {c['copy_cold']:6.3f} | {r['cold_gather_vs_contig_send']:.2f}")
    print("one-way: ucx_perftest tag_lat (half a round trip) of one message of the case's bytes; iov send / "
          "iov recv: the same bytes as a list of the case's blocks (every other one) on that side")
    if args.json:
        doc = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": platform.node(),
               "cores": os.cpu_count(), "torch": torch.__version__, "ucxx": ucxx.__version__,
               "ucx": ".".join(map(str, ucxx.get_ucx_version())), "ucx_tls": perftest_env(Path("."))["UCX_TLS"],
               "cpus": {"client": cpus[0], "server": cpus[1]} if cpus else None, "results": results}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"results: {args.json}")


if __name__ == "__main__":
    main()
