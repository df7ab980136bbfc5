"""UCX transport benchmark: xfer ``write`` of three KV cases between two processes, against the
wire's ceilings measured in the same run.

Per case (64 layers x 128 blocks x 32 KiB, 32 x 256 x 4 KiB, 32 x 64 x 512 B; every other block of
a cache twice as large, so no two slices are adjacent), interleaved iteration by iteration:

- ``tcp``: one contiguous send of the same bytes over a plain TCP socket + a 1-byte ack;
- ``ucxx``: one contiguous ucxx tag send of the same bytes + an 8-byte ack, UCX tuned as the
  transport tunes it; ``ucxx-default``: the same with UCX's defaults (what ucxx gets out of the box);
- ``xfer``: ``agent.write(...)`` of the blocks until ``wait()`` returns (the peer has scattered every
  byte, delivered its notification and acknowledged).

Bytes are verified (digests of the destination blocks, untouched blocks still poisoned) before
timing. ``post_us`` is the wall time of the ``write`` call alone (host CPU to post the transfer),
``post_cpu_us`` its thread CPU time (posted to an idle agent), ``post_burst_cpu_us`` the thread
CPU time of one ``write`` among eight posted back to back.

    python bench/ucx_bench.py [--iters 7] [--netns] [--json out.json]

``--netns`` runs the two processes in two network namespaces joined by a veth pair (ci/netns.sh;
root needed). The server side is this script with ``--serve``, driven over its stdin/stdout.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
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


def dims_of(case: str) -> dict:
    layers, n, bs, heads, hd = CASES[case]
    return dict(num_layers=layers, num_blocks=2 * n, block_size=bs, num_heads=heads, head_dim=hd)


def ids_of(case: str) -> tuple[list[int], list[int]]:
    n = CASES[case][1]
    return list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))[::-1]


# ---- the ucxx contiguous ceiling ---------------------------------------------------------------
class UcxxPipe:
    """A ucxx worker of its own, driven in blocking mode from the calling thread."""

    def __init__(self, options: dict):
        import select

        import ucxx._lib.libucxx as u
        from ucxx._lib.arr import Array

        self.u, self.Array = u, Array
        self.ctx = u.UCXContext(options, feature_flags=(u.Feature.TAG, u.Feature.WAKEUP))
        self.w = u.UCXWorker(self.ctx)
        self.w.init_blocking_progress_mode()
        self.ep, self._eps = None, []
        self._poll = select.epoll()
        self._poll.register(self.w.epoll_file_descriptor, select.EPOLLIN)

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
            if self.w.arm():
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


def tuned_options() -> dict:
    from xfer.transports.ucx_wire import UcxSettings

    return UcxSettings.from_env().context_options()


# ---- server side ---------------------------------------------------------------------------------
def serve(bind: str) -> None:
    """Commands as JSON lines on stdin, replies as JSON lines on stdout."""
    from xfer import Agent, AgentConfig, make_kv_cache

    out = sys.stdout
    sys.stdout = sys.stderr  # keep library prints off the reply channel
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
            tensors, layout = make_kv_cache(KIND, **dims_of(case))
            for t in tensors:
                t.view(-1).view(torch.uint8).fill_(POISON)
            agent = Agent("bench-dst", AgentConfig(transport="ucx", listen_host=bind, default_timeout_s=60))
            agent.register("kv", tensors, layout)
            nbytes = CASES[case][1] * layout.bytes_per_block
            buf = np.empty(nbytes, np.uint8)
            tcp = socket.create_server((bind, 0))
            pipes = {name: UcxxPipe(opts) for name, opts in (("ucxx", tuned_options()), ("ucxx-default", {}))}
            ports = {name: p.listen() for name, p in pipes.items()}
            state.update(agent=agent, tensors=tensors, layout=layout, buf=buf, tcp=tcp, pipes=pipes)
            reply(metadata=base64.b64encode(agent.metadata()).decode(), tcp=tcp.getsockname()[1], ucxx=ports,
                  nbytes=nbytes)
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
        elif op == "check":
            from bench.target import block_digests, untouched

            ids = cmd["ids"]
            notes = state["agent"].notifications()
            reply(digests=block_digests(state["layout"], state["tensors"], ids),
                  untouched=untouched(state["layout"], state["tensors"], ids), notes=len(notes))
        elif op == "stop":
            if "agent" in state:
                state["agent"].close()
            reply(ok=True)
            return


class Server:
    def __init__(self, bind: str, netns: str | None):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--bind", bind]
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
def run_case(case: str, server: Server, peer_host: str, bind: str, iters: int) -> dict:
    from bench.target import block_digests
    from xfer import Agent, AgentConfig, make_kv_cache

    prep = server.call(op="prepare", case=case)
    tensors, layout = make_kv_cache(KIND, **dims_of(case))
    gen = torch.Generator().manual_seed(1)
    for t in tensors:
        b = t.view(-1).view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
    src, dst = ids_of(case)
    nbytes = prep["nbytes"]
    data, ack = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8), np.zeros(1, np.uint64)
    with Agent("bench-src", AgentConfig(transport="ucx", listen_host=bind, default_timeout_s=60)) as agent:
        agent.register("kv", tensors, layout)
        peer = agent.connect(base64.b64decode(prep["metadata"]))
        t = agent.write(peer, src, dst, notify=b"bench")
        t.wait()
        check = server.call(op="check", ids=list(dst))
        ok = check["digests"] == block_digests(layout, tensors, src) and check["untouched"] and check["notes"] == 1
        if not ok:
            raise RuntimeError(f"{case}: destination bytes differ from the source; not timing a wrong transfer")
        path = t.path
        tcp = socket.create_connection((peer_host, prep["tcp"]))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pipes = {}
        for name in ("ucxx", "ucxx-default"):
            pipes[name] = UcxxPipe(tuned_options() if name == "ucxx" else {})
            pipes[name].connect(peer_host, prep["ucxx"][name])
        times = {k: [] for k in ("tcp", "ucxx", "ucxx-default", "xfer")}
        post, post_cpu = [], []
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        for i in range(iters + 1):  # the first round is warm-up
            th, _ = server.call_async(op="serve", what="tcp", iters=1)
            t0 = time.perf_counter()
            tcp.sendall(memoryview(data))
            tcp.recv(1)
            times["tcp"].append(time.perf_counter() - t0)
            th.join()
            for name, pipe in pipes.items():
                th, _ = server.call_async(op="serve", what=name, iters=1)
                t0 = time.perf_counter()
                pipe.xfer(data, ack, 1, 2)
                times[name].append(time.perf_counter() - t0)
                th.join()
            c0, t0 = time.thread_time(), time.perf_counter()
            t = agent.write(peer, src, dst)
            t1, c1 = time.perf_counter(), time.thread_time()
            t.wait()
            times["xfer"].append(time.perf_counter() - t0)
            post.append(t1 - t0)
            post_cpu.append(c1 - c0)
        # a burst: writes posted back to back while the transport is busy (warm code, no idle wake-up)
        burst = []
        for _ in range(8):
            c0 = time.thread_time()
            ts = agent.write(peer, src, dst)
            burst.append((time.thread_time() - c0, ts))
        for _, ts in burst:
            ts.wait()
        tcp.close()
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return {
        "case": case, "bytes": nbytes, "slices": CASES[case][0] * 2 * CASES[case][1], "path": path,
        "median_ms": {k: 1e3 * v for k, v in med.items()},
        "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
        "xfer_vs_tcp": med["tcp"] / med["xfer"], "xfer_vs_ucxx": med["ucxx"] / med["xfer"],
        "ucxx_default_vs_tcp": med["tcp"] / med["ucxx-default"],
        "post_us": 1e6 * statistics.median(post[1:]), "post_cpu_us": 1e6 * statistics.median(post_cpu[1:]),
        "post_burst_cpu_us": 1e6 * statistics.median(c for c, _ in burst[1:]),
        "iters": iters,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bind", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--netns", action="store_true", help="across a veth pair between two network namespaces")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.serve:
        return serve(args.bind)
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
                   "--cases", args.cases] + (["--json", args.json] if args.json else [])
            subprocess.run(cmd, check=True, env=env, cwd=str(ROOT))
            return
        inner = json.loads(os.environ.get("XFER_UCX_BENCH_NS", "null"))
        bind, peer = (inner["addr_a"], inner["addr_b"]) if inner else ("127.0.0.1", "127.0.0.1")
        if inner:
            os.environ["UCX_NET_DEVICES"] = inner["dev_b"]
        server = Server(peer, inner["ns_b"] if inner else None)
        if inner:
            os.environ["UCX_NET_DEVICES"] = inner["dev_a"]
        try:
            results = [run_case(c, server, peer, bind, args.iters) for c in args.cases.split(",")]
        finally:
            server.close()
        report(results, "veth" if inner else "loopback", args.json)
    finally:
        if ns:
            subprocess.run(["bash", str(ROOT / "ci" / "netns.sh"), "down", ns["id"]], check=False)


def report(results: list[dict], link: str, path: str | None) -> None:
    import ucxx

    print(f"\nxfer UCX transport, {link}, {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"ucxx {ucxx.__version__}, UCX {'.'.join(map(str, ucxx.get_ucx_version()))}")
    print(f"{'case':<14} {'MiB':>5} {'tcp GB/s':>9} {'ucxx':>6} {'ucxx-dflt':>9} {'xfer':>6} "
          f"{'xfer/tcp':>8} {'xfer/ucxx':>9} {'post µs':>8} {'post cpu':>8} {'burst cpu':>9}")
    for r in results:
        g = r["gb_per_s"]
        print(f"{r['case']:<14} {r['bytes'] / 2**20:5.0f} {g['tcp']:9.2f} {g['ucxx']:6.2f} {g['ucxx-default']:9.2f} "
              f"{g['xfer']:6.2f} {r['xfer_vs_tcp']:8.2f} {r['xfer_vs_ucxx']:9.2f} {r['post_us']:8.0f} {r['post_cpu_us']:8.0f} {r['post_burst_cpu_us']:9.0f}")
    print(f"path: {results[0]['path']}")
    if path:
        Path(path).write_text(json.dumps({"date": dt.datetime.now().isoformat(timespec="seconds"), "link": link,
                                          "machine": platform.node(), "cores": os.cpu_count(),
                                          "load_avg": os.getloadavg(), "python": platform.python_version(),
                                          "torch": torch.__version__, "ucxx": ucxx.__version__,
                                          "ucx": ".".join(map(str, ucxx.get_ucx_version())),
                                          "results": results}, indent=1))


if __name__ == "__main__":
    main()
