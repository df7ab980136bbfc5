"""The fence soak (issue 29): about 1,000 transfers in flight at once, random cancels, deadlines
that expire mid-flight, and the freed blocks reused at once by another agent.

Per round, initiator A1 posts ``TRANSFERS`` writes into disjoint block ranges of three target
agents (one to sixteen blocks each; one in six with a deadline of 20-200 ms, the rest ``DEADLINE``)
and cancels one in six of them right after posting. Every write that ends without DONE has its
destination revoked by its target (which must succeed: its stop was fenced), refilled with a
marker, and half of those blocks are written again at once by a second initiator A2 (another
agent: a second writer of freed blocks). Then, for 2 s, every destination block must hold exactly
what its last writer that read DONE wrote, or the marker. Counted over the run, all must be 0:

- bytes landed after an end (a block differing from its expected bytes at any of the looks);
- notices delivered for a transfer its initiator reported not DONE, and DONE ones not notified;
- hangs (a transfer that had not ended ``DEADLINE`` + the fence bound after it was posted);
- revokes that timed out, and second writers refused (a hold that outlived its fenced stop).

Runs over ``local`` (one host, shared memory) and over ``ucx`` across a veth pair (network
namespaces: root only, skipped elsewhere). ``XFER_SOAK_FENCE_ROUNDS`` (default 2) and
``XFER_SOAK_FENCE_TRANSFERS`` (default 1000) size it; one summary line each (``pytest -s``)."""

from __future__ import annotations

import collections
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fence_helpers import REFILL, Side
from xfer import AgentConfig, LayoutKind

ROUNDS = int(os.environ.get("XFER_SOAK_FENCE_ROUNDS", "2"))
TRANSFERS = int(os.environ.get("XFER_SOAK_FENCE_TRANSFERS", "1000"))
KIND = LayoutKind.VLLM_FLASH_ATTN_NHD
# 8 KiB a block (4 layers x K/V x 8 tokens x 1 head x 64 x bf16); 1,024 blocks a target
DIMS = dict(num_layers=4, num_blocks=1024, block_size=8, num_heads=1, head_dim=64)
TARGETS = ("B0", "B1", "B2")
DEADLINE = 8.0
_F = AgentConfig().settings.fence
WATCH_S = 2.0

pytestmark = [pytest.mark.timeout(600)]


def _transports():
    out = ["local"]
    try:
        import ucxx  # noqa: F401
    except ImportError:
        return out
    from ucx_helpers import netns_skip_reason

    return out + (["ucx-veth"] if netns_skip_reason() is None else [])


