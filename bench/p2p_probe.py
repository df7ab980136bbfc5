"""Can a copy on GPU A reach a KV cache of another process on GPU B, mapped by CUDA IPC? Each way
of mapping it, in a fresh process, checked byte for byte and timed.

    python -m xfer.bench.p2p_probe --local 0 --peer 1 [--out probe.json]

torch opens a CUDA IPC handle under a device guard of the index it is given
(``UntypedStorage._new_shared_cuda(device, ...)``), with ``cudaIpcMemLazyEnablePeerAccess``.
The ``ipc`` transport passes the *peer's* GPU (``IpcTransport.map_peer``), so the handle is
opened in B's context and nothing enables A's access to B; the copy kernel then runs on A.
Whether A can then read and write those bytes, and at what speed, is what this probe measures,
one variant per process (a fault kills a process's CUDA context, not the probe):

- ``as the ipc transport maps it``: opened on B, no peer access enabled;
- ``+ peer access enabled``: the same, after ``cudaDeviceEnablePeerAccess(B)`` on A;
- ``opened on the local GPU``: opened under A's guard (the lazy flag then enables the access);
- ``copy engines, as the transport maps it``: the first mapping, copied by ``cudaMemcpyBatchAsync``.

Each variant pulls 128 blocks of the peer's cache into its own (checked against the peer's
digests), pushes 128 others back (the peer checks them), then times the pull. Every variant runs
against a peer whose cache comes from torch's default allocator (``legacy``: one
``cudaIpcMemHandle`` per allocation) and one with ``expandable_segments`` (virtual memory:
torch maps the imported segment itself and grants access to the device it opens it under and to
those its own allocator enabled peer access for, which a raw ``cudaDeviceEnablePeerAccess`` is not). With A == B (one GPU) every variant is the
one-GPU case: the probe then only shows that it runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import statistics
import time
import traceback

import numpy as np

from xfer.bench.peer_copy import NO_MULTICAST

__all__ = ["VARIANTS", "main"]

VARIANTS = {  # name -> (open the handle on the local GPU, enable peer access first, copy path)
    "as the ipc transport maps it": (False, False, "kernel"),
    "+ peer access enabled": (False, True, "kernel"),
    "opened on the local GPU": (True, False, "kernel"),
    "copy engines, as the transport maps it": (False, False, "batch"),
}
KIND = "vllm_flash_attn_nhd"
DIMS = dict(num_layers=8, num_blocks=512, block_size=16, num_heads=8, head_dim=128)  # 32 KiB slices, 512 KiB blocks
PULL, PUSH = np.arange(0, 256, 2), np.arange(256, 512, 2)  # the peer's blocks read, and written


def _set_blocks(layout, tensors, ids, make) -> None:
    """Blocks ``ids`` of every (layer, K/V) view := ``make(byte shape, device)`` (uint8)."""
    import torch

    for v in layout.views(tensors):
        idx = torch.as_tensor(np.asarray(ids), device=v.device)
        shape = tuple(v[idx].shape)
        v[idx] = make(shape[:-1] + (shape[-1] * v.element_size(),), v.device).view(v.dtype)


def _exporter(conn, device: int, alloc: str) -> None:
    """The peer: a random KV cache on ``device`` (``alloc``: legacy or expandable), exported;
    answers digests of its blocks."""
    import torch

    if alloc == "expandable":  # before this process's first CUDA allocation
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")

    from xfer import make_kv_cache
    from xfer.bench.target import POISON, block_digests
    from xfer.transports.onesided.ipc import encode_share

    try:
        torch.cuda.set_device(device)
        tensors, layout = make_kv_cache(KIND, device=f"cuda:{device}", **DIMS)
        gen = torch.Generator(device=f"cuda:{device}").manual_seed(5)
        for t in tensors:
            b = t.view(-1).view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=b.device, generator=gen))
        torch.cuda.synchronize(device)
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        shares = [encode_share(t.untyped_storage()._share_cuda_(), t.data_ptr() - t.untyped_storage().data_ptr(), uuid)
                  for t in tensors]
        conn.send({"shares": shares, "pull_digests": block_digests(layout, tensors, PULL)})
        while (cmd := conn.recv()) != "stop":
            op, ids = cmd
            torch.cuda.synchronize(device)
            if op == "poison":
                _set_blocks(layout, tensors, ids, lambda shape, dev: torch.full(shape, POISON, dtype=torch.uint8,
                                                                               device=dev))
                torch.cuda.synchronize(device)
            conn.send(block_digests(layout, tensors, ids))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _importer(conn, local: int, peer: int, shares: list, variant: str) -> None:
    """One variant in a fresh process: map the peer's cache, pull, push, time the pull."""
    import torch

    from xfer import make_kv_cache
    from xfer.bench.target import POISON, block_digests
    from xfer.kernels import copy_blocks
    from xfer.transports.onesided.ipc import decode_share

    on_local, enable, path = VARIANTS[variant]
    out: dict = {"variant": variant, "path": path}
    try:
        torch.cuda.set_device(local)
        if enable and local != peer:
            from xfer.bench.peer_copy import Cudart

            out["peer_access"] = Cudart().enable(local, peer)
        if path != "kernel":
            from xfer.kernels import copy_engine

            why = copy_engine.available(path)
            if why:
                conn.send({**out, "skipped": why})
                return
        layout = make_kv_cache(KIND, device="meta", **DIMS)[1]
        mapped = []
        for i, share in enumerate(shares):
            args = decode_share(share)
            index = local if on_local else peer
            storage = torch.UntypedStorage._new_shared_cuda(index, *args[1:])
            flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage)
            start = share["tensor_offset"]
            mapped.append(flat[start:start + layout.tensor_numel[i] * layout.itemsize].view(layout.dtype))
        mine, _ = make_kv_cache(KIND, device=f"cuda:{local}", **DIMS)
        for t in mine:
            t.view(-1).view(torch.uint8).fill_(POISON)
        gen = torch.Generator(device=f"cuda:{local}").manual_seed(6)  # the blocks pushed: random bytes
        _set_blocks(layout, mine, PUSH, lambda shape, dev: torch.randint(0, 256, shape, dtype=torch.uint8, device=dev,
                                                                         generator=gen))
        stream = torch.cuda.Stream(device=local)
        torch.cuda.synchronize(local)
        copy_blocks(layout, mapped, PULL, layout, mine, PULL, stream=stream, path=path).synchronize()
        out["pull_digests"] = block_digests(layout, mine, PULL)
        copy_blocks(layout, mine, PUSH, layout, mapped, PUSH, stream=stream, path=path).synchronize()
        out["push_digests"] = block_digests(layout, mine, PUSH)
        times = []
        for i in range(6):  # the first is a warm-up
            t0 = time.perf_counter()
            copy_blocks(layout, mapped, PULL, layout, mine, PULL, stream=stream, path=path).synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        nbytes = len(PULL) * layout.bytes_per_block
        out.update(pull_ms=1e3 * statistics.median(times), pull_gb_per_s=nbytes / statistics.median(times) / 1e9,
                   bytes=nbytes)
    except BaseException as exc:  # noqa: BLE001 - the variant's verdict
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        out["traceback"] = traceback.format_exc()[-2000:]
    conn.send(out)


