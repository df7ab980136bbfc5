"""UCX transport benchmark: xfer ``write`` of three KV cases between two processes, against the
wire's ceilings measured in the same run.

Per case (64 layers x 128 blocks x 32 KiB, 32 x 256 x 4 KiB, 32 x 64 x 512 B; every other block of
a cache twice as large, so no two slices are adjacent), interleaved iteration by iteration:

- ``tcp``: one contiguous send of the same bytes over a plain TCP socket + a 1-byte ack;
- ``ucxx``: one contiguous ucxx tag send of the same bytes + an 8-byte ack, UCX tuned as the
  transport tunes it; ``ucxx-default``: the same with UCX's defaults (what ucxx gets out of the box);
- ``xfer``: ``agent.write(...)`` of the blocks until ``wait()`` returns (the peer has scattered every
  byte, delivered its notification and acknowledged).

Every row is timed right after the same server call (the poison of the peer's whole cache,
which every timed write needs anyway), so each starts from the same state: the client idle for as
long (~0.1 s for the 512 MiB case's 1 GiB cache), the server's caches as cold. On a VM a core left
idle runs the next work slower (a lone 2 MiB write: 0.78 ms after 1 ms idle, 1.1-1.6 ms after
10 ms), so a row timed after a shorter idle than the others would be favoured.

Bytes are verified (digests of the destination blocks, untouched blocks still poisoned) before
timing. ``post_us`` is the wall time of the ``write`` call alone (host CPU to post the transfer),
``post_cpu_us`` its thread CPU time (posted to an idle agent), ``post_burst_cpu_us`` the thread
CPU time of one ``write`` among eight posted back to back. ``burst_vs_ucxx`` (``x8 /ucxx``): those
eight writes (of the same blocks) in flight at once, their aggregate rate from the first post to
the last ``wait()`` (median of 3 bursts, each checked on fresh poison) against one contiguous
ucxx send's rate: how much of the wire a lone write's fixed costs leave when several overlap.
``ids_check_cold_cpu_us`` is the post's own two id checks timed alone in the same state as ``post_cpu_us`` (right after a transfer
moved the bytes through the host's caches), ``ids_check_warm_cpu_us`` the same checks warm: their
ratio is what cold caches cost any code at that point on this host.

``--device cuda[:N]`` puts both processes' KV caches on GPU N (two processes sharing it) and
measures, instead of the host ceilings:

- ``copy``: a same-bytes contiguous device copy (``b.copy_(a)``, timed with ``torch.cuda.synchronize``);
- ``ucxx``: one contiguous ucxx tag send of the same bytes from a device buffer into a device
  buffer of the other process + an 8-byte host ack (UCX picks cuda_ipc / cuda_copy as it likes;
  the JSON records UCX_TLS and the contexts' transports; the received bytes are checked once).

``--peer-device cuda:M`` puts the server's KV caches (and its ucxx buffer) on GPU M instead: UCX
on device memory across two GPUs; ``copy`` is then the same bytes copied from GPU N into GPU M
(``copy_``, peer access as torch sets it up), both devices synced.

``--chunk-bytes`` sets ``XFER_UCX_CHUNK_BYTES`` (host slots, e.g. 64M) for both processes. A host
transfer is still cut into at least ``XFER_UCX_MIN_CHUNKS`` (16) chunks, ``XFER_UCX_MIN_CHUNKS_IN_PLACE``
(4) where either side moves its blocks in place, so 64M slots move the 512 MiB case as 8 x 64 MiB.
``bench/ucx_floor.py`` measures what UCX and the host's memory make of the small cases' blocks
without xfer (their floors). ``--device-chunk-bytes`` sets ``XFER_UCX_DEVICE_CHUNK_BYTES`` (device slots, 64M by
default; a device-to-device transfer is cut into as few chunks as fit).

    python bench/ucx_bench.py [--iters 7] [--netns] [--json out.json] [--device cuda:0] [--chunk-bytes 64M]
                              [--device-chunk-bytes 128M]

``--netns`` runs the two processes in two network namespaces joined by a veth pair (ci/netns.sh;
root needed). The server side is this script with ``--serve``, driven over its stdin/stdout.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # name: (layers, blocks moved, block_size, heads, head_dim) in bf16
    "64x128x32KiB": (64, 128, 16, 8, 128),
    "32x256x4KiB": (32, 256, 16, 1, 128),
    "32x64x512B": (32, 64, 16, 1, 16),
}
KIND = "vllm_flash_attn_nhd"
POISON = 0xA5
HOST_CEILINGS = ("tcp", "ucxx", "ucxx-default")
BURST, BURSTS = 8, 3  # writes in flight at once, and how many such bursts are timed (median)
CUDA_CEILINGS = ("copy", "ucxx")


def dims_of(case: str) -> dict:
    layers, n, bs, heads, hd = CASES[case]
    return dict(num_layers=layers, num_blocks=2 * n, block_size=bs, num_heads=heads, head_dim=hd)


def ids_of(case: str) -> tuple[list[int], list[int]]:
    n = CASES[case][1]
    return list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))[::-1]


# ---- the ucxx contiguous ceiling ---------------------------------------------------------------
class UcxxPipe:
    """A ucxx worker of its own, driven in blocking mode from the calling thread (``spin``: polled
    without sleeping, the device ceiling's best case whether or not UCX's CUDA transports wake it)."""

    def __init__(self, options: dict, spin: bool = False):
        import select

        import ucxx._lib.libucxx as u
        from ucxx._lib.arr import Array

        self.u, self.Array = u, Array
        self.ctx = u.UCXContext(options, feature_flags=(u.Feature.TAG, u.Feature.WAKEUP))
        self.w = u.UCXWorker(self.ctx)
        self.w.init_blocking_progress_mode()
        self.ep, self._eps, self.spin = None, [], spin
        self._poll = select.epoll()
        self._poll.register(self.w.epoll_file_descriptor, select.EPOLLIN)

    def info(self) -> dict:
        """What UCX made of this context: its transports (UCX_TLS) and whether it moves CUDA memory."""
        return {"tls": self.ctx.config.get("TLS", "?"), "cuda_support": bool(self.ctx.cuda_support)}

    def listen(self) -> int:
        self.listener = self.u.UCXListener.create(
            self.w, 0, lambda cr: self._eps.append(self.listener.create_endpoint_from_conn_request(cr, True)))
        return self.listener.port

    def connect(self, host: str, port: int) -> None:
        self.ep = self.u.UCXEndpoint.create(self.w, host, port, True)

    def wait(self, cond) -> None:
        while True:
            while self.w.progress_once():
                pass
            if cond():
                return
            if not self.spin and self.w.arm():
                self._poll.poll(0.1)

    def accept(self) -> None:
        self.wait(lambda: self._eps)
        self.ep = self._eps[0]

    def xfer(self, send, recv, send_tag: int, recv_tag: int) -> None:
        reqs = [self.ep.tag_recv(self.Array(recv), self.u.UCXXTag(recv_tag)),
                self.ep.tag_send(self.Array(send), self.u.UCXXTag(send_tag))]
        self.wait(lambda: all(r.completed for r in reqs))
        for r in reqs:
            r.check_error()


def poison(t: torch.Tensor) -> None:
    """Fill ``t``'s bytes with POISON. Host memory through numpy, on this thread alone: torch's
    ``fill_`` runs an OpenMP region whose idle worker then spins for milliseconds (5 ms of CPU after
    each call on the 2-core VM), on the core the timed row right after it needs (the harness before
    2026-12-06 used torch's ``fill_``: case c measured 3.9-4.8 ms with it, 3.1 ms without)."""
    b = t.view(-1).view(torch.uint8)
    if b.is_cuda:
        b.fill_(POISON)
    else:
        b.numpy().fill(POISON)


def tuned_options() -> dict:
    from xfer.settings import UcxSettings

    return UcxSettings.from_env().context_options()


def digest(buf) -> str:
    """BLAKE2b of a buffer's bytes (a CUDA tensor is copied to the host first)."""
    if isinstance(buf, torch.Tensor):
        buf = buf.cpu().numpy()
    return hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest()


def set_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)  # UCX's CUDA transports and the default stream work on this one
    return dev


