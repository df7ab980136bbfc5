"""Process entry points: one prefill or decode instance per process, wired through the metadata store.

Each worker publishes its agent under ``agents/<name>``, sets ``ready/<name>``, then loops on its
inbox (``protocol.Inbox``). Messages, all JSON:

- router -> decode ``{"type": "request", <Request fields>}``: queue it; admitted when blocks fit.
- decode -> prefill ``{"type": "prefill", "id", "prompt", "decode", "blocks"}``: prefill and stream.
- decode -> prefill ``{"type": "release", "id"}``: every layer landed; free the lease's blocks.
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
import xfer.transports.local  # noqa: F401

from xfer.errors import XferError
from xfer.store import open_store

from .config import ModelSpec, PoolSpec, WaitMode
from .decode import DecodeInstance
from .prefill import PrefillInstance
from .protocol import Inbox, Request, send

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
    inst = PrefillInstance(name, ModelSpec.from_dict(cfg["model"]), PoolSpec.from_dict(cfg["prefill_pool"]),
                           lease_s=cfg.get("lease_s", 30.0))
    inbox = Inbox(store_url, name)
    inst.agent.publish(store)
    store.set(f"ready/{name}", b"1")
    pending: collections.deque[dict] = collections.deque()
    try:
        while True:
            msg = inbox.get(timeout=0.002 if pending else 0.05)
            if msg is not None:
                if msg["type"] == "stop":
                    return
                if msg["type"] == "release":
                    inst.release(msg["id"])
                elif msg["type"] == "prefill":
                    pending.append(msg)
                continue
            if pending and inst.can_prefill(len(pending[0]["prompt"])):
                _serve(inst, store, pending.popleft())
    finally:
        inbox.close()
        inst.close()


def _serve(inst: PrefillInstance, store, msg: dict) -> None:
    peer = msg["decode"]
    try:
        if peer not in inst.agent.peers:
            inst.agent.connect_by_name(store, peer)
        inst.prefill(msg["id"], msg["prompt"], peer, msg["blocks"])
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
                          on_ready=ready, on_finish=finish)
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
