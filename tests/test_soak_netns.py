"""The fault soak across two hosts: network namespaces A and B joined by a veth pair
(ci/netns.sh), UCX pinned. One initiator agent in A drives mixed-size concurrent writes into
three peer agents (three processes) in B, round after round, while faults hit mid-round, every
second round from round 2 on (A's outgoing traffic shaped to ``FAULT_RATE`` for that round, so its
transfers are surely in flight when the fault comes), in turn:

  * a link flap: A's veth end set down while transfers are in flight, up again after a pause
    shorter than the deadline: a short one (TCP recovers within the deadline) and a long one
    (``DEADLINE - 0.5`` s: transfers caught by it run out of time);
  * ``kill -9`` of a peer process while transfers into it are in flight; a replacement process
    under the same name starts in B and the initiator reconnects to it.

Checks: each transfer ends (DONE, or a typed xfer error) by its deadline + ``SLACK`` (the fence's
grace for the peer's confirmation, ``XFER_FENCE_GRACE_S``, plus 0.75 s; a transfer that has not: a hang);
each DONE transfer's blocks verify by digest on the peer (corrupt); over the whole run each peer
is notified of exactly the transfers reported DONE, none twice, none missing, with one counted
exception (below); no transfer without a fault on its path fails (quiet rounds, in particular
those after a flap: the agent stays usable; in a kill round, the transfers into the peers that
live); the initiator's RSS growth after warm-up stays bounded. One summary line is printed
(``pytest -s``), and one line a round.

The exception, a two-generals case (documented in xfer/transports/ucx/transport.py): when a flap delays
the target's ACK past the initiator's deadline, the target has landed every byte and delivered
its notification while the initiator reports TIMED_OUT (or the link's failure). Such a transfer
is counted and reported apart (``reported-but-not-done``), not failed on, provided its blocks on
the peer are whole (a complete block reported failed is not a half-written block reported
complete) and a flap was on its path; any other notification of a transfer not DONE fails.

CI-sized by default (~60 transfers in flight, 10 rounds, ~20 s of rounds plus ~20 s to start the
processes on a 2-core machine): it runs wherever network namespaces can be made (root, ``ip
netns``) and skips with the reason elsewhere. ``XFER_SOAK_SECONDS`` and ``XFER_SOAK_CONCURRENCY``
make it the opt-in long run (the fault cycle then repeats); ``XFER_SOAK_FLAPS`` (seconds, comma
separated, each < the deadline) replaces the two flap lengths."""

from __future__ import annotations

import collections
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("ucxx", reason="the UCX transport needs ucxx: pip install -e '.[ucx]'")

from helpers import fill_random  # noqa: E402
from ucx_helpers import NetnsPair, UcxPeer, netns_skip_reason  # noqa: E402
from xfer import LayoutKind, errors, make_kv_cache  # noqa: E402
from xfer import settings  # noqa: E402
from xfer.bench.target import block_digests  # noqa: E402

SECONDS = float(os.environ.get("XFER_SOAK_SECONDS", "0"))  # 0: just the CI fault cycle
CONCURRENCY = int(os.environ.get("XFER_SOAK_CONCURRENCY", "60"))  # in flight at once, across the 3 peers
DEADLINE = 4.0
# a transfer must have ended DEADLINE + SLACK after it was posted: its stop begins at the deadline and
# ucx's fence waits up to fence.grace_s for the peer's confirmation before it closes the connection
# (a link just back from a long flap may still be in TCP's retransmission backoff), plus scheduling
SLACK = settings.current().fence.grace_s + 0.75
FLAPS = [float(s) for s in os.environ.get("XFER_SOAK_FLAPS", f"1.0,{DEADLINE - 0.5}").split(",")]

pytestmark = [pytest.mark.netns, pytest.mark.timeout(int(SECONDS * 2) + 180)]
_reason = netns_skip_reason()
if _reason:
    pytestmark.append(pytest.mark.skip(reason=_reason))

KIND = LayoutKind.VLLM_FLASH_ATTN_NHD
# 32 KiB a block (8 layers x K/V x 8 tokens x 2 heads x 64 x bf16); 16 MiB a region
DIMS = dict(num_layers=8, num_blocks=512, block_size=8, num_heads=2, head_dim=64)
SEED = 5
PEERS = ("d0", "d1", "d2")
VICTIMS = ("d1", "d2")  # killed in turn; d0 lives throughout (its RSS is reported too)
WARMUP_ROUNDS = 2
FAULT_EVERY = 2  # faults in rounds 2, 4, 6, ...; a quiet round after each
TYPED = set(errors.__all__)
TERMINAL = {"DONE", "FAILED", "TIMED_OUT", "CANCELLED"}


