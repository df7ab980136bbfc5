"""The NVLink ceiling between two GPUs: ``cudaMemcpyPeerAsync`` of the same bytes, contiguous,
with peer access enabled, and what the GPUs report about reaching each other.

    python -m xfer.bench.peer_copy --pairs 0:1[,0:2,...] [--mib 512] [--iters 20] [--out ceil.json]

Per pair ``a:b`` (``a`` is the prefill GPU, whose kernels run xfer's copies):

- ``push``: ``a`` -> ``b``, queued on a stream of ``a`` (as an ``ipc`` write runs on the writer's GPU);
- ``pull``: ``b`` -> ``a``, queued on a stream of ``a`` (as an ``ipc`` read does);
- each ``lone`` (one copy, the device synced around it) and ``back to back`` (``--burst`` copies
  queued at once, per copy);
- ``device copy on a``: the same bytes within ``a`` (HBM), the one-GPU ceiling, for reference.

The bytes of each direction are checked once before it is timed. ``a:a`` (one GPU) measures
the same copies inside one GPU, so the script runs, and is smoke-tested, on one GPU.
The runtime's own entry points are called through ctypes on the libcudart torch loaded
(``xfer.kernels.copy_engine`` finds it), so torch's copy heuristics stay out of the ceiling.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import statistics
import time

import numpy as np

import torch

# multi-GPU hosts here share NVLink: NVLink multicast stays off in every process the multi-GPU
# benchmarks start (a program using it can put the host's shared GPUs out of service)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

__all__ = ["NO_MULTICAST", "parse_pairs", "Cudart", "p2p_report", "ceiling_rows", "peer_ceiling", "add_peer_ratios",
           "main"]

_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_P2P_ATTRS = {"performance_rank": 1, "access_supported": 2, "native_atomics": 3}  # cudaDeviceP2PAttr


def parse_pairs(text: str, n_gpus: int | None = None) -> list[tuple[int, int]]:
    """``"0:1,0:2"`` -> ``[(0, 1), (0, 2)]``; every index checked against ``n_gpus`` when given."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            a, b = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"a GPU pair is written SRC:DST (e.g. 0:1), got {item!r}") from None
        for i in (a, b):
            if i < 0 or (n_gpus is not None and i >= n_gpus):
                raise ValueError(f"GPU pair {item}: index {i} is not one of this machine's {n_gpus} GPUs")
        out.append((a, b))
    if not out:
        raise ValueError(f"no GPU pair in {text!r}")
    return out


