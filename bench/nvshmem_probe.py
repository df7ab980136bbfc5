"""NVSHMEM probe: each on-stream operation the NVSHMEM transport uses, one at a time, with a deadline.

    python -m xfer.bench.nvshmem_probe [--pes 1|2] [--device 0] [--step-s 5]

Where the transport hangs or fails, this says which primitive does it on this machine. Each PE
(``--pes`` processes, rank 0 here; on one GPU unless ``--devices`` spreads them) runs the same
steps against the next PE (itself when alone): set its own word, wait on a word already set,
put-with-signal into the next PE and wait on the previous PE's signal, set the previous PE's credit
word (the remote write) and wait on its own, then a wait that another stream releases (how a failed
lane drains). Every step is queued on a fresh stream and polled through an event, and every
host call runs in a thread with a deadline, so a step that blocks the host or the stream is
reported as such and the next steps still run on fresh streams. Prints one line per step and PE,
with the signal words after it, and the NVSHMEM init status (e.g. ``STATUS_LIMITED_MPG``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time

import torch

ROLE = 0  # the write lane's words


def _host(fn, limit: float):
    """Run ``fn`` in a thread; (returned, error text or None, seconds), 'host call blocked' past ``limit``."""
    box, start = {}, time.monotonic()

    def run():
        try:
            box["r"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported
            box["e"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        return None, f"host call blocked > {limit:g} s", time.monotonic() - start
    return box.get("r"), box.get("e"), time.monotonic() - start


def thread_stacks(match: str = "xfer") -> str:
    """The last frames of this process's threads whose name contains ``match`` (where a stuck
    transfer's lane and control threads are)."""
    import sys
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"--- {names.get(i, i)}\n" + "".join(traceback.format_stack(f)[-6:])
                     for i, f in sys._current_frames().items() if match in names.get(i, ""))


def _step(rt, name: str, queue, limit: float) -> str:
    """Queue ``queue(stream)`` on a fresh stream; wait (polling) for the stream to pass it."""
    stream = rt.new_stream()
    start = time.monotonic()
    _, err, _ = _host(lambda: (queue(stream), rt.record(stream))[1], limit)
    if err:
        return f"{name}: FAIL ({err})"
    event = rt.record(stream)
    while not event.query():
        if time.monotonic() - start > limit:
            return f"{name}: STUCK (the stream did not pass it within {limit:g} s)"
        time.sleep(1e-4)
    return f"{name}: ok {1e3 * (time.monotonic() - start):.2f} ms"


def _queued(rt, queue) -> dict:
    """Queue ``queue(stream)`` then an event on a fresh stream, from a thread of its own."""
    box = {"stream": rt.new_stream()}

    def run():
        try:
            queue(box["stream"])
            box["event"] = rt.record(box["stream"])
        except BaseException as exc:  # noqa: BLE001 - reported
            box["error"] = f"{type(exc).__name__}: {exc}"

    box["thread"] = threading.Thread(target=run, daemon=True)
    box["thread"].start()
    return box


def _released(box: dict, limit: float) -> str:
    """Whether a ``_queued`` wait has passed within ``limit``."""
    end = time.monotonic() + limit
    box["thread"].join(limit)
    if box["thread"].is_alive():
        return f"STUCK (the host call did not return within {limit:g} s)"
    if "error" in box:
        return f"FAIL ({box['error']})"
    while not box["event"].query():
        if time.monotonic() > end:
            return f"STUCK (the stream did not pass the wait within {limit:g} s)"
        time.sleep(1e-4)
    return "ok"


def _words(rt, limit: float) -> str:
    out, err, _ = _host(rt.describe, limit)
    return err or out


