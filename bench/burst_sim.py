"""A burst of one-sided WRITEs on the CPU with the GPU stream replaced by a clock: where a burst's
time goes outside the copies (issue 32: 128 back to back fell from 0.98 to 0.82-0.89 of the copy
on the H100 once WRITEs waited for grants).

The initiator's real worker loop, grant requests, completer and notices run against a target
agent in another process over the control channel; the copy of each transfer is a clock that
runs one copy of ``COPY_MS`` (default 0.375, the seed case on an H100) at a time in launch order,
and its launch sleeps 40 us of host time. Prints, per burst of 128: the total against 128 copies,
when the first copy started, the clock's idle time between copies, the tail after the last.

    python bench/burst_sim.py            # DETAIL=1: every 16th transfer's phases too
    RAMP=32 python bench/burst_sim.py    # the first batch as large as any (no ramp)
    POST_US=40 python bench/burst_sim.py # each post holds the GIL 40 us more (as on the H100 host)
    PIN=1 python bench/burst_sim.py      # the initiator on CPU 0, the target on CPU 1 (two one-core hosts)
    NBLK=1024 python bench/burst_sim.py  # a larger cache (the posts' id checks as on ipc_bench's sets)
"""
import multiprocessing as mp
import os
import time

COPY_MS = float(os.environ.get("COPY_MS", "0.375"))
DIMS = dict(num_layers=4, num_blocks=int(os.environ.get("NBLK", "64")), block_size=16, num_heads=1, head_dim=64)


def _pin(cpu: int) -> None:
    if os.environ.get("PIN") and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {cpu})


def target(conn):
    _pin(1)
    from xfer import Agent, AgentConfig, make_kv_cache, shared_empty
    ts, lay = make_kv_cache("vllm_flash_attn_nhd", empty=shared_empty, **DIMS)
    a = Agent("t", AgentConfig(enable=("local",)))
    a.register("kv", ts, lay)
    conn.send(a.metadata())
    while True:
        m = conn.recv()
        if m == "stop":
            break
        conn.send(len(a.notifications()))
    a.close()


class FakeStream:
    cuda_stream = 99


class FakeEvent:
    def __init__(self, end):
        self.end = end

    def query(self):
        return time.monotonic() >= self.end

    def synchronize(self):  # as cudaEventSynchronize: the GIL released for the whole wait
        left = self.end - time.monotonic()
        if left > 0:
            time.sleep(left)


def patch(transport):
    from xfer.transports.onesided import transport as ot
    gpu = {"free_at": 0.0}
    transport.stream = lambda job: FakeStream()
    transport.spin_wait = True

    def prepare(job):
        return ot._Prep(None, job.local_ids, job.peer_ids, "triton", FakeStream(), max(1, len(job.local_ids)))

    def launch(job, prep=None):
        time.sleep(40e-6)  # host work of a launch (~40 us)
        now = time.monotonic()
        start = max(now, gpu["free_at"])
        gpu["free_at"] = start + COPY_MS / 1e3
        job.transfer.mark("gpu_start")
        job.transfer.marks.append(("gpu_start_at", start))
        return FakeEvent(gpu["free_at"])
    transport._prepare = prepare
    transport._launch = launch


def main():
    _pin(0)
    from xfer import Agent, AgentConfig, make_kv_cache, shared_empty
    ctx = mp.get_context("spawn")
    c, ch = ctx.Pipe()
    p = ctx.Process(target=target, args=(ch,))
    p.start()
    md = c.recv()
    ts, lay = make_kv_cache("vllm_flash_attn_nhd", empty=shared_empty, **DIMS)
    a = Agent("i", AgentConfig(enable=("local",)))
    a.register("kv", ts, lay)
    peer = a.connect(md)
    patch(a.transports[next(iter(a.transports))])
    if os.environ.get("SWITCH_MS"):  # this process's GIL switch interval (Python's default: 5 ms)
        import sys
        sys.setswitchinterval(float(os.environ["SWITCH_MS"]) / 1e3)
    if os.environ.get("RAMP"):
        from xfer.transports.onesided import transport as ot
        ot.RAMP_FIRST = int(os.environ["RAMP"])
    sets = [list(range(8 * i, 8 * i + 4)) for i in range(8)]
    post_s = float(os.environ.get("POST_US", "0")) * 1e-6  # host work of a post, GIL held (the H100 host's: ~40 us more)
    if post_s:
        real_write = a.write

        def write(*args, **kw):
            end = time.perf_counter() + post_s
            while time.perf_counter() < end:
                pass
            return real_write(*args, **kw)
        a.write = write
    for k in (128, 128, 128):
        time.sleep(0.05)
        t0 = time.monotonic()
        xs = [a.write(peer, sets[i % 8], sets[i % 8]) for i in range(k)]
        posted = time.monotonic() - t0
        for x in xs:
            x.wait()
        total = time.monotonic() - t0
        starts = [dict(x.marks)["gpu_start_at"] for x in xs]
        idle = sum(max(0.0, starts[i] - (starts[i - 1] + COPY_MS / 1e3)) for i in range(1, k))
        first = starts[0] - t0
        print(f"burst {k}: total {total*1e3:.1f} ms (ideal {k*COPY_MS:.1f}), per request {total/k*1e3:.3f} ms = "
              f"{COPY_MS/(total/k*1e3):.2f} of the copy; posted in {posted*1e3:.1f} ms; first copy at {first*1e3:.2f} ms; "
              f"GPU idle between copies {idle*1e3:.2f} ms; tail after the last copy {(total - (starts[-1]-t0) - COPY_MS/1e3)*1e3:.2f} ms")
        if k == 128 and os.environ.get("DETAIL"):
            for i in range(0, k, 16):
                tl = {n: 1e3 * (v - t0) for n, v in xs[i].marks if n != "gpu_start_at"}
                print(i, {n: round(v, 2) for n, v in tl.items()}, "gpu", round(1e3 * (starts[i] - t0), 2))
    c.send("stop")
    a.close()
    p.join()


if __name__ == "__main__":
    main()
