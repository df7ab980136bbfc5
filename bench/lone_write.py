"""A lone small write's latency between two processes, per transport, against a TCP ping-pong of
the same bytes measured in the same run (the ceiling).

The target runs in a spawned child (its agent holds a shared-memory cache, so ``local`` can serve
it); the initiator writes one block (``--block-bytes`` of payload over every layer and K/V) and
waits for ``wait()`` (the peer landed it, was notified and acknowledged), idling ``--gap-ms``
between writes so each one is alone. Bytes are checked once before timing. Used to measure what
the control channel's and UCX's message authentication cost the fast path (issue 30): run it
against two trees, interleaved (``--rounds``), with ``PYTHONPATH`` naming each.

    python bench/lone_write.py [--transports local,ucx] [--writes 200] [--rounds 3] [--secret] [--json out]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import threading
import time

import numpy as np

SECRET = "lone-write-bench-secret-0123456789"
DIMS = dict(num_layers=4, num_blocks=64, block_size=16, num_heads=1, head_dim=64)  # 8 KiB a block
KIND = "vllm_flash_attn_nhd"


def _target(conn, enable, secret):
    from xfer import Agent, AgentConfig, make_kv_cache, shared_empty

    tensors, layout = make_kv_cache(KIND, empty=shared_empty, **DIMS)
    for t in tensors:
        t.zero_()
    agent = Agent("lone-target", AgentConfig(enable=(enable,), secret=secret, default_timeout_s=30))
    agent.register("kv", tensors, layout)
    conn.send(agent.metadata())
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            agent.close()
            conn.send("bye")
            return
        if cmd == "digest":
            agent.notifications()
            conn.send([np.asarray(t.view(-1).view(dtype=__import__("torch").uint8)).tobytes() for t in tensors])


def _tcp_ceiling(nbytes: int, n: int, gap: float) -> list[float]:
    """Seconds of one TCP send of ``nbytes`` + a 1-byte ack over loopback (to a thread of this process)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve():
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            got = 0
            while got < nbytes:
                data = c.recv(nbytes - got)
                if not data:
                    return
                got += len(data)
            c.sendall(b"k")
    th = threading.Thread(target=serve, daemon=True)
    th.start()
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = b"x" * nbytes
    out = []
    for _ in range(n):
        time.sleep(gap)
        t0 = time.perf_counter()
        s.sendall(payload)
        s.recv(1)
        out.append(time.perf_counter() - t0)
    s.close()
    srv.close()
    return out


def run(enable: str, writes: int, gap: float, secret: str | None) -> dict:
    import torch

    from xfer import Agent, AgentConfig, make_kv_cache

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, enable, secret), daemon=True)
    proc.start()
    md = conn.recv()
    tensors, layout = make_kv_cache(KIND, **DIMS)
    gen = torch.Generator().manual_seed(3)
    for t in tensors:
        t.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),), generator=gen,
                                                        dtype=torch.uint8))
    try:
        with Agent("lone-init", AgentConfig(enable=(enable,), secret=secret, default_timeout_s=30)) as a:
            a.register("kv", tensors, layout)
            peer = a.connect(md)
            path = a.route(peer).kind.value
            a.write(peer, [5], [9]).wait()  # checked once: the target's block 9 is our block 5
            conn.send("digest")
            remote = [torch.frombuffer(bytearray(r), dtype=torch.uint8).view(t.dtype).view(t.shape)
                      for r, t in zip(conn.recv(), tensors)]
            for mine, theirs in zip(layout.views(tensors), layout.views(remote)):
                assert torch.equal(mine[5].view(-1).view(torch.uint8), theirs[9].view(-1).view(torch.uint8)), \
                    "the target's block 9 differs from the source's block 5"
            lat = []
            for i in range(writes + 5):
                time.sleep(gap)
                t0 = time.perf_counter()
                a.write(peer, [i % 32], [32 + i % 32]).wait()
                if i >= 5:
                    lat.append(time.perf_counter() - t0)
        block = layout.bytes_per_block
    finally:
        conn.send("stop")
        conn.poll(10)
        proc.join(10)
    ceiling = _tcp_ceiling(block, writes, gap)
    return {"transport": path, "block_bytes": block, "median_us": statistics.median(lat) * 1e6,
            "p90_us": sorted(lat)[int(0.9 * len(lat))] * 1e6, "tcp_median_us": statistics.median(ceiling) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transports", default="local,ucx")
    ap.add_argument("--writes", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--secret", action="store_true", help="both agents share a secret (messages authenticated)")
    ap.add_argument("--json")
    args = ap.parse_args()
    out = []
    for t in args.transports.split(","):
        r = run(t, args.writes, args.gap_ms / 1e3, SECRET if args.secret else None)
        r["vs_tcp"] = r["tcp_median_us"] / r["median_us"]
        print(f"{t:6s} lone write of {r['block_bytes']} B: median {r['median_us']:.0f} us, p90 {r['p90_us']:.0f} us; "
              f"TCP ping-pong of the same bytes {r['tcp_median_us']:.0f} us (ceiling/xfer {r['vs_tcp']:.2f})")
        out.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
