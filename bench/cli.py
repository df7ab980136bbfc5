"""xfer-bench: move KV-cache blocks between two processes through xfer, verify every byte, and
time it beside the ceiling and the baselines measured in the same run.

With no arguments: two local processes, the best transport the machine has (both caches on the
GPU -> ipc; on CPU, host shared memory -> local), the seed workload (64 layers x K/V x 128
blocks, slice size fitted to this machine), a table, JSON and a plot in a results folder.

examples:
  xfer-bench                                        # the seed case, two local processes
  xfer-bench --preset llama3-70b-tp8 --json         # machine-readable output on stdout
  xfer-bench --slice-sizes 1K,4K,16K --blocks 32,128 --transport local,ucx --chunk-bytes 4M,16M
  xfer-bench --role target --listen 10.0.0.1:29555           # node A
  xfer-bench --role initiator --peer 10.0.0.1:29555          # node B
  torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr A -m xfer.bench.cli  # rank 0: target
  srun -N2 -n2 xfer-bench                            # MASTER_ADDR/MASTER_PORT, else the first node

exit status: 0 ok, 1 other error, 2 bad flags, 3 peer unreachable or stopped answering,
4 bytes not verified, 5 no requested transport can serve the pair.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from .errors import BenchError, Exit
from .presets import MLA_LAYOUTS, PRESETS, Workload, fit, fmt_bytes, parse_bytes, with_slice_bytes
from .remote import dist_env, parse_hostport

TRANSPORTS = ("auto", "local", "ipc", "nvshmem", "ucx")
LAYOUTS = ("distserve", "vllm_flash_attn_nhd", "vllm_flash_attn_hnd", "vllm_flashinfer", "vllm_cross_layer",
           "packed_kv", "mla", "mla_fp8", "sglang")
CPU_PAYLOAD_CAP = 128 << 20  # keeps the default CPU run under a minute (host copies run at a few GB/s)


def _csv(kind):
    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        try:
            return [kind(x) for x in items]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _choice(allowed):
    def check(x: str) -> str:
        if x not in allowed:
            raise ValueError(f"{x!r} is not one of {', '.join(allowed)}")
        return x
    return check


def _positive_int(x: str) -> int:
    v = int(x)
    if v < 1:
        raise ValueError(f"must be >= 1, got {x}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xfer-bench", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload and sweep (lists are comma-separated; every combination runs)")
    w.add_argument("--preset", choices=sorted(PRESETS), default="seed", help="model shape (default: seed)")
    w.add_argument("--layouts", type=_csv(_choice(LAYOUTS)), metavar="L,...",
                   help=f"KV layouts (default: the preset's): {', '.join(LAYOUTS)}")
    w.add_argument("--slice-sizes", type=_csv(parse_bytes), metavar="BYTES,...",
                   help="bytes per slice, e.g. 1K,4K,32K (heads change; MLA: tokens per block)")
    w.add_argument("--blocks", type=_csv(_positive_int), metavar="N,...", help="blocks moved per transfer")
    w.add_argument("--transport", type=_csv(_choice(TRANSPORTS)), default=["auto"], metavar="T,...",
                   help=f"auto (selection picks) or pinned: {', '.join(TRANSPORTS[1:])} (default: auto)")
    w.add_argument("--chunk-bytes", type=_csv(parse_bytes), metavar="BYTES,...",
                   help="transport chunk size (AgentConfig.chunk_bytes and XFER_UCX_CHUNK_BYTES)")
    w.add_argument("--baselines", default="auto", metavar="B,...",
                   help="auto, none, or a list of: copy, tcp, nccl, gloo, per-layer, per-slice")
    w.add_argument("--no-fit", action="store_true",
                   help="use the preset's shape as is (default: shrink it to fit this machine's memory and time)")
    w.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    m = p.add_argument_group("measurement")
    m.add_argument("--iters", type=int, default=10, help="timed rounds per measurement, after one warm-up (default 10)")
    m.add_argument("--max-seconds", type=float, default=5.0,
                   help="stop a measurement after this long once 3 rounds are done (default 5)")
    m.add_argument("--timeout", type=float, default=120.0, help="deadline of each transfer and command, s (default 120)")
    m.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N for this side's cache (default auto)")
    m.add_argument("--peer-device", default="auto",
                   help="local runs: the target's device (auto: the second GPU if there is one, else --device)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="xfer-bench-results", help="results folder (a timestamped subfolder is made)")
    o.add_argument("--json", action="store_true", help="print the results as JSON on stdout instead of the table")
    o.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    o.add_argument("--quiet", action="store_true", help="no progress bar or notes on stderr")
    r = p.add_argument_group("roles (across nodes; under torchrun or Slurm rank 0 is the target, rank 1 the initiator)")
    r.add_argument("--role", choices=["local", "target", "initiator"], help="default: local, or from torchrun/Slurm")
    r.add_argument("--listen", metavar="HOST:PORT", help="target: host the rendezvous store here")
    r.add_argument("--peer", metavar="HOST:PORT", help="initiator: the target's --listen address")
    r.add_argument("--store", metavar="URL", help="either role: use this store instead (tcp://HOST:PORT, etcd://HOST:PORT)")
    r.add_argument("--bind", metavar="ADDR", help="the address this side's agent listens on (default: toward the peer)")
    r.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to reach the peer (default 30)")
    r.add_argument("--idle-timeout", type=float, default=600.0,
                   help="target: exit after this long without a command (default 600)")
    return p


# ---- flags -> what to run -----------------------------------------------------------------------
def _check_flags(args, p) -> str:
    """Validate what needs no torch; returns the role."""
    if args.iters < 1:
        p.error(f"--iters must be >= 1, got {args.iters}")
    for name in ("max_seconds", "timeout", "connect_timeout", "idle_timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")
    if args.baselines not in ("auto", "none"):
        from .sweep import BASELINES

        args.baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
        bad = [b for b in args.baselines if b not in BASELINES]
        if bad or not args.baselines:
            p.error(f"--baselines: unknown {bad}; choose auto, none or from {', '.join(BASELINES)}")
    for chunk in args.chunk_bytes or []:
        if chunk < 4096:
            p.error(f"--chunk-bytes must be >= 4K, got {chunk}")
    try:
        env = dist_env()
    except BenchError as e:
        p.error(str(e))
    role = args.role or ("local" if env is None else ("target" if env.rank == 0 else "initiator"))
    if env is not None and not args.role and env.world_size != 2:
        p.error(f"xfer-bench runs one target/initiator pair: {env.source} world size must be 2, got {env.world_size}")
    try:
        if args.listen:
            parse_hostport(args.listen, "--listen")
        if args.peer:
            parse_hostport(args.peer, "--peer")
    except ValueError as e:
        p.error(str(e))
    if args.listen and role != "target":
        p.error(f"--listen is for --role target (this is the {role} role); the initiator takes --peer")
    if args.peer and role != "initiator":
        p.error(f"--peer is for --role initiator (this is the {role} role); the target takes --listen")
    if role == "target" and not (args.listen or args.store or env):
        p.error("--role target needs --listen HOST:PORT (or --store URL, or torchrun/Slurm)")
    if role == "initiator" and not (args.peer or args.store or env):
        p.error("--role initiator needs --peer HOST:PORT (the target's --listen; or --store URL, or torchrun/Slurm)")
    if role == "local" and args.store:
        p.error("--store needs --role target or initiator")
    if args.listen and parse_hostport(args.listen, "--listen")[0] in ("0.0.0.0", "::") and not args.bind:
        p.error(f"--listen {args.listen} listens everywhere: also give --bind ADDR, the address the initiator "
                "reaches this host at")
    return role


def _workloads(args, p, device) -> list[Workload]:
    base = PRESETS[args.preset]
    mla = base.layout in MLA_LAYOUTS
    layouts = args.layouts or [base.layout]
    wrong = [x for x in layouts if (x in MLA_LAYOUTS) != mla]
    if wrong:
        p.error(f"--layouts {','.join(wrong)} do not fit preset {args.preset} "
                f"({'MLA latents: use mla or mla_fp8' if mla else 'K/V heads: MLA layouts need --preset deepseek-v3'})")
    cap, why = _fit_cap(device)
    out = []
    for layout in layouts:
        row = {"mla": dict(head_dim=576, dtype="bfloat16"), "mla_fp8": dict(head_dim=656, dtype="uint8")}
        w = dataclasses.replace(base, layout=layout, **row.get(layout, {}))
        for size in args.slice_sizes or [None]:
            for blocks in args.blocks or [None]:
                try:
                    v = with_slice_bytes(w, size) if size else w
                    v = dataclasses.replace(v, blocks_moved=blocks) if blocks else v
                except ValueError as e:
                    p.error(f"--slice-sizes: {e}")
                if not args.no_fit:
                    v = fit(v, cap, why, slice_ok=not args.slice_sizes, blocks_ok=not args.blocks)
                out.append(v)
    return out


def _fit_cap(device) -> tuple[int, str]:
    """The largest payload to use: about 8 payloads live at once (source, destination and baseline
    caches of twice the blocks moved, two contiguous buffers); CPU runs are also capped for time."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 8, f"{fmt_bytes(free)} free on {device}"
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    shm = st.f_bavail * st.f_frsize if st else avail
    cap = min(avail // 8, shm // 4, CPU_PAYLOAD_CAP)
    return cap, (f"CPU: {fmt_bytes(CPU_PAYLOAD_CAP)} keeps the run short" if cap == CPU_PAYLOAD_CAP
                 else f"{fmt_bytes(avail)} of memory available")


def _device(text: str, p, flag: str = "--device"):
    import torch

    if text == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(text)
    except (RuntimeError, ValueError):
        p.error(f"{flag} must be auto, cpu, cuda or cuda:N, got {text!r}")
    if d.type == "cpu":
        return d
    if d.type != "cuda":
        p.error(f"{flag} must be auto, cpu, cuda or cuda:N, got {text!r}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = 0 if d.index is None else d.index
    if index >= n:
        p.error(f"{flag} {text}: this machine has {n} CUDA device(s)")
    return torch.device("cuda", index)


def _list_presets() -> str:
    lines = [f"{'preset':<16}{'layout':<22}{'layers':>7}{'blocks':>7}{'slice':>10}{'slices':>9}{'payload':>10}"]
    for name, w in PRESETS.items():
        lines.append(f"{name:<16}{w.layout:<22}{w.num_layers:>7}{w.blocks_moved:>7}{fmt_bytes(w.slice_bytes):>10}"
                     f"{w.slices:>9,}{fmt_bytes(w.payload_bytes):>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = argv
    if args.list_presets:
        print(_list_presets())
        return Exit.OK
    role = _check_flags(args, p)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets variables this UCX build does not know
    from xfer._stdio import own_stdout

    # stdout carries the table or the JSON document alone: what libraries print there (Gloo's
    # "[Gloo] Rank 1 is connected to 1 peer ranks") goes to stderr, children's included
    with own_stdout() as args.stdout:
        return _run(args, role, p)


def _run(args, role: str, p) -> int:
    from . import roles

    try:
        device = _device(args.device, p)
        if role == "target":
            return roles.run_target(args, device)
        workloads = _workloads(args, p, device)
        peer_device = None
        if role == "local":
            import torch

            auto = "cuda:1" if device.type == "cuda" and torch.cuda.device_count() > 1 else str(device)
            peer_device = _device(auto if args.peer_device == "auto" else args.peer_device, p, "--peer-device")
        return roles.run_initiator(args, role, device, peer_device, workloads)
    except BenchError as e:
        print(f"xfer-bench: error: {e}", file=sys.stderr, flush=True)
        return e.code
    except KeyboardInterrupt:
        print("xfer-bench: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # an xfer error the sweep did not expect: name it, no traceback
        from xfer.errors import XferError

        if not isinstance(e, XferError) or os.environ.get("XFER_BENCH_DEBUG"):
            raise
        print(f"xfer-bench: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return Exit.ERROR


if __name__ == "__main__":
    sys.exit(main())
