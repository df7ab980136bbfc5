"""Where a lone UCX write's time goes: both processes' engine steps on one clock (issue 32).

The target runs in a spawned child with the same case as ``bench/ucx_bench.py`` (every other block
of a cache twice as large, K/V per layer); the initiator posts ``--writes`` lone writes, each after
the target's poison of its cache (numpy: torch's ``fill_`` leaves an OpenMP worker spinning) and
``--gap-ms`` of idle, and a contiguous TCP send of the same bytes + a 1-byte ack (the ceiling) is
interleaved with them, after the same poison and idle. Printed: each variant's median (p25, p75,
min) and the ceiling's median over it; each thread's CPU (``/proc/self/task``, per write of all
kinds: multiply by the number of kinds for one kind's); garbage collections per thread; and, unless
``--no-trace``, when each traced function of the UCX engine began and ended (``time.monotonic``:
one clock for every process of a host), median ms from the post, for the faster and the slower
half of the writes apart, with the CPU each event ran on. ``--parts``: the thread CPU of each
part of the engine's loop turn (progress, inbox, probe/take, request checks, slot schedule,
expiry). ``--profile P``: cProfile of both engine threads to P.<pid>.

``--variant JSON`` (repeatable) runs one agent pair per variant, their writes interleaved in the
same run: ``{"ucx": {UCX option: value}, "settings": {UcxSettings field: value}, "engine":
{Engine attribute: value}}``, e.g. ``'{"ucx": {"RNDV_THRESH": "4M"}}'`` (eager chunks) or
``'{"settings": {"min_chunk_bytes": 4194304}}'`` (one chunk). Each cycle of kinds (the variants and
the TCP send) runs in a new random order: in a fixed one, the kind right after the TCP send read
~1 ms slower, which once passed for a gain.

    PYTHONPATH=<tree> python bench/ucx_trace.py [--case 32x64x512B] [--writes 150] [--gap-ms 2]
        [--no-trace] [--parts] [--variant JSON ...]

It imports ``xfer`` from ``PYTHONPATH`` (run it against two trees, alternating, to compare them).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time

CASES = {
    "64x128x32KiB": (64, 128, 16, 8, 128),
    "32x256x4KiB": (32, 256, 16, 1, 128),
    "32x64x512B": (32, 64, 16, 1, 16),
}
KIND = "vllm_flash_attn_nhd"
EVENTS: list = []  # (label, t, thread name)
GC = collections.defaultdict(lambda: [0, 0.0])  # (generation, thread) -> [collections, seconds]
_gc_t0 = [0.0]


def _gc_cb(phase, info):
    if phase == "start":
        _gc_t0[0] = time.perf_counter()
    else:
        g = GC[(info["generation"], threading.current_thread().name)]
        g[0] += 1
        g[1] += time.perf_counter() - _gc_t0[0]


def gc_watch():
    import gc

    gc.callbacks.append(_gc_cb)


def _dims(case):
    layers, n, bs, heads, hd = CASES[case]
    return dict(num_layers=layers, num_blocks=2 * n, block_size=bs, num_heads=heads, head_dim=hd)


try:
    import ctypes
    _getcpu = ctypes.CDLL(None).sched_getcpu
except (OSError, AttributeError):
    _getcpu = lambda: -1  # noqa: E731


def _rec(label):
    EVENTS.append((label, time.monotonic(), f"{threading.current_thread().name}@{_getcpu()}"))


def _wrap(obj, name, label):
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        _rec(label + ">")
        try:
            return fn(*a, **k)
        finally:
            _rec(label + "<")
    setattr(obj, name, wrapped)


def profile_engines(path):
    """cProfile each engine thread of this process from its start to its end; stats to ``path``.PID."""
    import cProfile
    import pstats

    from xfer.transports.ucx import loop

    run = loop.Engine._run

    def profiled(self):
        prof = cProfile.Profile()
        prof.enable()
        try:
            return run(self)
        finally:
            prof.disable()
            with open(f"{path}.{os.getpid()}", "w") as f:
                pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(70)
    loop.Engine._run = profiled


CPU = collections.defaultdict(lambda: [0, 0.0])  # (thread, part) -> [calls, thread CPU seconds]


def cpu_parts():
    """Thread CPU of each part of the engine's loop turn (``_step``) and of its epoll sleeps."""
    from xfer.transports.ucx import loop

    tt = time.thread_time

    def step(self):
        c = CPU
        busy = False
        t0 = tt()
        while self.worker.progress_once():
            busy = True
        t1 = tt()
        c["progress"][1] += t1 - t0
        c["progress"][0] += 1
        while self._inbox:
            fn, args = self._inbox.popleft()
            fn(*args)
            busy = True
        t2 = tt()
        c["inbox"][1] += t2 - t1
        while self._conn_requests:
            self.proto.accept(self._conn_requests.pop())
            busy = True
        busy |= self.data.take()
        t3 = tt()
        c["take"][1] += t3 - t2
        busy |= self._check_reqs()
        t4 = tt()
        c["check_reqs"][1] += t4 - t3
        busy |= self.slots.schedule()
        t5 = tt()
        c["schedule"][1] += t5 - t4
        self.flows.expire(time.monotonic())
        c["expire"][1] += tt() - t5
        return busy
    loop.Engine._step = step


