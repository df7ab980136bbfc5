"""Process entry points: one prefill or decode instance per process, wired through the metadata store.

Each worker publishes its agent under ``agents/<name>``, sets ``ready/<name>``, then loops on its
inbox (``protocol.Inbox``). Messages, all JSON:

- router -> decode ``{"type": "request", <Request fields>}``: queue it; admitted when blocks fit.
- decode -> prefill ``{"type": "prefill", "id", "prompt", "decode", "blocks"}``: prefill and stream.
- decode -> prefill ``{"type": "release", "id"}``: every layer landed; free the lease's blocks.
- prefill leader -> its other TP ranks: the prefill and release messages above, in its order.
- prefill -> decode ``{"type": "abort", "id", "error"}``: the KV cannot come; fail the request.
- anyone -> worker ``{"type": "stop"}``.

A decode worker writes each result to ``result/<id>``; a crashed worker its traceback to ``error/<name>``.
Importing this module loads torch, transformers and xfer: it is the forkserver's preload.
"""

from __future__ import annotations

import collections
import json
import traceback

import torch
# everything an instance imports lazily, loaded once in the forkserver: children start warm
from transformers import LlamaForCausalLM, Qwen2ForCausalLM  # noqa: F401
from transformers.masking_utils import create_causal_mask  # noqa: F401

import xfer.kernels
import xfer.transports.onesided.local  # noqa: F401

from xfer.errors import XferError
from xfer.store import open_store

from .block_manager import blocks_for
from .config import ModelSpec, PoolSpec, WaitMode
from .decode import DecodeInstance
from .prefill import PrefillInstance
from .protocol import Inbox, Request, send
from .tp import RowParallelLinear

__all__ = ["run"]


def run(role: str, name: str, store_url: str, cfg: dict) -> None:
    """Run a ``role`` ("prefill" | "decode") worker until told to stop."""
    torch.set_num_threads(int(cfg.get("threads", 1)))
    store = open_store(store_url)
    try:
        (_prefill if role == "prefill" else _decode)(name, store, store_url, cfg)
    except BaseException:
        store.set(f"error/{name}", traceback.format_exc().encode())
        raise
    finally:
        store.close()


def _prefill(name: str, store, store_url: str, cfg: dict) -> None:
    """A prefill instance, or one rank of a tensor-parallel prefill group (``cfg["tp"]`` > 1).

    A group's rank 0 (the leader, named like a plain instance) takes the decode instances'
    messages and forwards every command that changes block state (prefill, release, a lease that
    expired) to the other ranks' inboxes, in order, before acting on it: the ranks' block managers
    stay identical and their forwards meet in the same collectives. The other ranks only follow.
    """
    tp, rank = int(cfg.get("tp", 1)), int(cfg.get("tp_rank", 0))
    leader = cfg.get("tp_leader", name)
    pool = PoolSpec.from_dict(cfg["prefill_pool"])
    backend = None
    if tp > 1:
        from .tp import init_group

        backend = init_group(store, f"tp-{leader}", rank, tp, device=torch.device(pool.device),
                             timeout_s=float(cfg.get("tp_timeout_s", 60.0)))
    inst = PrefillInstance(name, ModelSpec.from_dict(cfg["model"]), pool, tp=(rank, tp) if tp > 1 else None,
                           lease_s=cfg.get("lease_s", 30.0) if rank == 0 else float("inf"))
    peer_heads = inst.heads if tp > 1 else None
    followers = [f"{leader}.r{r}" for r in range(1, tp)] if rank == 0 else []
    inbox = Inbox(store_url, name)
    inst.agent.publish(store)
    sharded = sum(isinstance(m, RowParallelLinear) for m in inst.model.modules()) if tp > 1 else 0
    store.set(f"info/{name}", json.dumps({"heads": list(inst.pool.heads), "tp": tp, "rank": rank, "backend": backend,
                                          "row_parallel_linears": sharded}).encode())
    store.set(f"ready/{name}", b"1")

    def forward(msg: dict) -> None:
        for f in followers:
            send(store, f, msg)

    pending: collections.deque[dict] = collections.deque()
    try:
        while True:
            msg = inbox.get(timeout=0.002 if pending else 0.05)
            if msg is not None:
                if msg["type"] == "stop":
                    return
                if msg["type"] == "release":
                    forward(msg)
                    inst.release(msg["id"])
                elif msg["type"] == "prefill":
                    if rank > 0:
                        _serve(inst, store, msg, peer_heads)
                    else:
                        pending.append(msg)
                continue
            if rank > 0:
                continue
            for req in inst.expire_leases():
                forward({"type": "release", "id": req})
            if pending and blocks_for(len(pending[0]["prompt"]), pool.block_size) > pool.num_blocks:
                msg = pending.popleft()  # could never fit: fail it now rather than wait forever
                send(store, msg["decode"], {"type": "abort", "id": msg["id"], "error": (
                    f"OutOfBlocksError: a {len(msg['prompt'])}-token prompt needs more than the "
                    f"{pool.num_blocks} blocks of prefill instance {name!r}")})
                continue
            if pending and inst.blocks.can_allocate(blocks_for(len(pending[0]["prompt"]), pool.block_size)):
                msg = pending.popleft()
                forward(msg)
                _serve(inst, store, msg, peer_heads)
    finally:
        inbox.close()
        inst.close()
        if tp > 1:
            from .tp import close_group

            close_group()