def _call(ctx, target, args, timeout: float) -> dict:
    """Run ``target(conn, *args)`` in a spawned process; its one message, or why there is none."""
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(writer, *args), daemon=True)
    proc.start()
    try:
        if reader.poll(timeout):
            return reader.recv()
        return {"error": f"no answer within {timeout:g} s (exit code {proc.exitcode})"}
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _probe(ctx, args, alloc: str, out: list) -> None:
    """Every variant against one peer process whose cache ``alloc`` allocated."""
    reader, writer = ctx.Pipe()
    exporter = ctx.Process(target=_exporter, args=(writer, args.peer, alloc), daemon=True)
    exporter.start()
    try:
        if not reader.poll(args.timeout_s):
            out.append({"allocation": alloc, "error": f"the peer process on GPU {args.peer} did not start"})
            return
        peer = reader.recv()
        if "error" in peer:
            out.append({"allocation": alloc, "error": f"the peer process failed: {peer['error']}"})
            return
        for variant in VARIANTS:
            res = {"allocation": alloc, **_call(ctx, _importer, (args.local, args.peer, peer["shares"], variant),
                                                args.timeout_s)}
            if "pull_digests" in res:
                res["pull_ok"] = res.pop("pull_digests") == peer["pull_digests"]
            if "push_digests" in res:
                reader.send(("check", PUSH.tolist()))  # the peer's own view of the pushed blocks
                res["push_ok"] = (reader.recv() == res.pop("push_digests")) if reader.poll(args.timeout_s) else None
            reader.send(("poison", PUSH.tolist()))  # the next variant's push lands on poison again
            if reader.poll(args.timeout_s):
                reader.recv()
            res["ok"] = bool(res.get("pull_ok") and res.get("push_ok"))
            out.append(res)
            verdict = (f"skipped: {res['skipped']}" if "skipped" in res else
                       f"pull {'ok' if res.get('pull_ok') else 'WRONG'}, push {'ok' if res.get('push_ok') else 'WRONG'}, "
                       f"{res['pull_gb_per_s']:.0f} GB/s" if "pull_gb_per_s" in res else f"error: {res.get('error')}")
            print(f"{alloc:<11}{variant:<42} {verdict}", flush=True)
    finally:
        try:
            reader.send("stop")
        except OSError:
            pass
        exporter.join(10)
        if exporter.is_alive():
            exporter.kill()


def main(argv=None) -> dict:
    import os

    os.environ.update(NO_MULTICAST)
    p = argparse.ArgumentParser(prog="xfer-p2p-probe", description=__doc__.splitlines()[0])
    p.add_argument("--local", type=int, default=0, help="the GPU whose copies reach into the peer (default 0)")
    p.add_argument("--peer", type=int, default=1, help="the GPU holding the peer's cache (default 1)")
    p.add_argument("--timeout-s", type=float, default=90.0, help="bound of each process's work")
    p.add_argument("--allocs", default="legacy,expandable", help="the peer's allocators to probe (default both)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if not set(args.allocs.split(",")) <= {"legacy", "expandable"}:
        p.error(f"--allocs takes legacy and/or expandable, got {args.allocs!r}")
    ctx = mp.get_context("spawn")
    doc = {"bench": "p2p_probe", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "local": args.local, "peer": args.peer, "variants": []}
    for alloc in args.allocs.split(","):
        _probe(ctx, args, alloc, doc["variants"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


if __name__ == "__main__":
    main()