def install():
    """Trace the engine's steps (class attributes: every agent of this process)."""
    from xfer.transports.ucx import datapath, flow, loop, protocol

    P, D, F, E = protocol.Protocol, datapath.DataPath, flow.Flow, loop.Engine
    for obj, name, label in ((P, "start", "start"), (P, "_on_req", "on_req"), (P, "_deliver", "deliver"),
                             (P, "_dispatch", "dispatch"), (P, "landed", "landed"), (P, "send_ctrl", "send_ctrl"),
                             (D, "send_chunk", "send_chunk"), (D, "send_iov", "send_iov"),
                             (D, "recv_chunk", "recv_chunk"), (F, "start_chunk", "start_chunk"),
                             (F, "sent", "chunk_sent"), (F, "landed_in_place", "landed_in_place"),
                             (F, "received", "received"), (F, "_scattered", "scattered"),
                             (E, "copy", "copy")):
        _wrap(obj, name, label)
    # every message the probe takes, and each epoll sleep of the engine
    take = D.take

    def traced_take(self):
        n0 = len(EVENTS)
        busy = take(self)
        if busy:
            EVENTS.insert(n0, ("take>", EVENTS[n0][1] if len(EVENTS) > n0 else time.monotonic(),
                               threading.current_thread().name))
        return busy
    D.take = traced_take
    run = E._run

    def traced_run(self):
        poll = self._epoll.poll

        class P:
            def poll(_, timeout=-1):
                _rec("sleep>")
                try:
                    return poll(timeout)
                finally:
                    _rec("sleep<")

            def __getattr__(_, k):
                return getattr(self.__dict__["_epoll_real"], k)
        self.__dict__["_epoll_real"] = self._epoll
        self._epoll = P()
        return run(self)
    E._run = traced_run