def pe_main(rank: int, size: int, device: int, store_url: str, limit: float, conn=None) -> list[str]:
    from xfer.config import NvshmemGroup
    from xfer.transports.nvshmem import runtime as nvshmem_runtime

    group = NvshmemGroup(store=store_url, name="probe", rank=rank, size=size, device=device,
                         staging_bytes=1 << 20, init_timeout_s=60.0)
    lines = []
    say = lines.append
    rt, err, secs = _host(lambda: nvshmem_runtime.acquire(group, "probe-host"), 90.0)
    if err:
        say(f"PE {rank}: init FAIL ({err})")
        return lines
    if torch.cuda.is_available():
        torch.cuda.set_device(rt.index)
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    say(f"PE {rank}/{size} on {getattr(rt, 'device', '?')}: init {secs:.1f} s, status {getattr(rt, 'status', '?')}, "
        f"limited-MPG ops {getattr(getattr(rt, '_mpg', None), 'mode', None)}")
    steps = [
        ("set own data word := 5", lambda s: rt.set_own_data(s, prev, ROLE, 5)),
        ("wait own data word >= 5 (already true)", lambda s: rt.wait_data(s, prev, ROLE, 5)),
        ("set own credit word := 1", lambda s: rt.set_own_credit(s, nxt, ROLE, 1)),
        ("wait own credit word >= 1 (already true)", lambda s: rt.wait_credit(s, nxt, ROLE, 1)),
    ]
    for name, queue in steps:
        say(f"PE {rank}: {_step(rt, name, queue, limit)}")
    _barrier(conn)
    say(f"PE {rank}: {_step(rt, f'put-with-signal 4 KiB to PE {nxt} (data word := 6)', lambda s: rt.put_signal(s, nxt, ROLE, 6, 4096), limit)}")
    say(f"PE {rank}: {_step(rt, f'wait data word from PE {prev} >= 6', lambda s: rt.wait_data(s, prev, ROLE, 6), limit)}")
    _barrier(conn)
    say(f"PE {rank}: {_step(rt, f'set PE {prev} credit word := 7 (remote write)', lambda s: rt.send_credit(s, prev, ROLE, 7), limit)}")
    say(f"PE {rank}: {_step(rt, f'wait own credit word (from PE {nxt}) >= 7', lambda s: rt.wait_credit(s, nxt, ROLE, 7), limit)}")
    _barrier(conn)
    # the pipeline's order: the receiver's wait is queued before the sender's put-with-signal (a
    # self put's wait blocks its thread until the put is queued: see SelfSignals), on its own thread
    waiting = _queued(rt, lambda s: rt.wait_data(s, prev, ROLE, 8))
    say(f"PE {rank}: {_step(rt, f'put-with-signal to PE {nxt} (:= 8) after the wait was queued', lambda s: rt.put_signal(s, nxt, ROLE, 8, 4096), limit)}")
    say(f"PE {rank}: wait >= 8 queued first, released by the put: {_released(waiting, limit)}")
    _barrier(conn)
    # a wait that only another stream releases (how a failed lane drains)
    blocked = _queued(rt, lambda s: rt.wait_data(s, prev, ROLE, 100))
    time.sleep(0.05)
    early = blocked["event"].query() if "event" in blocked else False
    say(f"PE {rank}: {_step(rt, 'set own data word := 100 from a side stream', lambda s: rt.set_own_data(s, prev, ROLE, 100), limit)}")
    result = _released(blocked, limit)
    say(f"PE {rank}: wait >= 100 released by the side stream: {'passed too early' if early else result}")
    say(f"PE {rank}: words {_words(rt, limit)}")
    _barrier(conn)
    _, err, secs = _host(lambda: nvshmem_runtime.release(rt), 30.0)
    say(f"PE {rank}: teardown {err or rt.teardown} ({secs:.1f} s)")
    return lines


def _barrier(conn) -> None:
    """Line the PEs up between phases (the parent relays): steps that need the peer's words set."""
    if conn is None:
        return
    conn.send("barrier")
    conn.recv()


def _child(rank, size, device, store_url, limit, conn):
    lines = pe_main(rank, size, device, store_url, limit, conn)
    conn.send(("done", lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pes", type=int, default=1)
    ap.add_argument("--devices", default="0", help="comma-separated CUDA index per PE (the last repeats)")
    ap.add_argument("--step-s", type=float, default=5.0, help="deadline of each step")
    args = ap.parse_args(argv)
    from xfer.store import open_store

    devs = [int(d) for d in args.devices.split(",")]
    devs += [devs[-1]] * (args.pes - len(devs))
    with open_store("tcp://127.0.0.1:0") as store:
        ctx = mp.get_context("spawn")
        pipes, procs = [], []
        for r in range(args.pes):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_child, args=(r, args.pes, devs[r], store.endpoint, args.step_s, theirs),
                            daemon=True)
            p.start()
            pipes.append(mine)
            procs.append(p)
        results, deadline = {}, time.monotonic() + 120 + 20 * args.step_s
        waiting = set()
        while len(results) < args.pes and time.monotonic() < deadline:
            for r, c in enumerate(pipes):
                if r in results or r in waiting or not c.poll(0.01):
                    continue
                try:
                    msg = c.recv()
                except EOFError:
                    results[r] = [f"PE {r}: process died (exit code {procs[r].exitcode})"]
                    continue
                if msg == "barrier":
                    waiting.add(r)
                else:
                    results[r] = msg[1]
            if waiting and len(waiting) + len(results) == args.pes:
                for r in waiting:
                    pipes[r].send("go")
                waiting.clear()
        for r in range(args.pes):
            print("\n".join(results.get(r, [f"PE {r}: no answer within the probe's deadline"])), flush=True)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
