"""The engine and the drop-ins free or reuse blocks only after the fence (issue 29): while a
transfer may still write (or read) a failed request's blocks, they are not handed back; once the
agent's revoke returned, they are. Each case holds the blocks the way a stuck transfer would (a
live hold of the agent's grants table), checks the call site keeps them, ends the hold, and checks
they come back; the engine thread never waits for it."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from test_dropin_fakes import caches, finished, req, smod, store, vconfig, vmod, worker_step  # noqa: F401


def _hold(agent, blocks, *, writes):
    """A transfer of another agent that may still write (or read) ``blocks`` of every region."""
    ids = np.asarray(blocks, dtype=np.int64)
    return [agent._grants.hold(agent._regions[r], ids, writes=writes, peer="stuck", tid=f"t-{r}", owner="stuck")
            for r in agent.regions if agent._regions[r].layout.num_blocks > ids.max()]


def _end(agent, holds):
    for h in holds:
        agent._grants.end(h)


def test_vllm_prefill_hands_back_a_lease_only_once_no_read_of_it_goes_on(vmod, store):  # noqa: F811
    """A lease that expires while a read of its blocks is still being served: get_finished does
    not report the request's blocks (vLLM would reuse them) until that read settled, and never
    waits for it (each step returns at once)."""
    cfg = vconfig("kv_producer", "pre-f", store.endpoint, timeout_s=0.3, lease_s=0.6)
    s, w = vmod.m.XferConnector(cfg, vmod.Role.SCHEDULER), vmod.m.XferConnector(cfg, vmod.Role.WORKER)
    try:
        w.register_kv_caches(caches("packed", 2))
        finished(s, req("p", list(range(8)), {"do_remote_decode": True}, vm=vmod), [0, 1])
        worker_step(w, s.build_connector_meta(None), finished={"p"})
        agent = w._worker.link.agent
        holds = _hold(agent, [1], writes=False)
        longest, sending, end = 0.0, set(), time.monotonic() + 2.0
        while time.monotonic() < end:  # the lease ends at 0.6 s; the read goes on
            t0 = time.monotonic()
            (got, _), _ = worker_step(w, type(s.build_connector_meta(None))())
            longest = max(longest, time.monotonic() - t0)
            sending |= got or set()
            time.sleep(0.01)
        assert not sending and longest < 0.1, (sending, longest)
        _end(agent, holds)
        end = time.monotonic() + 3.0
        while "p" not in sending and time.monotonic() < end:
            (got, _), _ = worker_step(w, type(s.build_connector_meta(None))())
            sending |= got or set()
            time.sleep(0.01)
        assert sending == {"p"}
    finally:
        s.shutdown()
        w.shutdown()


def test_sglang_failed_room_reads_transferring_until_its_pages_are_revoked(smod):  # noqa: F811
    """A decode room that fails (here: aborted) while a prefill write into its pages may still land
    reads Transferring (SGLang keeps its pages) until the agent's revoke returned, then Failed;
    abort() and poll() never wait."""
    rooms = sys.modules["xfer.engine.sglang_rooms"]
    from xfer import Agent, AgentConfig, make_kv_cache
    from xfer.engine.background import Background

    tensors, layout = make_kv_cache("vllm_flash_attn_nhd", num_layers=2, num_blocks=16, block_size=4, num_heads=1,
                                    head_dim=8)
    agent = Agent("sgl-decode-f", AgentConfig(enable=("local",)))
    agent.register("L0", tensors, layout)
    bg = Background("fence-test")
    dropped = []
    mgr = SimpleNamespace(link=SimpleNamespace(agent=agent), bg=bg, drop=dropped.append,
                          send_async=lambda *a: None)
    try:
        r = rooms.XferKVReceiver.__new__(rooms.XferKVReceiver)
        r.mgr, r.room, r.plan, r.errors, r.abort_notified = mgr, 9, [], [], False
        r.state, r.conclude_state, r.pages, r.aux, r.revoking = smod.KVPoll.Transferring, None, [3, 4], None, None
        holds = _hold(agent, [4], writes=True)
        t0 = time.monotonic()
        r.abort()
        assert time.monotonic() - t0 < 0.1 and r.poll() == smod.KVPoll.Transferring and r.conclude_state is None
        time.sleep(0.3)
        assert r.poll() == smod.KVPoll.Transferring and not dropped
        _end(agent, holds)
        end = time.monotonic() + 5
        while r.poll() != smod.KVPoll.Failed and time.monotonic() < end:
            time.sleep(0.01)
        assert r.poll() == smod.KVPoll.Failed and r.conclude_state == smod.KVPoll.Failed and dropped == [9]
    finally:
        bg.close()
        agent.close()


def test_the_built_in_decode_keeps_a_failed_requests_blocks_until_revoked():
    """The built-in decode instance aborts a request whose prefill write may still land: its blocks
    wait in quarantine (not reusable) until the agent's revoke returns, then a step frees them."""
    from xfer import Agent, AgentConfig, make_kv_cache
    from xfer.engine.block_manager import BlockManager as BM
    from xfer.engine.decode import DecodeInstance, State

    tensors, layout = make_kv_cache("vllm_flash_attn_nhd", num_layers=2, num_blocks=16, block_size=4, num_heads=1,
                                    head_dim=8)
    agent = Agent("builtin-decode-f", AgentConfig(enable=("local",)))
    agent.register("kv", tensors, layout)
    try:
        d = DecodeInstance.__new__(DecodeInstance)
        d.agent, d.blocks, d.quarantine, d.seqs, d.finished, d.swapper, d.on_finish = \
            agent, BM(16, 4), [], {}, [], None, None
        got = d.blocks.allocate(3)
        seq = SimpleNamespace(id="r", blocks=list(got), host_blocks=[], times={}, state=State.RUNNING, swap=None)
        d.seqs["r"] = seq
        holds = _hold(agent, got[1:2], writes=True)
        free = d.blocks.num_free
        assert d.abort("r", "the prefill gave up") and d.blocks.num_free == free and d.quarantine == [got]
        d._free_quarantined()
        assert d.blocks.num_free == free  # still held
        _end(agent, holds)
        d._free_quarantined()
        assert d.blocks.num_free == free + 3 and d.quarantine == []
    finally:
        agent.close()
