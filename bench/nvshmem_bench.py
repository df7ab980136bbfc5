"""NVSHMEM transport benchmark: two PEs (processes), on one GPU by default, the seed case.

    python -m xfer.bench.nvshmem_bench --out bench/results/nvshmem_h200.json [--peer-device 0]

This process is PE 0 (prefill); a spawned process is PE 1 (decode); the group's unique id goes
through a TCPStore hosted here. Moves 64 layers x K/V x 128 of 256 blocks x 32 KiB (512 MiB)
through the xfer API, end to end (call -> bytes in the decode cache -> notification delivered ->
acknowledged), on both paths: *staged* (gather -> symmetric staging -> put-with-signal -> scatter;
plain torch KV caches) and *direct* (KV caches on the symmetric heap; one copy_blocks into the
peer). Every path is verified byte-exact (digests of the destination blocks, the rest still
poisoned) before it is timed, beside the same-bytes contiguous device copy timed in the same run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import multiprocessing as mp
import os
import traceback

import numpy as np
import torch

from xfer.bench.ipc_bench import median_ms

KIND = "vllm_flash_attn_nhd"
DIMS = dict(num_layers=64, num_blocks=256, block_size=16, num_heads=8, head_dim=128)  # bf16: 32 KiB slices
POISON = 0xA5


def _caches(tr, memory: str, device, seed):
    from xfer import make_kv_cache

    empty = tr.symmetric_empty if memory == "symmetric" else torch.empty
    tensors, layout = make_kv_cache(KIND, device=device, empty=empty, **DIMS)
    gen = torch.Generator(device=device).manual_seed(seed or 0)
    for t in tensors:
        b = t.view(-1).view(torch.uint8)
        if seed is None:
            b.fill_(POISON)
        else:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=device, generator=gen))
    torch.cuda.synchronize()
    return tensors, layout


def _decode_main(conn, group_kw) -> None:
    """PE 1: owns the destination caches; answers digests of blocks."""
    from xfer import Agent, AgentConfig, TransportKind
    from xfer.bench.target import block_digests, untouched
    from xfer.config import NvshmemGroup

    agent, caches = None, {}
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "init":
                agent = Agent("nvshmem-bench-decode", AgentConfig(transport="nvshmem", nvshmem=NvshmemGroup(**group_kw)))
                if TransportKind.NVSHMEM not in agent.transports:
                    raise RuntimeError(agent.unavailable.get(TransportKind.NVSHMEM))
                out = agent.transports[TransportKind.NVSHMEM].info()
            elif cmd == "region":  # (name, memory): collective when memory == "symmetric"
                tr = agent.transports[TransportKind.NVSHMEM]
                caches[arg[0]] = _caches(tr, arg[1], tr.rt.device, None)
                agent.register(arg[0], *caches[arg[0]])
                out = agent.metadata()
            elif cmd == "check":  # (region, ids)
                tensors, layout = caches[arg[0]]
                torch.cuda.synchronize()
                out = (block_digests(layout, tensors, arg[1]), untouched(layout, tensors, arg[1]))
            elif cmd == "drain":
                out = len(agent.notifications())
            elif cmd == "stop":
                agent.close()
                out = agent.transports[TransportKind.NVSHMEM].rt.teardown
            else:
                raise ValueError(cmd)
            conn.send(("ok", out))
        except BaseException as exc:  # noqa: BLE001 - printed by the parent
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        if cmd == "stop":
            return


class _Decode:
    def __init__(self, group_kw):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_main, args=(child, group_kw), daemon=True)
        self.proc.start()

    def send(self, cmd, arg=None):
        self.conn.send((cmd, arg))

    def reply(self, what, timeout=600.0):
        if not self.conn.poll(timeout):
            raise SystemExit(f"nvshmem bench: the decode PE did not answer {what!r} within {timeout:.0f} s "
                             f"(alive: {self.proc.is_alive()}, exit code {self.proc.exitcode})")
        status, out = self.conn.recv()
        if status != "ok":
            raise SystemExit(f"nvshmem bench: the decode PE failed {what!r}:\n{out}")
        return out

    def call(self, cmd, arg=None, timeout=600.0):
        self.send(cmd, arg)
        return self.reply(cmd, timeout)

    def close(self):
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=60)
            except SystemExit:
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def _versions() -> dict:
    v = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import nvshmem
        import nvshmem.core as nvc

        v["nvshmem4py"] = getattr(nvshmem, "__version__", "?")
        v["libnvshmem"] = nvc.get_version().libnvshmem_version
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        v["nvshmem"] = repr(exc)
    return v


def _run_paths(agent, tr, decode, dev, src, dst, iters, rows, paths):
    """Verify, then time, each path; appends to ``rows`` and ``paths``; returns (payload bytes, layout)."""
    from xfer.bench.target import block_digests

    for path, memory in (("staged", "torch"), ("direct", "symmetric")):
        region = f"kv_{path}"
        decode.send("region", (region, memory))  # collective for symmetric memory: both PEs allocate together
        tensors, layout = _caches(tr, memory, dev, seed=1)
        agent.register(region, tensors, layout)
        peer = agent.connect(decode.reply("region"))
        before = dict(tr.stats)
        print(f"nvshmem bench: {path} path ({memory} KV caches): verifying one write", flush=True)
        t = agent.write(peer, src, dst, region=region, peer_region=region, timeout=30)
        try:
            t.wait()
        except Exception as exc:  # noqa: BLE001 - the state of the PE says why
            raise SystemExit(f"nvshmem bench: {path} path: the verifying write failed: {exc!r}\n"
                             f"{tr.rt.describe()}\n{tr.rt.lanes!r}") from None
        taken = {k: v - before.get(k, 0) for k, v in tr.stats.items() if v != before.get(k, 0)}
        digests, clean = decode.call("check", (region, dst.tolist()))
        if not clean or digests != block_digests(layout, tensors, src):
            raise SystemExit(f"nvshmem bench: {path} path: destination bytes differ from the source "
                             f"(untouched blocks clean: {clean}); refusing to time")
        paths[path] = {"verified": True, "counted_as": taken}
        print(f"nvshmem bench: {path} path verified byte-exact ({t.elapsed * 1e3:.1f} ms); timing", flush=True)
        nbytes = len(src) * layout.bytes_per_block
        if not rows:
            a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            b = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            ceil_ms, _ = median_ms(lambda a=a, b=b: b.copy_(a), iters)
            rows.append({"name": "contiguous device copy (ceiling)", "ms": ceil_ms, "p99_ms": ceil_ms})
            del a, b

        def one(op="write", region=region, peer=peer):
            s, d = (src, dst) if op == "write" else (dst, src)
            getattr(agent, op)(peer, s, d, region=region, peer_region=region, timeout=120).wait()

        def burst(k=8, region=region, peer=peer):
            ts = [agent.write(peer, src, dst, region=region, peer_region=region, timeout=120) for _ in range(k)]
            for t in ts:
                t.wait()

        for name, fn, div in ((f"{path}: write, one request end to end", one, 1),
                              (f"{path}: write, 8 back to back (per request)", burst, 8),
                              (f"{path}: read (pull), one request", lambda: one("read"), 1)):
            ms, p99 = median_ms(fn, max(3, iters // div))
            rows.append({"name": name, "ms": ms / div, "p99_ms": p99 / div})
        decode.call("drain")
        lat, lat99 = median_ms(lambda region=region, peer=peer: agent.write(
            peer, [5], [7], region=region, peer_region=region, timeout=60).wait(), iters)
        paths[path]["one_block_request_ms"] = {"p50": lat, "p99": lat99}
        decode.call("drain")
    return nbytes, layout


def main(argv=None) -> dict:
    from xfer import Agent, AgentConfig, TransportKind
    from xfer.config import NvshmemGroup
    from xfer.store import open_store

    p = argparse.ArgumentParser(prog="xfer-nvshmem-bench")
    p.add_argument("--out", default=None, help="write the results as JSON here (e.g. bench/results/...json)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--peer-device", type=int, default=0)
    p.add_argument("--staging-mib", type=int, default=256, help="NvshmemGroup.staging_bytes per peer, MiB")
    args = p.parse_args(argv)
    torch.cuda.set_device(args.device)
    dev = torch.device("cuda", args.device)
    staging = args.staging_mib << 20
    # the heap holds the send and receive staging areas (2 PEs each) and one symmetric KV cache
    kv_bytes = 2 * math.prod(DIMS.values())
    heap = os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(4 * staging + kv_bytes + (512 << 20)))
    src = np.arange(0, 256, 2)
    dst = np.arange(128, 256)[::-1].copy()
    rows, paths, teardown = [], {}, {}
    with open_store("tcp://127.0.0.1:0") as store:
        kw = dict(store=store.endpoint, name=f"bench-{os.getpid()}", size=2, staging_bytes=staging,
                  init_timeout_s=180.0)
        decode = _Decode(dict(kw, rank=1, device=args.peer_device))
        try:
            decode.send("init")  # init is collective: both PEs join together
            agent = Agent("nvshmem-bench-prefill", AgentConfig(transport="nvshmem",
                                                               nvshmem=NvshmemGroup(**kw, rank=0, device=args.device)))
            if TransportKind.NVSHMEM not in agent.transports:
                raise SystemExit(f"nvshmem bench: {agent.unavailable.get(TransportKind.NVSHMEM)}")
            tr = agent.transports[TransportKind.NVSHMEM]
            info = {"prefill": tr.info(), "decode": decode.reply("init")}
            print(f"nvshmem bench: 2 PEs up, status {info['prefill'].get('status')}", flush=True)
            try:
                nbytes, layout = _run_paths(agent, tr, decode, dev, src, dst, args.iters, rows, paths)
                info["stats"] = dict(tr.stats)
            finally:
                decode.send("stop")  # both PEs close together: the teardown is collective
                agent.close()
                try:
                    teardown["decode"] = decode.reply("stop", timeout=60)
                except SystemExit as exc:
                    teardown["decode"] = str(exc)
                teardown["prefill"] = tr.rt.teardown
        finally:
            decode.close()
    ceil_ms = rows[0]["ms"]
    for r in rows:
        r["gb_per_s"] = nbytes / (r["ms"] * 1e-3) / 1e9
        r["ratio_to_ceiling"] = ceil_ms / r["ms"]
    res = {
        "bench": "nvshmem", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(args.device), "peer_device": args.peer_device,
        "versions": _versions(), "nvshmem_symmetric_size": heap, "staging_bytes": staging,
        "workload": {**DIMS, "layout": KIND, "blocks_moved": len(src), "slice_bytes": layout.block_nbytes,
                     "payload_bytes": nbytes, "slices": len(src) * layout.num_slots},
        "pes": info, "paths": paths, "rows": rows, "teardown": teardown,
    }
    print(f"nvshmem bench on {res['device']} (PE 1 on cuda:{args.peer_device}, NVSHMEM status "
          f"{info['prefill']['status']}): {res['workload']['slices']} slices, {nbytes / 2**20:.0f} MiB")
    print(f"{'what':<46}{'ms':>9}{'p99 ms':>9}{'GB/s':>9}{'x ceiling':>11}")
    for r in rows:
        print(f"{r['name']:<46}{r['ms']:>9.3f}{r['p99_ms']:>9.3f}{r['gb_per_s']:>9.0f}{r['ratio_to_ceiling']:>11.3f}")
    for path, d in paths.items():
        lat = d["one_block_request_ms"]
        print(f"{path}: verified, counted as {d['counted_as']}; 1-block request ({layout.num_slots} slices): "
              f"p50 {lat['p50']:.3f} ms, p99 {lat['p99']:.3f} ms")
    print(f"teardown: {teardown}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
