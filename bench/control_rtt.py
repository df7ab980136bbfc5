"""The control channel's round trip between two agents of one host, over the control server's
Unix socket against loopback TCP (``XFER_CONTROL_UNIX``), alternated in one run.

The target agent runs in a spawned child; the initiator times ``Agent.send`` (one message: it
returns once the peer queued it, i.e. one authenticated request and its reply), ``--sends`` times
0.5 ms apart, per variant and round, and prints each one's median and p90 (the first 100 sends
are warm-up). Both variants pay the same framing, MACs and handler: the difference is the
socket's.

    python bench/control_rtt.py --rounds 3
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time


def _target(conn, unix: str) -> None:
    os.environ["XFER_CONTROL_UNIX"] = unix
    from xfer import Agent, AgentConfig

    b = Agent(f"rtt-target-{unix}", AgentConfig(enable=("local",)))
    conn.send(b.metadata())
    conn.recv()
    b.close()


def _one(ctx, unix: str, sends: int) -> tuple[float, float, bool]:
    os.environ["XFER_CONTROL_UNIX"] = unix
    from xfer import Agent, AgentConfig
    from xfer.settings import reload

    reload()
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, unix))
    proc.start()
    try:
        with Agent("rtt-initiator", AgentConfig(enable=("local",))) as a:
            peer = a.connect(conn.recv())
            via_unix = a._clients[peer].unix is not None
            times = []
            for _ in range(sends):
                t0 = time.perf_counter()
                a.send(peer, b"x")
                times.append((time.perf_counter() - t0) * 1e6)
                time.sleep(0.0005)
    finally:
        conn.send("stop")
        proc.join(10)
    warm = sorted(times[100:])
    return statistics.median(warm), warm[int(0.9 * (len(warm) - 1))], via_unix


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sends", type=int, default=600)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    medians = {"unix": [], "tcp": []}
    for r in range(args.rounds):
        for unix, label in (("1", "unix"), ("0", "tcp")):
            med, p90, via = _one(ctx, unix, args.sends)
            medians[label].append(med)
            print(f"round {r} {label:<4} (over the Unix socket: {via}): send() median {med:.1f} us, p90 {p90:.1f} us")
    print("medians, us:", {k: [round(v, 1) for v in vs] for k, vs in medians.items()})


if __name__ == "__main__":
    main()