def _fault_cycle():
    """[("flap", seconds) | ("kill", victim)]: short flap, kill, long flap, kill, ..."""
    kills = iter(VICTIMS * len(FLAPS))
    out = []
    for s in FLAPS:
        assert 0 < s < DEADLINE, f"XFER_SOAK_FLAPS: each flap must be shorter than the deadline {DEADLINE} s"
        out += [("flap", s), ("kill", next(kills))]
    return out


def _rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of process ``pid`` in KiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(rest.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


@pytest.fixture
def hosts(request, monkeypatch):
    """Namespaces A and B (unique names per run) and every agent process started in them, all
    removed at teardown whatever happened (deleting the namespaces also ends a flap cut short)."""
    # five busy processes on a small CI machine: one compute thread each, no OpenMP spinning
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    pair = NetnsPair()  # skips when namespaces cannot be made
    procs: list[UcxPeer] = []
    lock = threading.Lock()

    def cleanup():
        for p in procs:
            try:
                p.close()
            except Exception:
                p.kill()
        pair.close()
        leftover = [ns for ns in (pair["ns_a"], pair["ns_b"]) if os.path.exists(f"/var/run/netns/{ns}")]
        assert not leftover, f"namespaces left behind: {leftover}"

    request.addfinalizer(cleanup)

    def start(side, name, seed=None):
        peer = UcxPeer(name, KIND, DIMS, seed=seed, netns=pair[f"ns_{side}"], device=pair[f"dev_{side}"],
                       bind=pair[f"addr_{side}"], timeout=DEADLINE)
        with lock:
            procs.append(peer)
        return peer

    return pair, start


SETTLE_S = 20.0
# A's outgoing rate in fault rounds: unshaped, a round's transfers could all end within ~20 ms,
# before the watch loop's first look, and the fault was then not injected at all
FAULT_RATE = "400mbit"


def _settle(a, names, where, r) -> float:
    """One 1-block write to each peer, again until all succeed; the seconds that took."""
    t0, k = time.monotonic(), 0
    while True:
        batch = []
        for name in names:
            tag = f"settle{r}-{k}-{name}".encode()
            where[tag] = (name, [0], [0], r)
            batch.append(("write", name, [0], [0], DEADLINE, tag))
        a.call("post", batch, timeout=DEADLINE)
        results = a.call("wait", timeout=DEADLINE + SLACK)
        if all(res[0] == "ok" for res in results):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < SETTLE_S, \
            f"round {r}: the peers took no transfer within {SETTLE_S} s after the link came back: {results}"
        k += 1
        time.sleep(0.2)


def _plan(rng: random.Random, names, per_peer: int, tag0: str):
    """Up to ``per_peer`` writes per peer into disjoint random block ranges; mostly small (1-4
    blocks), one in four large (up to 48 blocks = 1.5 MiB). Returns [(peer, src, dst, tag)]; the
    tag is the transfer's notification payload (unique over the run)."""
    n_blocks, plan = DIMS["num_blocks"], []
    for name in names:
        cuts = sorted(rng.sample(range(1, n_blocks), min(per_peer, n_blocks) - 1))
        for lo, hi in zip([0] + cuts, cuts + [n_blocks]):
            cap = 48 if rng.random() < 0.25 else 4
            n = rng.randint(1, min(cap, hi - lo))
            dst = list(range(lo, lo + n))
            src = [rng.randrange(n_blocks) for _ in range(n)]
            plan.append((name, src, dst, f"{tag0}-{len(plan)}".encode()))
    return plan


def test_soak_across_the_veth_with_link_flaps_and_peer_kills(hosts):
    pair, start = hosts
    rng = random.Random(11)
    src_tensors, src_layout = make_kv_cache(KIND, **DIMS)
    fill_random(src_tensors, SEED)  # what the initiator holds (same seed)
    src_digest = {}

    t_setup = time.monotonic()
    with ThreadPoolExecutor(4) as pool:  # the four processes start in parallel
        fa = pool.submit(start, "a", "prefill", SEED)
        fb = {name: pool.submit(start, "b", name) for name in PEERS}
        a = fa.result()
        peers = {name: f.result() for name, f in fb.items()}
    for p in peers.values():
        assert a.call("connect", p.metadata) == p.name
    setup_s = time.monotonic() - t_setup

    stats = collections.Counter()
    errs = collections.Counter()
    outcome: dict[bytes, str] = {}  # tag -> DONE or the error class
    where: dict[bytes, tuple] = {}  # tag -> (peer, src, dst, round)
    checked: set[bytes] = set()  # tags into a peer process that lived on (notifications are checked)
    notified = collections.Counter()  # tag -> notifications received
    bad_notes = []  # notifications that match no transfer of that peer
    ghosts = []  # (tag, round, error, intact, fault of the round) of transfers notified but not DONE
    fault_log = []
    cycle = _fault_cycle()
    max_end = 0.0
    rss0 = hwm0 = rss_d0 = None
    per_peer = max(1, CONCURRENCY // len(PEERS))
    t_rounds = time.monotonic()
    r = 0

    def drain(name):
        for sender, op, blocks, payload in peers[name].call("notifications"):
            notified[payload] += 1
            w = where.get(payload)
            if w is None or w[0] != name or sender != "prefill" or op != "write" or blocks != w[2]:
                bad_notes.append((name, sender, op, payload))

    def digest(src):
        key = tuple(src)
        if key not in src_digest:
            src_digest[key] = block_digests(src_layout, src_tensors, src)
        return src_digest[key]

    # run the fault cycle once (then once more per cycle while XFER_SOAK_SECONDS last), and a
    # quiet round after the last fault
    n_rounds = WARMUP_ROUNDS + FAULT_EVERY * len(cycle)
    while r < n_rounds or time.monotonic() - t_rounds < SECONDS or (r - WARMUP_ROUNDS) % FAULT_EVERY:
        fault = victim = flap_s = None
        if r >= WARMUP_ROUNDS and (r - WARMUP_ROUNDS) % FAULT_EVERY == 0:
            fault, arg = cycle[(r - WARMUP_ROUNDS) // FAULT_EVERY % len(cycle)]
            victim, flap_s = (arg, None) if fault == "kill" else (None, arg)
        plan = _plan(rng, list(peers), per_peer, f"r{r}")
        for name, src, dst, tag in plan:
            where[tag] = (name, src, dst, r)
            if name != victim:
                checked.add(tag)
        if fault:  # a round's bytes (~15 MB) then take ~0.3 s: still in flight when the fault comes
            pair.rate(FAULT_RATE)
        t0 = time.monotonic()
        n = a.call("post", [("write", name, src, dst, DEADLINE, tag) for name, src, dst, tag in plan],
                    timeout=DEADLINE)
        assert n == len(plan), f"the initiator holds {n} posted transfers, expected {len(plan)}"
        stats["tried"] += len(plan)

        # watch the round; the fault hits at a random moment while transfers are in flight
        ended = [None] * len(plan)
        up_timer, in_flight_at_fault = None, None
        fault_at = rng.uniform(0.0, 0.03)  # a round's transfers may all end within ~0.1 s
        mine = [i for i, p in enumerate(plan) if victim is None or p[0] == victim]
        while True:
            states = a.call("states", timeout=DEADLINE + SLACK)
            now = time.monotonic()
            for i, s in enumerate(states):
                if s in TERMINAL and ended[i] is None:
                    ended[i] = now - t0
            if fault and in_flight_at_fault is None:
                running = [i for i in mine if states[i] not in TERMINAL]
                if (running and (now - t0 >= fault_at or 2 * len(running) <= len(mine))) or now - t0 > 0.5:
                    in_flight_at_fault = len(running)
                    if fault == "flap":
                        pair.link("down")
                        up_timer = threading.Timer(flap_s, pair.link, args=("up",))
                        up_timer.start()
                    else:
                        peers[victim].kill()
                    fault_log.append((r, fault, victim or flap_s, in_flight_at_fault, round(now - t0, 3)))
            if all(e is not None for e in ended) and (up_timer is None or not up_timer.is_alive()):
                break
            if now > t0 + DEADLINE + SLACK:
                break
            time.sleep(0.01)
        if up_timer is not None:
            up_timer.join()
        if fault:
            pair.rate("off")
        hangs = sum(e is None for e in ended)
        stats["hangs"] += hangs
        max_end = max([max_end] + [e for e in ended if e is not None])
        assert hangs == 0, f"round {r}: {hangs} transfers had not ended {DEADLINE + SLACK} s after being posted"
        results = a.call("wait", timeout=DEADLINE + SLACK)
        assert len(results) == len(plan)

        round_errs = collections.Counter()
        for (name, src, dst, tag), res in zip(plan, results):
            outcome[tag] = "DONE" if res[0] == "ok" else res[1]
            if res[0] == "ok":
                stats["done"] += 1
                continue
            stats["failed"] += 1
            errs[res[1]] += 1
            stats["untyped"] += res[1] not in TYPED
            round_errs[res[1]] += 1
            if fault != "flap" and name != victim:  # no fault touched it: losing it is an xfer bug
                stats["lost_unfaulted"] += 1
                stats["lost_after_flap"] += any(f[1] == "flap" for f in fault_log)

        for name in list(peers):
            if name == victim:
                continue
            drain(name)
            tensors = peers[name].tensors()
            for pname, src, dst, tag in plan:
                if pname != name:
                    continue
                if outcome[tag] == "DONE":
                    stats["verified"] += 1
                    stats["corrupt"] += block_digests(peers[name].layout, tensors, dst) != digest(src)
                elif notified[tag]:  # notified although it failed: are its blocks at least whole?
                    intact = block_digests(peers[name].layout, tensors, dst) == digest(src)
                    ghosts.append((tag, r, outcome[tag], intact, fault))
        if victim:  # a replacement process under the same name; the initiator reconnects to it
            t_rep = time.monotonic()
            peers[victim].close()
            peers[victim] = start("b", victim)
            assert a.call("connect", peers[victim].metadata) == victim
            stats["replace_ms"] = max(stats["replace_ms"], int(1000 * (time.monotonic() - t_rep)))

        if fault == "flap":  # TCP may still be backing off after the outage: the next round starts
            # once every live peer takes a transfer again (within SETTLE_S, or the agent is not usable)
            settle_s = _settle(a, list(peers), where, r)
            stats["settle_ms"] = max(stats["settle_ms"], int(1000 * settle_s))

        done = sum(outcome[t[3]] == "DONE" for t in plan)
        print(f"round {r}: {done}/{len(plan)} done {dict(round_errs)}, last ended at {max(ended):.2f} s, round "
              f"{time.monotonic() - t0:.2f} s" + (f"; {fault_log[-1][1]} {fault_log[-1][2]} with "
                                                 f"{fault_log[-1][3]} in flight" if fault_log and fault_log[-1][0] == r
                                                 else f"; {fault} not injected: its transfers ended first"
                                                 if fault else ""), flush=True)
        r += 1
        if r == WARMUP_ROUNDS:
            rss0, hwm0 = _rss_kib(a.proc.pid)
            rss_d0 = _rss_kib(peers["d0"].proc.pid)[0]

    time.sleep(0.5)  # late notifications (of failed transfers) would have arrived by now
    for name in peers:
        drain(name)
    rounds_s = time.monotonic() - t_rounds
    for tag in checked:
        if outcome[tag] == "DONE":
            stats["done_not_notified"] += notified[tag] == 0
        else:
            stats["reported_not_done"] += notified[tag] > 0
        stats["notified_twice"] += notified[tag] > 1
    ghost_rounds = collections.Counter(g[1] for g in ghosts)
    rss1, hwm1 = _rss_kib(a.proc.pid)
    growth, peak_growth = (rss1 - rss0) / 1024, (hwm1 - hwm0) / 1024
    d0_growth = (_rss_kib(peers["d0"].proc.pid)[0] - rss_d0) / 1024
    summary = (
        f"soak-netns: {r} rounds in {rounds_s:.1f} s (setup {setup_s:.1f} s), tried {stats['tried']}, "
        f"done {stats['done']}, failed {stats['failed']} {dict(errs)}; faults injected {len(fault_log)} "
        f"[(round, kind, victim|seconds, in flight, at s)] {fault_log}; hangs {stats['hangs']} (latest end "
        f"{max_end:.2f} s, deadline {DEADLINE} s); corrupt {stats['corrupt']}/{stats['verified']} verified; "
        f"reported-but-not-done (ACK after the deadline, two generals) {stats['reported_not_done']} (by round "
        f"{dict(ghost_rounds)}, blocks whole {sum(g[3] for g in ghosts)}/{len(ghosts)} checked); done-not-notified {stats['done_not_notified']}; "
        f"notified twice {stats['notified_twice']}; stray notifications {len(bad_notes)}; untyped errors "
        f"{stats['untyped']}; lost without a fault on their path {stats['lost_unfaulted']} (after a flap "
        f"{stats['lost_after_flap']}); replacement {stats['replace_ms']} ms; settle after a flap {stats['settle_ms']} ms; RSS growth after warm-up: "
        f"initiator {growth:+.1f} MiB (peak {peak_growth:+.1f}), d0 {d0_growth:+.1f} MiB")
    print(summary)
    assert stats["hangs"] == 0 and max_end <= DEADLINE + SLACK, summary
    assert stats["corrupt"] == 0 and stats["untyped"] == 0, summary
    assert {f[1] for f in fault_log} == {"flap", "kill"} and all(f[3] > 0 for f in fault_log), summary
    # the two-generals case is counted, not failed on: each one seen in its own round (blocks checked
    # whole there, before a later round overwrote them), in a round with a flap
    assert stats["reported_not_done"] == len(ghosts), summary
    assert all(g[3] for g in ghosts), (summary, [g for g in ghosts if not g[3]][:5])
    assert all(g[4] == "flap" for g in ghosts), (summary, [g for g in ghosts if g[4] != "flap"][:5])
    assert stats["done_not_notified"] == 0 and stats["notified_twice"] == 0 and not bad_notes, \
        (summary, bad_notes[:5])
    assert stats["lost_unfaulted"] == 0, summary
    assert growth < 200, summary