def _serve(inst: PrefillInstance, store, msg: dict, peer_heads=None) -> None:
    peer = msg["decode"]
    try:
        if peer not in inst.agent.peers:
            inst.agent.connect_by_name(store, peer)
        inst.prefill(msg["id"], msg["prompt"], peer, msg["blocks"], peer_heads=peer_heads)
    except XferError as exc:
        send(store, peer, {"type": "abort", "id": msg["id"], "error": f"{type(exc).__name__}: {exc}"})


def _decode(name: str, store, store_url: str, cfg: dict) -> None:
    def ready(seq):
        send(store, seq.req.prefill, {"type": "release", "id": seq.id})

    def finish(seq):
        store.set(f"result/{seq.id}", json.dumps({**seq.result(), "decode": name}).encode())

    swap_blocks = cfg.get("swap_blocks", 0)
    inst = DecodeInstance(name, ModelSpec.from_dict(cfg["model"]), PoolSpec.from_dict(cfg["decode_pool"]),
                          wait=WaitMode(cfg.get("wait", "request")), swap_blocks=swap_blocks,
                          on_ready=ready, on_finish=finish, shards=cfg.get("shards") or None,
                          max_batch=int(cfg.get("max_batch", 64)))
    inbox = Inbox(store_url, name)
    inst.agent.publish(store)
    store.set(f"ready/{name}", b"1")
    try:
        while True:
            while (msg := inbox.get(timeout=0.0 if inst.busy else 0.05)) is not None:
                if msg["type"] == "stop":
                    return
                if msg["type"] == "request":
                    inst.waiting.append(Request(**{k: v for k, v in msg.items() if k != "type"}))
                elif msg["type"] == "abort":
                    inst.abort(msg["id"], msg["error"])
            for req, blocks in inst.admit_waiting():
                send(store, req.prefill, {"type": "prefill", "id": req.id, "prompt": req.prompt, "decode": name,
                                          "blocks": blocks})
            inst.poll(timeout=0.0 if inst.step() else 0.002)
    finally:
        store.set(f"stats/{name}", json.dumps(_decode_stats(inst)).encode())
        inbox.close()
        inst.close()


def _decode_stats(inst: DecodeInstance) -> dict:
    sw = inst.swapper
    steps = sum(inst.batch_sizes.values())
    return {"swaps": sw.count if sw else 0, "swap_seconds": sw.total_seconds if sw else 0.0, "decode_steps": steps,
            "mean_batch": sum(b * n for b, n in inst.batch_sizes.items()) / steps if steps else 0.0,
            "max_batch": max(inst.batch_sizes, default=0)}
