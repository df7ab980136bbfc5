"""NCCL send/recv of the same bytes between two GPUs, one process each (torch.distributed): the
baseline an ``ipc`` transfer between the same GPUs should beat.

    python -m xfer.bench.nccl_baseline --devices 0,1 [--mib 512] [--iters 20] [--out nccl.json]

Rank 0 (GPU ``a``, the prefill side) and rank 1 (GPU ``b``) follow one fixed schedule, so no
message says what comes next. Rank 0 times (wall clock, both devices synced around each round;
one warm-up round):

- ``push lone``: rank 0 sends the payload, rank 1 answers an 8-byte ack (an ``ipc`` write ends
  on its ack too);
- ``push back to back``: ``--burst`` payloads, then one ack (per payload);
- ``pull lone`` / ``pull back to back``: rank 0 sends an 8-byte request, rank 1 sends the
  payload(s) back (what an ``ipc`` read moves).

Before timing, each direction's first payload is checked on the receiver against the bytes the
sender drew from the same seed. ``--backend gloo --device cpu`` runs the same schedule on host
memory (the CPU tests use it; it is no baseline). NCCL refuses two ranks on one GPU: that case
is reported, not run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import statistics
import time
import traceback

import numpy as np

from xfer.bench.peer_copy import NO_MULTICAST

__all__ = ["run", "main", "CASES"]

CASES = ("push lone", "push back to back", "pull lone", "pull back to back")


def _payload(nbytes: int, seed: int, device):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def _xchg(dist, tensor, send: bool, other: int) -> None:
    if send:
        dist.send(tensor, dst=other)
    else:
        dist.recv(tensor, src=other)


def _rank(rank: int, cfg: dict, conn) -> None:
    """One rank's whole schedule; rank 0 sends its timings (or the error) through ``conn``."""
    os.environ.update(NO_MULTICAST)
    import torch
    import torch.distributed as dist

    try:
        cuda = cfg["device"] == "cuda"
        dev = torch.device("cuda", cfg["devices"][rank]) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(dev)
        timeout = dt.timedelta(seconds=cfg["timeout_s"])
        store = dist.TCPStore("127.0.0.1", cfg["port"], None, False, timeout)
        dist.init_process_group(cfg["backend"], store=store, rank=rank, world_size=2, timeout=timeout)
        nbytes, burst, other = cfg["nbytes"], cfg["burst"], 1 - rank
        sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
        small = torch.zeros(1, dtype=torch.int64, device=dev)
        verified = {}
        bufs = {}
        for direction, sender, seed in (("push", 0, 1), ("pull", 1, 2)):
            if rank == sender:
                bufs[direction] = _payload(nbytes, seed, dev)
                dist.send(bufs[direction], dst=other)
            else:
                buf = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=dev)
                dist.recv(buf, src=other)
                verified[direction] = bool(torch.equal(buf, _payload(nbytes, seed, dev)))
                bufs[direction] = buf
            sync()
        flag = torch.zeros(1, dtype=torch.int64, device=dev)  # rank 1's verdict on the push reaches rank 0
        if rank == 1:
            flag.fill_(int(verified["push"]))
        _xchg(dist, flag, rank == 1, other)
        verified["push"] = bool(flag.item())

        def step(case: str) -> None:
            """One round of ``case`` from this rank's side (both ranks run the same rounds)."""
            k = burst if "back to back" in case else 1
            payload = bufs["push" if case.startswith("push") else "pull"]
            sends = (rank == 0) == case.startswith("push")  # who sends the payload this round
            if not case.startswith("push"):  # a pull starts with rank 0's request
                _xchg(dist, small, rank == 0, other)
            for _ in range(k):
                _xchg(dist, payload, sends, other)
            if case.startswith("push"):  # a push ends with rank 1's ack
                _xchg(dist, small, rank == 1, other)

        rows = []
        for case in CASES:
            per = burst if "back to back" in case else 1
            times = []
            for i in range(1 + cfg["iters"]):  # round 0 is the warm-up
                if not cuda:
                    dist.barrier()  # gloo: both ranks start the round together
                sync()
                t0 = time.perf_counter()
                step(case)
                sync()
                if i:
                    times.append(1e3 * (time.perf_counter() - t0) / per)
            rows.append({"name": f"{cfg['backend']} send/recv, {case}" + (" (per payload)" if per > 1 else ""),
                         "case": case, "ms": statistics.median(times), "p99_ms": float(np.percentile(times, 99)),
                         "n": len(times), "gb_per_s": nbytes / (statistics.median(times) * 1e-3) / 1e9})
        dist.barrier()
        if rank == 0:
            versions = {"torch": torch.__version__}
            if cuda:
                v = torch.cuda.nccl.version()
                versions["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            conn.send({"rows": rows, "verified": verified, "versions": versions})
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        conn.send({"error": f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"})


def run(devices: tuple[int, int], nbytes: int, *, iters: int = 20, burst: int = 8, backend: str = "nccl",
        device: str = "cuda", timeout_s: float = 120.0) -> dict:
    """Both ranks in spawned processes; rank 0's timings, or ``{"skipped": why}`` / ``{"error": ...}``."""
    import torch.distributed as dist

    if backend == "nccl" and devices[0] == devices[1]:
        return {"skipped": f"NCCL needs two GPUs: both ranks would use GPU {devices[0]} (NCCL refuses that)"}
    server = dist.TCPStore("127.0.0.1", 0, None, True, dt.timedelta(seconds=timeout_s), wait_for_workers=False)
    cfg = {"devices": list(devices), "nbytes": nbytes, "iters": iters, "burst": burst, "backend": backend,
           "device": device, "port": server.port, "timeout_s": timeout_s}
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, cfg, pipes[r][1]), daemon=True) for r in range(2)]
    for proc in procs:
        proc.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s + 60
    try:
        # rank 0 reports its timings or an error, rank 1 only an error: stop at rank 0's report or
        # at the first error (the other rank may then wait in NCCL until killed)
        while 0 not in got and not any("error" in x for x in got.values()):
            for r in range(2):
                if r not in got and pipes[r][0].poll(0.1):
                    got[r] = pipes[r][0].recv()
            if time.monotonic() > deadline:
                return {"error": f"no result within {timeout_s + 60:.0f} s"}
            if 0 not in got and not procs[0].is_alive() and not pipes[0][0].poll(0.5):
                return {"error": f"rank 0 exited (code {procs[0].exitcode}) without a result"}
    finally:
        for proc in procs:
            proc.join(10 if "error" not in got.get(0, {}) else 1)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        server = None
    errors = [x["error"] for x in got.values() if "error" in x]
    if errors:
        return {"error": "\n".join(errors)}
    return got[0]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="xfer-nccl-baseline", description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="0,1", help="rank 0's and rank 1's GPU (default 0,1)")
    p.add_argument("--mib", type=float, default=512, help="payload, MiB (default 512: the seed case's bytes)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--burst", type=int, default=8, help="payloads per back-to-back round")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: host memory (gloo only)")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    try:
        devices = tuple(int(x) for x in args.devices.split(","))
    except ValueError:
        devices = ()
    if len(devices) != 2:
        p.error(f"--devices takes two GPU indices, e.g. 0,1; got {args.devices!r}")
    if args.device == "cpu" and args.backend == "nccl":
        p.error("--device cpu needs --backend gloo (NCCL moves device memory)")
    nbytes = int(args.mib * (1 << 20))
    res = run(devices, nbytes, iters=args.iters, burst=args.burst, backend=args.backend, device=args.device,
              timeout_s=args.timeout_s)
    doc = {"bench": "nccl_baseline", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "backend": args.backend, "device": args.device, "devices": list(devices), "payload_bytes": nbytes,
           "burst": args.burst, **res}
    if args.device == "cuda" and "rows" in res:
        import torch

        doc["device_names"] = [torch.cuda.get_device_name(i) for i in devices]
    for r in res.get("rows", []):
        print(f"{r['name']:<52}{r['ms']:>9.3f} ms{r['gb_per_s']:>9.1f} GB/s")
    for key in ("skipped", "error"):
        if key in res:
            print(f"{args.backend} send/recv: {key}: {res[key]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


if __name__ == "__main__":
    raise SystemExit(0 if "error" not in main() else 1)
