"""The initiator's side of xfer-bench: the sweep grid and the loop that runs it.

Per workload (slice size × blocks × layout): for every transport × chunk size, the target prepares
a poisoned cache and publishes its agent; this side connects, asks ``route()``, writes once with a
notification, has the target check every destination byte (and that no other block changed),
then times ``write(...).wait()``, and checks the bytes again. Then the ceilings and baselines are
measured once for the workload, on the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from xfer import Agent, make_kv_cache
from xfer.errors import PeerDisconnectedError, TransportUnavailableError, XferError

from . import measure
from .agents import agent_config, host_id
from .errors import BenchError, Exit
from .presets import Workload, fmt_bytes
from .target import block_digests

__all__ = ["Plan", "BASELINES", "Initiator"]

# name -> what it measures; "auto" picks copy, per-layer, per-slice, plus tcp for a ucx route or
# another host, plus nccl when both sides hold distinct GPUs
BASELINES = {
    "copy": "same-bytes contiguous copy (the ceiling of a same-host route)",
    "tcp": "single contiguous TCP send of the same bytes + 1-byte ack (the ceiling of a ucx route over TCP)",
    "nccl": "torch.distributed NCCL send/recv of the same bytes + ack (two distinct GPUs)",
    "gloo": "torch.distributed gloo send/recv of the same host bytes + ack",
    "per-layer": "per-layer torch indexing: dst[ids] = src[ids] per (layer, K/V)",
    "per-slice": "the seed's per-slice copy_ loop: one copy_ per (layer, K/V, block)",
}
NAMES = {"copy": "contiguous copy", "tcp": "contiguous TCP send", "nccl": "NCCL send/recv",
         "gloo": "gloo send/recv", "per-layer": "per-layer torch indexing", "per-slice": "per-slice copy_ loop"}
VERIFY_NOTE = "xfer-bench verify"


@dataclass(frozen=True)
class Plan:
    workloads: tuple[Workload, ...]
    transports: tuple[str, ...]  # "auto" (selection picks) or a TransportKind value (pinned)
    chunks: tuple[int | None, ...]  # None: the transports' defaults
    baselines: tuple[str, ...] | None  # None: the default set per workload
    iters: int
    budget_s: float  # per measurement: stop after min_iters once this is spent
    timeout_s: float  # deadline of each transfer and of each command to the target

    @property
    def steps(self) -> int:
        return len(self.workloads) * (3 * len(self.transports) * len(self.chunks) + 4)


class Initiator:
    """Runs a :class:`Plan` against a target driven through ``channel``."""

    def __init__(self, channel, store, device: torch.device, target: dict, bind: str, progress, log):
        self.channel, self.store, self.device, self.target = channel, store, device, target
        self.bind, self.progress, self.log = bind, progress, log
        self.same_host = target.get("host_id") == host_id()
        self.peer_device = torch.device(target["device"]) if self.same_host else device
        self.agents: dict[tuple, Agent] = {}
        self.registered: dict[tuple, list] = {}  # (transport, chunk) -> the tensors registered as kv

    def close(self) -> None:
        for agent in self.agents.values():
            agent.close()
        self.agents.clear()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def run(self, plan: Plan) -> list[dict]:
        return [self.workload(w, plan, i) for i, w in enumerate(plan.workloads)]

    # ---- one workload ------------------------------------------------------------------------
    def workload(self, w: Workload, plan: Plan, index: int) -> dict:
        self.progress.note(f"workload {index + 1}/{len(plan.workloads)}: {w.label()}")
        tensors, layout = make_kv_cache(w.layout, device=self.device, dtype=getattr(torch, w.dtype), **w.dims())
        measure.fill_pattern(tensors, seed=index)
        src, dst = (np.asarray(x, dtype=np.int64) for x in w.ids())
        expected = block_digests(layout, tensors, src)
        runs = [self.one_run(w, tensors, layout, src, dst, expected, t, c, plan)
                for t in plan.transports for c in plan.chunks]
        if any(r["status"] == "ok" for r in runs):
            baselines, skipped = self.baselines(w, tensors, layout, src, dst, plan, runs)
        else:  # nothing to compare them with
            baselines, skipped = [], {"all": "no transport run succeeded for this workload"}
        by_name = {b["name"]: b for b in baselines}
        copy = by_name.get(NAMES["copy"])
        for b in baselines:  # engine baselines against the same-bytes copy; each ceiling against itself
            ref = b if b["kind"] == "ceiling" else copy
            if ref is not None:
                b.update(ceiling=ref["name"], ratio_to_ceiling=ref["median_s"] / b["median_s"])
        for r in runs:
            res = r["result"]
            if res is None:
                continue
            ceil = by_name.get(NAMES["tcp"]) if res["transport"] == "ucx" else None
            ceil = ceil or copy
            if ceil is not None:
                res.update(ceiling=ceil["name"], ratio_to_ceiling=ceil["median_s"] / res["median_s"])
        return {"workload": w.to_dict(), "runs": runs, "baselines": baselines, "skipped_baselines": skipped}

    def _agent(self, transport: str, chunk: int | None, tensors, layout, timeout_s: float) -> Agent:
        key = (transport, chunk)
        if key not in self.agents:
            self.agents[key] = Agent(f"xfer-bench-initiator-{len(self.agents)}",
                                     agent_config(transport, chunk, self.bind, timeout_s))
        agent = self.agents[key]
        # the registered cache itself, not its id(): a later workload's list can reuse a freed one's
        # id, and the agent would then keep the previous workload's region and layout
        if self.registered.get(key) is not tensors:
            if key in self.registered:
                agent.deregister("kv")
            agent.register("kv", tensors, layout)
            self.registered[key] = tensors
        return agent

    def one_run(self, w: Workload, tensors, layout, src, dst, expected, transport: str, chunk: int | None,
                plan: Plan) -> dict:
        run = {"transport": transport, "chunk_bytes": chunk, "status": "ok", "reason": None, "route": None,
               "path": None, "verified": None, "result": None}
        what = transport + (f", chunk {fmt_bytes(chunk)}" if chunk else "")
        self.progress.step(f"{what}: preparing the target")
        agent = self._agent(transport, chunk, tensors, layout, plan.timeout_s)
        reply = self.channel.call("prepare", plan.timeout_s, workload=w.to_dict(), transport=transport,
                                  chunk_bytes=chunk, timeout_s=plan.timeout_s)
        peer = agent.connect_by_name(self.store, reply["name"], timeout=plan.timeout_s)
        try:
            sel = agent.route(peer)
        except TransportUnavailableError as e:
            run.update(status="skipped", reason=str(e))
            self.progress.step(f"{what}: skipped", extra=1)
            return run
        run["route"] = {"kind": sel.kind.value, "reason": sel.reason, "rejected": dict(sel.rejected)}
        label = f"xfer write [{sel.kind.value}" + (f", chunk {fmt_bytes(chunk)}]" if chunk else "]")
        sync = measure.syncer(self.device, self.peer_device)
        try:
            self.progress.step(f"{what}: verifying ({sel.kind.value})")
            t = agent.write(peer, src, dst, notify=VERIFY_NOTE.encode())
            t.wait()
            run["path"] = t.path
            chk = self.channel.call("check", plan.timeout_s, ids=dst.tolist())
            problems = self._problems(chk, expected, notes=[VERIFY_NOTE])
            if problems:
                run.update(status="failed", verified=False, reason="before timing: " + problems)
                self.progress.step(f"{what}: NOT VERIFIED")
                return run
            self.progress.step(f"{what}: timing {label}")
            times, post, post_cpu = measure.time_xfer(agent, peer, src, dst, iters=plan.iters,
                                                      budget_s=plan.budget_s, sync=sync)
            chk = self.channel.call("check", plan.timeout_s, ids=dst.tolist())
            problems = self._problems(chk, expected, notes=None)
            run["verified"] = not problems
            if problems:
                run.update(status="failed", reason="after timing: " + problems)
            run["result"] = measure.row(label, "xfer", times, w.payload_bytes, w.slices, post=post,
                                        post_cpu=post_cpu, transport=sel.kind.value, chunk_bytes=chunk)
        except PeerDisconnectedError as e:  # the target is gone: nothing else can run
            raise BenchError(f"the xfer-bench target went away during {label}: {e}", Exit.UNREACHABLE) from None
        except XferError as e:  # a transfer failed or timed out: recorded, the sweep goes on
            run.update(status="failed", reason=f"{type(e).__name__}: {e}")
        return run

    @staticmethod
    def _problems(chk: dict, expected: list[str], notes: list[str] | None) -> str:
        bad = [i for i, (a, b) in enumerate(zip(chk["digests"], expected)) if a != b]
        out = []
        if bad:
            out.append(f"{len(bad)} of {len(expected)} (layer, K/V) slots differ from the source (first: slot {bad[0]})")
        if not chk["untouched"]:
            out.append("blocks outside the transfer were modified")
        if notes is not None and chk["notes"] != notes:
            out.append(f"the target received notifications {chk['notes']!r}, expected {notes!r}")
        return "; ".join(out)

    # ---- ceilings and baselines --------------------------------------------------------------
    def default_baselines(self, runs: list[dict]) -> list[str]:
        names = ["copy", "per-layer", "per-slice"]
        ucx = any(r["route"] and r["route"]["kind"] == "ucx" for r in runs)
        if ucx or not self.same_host:
            names.insert(1, "tcp")
        if self._nccl_blocker() is None:
            names.insert(1, "nccl")
        return names

    def _nccl_blocker(self) -> str | None:
        if self.device.type != "cuda" or self.target["device"].split(":")[0] != "cuda":
            return f"needs a GPU on both sides (here {self.device}, target {self.target['device']})"
        mine = str(torch.cuda.get_device_properties(self.device).uuid)
        if self.same_host and self.target.get("device_uuid") == mine:
            return f"needs two GPUs: both processes use {self.device} ({mine}); NCCL refuses two ranks on one GPU"
        return None

    def baselines(self, w: Workload, tensors, layout, src, dst, plan: Plan, runs) -> tuple[list[dict], dict]:
        names = list(plan.baselines) if plan.baselines is not None else self.default_baselines(runs)
        rows, skipped = [], {}
        nbytes, kw = w.payload_bytes, dict(iters=plan.iters, budget_s=plan.budget_s)
        dst_views = None
        for name in names:
            self.progress.step(f"timing {NAMES[name]}")
            if name == "nccl" and (why := self._nccl_blocker()):
                skipped[name] = why
                continue
            try:
                if name == "copy":
                    from xfer import shared_empty

                    empty = shared_empty if self.same_host and self.peer_device.type == "cpu" else torch.empty
                    times = measure.copy_contiguous(nbytes, self.device, self.peer_device, dst_empty=empty, **kw)
                    kind, label = "ceiling" if self.same_host else "baseline", NAMES[name]
                elif name == "tcp":
                    port = self.channel.call("tcp_listen", plan.timeout_s)["port"]
                    try:
                        times = measure.tcp_send(self.target["bind"], port, nbytes, timeout_s=plan.timeout_s, **kw)
                    finally:
                        self.channel.call("wait", plan.timeout_s, job="tcp", timeout_s=plan.timeout_s)
                    kind, label = "ceiling", NAMES[name]
                elif name in ("nccl", "gloo"):
                    port = self.channel.call("dist_start", plan.timeout_s, backend=name, nbytes=nbytes,
                                             timeout_s=plan.timeout_s)["port"]
                    try:
                        times = measure.dist_send(name, self.device, self.target["bind"], port, nbytes,
                                                  timeout_s=plan.timeout_s, **kw)
                    finally:
                        self.channel.call("wait", plan.timeout_s, job="dist", timeout_s=plan.timeout_s)
                    kind, label = "baseline", NAMES[name]
                else:  # per-layer / per-slice: engine-style copies into a cache of the same layout
                    if dst_views is None:
                        dst_t, dst_l = make_kv_cache(w.layout, device=self.peer_device, dtype=getattr(torch, w.dtype),
                                                     **w.dims())
                        dst_views, src_views = dst_l.views(dst_t), layout.views(tensors)
                    fn = measure.per_layer_indexing if name == "per-layer" else measure.per_slice_loop
                    times = fn(src_views, dst_views, src, dst, sync=measure.syncer(self.device, self.peer_device), **kw)
                    kind, label = "baseline", NAMES[name]
            except (OSError, RuntimeError) as e:  # a baseline that cannot run here is reported, not fatal
                skipped[name] = f"{type(e).__name__}: {e}"
                continue
            # slices/s of contiguous rows: the same bytes as the workload's slices, for comparison
            rows.append(measure.row(label, kind, times, nbytes, w.slices, transport=None, chunk_bytes=None))
        return rows, skipped
