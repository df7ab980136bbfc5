"""NVSHMEM transport benchmark: two PEs (processes) on one GPU by default, or one PE; the seed case.

    python -m xfer.bench.nvshmem_bench --out bench/results/nvshmem_h200.json [--peer-device 0]
    python -m xfer.bench.nvshmem_bench --pes 1 [--chunk-mib 4] [--paths staged]

``--pes 2`` (default): this process is PE 0 (prefill); a spawned process is PE 1 (decode); the
group's unique id goes through a TCPStore hosted here. ``--pes 1``: both agents live in this
process and share PE 0 (the decode agent's command loop runs on a thread), so every put is a put
of the PE to itself (``SelfSignals``), as in the GPU test ``test_gpu_one_pe_puts_to_itself``.

Moves 64 layers x K/V x 128 of 256 blocks x 32 KiB (512 MiB) through the xfer API, end to end (call
-> bytes in the decode cache -> notification delivered -> acknowledged), on both paths: *staged*
(gather -> symmetric staging -> put-with-signal -> scatter; plain torch KV caches) and *direct* (KV
caches on the symmetric heap; one copy_blocks into the peer). Every path is verified byte-exact
(digests of the destination blocks, the rest still poisoned) before it is timed, beside the
same-bytes contiguous device copy timed in the same run. A verifying write still in flight after
``--snapshot-s`` prints both PEs' signal words and lanes; a failed one prints them again (the
decode side's through its command loop, bounded: a stuck decode PE never hangs the bench).

``--pes 2 --peer-device 1`` puts PE 1 on another GPU (NVSHMEM's normal mode, one PE per GPU);
``--peer-ceiling`` then adds, after both PEs finalized, the NVLink ceiling of the same bytes
(``cudaMemcpyPeerAsync`` both ways, peer access enabled: ``bench/peer_copy.py``) as
``peer_ceiling`` and a ``ratio_to_peer_ceiling`` on every row (reads against the pull).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import threading
import traceback

import numpy as np
import torch

from xfer.bench.ipc_bench import median_ms

KIND = "vllm_flash_attn_nhd"
DIMS = dict(num_layers=64, num_blocks=256, block_size=16, num_heads=8, head_dim=128)  # bf16: 32 KiB slices
POISON = 0xA5
DESCRIBE_S = 5.0  # bound of each host call of a diagnostic report (a stuck GPU must not hang it)


def _say(msg: str) -> None:
    print(f"nvshmem bench: {msg}", flush=True)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _caches(tr, memory: str, dims: dict, seed):
    """A KV cache on ``tr``'s PE device: random (``seed``) or poisoned; symmetric memory is collective."""
    from xfer import make_kv_cache

    device = tr.rt.device
    empty = tr.symmetric_empty if memory == "symmetric" else torch.empty
    tensors, layout = make_kv_cache(KIND, device=device, empty=empty, **dims)
    gen = torch.Generator(device=device).manual_seed(seed or 0)
    for t in tensors:
        b = t.view(-1).view(torch.uint8)
        if seed is None:
            b.fill_(POISON)
        else:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=device, generator=gen))
    _sync(device)
    return tensors, layout


def describe_pe(tr, limit: float | None = None) -> dict:
    """This PE's signal words, lanes, stats and transport threads; every host call bounded by
    ``limit`` (default DESCRIBE_S)."""
    from xfer.bench.nvshmem_probe import _host, thread_stacks

    limit = limit or DESCRIBE_S
    words, err, _ = _host(tr.rt.describe, limit)
    lanes, lerr, _ = _host(lambda: repr(getattr(tr.rt, "lanes", None)), limit)
    return {"words": err or words, "lanes": lerr or lanes, "stats": dict(tr.stats),
            "threads": thread_stacks("xfer-nvshmem")}


def _agent(name: str, group_kw: dict, config_kw: dict):
    from xfer import Agent, AgentConfig, TransportKind
    from xfer.config import NvshmemGroup

    agent = Agent(name, AgentConfig(transport="nvshmem", nvshmem=NvshmemGroup(**group_kw), **config_kw))
    if TransportKind.NVSHMEM not in agent.transports:
        reason = agent.unavailable.get(TransportKind.NVSHMEM)
        agent.close()
        raise RuntimeError(f"nvshmem unavailable: {reason}")
    return agent, agent.transports[TransportKind.NVSHMEM]