# ---- server side ---------------------------------------------------------------------------------
def serve(bind: str, device: str) -> None:
    """Commands as JSON lines on stdin, replies as JSON lines on stdout."""
    from xfer import Agent, AgentConfig, make_kv_cache

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # keep library prints (Python's and C's, e.g. UCX_PROTO_INFO) off the reply channel
    sys.stdout = sys.stderr
    dev = set_device(device)
    cuda = dev.type == "cuda"
    state: dict = {}

    def reply(**kw):
        out.write(json.dumps(kw) + "\n")
        out.flush()

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "prepare":
            if "agent" in state:
                state["agent"].close()
            state.clear()
            case = cmd["case"]
            tensors, layout = make_kv_cache(KIND, device=dev, **dims_of(case))
            for t in tensors:
                poison(t)
            if cuda:  # the initiator's chunks are scattered on another stream: the poison lands first
                torch.cuda.synchronize(dev)
            agent = Agent("bench-dst", AgentConfig(transport="ucx", listen_host=bind, default_timeout_s=60))
            agent.register("kv", tensors, layout)
            nbytes = CASES[case][1] * layout.bytes_per_block
            buf = torch.empty(nbytes, dtype=torch.uint8, device=dev) if cuda else np.empty(nbytes, np.uint8)
            tcp = socket.create_server((bind, 0))
            wanted = (("ucxx", tuned_options()),) if cuda else (("ucxx", tuned_options()), ("ucxx-default", {}))
            pipes = {name: UcxxPipe(opts, spin=cuda) for name, opts in wanted}
            ports = {name: p.listen() for name, p in pipes.items()}
            state.update(agent=agent, tensors=tensors, layout=layout, buf=buf, tcp=tcp, pipes=pipes)
            reply(metadata=base64.b64encode(agent.metadata()).decode(), tcp=tcp.getsockname()[1], ucxx=ports,
                  nbytes=nbytes, ucx={name: p.info() for name, p in pipes.items()})
        elif op == "serve":  # run `iters` rounds of the named ceiling, then reply
            buf, ack, iters = state["buf"], np.zeros(1, np.uint64), cmd["iters"]
            if cmd["what"] == "tcp":
                if "conn" not in state:
                    state["conn"] = state["tcp"].accept()[0]
                conn, mv = state["conn"], memoryview(buf)
                for _ in range(iters):
                    got = 0
                    while got < len(buf):
                        got += conn.recv_into(mv[got:], len(buf) - got)
                    conn.sendall(b"k")
            else:
                pipe = state["pipes"][cmd["what"]]
                if pipe.ep is None:
                    pipe.accept()
                for _ in range(iters):
                    pipe.xfer(ack, buf, 2, 1)
            reply(ok=True)
        elif op == "digest":  # of the last contiguous receive
            reply(digest=digest(state["buf"]))
        elif op == "poison":  # between timed writes: each one is checked on fresh poison
            for t in state["tensors"]:
                poison(t)
            if cuda:
                torch.cuda.synchronize(dev)
            reply(ok=True)
        elif op == "check":
            from xfer.bench.target import block_digests, untouched

            ids = cmd["ids"]
            if cuda:
                torch.cuda.synchronize(dev)
            notes = state["agent"].notifications()
            reply(digests=block_digests(state["layout"], state["tensors"], ids),
                  untouched=untouched(state["layout"], state["tensors"], ids), notes=len(notes))
        elif op == "stop":
            if "agent" in state:
                state["agent"].close()
            reply(ok=True)
            return