class Cudart:
    """The few runtime calls torch does not expose, on torch's own libcudart (one runtime, one
    set of primary contexts with torch)."""

    def __init__(self) -> None:
        from xfer.kernels import copy_engine

        rt = copy_engine._runtime()
        if isinstance(rt, str):
            raise RuntimeError(f"no CUDA runtime to call: {rt}")
        self.path = rt.path
        lib = ctypes.CDLL(rt.path)  # its own function objects: argtypes set here touch no one else's
        i32, vp, sz = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        lib.cudaMemcpyPeerAsync.argtypes, lib.cudaMemcpyPeerAsync.restype = [vp, i32, vp, i32, sz, vp], i32
        lib.cudaDeviceEnablePeerAccess.argtypes, lib.cudaDeviceEnablePeerAccess.restype = [i32, ctypes.c_uint], i32
        lib.cudaDeviceCanAccessPeer.argtypes = [ctypes.POINTER(i32), i32, i32]
        lib.cudaDeviceCanAccessPeer.restype = i32
        lib.cudaDeviceGetP2PAttribute.argtypes = [ctypes.POINTER(i32), i32, i32, i32]
        lib.cudaDeviceGetP2PAttribute.restype = i32
        lib.cudaGetErrorName.argtypes, lib.cudaGetErrorName.restype = [i32], ctypes.c_char_p
        lib.cudaGetLastError.argtypes, lib.cudaGetLastError.restype = [], i32
        self.lib = lib

    def _name(self, rc: int) -> str:
        self.lib.cudaGetLastError()  # clear it: torch checks the last error after its own launches
        return f"{(self.lib.cudaGetErrorName(rc) or b'?').decode()} ({rc})"

    def can_access(self, a: int, b: int) -> bool:
        v = ctypes.c_int(0)
        rc = self.lib.cudaDeviceCanAccessPeer(ctypes.byref(v), a, b)
        if rc:
            raise RuntimeError(f"cudaDeviceCanAccessPeer({a}, {b}) failed: {self._name(rc)}")
        return bool(v.value)

    def p2p_attrs(self, a: int, b: int) -> dict:
        out = {}
        for name, attr in _P2P_ATTRS.items():
            v = ctypes.c_int(0)
            rc = self.lib.cudaDeviceGetP2PAttribute(ctypes.byref(v), attr, a, b)
            out[name] = v.value if rc == 0 else f"error {self._name(rc)}"
        return out

    def enable(self, a: int, b: int) -> str:
        """Let kernels and copies on GPU ``a`` reach GPU ``b``'s memory; what happened, in words."""
        with torch.cuda.device(a):
            rc = self.lib.cudaDeviceEnablePeerAccess(b, 0)
        if rc == 0:
            return "enabled"
        if rc == _ALREADY_ENABLED:
            self.lib.cudaGetLastError()
            return "already enabled"
        return f"failed: {self._name(rc)}"

    def memcpy_peer(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        rc = self.lib.cudaMemcpyPeerAsync(dst.data_ptr(), dst.device.index, src.data_ptr(), src.device.index,
                                          src.numel() * src.element_size(), stream.cuda_stream)
        if rc:
            raise RuntimeError(f"cudaMemcpyPeerAsync {src.device} -> {dst.device} failed: {self._name(rc)}")


def p2p_report(rt: Cudart, n: int) -> dict:
    """Every ordered pair of the ``n`` GPUs: can it reach the other, and the P2P attributes."""
    out = {}
    for a in range(n):
        for b in range(n):
            if a != b:
                out[f"{a}->{b}"] = {"can_access": rt.can_access(a, b), **rt.p2p_attrs(a, b)}
    return out


def _time(fn, sync, iters: int, per: int = 1) -> dict:
    """Wall-clock ms of ``fn`` (``sync`` around each call, one warm-up), divided by ``per``."""
    fn()
    sync()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t0) / per)
    return {"ms": statistics.median(times), "p99_ms": float(np.percentile(times, 99)), "n": len(times)}


def ceiling_rows(rt: Cudart, a: int, b: int, nbytes: int, iters: int, burst: int = 8) -> list[dict]:
    """Push, pull (each lone and back to back) and the device copy on ``a``; bytes checked first."""
    stream = torch.cuda.Stream(device=a)  # every copy is queued on GPU a, like xfer's kernels
    on_a = torch.empty(nbytes, dtype=torch.uint8, device=a)
    on_b = torch.empty(nbytes, dtype=torch.uint8, device=b)
    rows = []
    cases = (("push", f"peer copy {a}->{b} (cudaMemcpyPeerAsync on GPU {a}'s stream)", on_b, on_a),
             ("pull", f"peer copy {b}->{a} (cudaMemcpyPeerAsync on GPU {a}'s stream)", on_a, on_b))
    for direction, name, dst, src in cases:
        src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=src.device,
                                generator=torch.Generator(device=src.device).manual_seed(len(rows))))
        dst.fill_(0xA5)
        torch.cuda.synchronize(a), torch.cuda.synchronize(b)
        with torch.cuda.device(a):
            rt.memcpy_peer(dst, src, stream)
        stream.synchronize()
        verified = bool(torch.equal(dst.cpu(), src.cpu()))
        if not verified:
            raise RuntimeError(f"{name}: the destination holds other bytes than the source; not timing it")

        def one(dst=dst, src=src):
            rt.memcpy_peer(dst, src, stream)

        def many(dst=dst, src=src):
            for _ in range(burst):
                rt.memcpy_peer(dst, src, stream)

        with torch.cuda.device(a):
            for label, fn, per in (("lone", one, 1), (f"{burst} back to back (per copy)", many, burst)):
                row = {"name": f"{name}, {label}", "direction": direction, "mode": "lone" if per == 1 else "burst",
                       "src": src.device.index, "dst": dst.device.index, "verified": verified,
                       **_time(fn, stream.synchronize, iters, per)}
                rows.append(row)
    dst = torch.empty_like(on_a)
    rows.append({"name": f"device copy on GPU {a} (same bytes, HBM)", "direction": "local", "mode": "lone",
                 "src": a, "dst": a, "verified": None,
                 **_time(lambda: dst.copy_(on_a), lambda: torch.cuda.synchronize(a), iters)})
    for r in rows:
        r["gb_per_s"] = nbytes / (r["ms"] * 1e-3) / 1e9
    return rows