@pytest.fixture(params=_transports())
def sides(request):
    transport = request.param
    pair, made = None, []
    kw = {n: {} for n in ("A1", "A2", *TARGETS)}
    if transport == "ucx-veth":
        from ucx_helpers import NetnsPair

        pair = NetnsPair()
        for n in kw:
            s = "a" if n.startswith("A") else "b"
            kw[n] = dict(netns=pair[f"ns_{s}"], bind=pair[f"addr_{s}"],
                         env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": pair[f"dev_{s}"], "UCX_WARN_UNUSED_ENV_VARS": "n"})
    wire = "local" if transport == "local" else "ucx"
    try:
        with ThreadPoolExecutor(5) as pool:
            futs = {n: pool.submit(Side, n, wire, KIND, DIMS, config={"default_timeout_s": DEADLINE}, **kw[n])
                    for n in kw}
            out = {n: f.result() for n, f in futs.items()}
        made = list(out.values())
        for a in ("A1", "A2"):
            for b in TARGETS:
                out[a].call("connect", out[b].metadata)
        yield transport, out
    finally:
        for s in made:
            s.close()
        if pair is not None:
            pair.close()


def _plan(rng: random.Random):
    """[(target, dst blocks, deadline)]: disjoint ranges, ~TRANSFERS in all."""
    per = TRANSFERS // len(TARGETS)
    plan = []
    for b in TARGETS:
        cuts = sorted(rng.sample(range(1, DIMS["num_blocks"]), per - 1))
        for lo, hi in zip([0] + cuts, cuts + [DIMS["num_blocks"]]):
            n = rng.randint(1, min(16 if rng.random() < 0.1 else 2, hi - lo))
            tmo = rng.uniform(0.02, 0.2) if rng.random() < 1 / 6 else DEADLINE
            plan.append((b, list(range(lo, lo + n)), tmo))
    return plan


def test_a_thousand_transfers_in_flight_with_cancels_deadlines_and_reuse(sides):
    transport, S = sides
    rng = random.Random(29)
    n_blocks = DIMS["num_blocks"]
    S["A1"].fill_random(1)
    S["A2"].fill_random(2)
    stats = collections.Counter()
    longest_fence, latest_end = 0.0, 0.0
    t_run = time.monotonic()
    for r in range(ROUNDS):
        for b in TARGETS:
            S[b].poison()
            S[b].call("notes")
        plan = _plan(rng)
        srcs = [[rng.randrange(n_blocks) for _ in dst] for _, dst, _ in plan]
        posted_at = time.monotonic()
        first = S["A1"].call("post_many", [("write", b, src, dst, tmo, b"")
                                           for (b, dst, tmo), src in zip(plan, srcs)])
        idx = list(range(first, first + len(plan)))
        cancel = [i for i in idx if rng.random() < 1 / 6]
        stats["cancels started"] += S["A1"].call("cancel_some", cancel)
        outs = S["A1"].call("outcomes", idx, timeout=DEADLINE + _F.bound_s + 60)
        stats["transfers"] += len(plan)
        expect = {b: {} for b in TARGETS}  # target -> block -> (source side, source block) or None (marker)
        freed = {b: [] for b in TARGETS}
        done_ids, not_done_ids = {b: set() for b in TARGETS}, {b: set() for b in TARGETS}
        for (b, dst, tmo), src, (state, err, fence, end, tid, deadline) in zip(plan, srcs, outs):
            stats[state] += 1
            if state == "FAILED":
                stats[f"FAILED {err}"] += 1
            latest_end = max(latest_end, end - posted_at)
            stats["hangs"] += end - deadline > _F.bound_s  # every transfer ends by its deadline + the bound
            if fence is not None:
                longest_fence = max(longest_fence, fence)
            if state == "DONE":
                done_ids[b].add(tid)
                for d, s in zip(dst, src):
                    expect[b][d] = ("A1", s)
            else:
                not_done_ids[b].add(tid)
                freed[b] += dst
        # the stopped ones' blocks: revoked (at once: their stops were fenced), refilled, half reused
        reuse = []
        for b in TARGETS:
            if not freed[b]:
                continue
            res = S[b].call("revoke", (freed[b], _F.bound_s))
            stats["revoke timeouts"] += res[0] != "ok"
            stats["revoked holds"] += res[1] if res[0] == "ok" else 0
            S[b].fill_blocks(freed[b], REFILL)
            for d in freed[b]:
                expect[b][d] = None
            again = [d for d in freed[b] if rng.random() < 0.5]
            for d in again:
                reuse.append((b, [d], [rng.randrange(n_blocks)]))
        if reuse:
            first2 = S["A2"].call("post_many", [("write", b, src, dst, DEADLINE, b"") for b, dst, src in reuse])
            outs2 = S["A2"].call("outcomes", list(range(first2, first2 + len(reuse))), timeout=DEADLINE + 60)
            for (b, dst, src), (state, err, *_rest) in zip(reuse, outs2):
                stats["reuses"] += 1
                stats["reuse refused"] += err == "BlocksBusyError"
                if state == "DONE":
                    done_ids[b].add(_rest[2])
                    expect[b][dst[0]] = ("A2", src[0])
                else:
                    not_done_ids[b].add(_rest[2])
                    stats["reuse not done"] += 1
        # every destination block holds what its last DONE writer wrote, or the marker, for 2 s
        want = {}
        for b in TARGETS:
            blocks = sorted(expect[b])
            parts = []
            for d in blocks:
                e = expect[b][d]
                parts.append(S[e[0]].blocks([e[1]]) if e is not None else
                             torch.full_like(S[b].blocks([d]), REFILL))
            want[b] = (blocks, parts)
        end = time.monotonic() + WATCH_S
        while True:
            for b in TARGETS:
                blocks, parts = want[b]
                for d, w in zip(blocks, parts):
                    stats["bytes checked"] += w.numel()
                    stats["bytes landed after an end"] += int((S[b].blocks([d]) != w).sum())
            if time.monotonic() >= end:
                break
            time.sleep(0.5)
        time.sleep(0.2)
        for b in TARGETS:  # notices: exactly the DONE ones, once each
            notes = [n[0] for n in S[b].call("notes")]
            seen = collections.Counter(notes)
            stats["notices of transfers not DONE"] += sum(1 for t in notes if t in not_done_ids[b])
            stats["DONE not notified"] += sum(1 for t in done_ids[b] if seen[t] == 0)
            stats["notified twice"] += sum(1 for c in seen.values() if c > 1)
    summary = (f"soak-fence ({transport}): {ROUNDS} rounds of ~{TRANSFERS} writes in flight in {time.monotonic() - t_run:.1f} s; "
               f"{dict(stats)}; longest fence {longest_fence:.3f} s (bound: grace {_F.grace_s} s + close); latest "
               f"end {latest_end:.2f} s after posting (deadline {DEADLINE} s)")
    print(summary)
    for key in ("FAILED", "bytes landed after an end", "notices of transfers not DONE", "DONE not notified", "notified twice",
                "hangs", "revoke timeouts", "reuse refused", "reuse not done"):
        assert stats[key] == 0, (key, summary)
    assert stats["CANCELLED"] > 0 and stats["TIMED_OUT"] > 0 and stats["DONE"] > 0, summary