def split_cpus(pin: str) -> tuple[list[int], list[int]] | None:
    """(the client's CPUs, the server's) for ``--pin``: ``auto`` halves the CPUs this process may
    use, ``off`` (or a single CPU) leaves both processes to the scheduler.

    Two hosts each have their own cores. On one machine, Linux wakes the receiving process on the
    core of the process that woke it, which then waits until the woken one sleeps again: on the
    2-core VM both engine threads ran on one core while the other idled, and a lone 2 MiB write
    went from 1.8-2.0 ms (pinned apart) to 2.4-2.5 ms. Every row of a run, the ceilings included,
    is measured with the same pinning."""
    if pin == "off":
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    half = len(allowed) // 2
    return allowed[:half], allowed[half:]


def pin_process(cpus) -> None:
    """Every thread of this process (and so every thread it starts later) on ``cpus``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended
            pass


class Server:
    def __init__(self, bind: str, netns: str | None, device: str = "cpu", cpus=None):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--bind", bind, "--device", device]
        if cpus:
            cmd += ["--cpus", ",".join(map(str, cpus))]
        if netns:
            cmd = ["ip", "netns", "exec", netns] + cmd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=str(ROOT), env=os.environ.copy())

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            try:
                rc = self.proc.wait(5)
            except subprocess.TimeoutExpired:
                rc = None
            raise RuntimeError(f"bench server exited (rc {rc})")
        return json.loads(line)

    def call_async(self, **cmd):
        box = {}
        th = threading.Thread(target=lambda: box.update(self.call(**cmd)))
        th.start()
        return th, box

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call(op="stop")
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)


# ---- client side ---------------------------------------------------------------------------------
def run_case(case: str, server: Server, peer_host: str, bind: str, iters: int, device: str = "cpu",
             peer_device: str | None = None) -> dict:
    from xfer.bench.target import block_digests
    from xfer import Agent, AgentConfig, make_kv_cache
    from xfer.metadata import decode

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    prep = server.call(op="prepare", case=case)
    tensors, layout = make_kv_cache(KIND, device=dev, **dims_of(case))
    gen = torch.Generator().manual_seed(1)
    for t in tensors:
        b = t.view(-1).view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
    src, dst = ids_of(case)
    nbytes = prep["nbytes"]
    data, ack = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8), np.zeros(1, np.uint64)
    peer_dev = torch.device(peer_device or device)
    if cuda:
        data = torch.from_numpy(data).to(dev)
        copy_dst = torch.empty(nbytes, dtype=torch.uint8, device=peer_dev)  # the server's GPU: a peer copy across two
        torch.cuda.synchronize(dev)
    with Agent("bench-src", AgentConfig(transport="ucx", listen_host=bind, default_timeout_s=60)) as agent:
        agent.register("kv", tensors, layout)
        peer = agent.connect(base64.b64decode(prep["metadata"]))
        t = agent.write(peer, src, dst, notify=b"bench")
        t.wait()
        check = server.call(op="check", ids=list(dst))
        want = block_digests(layout, tensors, src)
        ok = check["digests"] == want and check["untouched"] and check["notes"] == 1
        if not ok:
            raise RuntimeError(f"{case}: destination bytes differ from the source; not timing a wrong transfer")
        path = t.path
        pipes = {}
        for name in prep["ucxx"]:
            pipes[name] = UcxxPipe(tuned_options() if name == "ucxx" else {}, spin=cuda)
            pipes[name].connect(peer_host, prep["ucxx"][name])
        if cuda:
            ceilings = CUDA_CEILINGS
            if not (pipes["ucxx"].info()["cuda_support"] and prep["ucx"]["ucxx"]["cuda_support"]):
                raise RuntimeError("this UCX has no CUDA support: a device-to-device ucxx send cannot run "
                                   "(install ucxx-cu12 / ucxx-cu13, or a system UCX built with CUDA)")
        else:
            ceilings = HOST_CEILINGS
            tcp = socket.create_connection((peer_host, prep["tcp"]))
            tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = {k: [] for k in (*ceilings, "xfer")}
        post, post_cpu, ref_cold, ref_warm = [], [], [], []
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        for i in range(iters + 1):  # the first round is warm-up
            if cuda:
                server.call(op="poison")  # every row starts from the same state: see the module doc
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                copy_dst.copy_(data)
                torch.cuda.synchronize(dev)
                if peer_dev != dev:
                    torch.cuda.synchronize(peer_dev)
                times["copy"].append(time.perf_counter() - t0)
            else:
                server.call(op="poison")
                th, _ = server.call_async(op="serve", what="tcp", iters=1)
                t0 = time.perf_counter()
                tcp.sendall(memoryview(data))
                tcp.recv(1)
                times["tcp"].append(time.perf_counter() - t0)
                th.join()
            for name, pipe in pipes.items():
                server.call(op="poison")
                th, _ = server.call_async(op="serve", what=name, iters=1)
                t0 = time.perf_counter()
                pipe.xfer(data, ack, 1, 2)
                times[name].append(time.perf_counter() - t0)
                th.join()
                if cuda and i == 0 and server.call(op="digest")["digest"] != digest(data):
                    raise RuntimeError(f"{case}: the contiguous ucxx send delivered other bytes; not timing it")
            server.call(op="poison")
            c0, t0 = time.thread_time(), time.perf_counter()
            t = agent.write(peer, src, dst)
            t1, c1 = time.perf_counter(), time.thread_time()
            t.wait()
            times["xfer"].append(time.perf_counter() - t0)
            post.append(t1 - t0)
            post_cpu.append(c1 - c0)
            check = server.call(op="check", ids=dst.tolist())  # every timed write, on fresh poison
            if check["digests"] != want or not check["untouched"]:
                raise RuntimeError(f"{case}: timed write {i} left bytes that differ from the source")
            # the cold-cache floor in the same state as the post above: after a transfer moved the
            # bytes through this host's caches, the ids check the post itself runs, timed alone
            agent.write(peer, src, dst).wait()
            server.call(op="poison")
            c0 = time.thread_time()
            layout.check_block_ids(src), layout.check_block_ids(dst, unique=True)
            ref_cold.append(time.thread_time() - c0)
            for _ in range(3):
                c0 = time.thread_time()
                layout.check_block_ids(src), layout.check_block_ids(dst, unique=True)
                c1 = time.thread_time()
            ref_warm.append(c1 - c0)
        # bursts: BURST writes posted back to back (warm code, no idle wake-up: the burst post
        # CPU), all in flight at once (their aggregate rate: what a lone write's fixed costs leave
        # of the wire when an engine moves several requests), each burst checked on fresh poison
        burst, burst_wall = [], []
        for _ in range(BURSTS):
            server.call(op="poison")
            posted, t0 = [], time.perf_counter()
            for _ in range(BURST):
                c0 = time.thread_time()
                ts = agent.write(peer, src, dst)
                posted.append((time.thread_time() - c0, ts))
            for _, ts in posted:
                ts.wait()
            burst_wall.append(time.perf_counter() - t0)
            burst.extend(posted[1:])
            check = server.call(op="check", ids=dst.tolist())
            if check["digests"] != want or not check["untouched"]:
                raise RuntimeError(f"{case}: a burst of {BURST} writes left bytes that differ from the source")
        if not cuda:
            tcp.close()
        xfer_ucx = decode(agent.metadata()).transports.get("ucx", {})
        peer_ucx = decode(base64.b64decode(prep["metadata"])).transports.get("ucx", {})
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    out = {
        "case": case, "bytes": nbytes, "slices": CASES[case][0] * 2 * CASES[case][1], "path": path,
        "median_ms": {k: 1e3 * v for k, v in med.items()},
        "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
    }
    if cuda:
        out.update({
            "xfer_vs_copy": med["copy"] / med["xfer"], "xfer_vs_ucxx": med["ucxx"] / med["xfer"],
            "ucxx_vs_copy": med["copy"] / med["ucxx"],
            "ucx": {"xfer": {"tls": xfer_ucx.get("tls"), "cuda_support": xfer_ucx.get("cuda"),
                             "chunk_bytes": xfer_ucx.get("chunk_bytes"), "peer_chunk_bytes": peer_ucx.get("chunk_bytes"),
                             "device_chunk_bytes": xfer_ucx.get("device_chunk_bytes"),
                             "peer_device_chunk_bytes": peer_ucx.get("device_chunk_bytes")},
                    "ucxx_client": pipes["ucxx"].info(), "ucxx_server": prep["ucx"]["ucxx"],
                    "ucxx_progress": "spin"},
        })
    else:
        out.update({"xfer_vs_tcp": med["tcp"] / med["xfer"], "xfer_vs_ucxx": med["ucxx"] / med["xfer"],
                    "ucxx_default_vs_tcp": med["tcp"] / med["ucxx-default"]})
    out.update({
        "post_us": 1e6 * statistics.median(post[1:]), "post_cpu_us": 1e6 * statistics.median(post_cpu[1:]),
        "post_burst_cpu_us": 1e6 * statistics.median(c for c, _ in burst),
        "burst": BURST, "burst_gb_per_s": BURST * nbytes / statistics.median(burst_wall) / 1e9,
        "burst_vs_ucxx": med["ucxx"] * BURST / statistics.median(burst_wall),
        # the post's own id checks timed alone, after a transfer (as the post above) and warm:
        # how much of post_cpu_us is this host's cold caches rather than the post's work
        "ids_check_cold_cpu_us": 1e6 * statistics.median(ref_cold[1:]),
        "ids_check_warm_cpu_us": 1e6 * statistics.median(ref_warm[1:]),
        "iters": iters,
    })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bind", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--cpus", help=argparse.SUPPRESS)  # the server's CPUs
    ap.add_argument("--pin", choices=("auto", "off"), default="auto",
                    help="auto (default): the two processes on two halves of this machine's CPUs, as two "
                    "hosts would be; off: wherever the scheduler puts them")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--netns", action="store_true", help="across a veth pair between two network namespaces")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--device", default="cpu", help="where both processes' KV caches live: cpu (host memory, "
                    "the default) or cuda[:N] (GPU N, shared by the two processes)")
    ap.add_argument("--peer-device", help="cuda[:M]: the server's KV caches on GPU M (default: --device, both on one GPU)")
    ap.add_argument("--chunk-bytes", help="XFER_UCX_CHUNK_BYTES of both processes (host slots), e.g. 16M or 64M")
    ap.add_argument("--device-chunk-bytes", help="XFER_UCX_DEVICE_CHUNK_BYTES of both processes (device slots), "
                    "e.g. 64M or 128M")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown case(s) {unknown}; known: {','.join(CASES)}")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        ap.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.peer_device and (not args.peer_device.startswith("cuda") or not args.device.startswith("cuda")):
        ap.error(f"--peer-device takes cuda[:M] beside --device cuda[:N], got --device {args.device} "
                 f"--peer-device {args.peer_device}")
    for flag, var, value in (("--chunk-bytes", "XFER_UCX_CHUNK_BYTES", args.chunk_bytes),
                             ("--device-chunk-bytes", "XFER_UCX_DEVICE_CHUNK_BYTES", args.device_chunk_bytes)):
        if value:
            from xfer.settings import UcxSettings

            os.environ[var] = value  # the server inherits it
            try:
                UcxSettings.from_env()
            except Exception as exc:
                ap.error(f"{flag} {value}: {exc}")
    if args.serve:
        if args.cpus:
            pin_process([int(c) for c in args.cpus.split(",")])
        return serve(args.bind, args.device)
    device = str(set_device(args.device))
    peer_device = device if not args.peer_device else str(torch.device(args.peer_device))
    if peer_device == "cuda":
        peer_device = "cuda:0"
    ns = None
    if args.netns:
        ns = json.loads(subprocess.run(["bash", str(ROOT / "ci" / "netns.sh"), "up"], check=True,
                                       capture_output=True, text=True).stdout)
        os.environ["UCX_NET_DEVICES"] = ns["dev_b"]  # the server's interface; the client re-execs below
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        if ns:  # the client side runs in namespace A: re-exec this script there
            env = dict(os.environ, UCX_NET_DEVICES=ns["dev_a"], XFER_UCX_BENCH_NS=json.dumps(ns))
            cmd = ["ip", "netns", "exec", ns["ns_a"], sys.executable, __file__, "--iters", str(args.iters),
                   "--cases", args.cases, "--device", args.device, "--pin", args.pin] + (
                       ["--json", args.json] if args.json else []) + (
                       ["--peer-device", args.peer_device] if args.peer_device else [])
            subprocess.run(cmd, check=True, env=env, cwd=str(ROOT))
            return
        inner = json.loads(os.environ.get("XFER_UCX_BENCH_NS", "null"))
        bind, peer = (inner["addr_a"], inner["addr_b"]) if inner else ("127.0.0.1", "127.0.0.1")
        if inner:
            os.environ["UCX_NET_DEVICES"] = inner["dev_b"]
        cpus = split_cpus(args.pin)
        if cpus:
            pin_process(cpus[0])
        server = Server(peer, inner["ns_b"] if inner else None, peer_device, cpus[1] if cpus else None)
        if inner:
            os.environ["UCX_NET_DEVICES"] = inner["dev_a"]
        try:
            results = [run_case(c, server, peer, bind, args.iters, device, peer_device) for c in args.cases.split(",")]
        finally:
            server.close()
        report(results, "veth" if inner else "loopback", args.json, device, cpus, peer_device)
    finally:
        if ns:
            subprocess.run(["bash", str(ROOT / "ci" / "netns.sh"), "down", ns["id"]], check=False)


def describe_device(device: str, peer_device: str | None = None) -> dict:
    dev = torch.device(device)
    if dev.type != "cuda":
        return {"device": "cpu"}
    p = torch.cuda.get_device_properties(dev)
    two = peer_device is not None and torch.device(peer_device) != dev
    return {"device": str(dev), "device_name": p.name, "capability": f"{p.major}.{p.minor}",
            "memory_gib": round(p.total_memory / 2**30, 1), "torch_cuda": torch.version.cuda,
            "processes": f"client on {dev}, server on {peer_device}" if two else "2 on the same GPU",
            **({"peer_device": peer_device} if two else {})}


def report(results: list[dict], link: str, path: str | None, device: str = "cpu", cpus=None,
           peer_device: str | None = None) -> None:
    import ucxx

    from xfer.settings import UcxSettings

    cuda = device.startswith("cuda")
    print(f"\nxfer UCX transport, {link}, {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"ucxx {ucxx.__version__}, UCX {'.'.join(map(str, ucxx.get_ucx_version()))}")
    print(f"CPUs: client {cpus[0]}, server {cpus[1]}" if cpus else "CPUs: not pinned (--pin off, or one CPU)")
    if cuda:
        d, u = describe_device(device, peer_device), results[0]["ucx"]
        print(f"device {d['device']} ({d['device_name']}, CUDA {d['torch_cuda']}), {d['processes']}; "
              f"UCX_TLS={os.environ.get('UCX_TLS', '(unset)')}; device chunk "
              f"{UcxSettings.from_env().device_chunk_bytes / 2**20:g} MiB")
        print(f"UCX transports: ucxx {u['ucxx_client']['tls']} (cuda {u['ucxx_client']['cuda_support']}), "
              f"xfer {u['xfer']['tls']} (cuda {u['xfer']['cuda_support']})")
        print(f"{'case':<14} {'MiB':>5} {'copy GB/s':>10} {'ucxx':>7} {'xfer':>7} {'xfer/copy':>9} {'xfer/ucxx':>9} "
              f"{'x' + str(BURST) + ' /ucxx':>9} {'ucxx/copy':>9} {'post µs':>8} {'post cpu':>8} {'burst cpu':>9}")
        for r in results:
            g = r["gb_per_s"]
            print(f"{r['case']:<14} {r['bytes'] / 2**20:5.0f} {g['copy']:10.1f} {g['ucxx']:7.1f} {g['xfer']:7.2f} "
                  f"{r['xfer_vs_copy']:9.3f} {r['xfer_vs_ucxx']:9.3f} {r['burst_vs_ucxx']:9.3f} {r['ucxx_vs_copy']:9.3f} "
                  f"{r['post_us']:8.0f} {r['post_cpu_us']:8.0f} {r['post_burst_cpu_us']:9.0f}")
    else:
        print(f"{'case':<14} {'MiB':>5} {'tcp GB/s':>9} {'ucxx':>6} {'ucxx-dflt':>9} {'xfer':>6} "
              f"{'xfer/tcp':>8} {'xfer/ucxx':>9} {'x' + str(BURST) + ' /ucxx':>9} {'post µs':>8} {'post cpu':>8} "
              f"{'burst cpu':>9}")
        for r in results:
            g = r["gb_per_s"]
            print(f"{r['case']:<14} {r['bytes'] / 2**20:5.0f} {g['tcp']:9.2f} {g['ucxx']:6.2f} {g['ucxx-default']:9.2f} "
                  f"{g['xfer']:6.2f} {r['xfer_vs_tcp']:8.2f} {r['xfer_vs_ucxx']:9.2f} {r['burst_vs_ucxx']:9.2f} "
                  f"{r['post_us']:8.0f} {r['post_cpu_us']:8.0f} {r['post_burst_cpu_us']:9.0f}")
    for p in dict.fromkeys(r["path"] for r in results):
        print(f"path: {p} ({', '.join(r['case'] for r in results if r['path'] == p)})")
    for r in results:
        print(f"{r['case']}: the post's two id checks alone take {r['ids_check_cold_cpu_us']:.0f} us of CPU after "
              f"a transfer (as 'post cpu' is measured), {r['ids_check_warm_cpu_us']:.0f} us warm")
    if path:
        doc = {"date": dt.datetime.now().isoformat(timespec="seconds"), "link": link,
               "machine": platform.node(), "cores": os.cpu_count(),
               "load_avg": os.getloadavg(), "python": platform.python_version(),
               "torch": torch.__version__, "ucxx": ucxx.__version__,
               "ucx": ".".join(map(str, ucxx.get_ucx_version())), **describe_device(device, peer_device),
               "chunk_bytes": UcxSettings.from_env().chunk_bytes,
               "device_chunk_bytes": UcxSettings.from_env().device_chunk_bytes,
               "cpus": {"client": cpus[0], "server": cpus[1]} if cpus else None}
        doc["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "XFER_UCX_"))}
        if cuda:
            doc["ceilings"] = list(CUDA_CEILINGS)
        Path(path).write_text(json.dumps({**doc, "results": results}, indent=1))


if __name__ == "__main__":
    main()