def _decode_main(conn, group_kw, config_kw, dims) -> None:
    """The decode agent: owns the destination caches; answers digests of blocks. Its own process
    (PE 1) or, with one PE, a thread of the prefill process sharing PE 0. Replies are (cmd, status,
    value); the transport runs on threads of its own, so ``describe`` is answered while a transfer
    into this PE is stuck."""
    from xfer.bench.target import block_digests, untouched

    agent, tr, caches = None, None, {}
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "init":
                agent, tr = _agent("nvshmem-bench-decode", group_kw, config_kw)
                out = tr.info()
            elif cmd == "region":  # (name, memory): collective when memory == "symmetric"
                caches[arg[0]] = _caches(tr, arg[1], dims, None)
                agent.register(arg[0], *caches[arg[0]])
                out = agent.metadata()
            elif cmd == "check":  # (region, ids)
                tensors, layout = caches[arg[0]]
                _sync(tr.rt.device)
                out = (block_digests(layout, tensors, arg[1]), untouched(layout, tensors, arg[1]))
            elif cmd == "drain":
                out = len(agent.notifications())
            elif cmd == "describe":
                out = describe_pe(tr, arg) if tr is not None else {"words": "not initialised"}
            elif cmd == "stop":
                if agent is not None:
                    agent.close()
                out = tr.rt.teardown if tr is not None else "never initialised"
            else:
                raise ValueError(cmd)
            conn.send((cmd, "ok", out))
        except BaseException as exc:  # noqa: BLE001 - printed by the parent
            conn.send((cmd, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        if cmd == "stop":
            break


class _Decode:
    """The decode agent's command loop: in a spawned process (its own PE) or on a thread here (one
    PE shared by both agents, like the tests' ``PeThread``)."""

    def __init__(self, group_kw, config_kw, dims, in_process: bool = False):
        self.stopped = False
        if in_process:
            self.conn, child = mp.Pipe()
            self.proc = threading.Thread(target=_decode_main, args=(child, group_kw, config_kw, dims),
                                         name="nvshmem-bench-decode", daemon=True)
        else:
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_decode_main, args=(child, group_kw, config_kw, dims), daemon=True)
        self.proc.start()

    def _state(self) -> str:
        alive = self.proc.is_alive()
        return f"alive: {alive}" + ("" if alive else f", exit code {getattr(self.proc, 'exitcode', None)}")

    def send(self, cmd, arg=None):
        self.stopped = self.stopped or cmd == "stop"
        self.conn.send((cmd, arg))

    def reply(self, what, timeout=600.0):
        """The reply to ``what``; replies to earlier commands that came late are dropped."""
        while True:
            if not self.conn.poll(timeout):
                raise SystemExit(f"nvshmem bench: the decode agent did not answer {what!r} within {timeout:.0f} s "
                                 f"({self._state()})")
            try:
                cmd, status, out = self.conn.recv()
            except EOFError:
                raise SystemExit(f"nvshmem bench: the decode agent died during {what!r} ({self._state()})") from None
            if cmd == what:
                break
        if status != "ok":
            raise SystemExit(f"nvshmem bench: the decode agent failed {what!r}:\n{out}")
        return out

    def call(self, cmd, arg=None, timeout=600.0):
        self.send(cmd, arg)
        return self.reply(cmd, timeout)

    def describe(self, timeout: float | None = None) -> dict:
        """The decode PE's words, lanes, stats and threads; never raises, never waits past ``timeout``
        (default: a little more than the decode side's own bounds)."""
        try:
            return self.call("describe", DESCRIBE_S, timeout=timeout or 2 * DESCRIBE_S + 5)
        except (SystemExit, OSError) as exc:
            return {"words": f"no answer: {exc}"}

    def close(self):
        if self.proc.is_alive() and not self.stopped:
            try:
                self.call("stop", timeout=60)
            except (SystemExit, OSError):
                pass
        self.proc.join(10)
        if self.proc.is_alive() and hasattr(self.proc, "kill"):
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


def _report(tr, decode) -> str:
    """Both sides' state, each bounded (the decode side through its command loop)."""
    mine, theirs = describe_pe(tr), decode.describe()
    lines = []
    for who, d in (("prefill (sender)", mine), ("decode (receiver)", theirs)):
        lines.append(f"  {who}: {d.get('words')}\n  {who} lanes: {d.get('lanes')}\n  {who} stats: {d.get('stats')}")
        if d.get("threads"):
            lines.append(f"  {who} lane threads:\n{d['threads']}")
    return "\n".join(lines)


def _verify_wait(t, tr, decode, path: str, snapshot_s: float) -> None:
    """Wait for the verifying write; past ``snapshot_s`` print both sides' state while it is in flight."""
    try:
        t.wait(timeout=snapshot_s)
        return
    except Exception:  # noqa: BLE001 - the caller's wait timed out, or the transfer ended failed
        if t.done():
            raise
    _say(f"{path} path: the verifying write is still {t.poll().name} after {snapshot_s:g} s; state now:\n"
         f"{_report(tr, decode)}")
    t.wait()


def _run_paths(agent, tr, decode, src, dst, args, dims, rows, paths):
    """Verify, then time, each path; appends to ``rows`` and ``paths``; returns (payload bytes, layout)."""
    from xfer.bench.target import block_digests
    from xfer.transports.nvshmem import proto as proto

    dev, sync = tr.rt.device, (lambda: _sync(tr.rt.device))
    one_pe = tr.rt.size == 1
    nbytes = layout = None
    for path, memory in (("staged", "torch"), ("direct", "symmetric")):
        if path not in args.paths:
            paths[path] = {"skipped": "not in --paths"}
            continue
        region = f"kv_{path}"
        decode.send("region", (region, memory))  # collective for symmetric memory: both PEs allocate together
        tensors, layout = _caches(tr, memory, dims, seed=1)
        agent.register(region, tensors, layout)
        peer = agent.connect(decode.reply("region"))
        plan = proto.plan_chunks(len(src), layout.bytes_per_block, tr.rt.plan.chunk_cap, agent.config.chunk_bytes)
        per = min(plan.per, len(src))
        before = dict(tr.stats)
        chunking = (f" ({plan.chunks} chunk(s) of {per} blocks, {per * layout.bytes_per_block / 2**20:g} MiB; "
                    f"chunk cap {tr.rt.plan.chunk_cap / 2**20:g} MiB)" if path == "staged" else "")
        _say(f"{path} path ({memory} KV caches, {'one PE: put to itself' if one_pe else 'PE 0 -> PE 1'}): "
             f"verifying one write of {len(src)} blocks{chunking}")
        t = agent.write(peer, src, dst, region=region, peer_region=region, timeout=args.verify_s)
        try:
            _verify_wait(t, tr, decode, path, args.snapshot_s)
        except Exception as exc:  # noqa: BLE001 - the state of both PEs says why
            raise SystemExit(f"nvshmem bench: {path} path: the verifying write failed: {exc!r}\n"
                             f"{_report(tr, decode)}") from None
        taken = {k: v - before.get(k, 0) for k, v in tr.stats.items() if v != before.get(k, 0)}
        digests, clean = decode.call("check", (region, dst.tolist()))
        if not clean or digests != block_digests(layout, tensors, src):
            raise SystemExit(f"nvshmem bench: {path} path: destination bytes differ from the source "
                             f"(untouched blocks clean: {clean}); refusing to time")
        if not taken.get(f"{path}_write"):
            why = f"the transport did not take the {path} path here (counted as {taken})"
            _say(f"{path} path: verified, but skipped: {why}")
            paths[path] = {"verified": True, "skipped": why, "counted_as": taken}
            decode.call("drain")
            continue
        paths[path] = {"verified": True, "counted_as": taken, "verify_ms": 1e3 * t.elapsed,
                       **({"chunks": plan.chunks, "blocks_per_chunk": per} if path == "staged" else {})}
        _say(f"{path} path verified byte-exact ({t.elapsed * 1e3:.1f} ms); timing")
        nbytes = len(src) * layout.bytes_per_block
        if not rows:
            a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            b = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            ceil_ms, _ = median_ms(lambda a=a, b=b: b.copy_(a), args.iters, sync=sync)
            rows.append({"name": "contiguous device copy (ceiling)", "ms": ceil_ms, "p99_ms": ceil_ms})
            del a, b

        def one(op="write", region=region, peer=peer):
            s, d = (src, dst) if op == "write" else (dst, src)
            getattr(agent, op)(peer, s, d, region=region, peer_region=region, timeout=120).wait()

        def burst(k=8, region=region, peer=peer):
            from xfer.bench.ipc_bench import windowed

            # --burst-window n: request i writes the (i % n)-th of n disjoint sets of decode blocks, at
            # most n in flight (grants refuse two unfenced writers of one block); 0: k writes of dst at once
            n = min(args.burst_window, dims["num_blocks"] // len(dst)) or 0
            sets = [dst] + [np.setdiff1d(np.arange(dims["num_blocks"]), dst)[j * len(dst):(j + 1) * len(dst)]
                            for j in range(n - 1)]
            windowed(lambda i: agent.write(peer, src, sets[i % n] if n else dst, region=region, peer_region=region,
                                           timeout=120), k, n)

        for name, fn, div in ((f"{path}: write, one request end to end", one, 1),
                              (f"{path}: write, 8 back to back (per request)", burst, 8),
                              (f"{path}: read (pull), one request", lambda: one("read"), 1)):
            ms, p99 = median_ms(fn, max(3, args.iters // div), sync=sync)
            rows.append({"name": name, "ms": ms / div, "p99_ms": p99 / div})
            _say(f"{name}: {ms / div:.3f} ms")
        decode.call("drain")
        lat, lat99 = median_ms(lambda region=region, peer=peer: agent.write(
            peer, [5], [7], region=region, peer_region=region, timeout=60).wait(), args.iters, sync=sync)
        paths[path]["one_block_request_ms"] = {"p50": lat, "p99": lat99}
        _say(f"{path}: 1-block request p50 {lat:.3f} ms")
        decode.call("drain")
    return nbytes, layout


def _heap_bytes(pes: int, staging: int, dims: dict) -> int:
    """Per PE: the send and receive staging areas (``pes * staging`` each), the symmetric KV caches
    this PE holds (one; both agents' with one PE) and a margin."""
    from xfer import make_kv_cache

    layout = make_kv_cache(KIND, device="meta", **dims)[1]
    kv = layout.bytes_per_block * layout.num_blocks
    return 2 * pes * staging + (2 if pes == 1 else 1) * kv + (512 << 20)


def main(argv=None, *, dims: dict | None = None, decode_thread: bool = False) -> dict:
    """``dims``: the KV cache shape (default DIMS). ``decode_thread``: run the decode agent's command
    loop on a thread of this process even with 2 PEs (CPU dry runs on one fake fabric only: a real
    process holds one PE). The CPU tests pass both."""
    from xfer.bench.target import describe_device
    from xfer.store import open_store

    p = argparse.ArgumentParser(prog="xfer-nvshmem-bench")
    p.add_argument("--out", default=None, help="write the results as JSON here (e.g. bench/results/...json)")
    p.add_argument("--pes", type=int, choices=(1, 2), default=2,
                   help="2: decode is PE 1 in a spawned process; 1: both agents in this process share PE 0")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--peer-device", type=int, default=0, help="PE 1's CUDA device (--pes 2)")
    p.add_argument("--staging-mib", type=int, default=256, help="NvshmemGroup.staging_bytes per peer, MiB")
    p.add_argument("--chunk-mib", type=float, default=None,
                   help="AgentConfig.chunk_bytes, MiB: the staged path's chunk is min(this, staging/8), whole "
                        "blocks, at least one (default: the AgentConfig default, 64 MiB)")
    p.add_argument("--paths", default="staged,direct", help="comma-separated: staged, direct")
    p.add_argument("--verify-s", type=float, default=30.0, help="deadline of each verifying write")
    p.add_argument("--burst-window", type=int, default=0, help="back to back: requests spread over this many "
                   "disjoint decode block sets, one in flight per set (at most what the cache holds: 2); 0: as before")
    p.add_argument("--peer-ceiling", action="store_true",
                   help="after the PEs finalized, time cudaMemcpyPeerAsync of the same bytes, device <-> PE 1's device")
    p.add_argument("--snapshot-s", type=float, default=10.0,
                   help="print both PEs' words and lanes if a verifying write is still in flight after this")
    args = p.parse_args(argv)
    args.paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not set(args.paths) <= {"staged", "direct"}:
        p.error(f"--paths takes staged and/or direct, got {args.paths}")
    dims = dict(dims or DIMS)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(args.device)
    staging = args.staging_mib << 20
    config_kw = {} if args.chunk_mib is None else {"chunk_bytes": max(1, int(args.chunk_mib * (1 << 20)))}
    heap = os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(_heap_bytes(args.pes, staging, dims)))
    nb = dims["num_blocks"]
    src = np.arange(0, nb, 2)
    dst = np.arange(nb // 2, nb)[::-1].copy()
    rows, paths, teardown, info = [], {}, {}, {}
    nbytes = layout = None
    with open_store("tcp://127.0.0.1:0") as store:
        kw = dict(store=store.endpoint, name=f"bench-{os.getpid()}", size=args.pes, staging_bytes=staging,
                  init_timeout_s=180.0)
        one_pe = args.pes == 1
        decode = _Decode(dict(kw, rank=args.pes - 1, device=args.device if one_pe else args.peer_device),
                         config_kw, dims, in_process=one_pe or decode_thread)
        try:
            decode.send("init")  # init is collective: both PEs join together (with one PE: shared)
            try:
                agent, tr = _agent("nvshmem-bench-prefill", dict(kw, rank=0, device=args.device), config_kw)
            except RuntimeError as exc:
                raise SystemExit(f"nvshmem bench: {exc}") from None
            info = {"prefill": tr.info(), "decode": decode.reply("init")}
            _say(f"{args.pes} PE{'s' if args.pes > 1 else ''} up "
                 f"({'both agents share PE 0: puts to itself' if one_pe else 'decode is PE 1'}), "
                 f"status {info['prefill'].get('status')}, chunk cap {tr.rt.plan.chunk_cap / 2**20:g} MiB, "
                 f"chunk_bytes {agent.config.chunk_bytes / 2**20:g} MiB, NVSHMEM_SYMMETRIC_SIZE {heap}, "
                 f"heap: {info['prefill'].get('heap')}")
            try:
                nbytes, layout = _run_paths(agent, tr, decode, src, dst, args, dims, rows, paths)
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
    if not rows:
        raise SystemExit(f"nvshmem bench: no path was timed: {paths}")
    ceil_ms = rows[0]["ms"]
    for r in rows:
        r["gb_per_s"] = nbytes / (r["ms"] * 1e-3) / 1e9
        r["ratio_to_ceiling"] = ceil_ms / r["ms"]
    ceiling = None
    if args.peer_ceiling:  # after finalize: nothing it enables is there while NVSHMEM runs
        from xfer.bench.peer_copy import add_peer_ratios, peer_ceiling

        ceiling = peer_ceiling(args.device, args.device if one_pe else args.peer_device, nbytes, args.iters)
        add_peer_ratios(rows, ceiling)
    dev = torch.device(info["prefill"]["device"])
    status = info["prefill"].get("status")
    res = {
        "bench": "nvshmem", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": describe_device(dev)["device_name"], "peer_device": None if one_pe else args.peer_device,
        "mode": {"pes": args.pes, "status": status,
                 "agents": "both on PE 0 (self put)" if one_pe else "prefill PE 0, decode PE 1 (own process)"},
        "versions": _versions(), "nvshmem_symmetric_size": heap, "staging_bytes": staging,
        "chunk_bytes": agent.config.chunk_bytes, "chunk_cap": tr.rt.plan.chunk_cap,
        "workload": {**dims, "layout": KIND, "blocks_moved": len(src), "slice_bytes": layout.block_nbytes,
                     "payload_bytes": nbytes, "slices": len(src) * layout.num_slots},
        "pes": info, "paths": paths, "rows": rows, "teardown": teardown,
        **({"peer_ceiling": ceiling} if ceiling is not None else {}),
    }
    where = "both agents on PE 0" if one_pe else f"PE 1 on cuda:{args.peer_device}"
    print(f"nvshmem bench on {res['device']} ({args.pes} PE: {where}, NVSHMEM status {status}): "
          f"{res['workload']['slices']} slices, {nbytes / 2**20:.0f} MiB", flush=True)
    print(f"{'what':<46}{'ms':>9}{'p99 ms':>9}{'GB/s':>9}{'x ceiling':>11}")
    for r in rows:
        print(f"{r['name']:<46}{r['ms']:>9.3f}{r['p99_ms']:>9.3f}{r['gb_per_s']:>9.0f}{r['ratio_to_ceiling']:>11.3f}")
    for path, d in paths.items():
        if "skipped" in d:
            print(f"{path}: skipped: {d['skipped']}")
            continue
        lat = d["one_block_request_ms"]
        print(f"{path}: verified, counted as {d['counted_as']}; 1-block request ({layout.num_slots} slices): "
              f"p50 {lat['p50']:.3f} ms, p99 {lat['p99']:.3f} ms")
    print(f"teardown: {teardown}", flush=True)
    if ceiling is not None:
        print(f"peer ceiling (peer access {ceiling.get('peer_access')}): " + ("; ".join(
            f"{r['name']} {r['ms']:.3f} ms {r['gb_per_s']:.0f} GB/s" for r in ceiling.get("rows", []))
            or ceiling.get("error", "")))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