def peer_ceiling(a: int, b: int, nbytes: int, iters: int, burst: int = 8) -> dict:
    """The ceiling rows of pair ``a:b`` inside a benchmark's own run (peer access enabled first,
    both ways): ``{"peer_access": ..., "rows": [...]}``, or ``{"error": why}``."""
    try:
        rt = Cudart()
        access = None if a == b else {f"{a}->{b}": rt.enable(a, b), f"{b}->{a}": rt.enable(b, a)}
        return {"peer_access": access, "rows": ceiling_rows(rt, a, b, nbytes, iters, burst)}
    except RuntimeError as exc:
        return {"error": str(exc)}


def add_peer_ratios(rows: list[dict], ceiling: dict) -> None:
    """Each row's ``ratio_to_peer_ceiling``: the lone peer copy of its direction (a row named
    for a read or a pull moves the peer's bytes here; any other, this GPU's to the peer) / the row."""
    lone = {r["direction"]: r["ms"] for r in ceiling.get("rows", []) if r["mode"] == "lone"}
    for r in rows:
        direction = "pull" if ("read" in r["name"] or "pull" in r["name"]) else "push"
        if direction in lone and r.get("ms"):
            r["ratio_to_peer_ceiling"] = lone[direction] / r["ms"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="xfer-peer-copy", description=__doc__.splitlines()[0])
    p.add_argument("--pairs", default="0:1", help="GPU pairs SRC:DST, comma-separated (default 0:1)")
    p.add_argument("--mib", type=float, default=512, help="bytes per copy, MiB (default 512: the seed case)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--burst", type=int, default=8, help="copies queued at once in the back-to-back rows")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("peer_copy: no CUDA device in this process")
    n = torch.cuda.device_count()
    try:
        pairs = parse_pairs(args.pairs, n)
    except ValueError as exc:
        p.error(str(exc))
    nbytes = int(args.mib * (1 << 20))
    rt = Cudart()
    doc = {"bench": "peer_copy", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "gpus": n, "devices": [torch.cuda.get_device_name(i) for i in range(n)],
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "cudart": rt.path},
           "payload_bytes": nbytes, "p2p": p2p_report(rt, n), "pairs": []}
    for a, b in pairs:
        entry = {"src": a, "dst": b, "peer_access": None}
        if a != b:  # both ways: pushes from a write into b, pulls from a read b
            entry["peer_access"] = {f"{a}->{b}": rt.enable(a, b), f"{b}->{a}": rt.enable(b, a)}
        try:
            entry["rows"] = ceiling_rows(rt, a, b, nbytes, args.iters, args.burst)
        except RuntimeError as exc:
            entry["error"] = str(exc)
        doc["pairs"].append(entry)
        torch.cuda.empty_cache()
    for e in doc["pairs"]:
        print(f"GPU {e['src']} -> GPU {e['dst']}, {nbytes / 2**20:g} MiB, peer access {e['peer_access']}")
        for r in e.get("rows", []):
            print(f"  {r['name']:<76}{r['ms']:>9.3f} ms{r['gb_per_s']:>9.0f} GB/s")
        if "error" in e:
            print(f"  error: {e['error']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


if __name__ == "__main__":
    main()
