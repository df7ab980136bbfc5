"""A lone small write's latency between two processes, per transport, against a TCP ping-pong of
the same bytes measured in the same run (the ceiling).

The target runs in a spawned child (its agent holds a shared-memory cache, so ``local`` can serve
it); the initiator writes one block (``--block-bytes`` of payload over every layer and K/V) and
waits for ``wait()`` (the peer landed it, was notified and acknowledged), idling ``--gap-ms``
between writes so each one is alone. Bytes are checked once before timing. Used to measure what
the control channel's and UCX's message authentication cost the fast path (issue 30): run it
against two trees, interleaved (``--rounds``), with ``PYTHONPATH`` naming each.

``--phases`` also prints where a lone write's time goes (issue 32): the median ms from the call to
each phase the transport marked (``Transfer.timeline``: granted, started, launched, copied,
acked, finished) and from its end to ``wait()`` returning, the initiator's control round trips by message type (the grant's, the
notice's: timed around the peer handle's request function, so the same on any tree) and the
target's handler time per message type (its control server's handler, timed in the target).
``--layers`` / ``--blocks`` / ``--block-size`` shape the write (e.g. ``--layers 64 --blocks 128
--block-size 1``: the seed case's 16,384 slices, small).

``--ahead on|both`` times each write under a grant its target issued ahead (``Agent.grant``, the
token passed over the bench's pipe before the write's clock starts): no grant round trip.

    python bench/lone_write.py [--transports local,ucx] [--writes 200] [--rounds 3] [--secret] [--phases] [--ahead both] [--json out]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time

import numpy as np

SECRET = "lone-write-bench-secret-0123456789"
DIMS = dict(num_layers=4, num_blocks=64, block_size=16, num_heads=1, head_dim=64)  # 8 KiB a block
KIND = "vllm_flash_attn_nhd"


def _timed(fn, log: dict, key):
    """``fn`` timed per call into ``log[key(args)]`` (a list of seconds)."""
    def wrapper(header, *args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(header, *args, **kw)
        finally:
            log.setdefault(key(header), []).append(time.perf_counter() - t0)
    return wrapper


def _kind(header) -> str:
    return str(header.get("type")) if isinstance(header, dict) else "?"


def _target(conn, enable, secret, dims):
    from xfer import Agent, AgentConfig, make_kv_cache, shared_empty

    tensors, layout = make_kv_cache(KIND, empty=shared_empty, **dims)
    for t in tensors:
        t.zero_()
    agent = Agent("lone-target", AgentConfig(enable=(enable,), secret=secret, default_timeout_s=30))
    agent.register("kv", tensors, layout)
    handled: dict = {}
    server = getattr(agent, "_server", None)
    if server is not None and hasattr(server, "_handler"):  # the handler's time per message type
        server._handler = _timed(server._handler, handled, _kind)
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
        if cmd == "handled":
            agent.notifications()
            conn.send(handled)
            handled.clear()
        if isinstance(cmd, tuple) and cmd[0] == "connect":  # (--ahead) the initiator's metadata
            conn.send(agent.connect(cmd[1]))
        if isinstance(cmd, tuple) and cmd[0] == "grant":  # (--ahead) blocks held for the next write
            conn.send(agent.grant(cmd[1], cmd[2]))
        if isinstance(cmd, tuple) and cmd[0] == "ping":  # (without --ahead) the same exchange, no grant
            conn.send("pong")


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


def _ms(xs) -> float:
    return 1e3 * statistics.median(xs) if xs else float("nan")


def run(enable: str, writes: int, gap: float, secret: str | None, dims: dict | None = None, blocks: int = 1,
        phases: bool = False, bursts: tuple = (0, 0), ahead: bool = False) -> dict:
    import torch

    from xfer import Agent, AgentConfig, make_kv_cache

    dims = dims or DIMS
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, enable, secret, dims), daemon=True)
    proc.start()
    md = conn.recv()
    tensors, layout = make_kv_cache(KIND, **dims)
    half = dims["num_blocks"] // 2
    if not 0 < blocks <= half // 2:
        raise SystemExit(f"--blocks must be in 1..{half // 2} for a cache of {dims['num_blocks']} blocks")
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
            requests: dict = {}
            handle = getattr(a, "_peers", {}).get(peer)
            if phases and handle is not None:  # the initiator's blocking control round trips per message type
                timed = _timed(handle.request, requests, _kind)
                client = getattr(handle.request, "__self__", None)
                if client is not None:  # a pipelined client (issue 32) is still reached through it
                    timed.__self__ = client
                handle.request = timed
            if ahead:  # the target grants each write's blocks before it (untimed: xfer.ahead)
                conn.send(("connect", a.metadata()))
                conn.recv()
            conn.send("handled")
            conn.recv()  # the target's handler times from here on
            lat, timelines, posts, tails = [], [], [], []
            sets = half // blocks
            for i in range(writes + 5):
                time.sleep(gap)
                k = i % sets
                src, dst = list(range(k * blocks, (k + 1) * blocks)), list(range(half + k * blocks,
                                                                                  half + (k + 1) * blocks))
                # the same pipe exchange with the target before every write, with or without --ahead
                conn.send(("grant", a.name, dst) if ahead else ("ping",))
                token = conn.recv() if ahead else conn.recv() and None
                t0 = time.perf_counter()
                t = a.write(peer, src, dst, grant=token)
                t1 = time.perf_counter()
                t.wait()
                if i >= 5:
                    lat.append(time.perf_counter() - t0)
                    tails.append(time.monotonic() - t.finished)  # its end to wait() returning
                    posts.append(t1 - t0)
                    timelines.append(t.timeline())
                if i == 4:
                    requests.clear()
            conn.send("handled")
            handled = conn.recv()
            burst_s = []
            for _ in range(bursts[1] if bursts[0] else 0):  # back to back: bursts[0] writes posted at once
                time.sleep(gap)
                t0 = time.perf_counter()
                ts = []
                for i in range(bursts[0]):
                    k = i % sets
                    ts.append(a.write(peer, list(range(k * blocks, (k + 1) * blocks)),
                                      list(range(half + k * blocks, half + (k + 1) * blocks))))
                for t in ts:
                    t.wait()
                burst_s.append((time.perf_counter() - t0) / bursts[0])
            conn.send("handled")
            conn.recv()
        block = layout.bytes_per_block * blocks
    finally:
        conn.send("stop")
        conn.poll(10)
        proc.join(10)
    ceiling = _tcp_ceiling(block, writes, gap)
    out = {"transport": path, "block_bytes": block, "median_us": statistics.median(lat) * 1e6,
           "p90_us": sorted(lat)[int(0.9 * len(lat))] * 1e6, "tcp_median_us": statistics.median(ceiling) * 1e6}
    if burst_s:
        out["burst"] = {"writes": bursts[0], "rounds": len(burst_s), "per_write_us": statistics.median(burst_s) * 1e6}
    if phases:
        names = list(dict.fromkeys(k for tl in timelines for k in tl))
        out["phases_ms"] = {k: _ms([tl[k] for tl in timelines if k in tl]) for k in names}
        out["post_ms"] = _ms(posts)
        out["ended_to_returned_ms"] = _ms(tails)
        out["request_ms"] = {k: _ms(v) for k, v in requests.items()}
        rtt = [tl["granted"] - tl["asked"] for tl in timelines if "asked" in tl and "granted" in tl]
        if rtt:  # a grant asked without blocking (issue 32): its round trip from the marks
            out["request_ms"]["grant (asked to granted)"] = _ms(rtt)
        out["handler_ms"] = {k: _ms(v) for k, v in handled.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transports", default="local,ucx")
    ap.add_argument("--writes", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--secret", action="store_true", help="both agents share a secret (messages authenticated)")
    ap.add_argument("--phases", action="store_true", help="where the time goes: phases, round trips, handler")
    ap.add_argument("--layers", type=int, default=DIMS["num_layers"])
    ap.add_argument("--blocks", type=int, default=1, help="blocks per write")
    ap.add_argument("--block-size", type=int, default=DIMS["block_size"], help="tokens per block")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--burst", type=int, default=0, help="also time this many writes posted back to back (block "
                                                          "sets reused round robin: one initiator's overlapping writes)")
    ap.add_argument("--burst-rounds", type=int, default=20)
    ap.add_argument("--ask-inline", action="store_true",
                    help="a lone write's grant request sent by the posting thread (XFER_ASK_INLINE)")
    ap.add_argument("--ahead", default="off", choices=("off", "on", "both"),
                    help="each write under a grant its target issued ahead (Agent.grant, untimed); both: each "
                         "transport without, then with")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.ask_inline:  # the setting every agent of this run reads (the target's too: spawned after)
        os.environ["XFER_ASK_INLINE"] = "1"
    dims = {**DIMS, "num_layers": args.layers, "block_size": args.block_size,
            "num_blocks": max(DIMS["num_blocks"], 4 * args.blocks)}
    out = []
    for _ in range(args.rounds):
        for t, ahead in [(t, a) for t in args.transports.split(",") for a in
                         {"off": (False,), "on": (True,), "both": (False, True)}[args.ahead]]:
            r = run(t, args.writes, args.gap_ms / 1e3, SECRET if args.secret else None, dims, args.blocks, args.phases,
                  (args.burst, args.burst_rounds), ahead)
            r["vs_tcp"], r["ahead"] = r["tcp_median_us"] / r["median_us"], ahead
            print(f"{t:6s}{' granted ahead' if ahead else ''} lone write of {r['block_bytes']} B: median {r['median_us']:.0f} us, p90 {r['p90_us']:.0f} "
                  f"us; TCP ping-pong of the same bytes {r['tcp_median_us']:.0f} us (ceiling/xfer {r['vs_tcp']:.2f})")
            if "burst" in r:
                print(f"  {args.burst} back to back: {r['burst']['per_write_us']:.0f} us a write (median of "
                      f"{r['burst']['rounds']} bursts)")
            if args.phases:
                print(f"  write() returned after {r['post_ms']:.3f} ms; one write, median ms from the call to each phase: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in r["phases_ms"].items())
                      + f"; from its end (finished) to wait() returning {r['ended_to_returned_ms']:.3f}")
                print("  initiator's control round trips, median ms: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in r["request_ms"].items()))
                print("  target's handler, median ms: " + ", ".join(f"{k} {v:.3f}" for k, v in r["handler_ms"].items()))
            out.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