def thread_cpu():
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                s = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = s[s.rindex(")") + 2:].split()
        out[f"{names.get(int(tid), name)}/{tid}"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _config(name, variant):
    """An AgentConfig for one variant: ``ucx`` (UCX context options), ``settings`` (UcxSettings fields)."""
    import dataclasses

    from xfer import AgentConfig
    from xfer.settings import Settings

    st = Settings.from_env()
    ucx = dataclasses.replace(st.ucx, **variant.get("settings", {}),
                              ucx_options={**st.ucx.ucx_options, **variant.get("ucx", {})})
    return AgentConfig(transport="ucx", listen_host="127.0.0.1", default_timeout_s=60,
                       settings=dataclasses.replace(st, ucx=ucx))


def _apply(agent, variant):
    """Engine attributes a variant sets (``engine``: {name: value}) once the agent runs."""
    for k, v in variant.get("engine", {}).items():
        from xfer.transports import TransportKind

        setattr(agent.transports[TransportKind.UCX]._engine, k, v)


def _target(conn, case, trace, profile, variants, parts):
    import torch

    from xfer import Agent, make_kv_cache

    if trace:
        install()
    if profile:
        profile_engines(profile)
    if parts:
        cpu_parts()
    gc_watch()
    caches, agents = [], []
    for i, v in enumerate(variants):
        tensors, layout = make_kv_cache(KIND, **_dims(case))
        for t in tensors:
            t.view(-1).view(torch.uint8).fill_(0xA5)
        agent = Agent(f"trace-dst{i}", _config(f"trace-dst{i}", v))
        agent.register("kv", tensors, layout)
        _apply(agent, v)
        caches.append(tensors)
        agents.append(agent)
    import socket

    nbytes = CASES[case][1] * layout.bytes_per_block
    srv = socket.create_server(("127.0.0.1", 0))

    def serve_tcp():  # the ceiling: one contiguous send of the same bytes, a 1-byte ack
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(nbytes))
        while True:
            got = 0
            while got < nbytes:
                k = c.recv_into(buf[got:], nbytes - got)
                if not k:
                    return
                got += k
            c.sendall(b"k")
    threading.Thread(target=serve_tcp, daemon=True).start()
    conn.send(([a.metadata() for a in agents], srv.getsockname()[1]))
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            for a in agents:
                a.close()
            conn.send("bye")
            return
        if cmd == "poison":
            for t in caches[arg % len(caches)]:  # numpy: torch's fill_ leaves an OpenMP worker spinning
                t.view(-1).view(torch.uint8).numpy().fill(0xA5)
            agents[arg % len(agents)].notifications()
            conn.send("ok")
        elif cmd == "reset":
            CPU.clear()
            EVENTS.clear()
            GC.clear()
            conn.send(thread_cpu())
        elif cmd == "dump":
            conn.send((list(EVENTS), thread_cpu(), dict(GC), {k: list(v) for k, v in CPU.items()}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="32x64x512B", choices=list(CASES))
    ap.add_argument("--writes", type=int, default=50)
    ap.add_argument("--gap-ms", type=float, default=5.0, help="idle before each write (after the poison call)")
    ap.add_argument("--no-trace", action="store_true", help="time the writes without the tracing wrappers")
    ap.add_argument("--variant", action="append", default=[],
                    help='JSON {"ucx": {UCX option: value}, "settings": {UcxSettings field: value}, "engine": '
                    '{attribute: value}}; several: one agent pair each, their writes interleaved')
    ap.add_argument("--parts", action="store_true", help="thread CPU of each part of the engine's loop turn")
    ap.add_argument("--profile", help="cProfile both engine threads (no tracing): stats to PROFILE.<pid>")
    args = ap.parse_args()
    if args.profile:
        args.no_trace = True
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import numpy as np
    import torch

    import xfer
    from xfer import Agent, AgentConfig, make_kv_cache

    if not args.no_trace:
        install()
    if args.profile:
        profile_engines(args.profile)
    if args.parts:
        cpu_parts()
    gc_watch()
    import json

    variants = [json.loads(v) for v in args.variant] or [{}]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, args.case, not args.no_trace, args.profile, variants, args.parts),
                       daemon=True)
    proc.start()
    if not conn.poll(120):
        raise RuntimeError("the target process did not start (see its traceback above)")
    mds, tcp_port = conn.recv()
    tensors, layout = make_kv_cache(KIND, **_dims(args.case))
    for t in tensors:
        t.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8))
    n = CASES[args.case][1]
    src, dst = np.arange(0, 2 * n, 2), np.arange(1, 2 * n, 2)[::-1].copy()
    per_write, lat = [], {i: [] for i in range(len(variants) + 1)}
    import socket

    tcp = socket.create_connection(("127.0.0.1", tcp_port))
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = np.random.default_rng(0).integers(0, 256, n * layout.bytes_per_block, dtype=np.uint8)
    agents = [Agent(f"trace-src{i}", _config(f"trace-src{i}", v)) for i, v in enumerate(variants)]
    try:
        peers = []
        for a, v, md in zip(agents, variants, mds):
            a.register("kv", tensors, layout)
            _apply(a, v)
            peers.append(a.connect(md))
            for _ in range(3):
                a.write(peers[-1], src, dst).wait()
        conn.send(("reset", None))
        cpu_t0 = conn.recv()
        cpu_i0 = thread_cpu()
        EVENTS.clear()
        GC.clear()
        CPU.clear()
        order, rng = [], random.Random(7)
        for i in range(args.writes):  # each cycle of kinds in a new random order: no kind always follows another
            if not order:
                order = list(range(len(variants) + 1))
                rng.shuffle(order)
            k = order.pop()
            conn.send(("poison", k))
            conn.recv()
            time.sleep(args.gap_ms / 1e3)
            if k == len(variants):  # the TCP ceiling, interleaved with the writes
                t0 = time.monotonic()
                tcp.sendall(memoryview(payload))
                tcp.recv(1)
                lat[k].append(time.monotonic() - t0)
                continue
            m0 = len(EVENTS)
            t0 = time.monotonic()
            t = agents[k].write(peers[k], src, dst)
            t1 = time.monotonic()
            t.wait()
            t2 = time.monotonic()
            lat[k].append(t2 - t0)
            per_write.append((t0, t1, t2, m0, t.timeline()))
        cpu_i1 = thread_cpu()
        conn.send(("dump", None))
        tev, cpu_t1, gc_t, parts_t = conn.recv()
        parts_i = {k: list(v) for k, v in CPU.items()}
        gc_i = dict(GC)
    finally:
        for a in agents:
            a.close()
    conn.send(("stop", None))
    conn.recv()
    proc.join(10)
    print(f"xfer {xfer.__file__}")
    tcp_med = statistics.median(lat[len(variants)])
    for k, v in enumerate(variants + ["tcp ceiling"]):
        q = sorted(lat[k])
        print(f"case {args.case}, {len(q)} lone writes, gap {args.gap_ms} ms, variant {json.dumps(v)}: median "
              f"{statistics.median(q) * 1e3:.3f} ms, p25 {q[len(q) // 4] * 1e3:.3f}, p75 {q[3 * len(q) // 4] * 1e3:.3f}, "
              f"min {q[0] * 1e3:.3f}; ceiling/this {tcp_med / statistics.median(q):.2f}")
    for who, c0, c1 in (("initiator", cpu_i0, cpu_i1), ("target", cpu_t0, cpu_t1)):
        busy = {k: (c1[k] - c0.get(k, 0)) * 1e3 / args.writes for k in c1}
        print(f"  {who} CPU per write (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in busy.items() if v > 0.005))
    if args.parts:
        for who, parts in (("initiator", parts_i), ("target", parts_t)):
            print(f"  {who} engine CPU per write (us): " + ", ".join(
                f"{k} {v[1] * 1e6 / args.writes:.0f}" for k, v in parts.items()) +
                f"; loop turns {parts.get('progress', [0])[0] / args.writes:.1f}")
    for who, g in (("initiator", gc_i), ("target", gc_t)):
        print(f"  {who} GC: " + ", ".join(f"gen{gen} on {th}: {n} runs, {sec * 1e3:.1f} ms" for (gen, th), (n, sec)
                                          in sorted(g.items())))
    if args.no_trace:
        return
    # each write's events (both processes), relative to its post; medians by (side, event, occurrence),
    # for the faster and the slower half of the writes apart
    ends = [w[0] for w in per_write[1:]] + [float("inf")]
    cut = statistics.median(w[2] - w[0] for w in per_write)
    for half, keep in (("faster half", lambda d: d <= cut), ("slower half", lambda d: d > cut)):
        rel = collections.defaultdict(list)
        cpus = collections.defaultdict(collections.Counter)
        chosen = [(w, end) for w, end in zip(per_write, ends) if keep(w[2] - w[0])]
        for (t0, t1, t2, m0, tl), end in chosen:
            seen = collections.Counter()
            evs = [("I", *e) for e in EVENTS if t0 - 1e-4 <= e[1] < min(end, t2 + 2e-3)] + \
                  [("T", *e) for e in tev if t0 - 1e-4 <= e[1] < min(end, t2 + 2e-3)]
            evs += [("I", "post<", t1, "main@?"), ("I", "wait<", t2, "main@?")]
            for side, label, t, th in sorted(evs, key=lambda e: e[2]):
                key = (side, label, seen[(side, label)], th.split("-")[0])
                cpus[key][th.rsplit("@", 1)[-1]] += 1
                seen[(side, label)] += 1
                rel[key].append(t - t0)
        rows = [(statistics.median(v), k, len(v)) for k, v in rel.items() if len(v) >= len(chosen) // 2]
        print(f"  {half} ({len(chosen)} writes)\n  {'median ms':>9}  side event (occurrence) thread [writes that had it]")
        for med, (side, label, occ, th), cnt in sorted(rows):
            where = " ".join(f"cpu{c}:{n}" for c, n in sorted(cpus[(side, label, occ, th)].items()))
            print(f"  {med * 1e3:9.3f}  {side} {label:<18} #{occ} {th} [{cnt}] {where}")


if __name__ == "__main__":
    main()
