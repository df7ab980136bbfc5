"""The per-request (room) halves of xfer's SGLang backend: ``XferKVSender`` (prefill) and
``XferKVReceiver`` (decode). Protocol and deadlines: ``xfer.engine.sglang_conn``.

Every method SGLang's scheduler loop calls returns at once: network work goes to the manager's
``Background`` (``mgr.bg``) and is polled. Both sides report a room ended only once nothing of
it can land any more (issue 29's fence): the sender once its writes ended (a transfer reads ended
only once fenced), the receiver of a failed or aborted room once its agent revoked the room's
pages (``XferKVReceiver._conclude``: it reads Transferring until then, so SGLang frees them after).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from sglang.srt.disaggregation.base.conn import BaseKVReceiver, BaseKVSender, KVPoll

from xfer.errors import FenceTimeoutError, XferError
from xfer.transfer import Op

from .kvlink import TransferGroup, readers_of

__all__ = ["XferKVSender", "XferKVReceiver", "XferTransferError"]

PROBE_S = 1.0  # a decode rank waiting on a prefill rank checks it is alive this often


def sglang_wait_s(name: str, default: float = 300.0) -> float:
    """SGLang's own disaggregation timeout ``name`` (``SGLANG_DISAGGREGATION_*``), or ``default``."""
    try:
        from sglang.srt.environ import envs
        return float(getattr(envs, name).get())
    except Exception:  # older SGLang, or a stand-in in tests
        return default


class XferTransferError(RuntimeError):
    """What ``failure_exception`` raises: the room and every reason it failed."""


def _metric(**kw):
    try:
        from sglang.srt.disaggregation.base.conn import KVTransferMetric
        return KVTransferMetric(**kw)
    except ImportError:  # older SGLang: no metrics
        return None


class XferKVSender(BaseKVSender):
    """Prefill side of one request (room): waits for the decode ranks' wants, writes each chunk."""

    def __init__(self, mgr, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False):
        self.mgr = self.kv_mgr = mgr
        self.addr, self.room = bootstrap_addr, int(bootstrap_room)
        self.num_pages, self.aux_index, self.cursor = 0, None, 0
        self.groups: list[TransferGroup] = []
        self.jobs: list = []  # Background writes (connect, then post)
        self.errors: list[str] = []
        self.sent_last = self.reported = self.aborted = self.stopping = False
        self.created = time.monotonic()
        self.lock = threading.Lock()  # held by a Background write while it posts
        self.wants: list = []

    def init(self, num_kv_indices: int, aux_index=None):
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index

    def _expected(self, want) -> int:
        if self.mgr.is_mla:
            return len([d for d in range(want.dst_tp) if d % self.mgr.tp_size == self.mgr.rank])
        return len(readers_of(self.mgr.total_heads, self.mgr.tp_size, want.dst_tp, self.mgr.rank))

    def _wants(self) -> list:
        self.mgr.pump()
        wants = self.mgr.room(self.room).wants
        for w in wants:  # connect to the decode ranks early, off the scheduler loop
            self.mgr.connect_async(self.addr, w.peer, w.version)
        self.wants = wants if wants and len(wants) >= self._expected(wants[0]) else []
        return self.wants

    def _room_aborted(self) -> bool:
        self.mgr.pump()  # an abort may come at any time
        return bool(self.mgr.room(self.room).aborted_by)

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None):
        pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        wants = self._wants()
        if not wants:
            self.errors.append(f"room {self.room}: send() before every decode rank asked for the KV")
            return
        last = self.cursor + len(pages) >= self.num_pages
        for w in wants:
            self.jobs.append(self.mgr.bg.submit(self._write, w, pages, self.cursor, last))
        self.cursor += len(pages)
        self.sent_last = self.sent_last or last

    def _write(self, w, pages: list[int], cursor: int, last: bool) -> None:
        """Background: connect to the decode rank (bounded), then post one WRITE per layer."""
        peer = self.mgr.connect_async(self.addr, w.peer, w.version).result(timeout=self.mgr.timeout_s + 1.0)
        link = self.mgr.link
        with self.lock:
            if self.stopping or self.mgr.room(self.room).aborted_by:
                return  # the decode side aborted: not one byte into its pages
            group = TransferGroup(f"{self.room}", link.num_layers if pages else 0)
            dst = w.pages[cursor:cursor + len(pages)]
            if pages:
                if w.heads is not None:
                    link.ensure_heads(w.heads, publish=False)
                for layer in range(link.num_layers):
                    group.add(layer, link.post(Op.WRITE, peer, layer, pages, dst, heads=w.heads,
                                               peer_heads=w.dst_heads, note={"room": self.room, "l": layer}))
            if last and self.aux_index is not None and w.aux is not None:
                for i, region in enumerate(self.mgr.aux_regions):
                    group.add(10_000 + i, link.agent.write(peer, [int(self.aux_index)], [int(w.aux)],
                                                           region=region, peer_region=region))
            self.groups.append(group)

    def poll(self) -> int:
        if self.reported:
            return KVPoll.Success if not self.errors and not self.aborted else KVPoll.Failed
        if self.aborted or self.errors or self._room_aborted():
            return self._stop()
        if not self.sent_last:
            if self._wants():
                return KVPoll.WaitingForInput
            limit = sglang_wait_s("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
            if time.monotonic() - self.created > limit:
                self.errors.append(f"room {self.room}: no decode rank asked for the KV in {limit:g} s")
                return self._stop()
            return KVPoll.Bootstrapping
        if any(not j.done() for j in self.jobs):
            return KVPoll.Transferring
        for j in self.jobs:
            if j.exception() is not None:
                self.errors.append(f"room {self.room}: {j.exception()}")
        if self.errors:
            return self._stop()
        outcomes = [g.poll() for g in self.groups]
        if any(o is None for o in outcomes):
            return KVPoll.Transferring
        for g in self.groups:
            self.errors.extend(g.errors)
        return self._conclude(all(outcomes))

    def _stop(self) -> int:
        """Stop writing (abort, failure): cancel what runs; Failed once every write ended."""
        if not self.stopping:
            if not self.lock.acquire(blocking=False):
                return KVPoll.Transferring  # a Background write is posting: look again next poll
            try:
                self.stopping = True
                for g in self.groups:
                    g.cancel()
            finally:
                self.lock.release()
        if any(not j.done() for j in self.jobs) or any(g.poll() is None for g in self.groups):
            return KVPoll.Transferring
        if self._room_aborted() and not self.errors:
            self.errors.append(f"room {self.room}: the decode side aborted")
        return self._conclude(False)

    def _conclude(self, ok: bool) -> int:
        """The room's writes all ended: report (SGLang then frees the prefill pages) and tell the decode ranks."""
        if not self.reported:
            self.reported = True
            msg = {"t": "done", "room": self.room, "src": self.mgr.rank, "ok": ok,
                   "err": "; ".join(self.errors)[:2000]}
            for w in self.mgr.room(self.room).wants:
                if w.peer not in self.mgr.room(self.room).aborted_by:
                    self.mgr.bg.submit(self._tell, w, msg)
            self.mgr.drop(self.room)
        return KVPoll.Success if ok else KVPoll.Failed

    def _tell(self, w, msg: dict) -> None:
        try:
            self.mgr.connect(self.addr, w.peer, w.version)
            self.mgr.link.send(w.peer, msg)
        except XferError:  # the decode side ends on its own (liveness probe, its deadline)
            pass

    def get_transfer_metric(self):
        return _metric(transfer_total_bytes=sum(t.nbytes for g in self.groups for ts in g.by_layer.values()
                                                for t in ts) or None)

    def failure_exception(self):
        raise XferTransferError(f"xfer: room {self.room} failed: " + "; ".join(self.errors or ["aborted"]))

    def abort(self):
        self.aborted = True  # poll() stops the writes and reports Failed once they ended

    def clear(self):
        self.mgr.drop(self.room)


class XferKVReceiver(BaseKVReceiver):
    """Decode side of one request (room): asks the prefill ranks holding its heads for the KV."""

    def __init__(self, mgr, bootstrap_addr: str, bootstrap_room=None, prefill_dp_rank=None):
        self.mgr = self.kv_mgr = mgr
        self.addr, self.room = bootstrap_addr, int(bootstrap_room or 0)
        self.plan: list[tuple[str, tuple[int, int] | None]] = []
        self.bootstrap_infos: list[dict] = []  # one per prefill rank this rank reads from
        self.errors: list[str] = []
        self.state = KVPoll.Bootstrapping
        self.conclude_state = None  # SGLang reads it after init(): Failed once the request failed
        self.require_staging = False
        self.abort_notified = False
        self.started = False
        self.sent: list = []  # Background deliveries of the wants
        self.since = None
        self.pages: list[int] = []  # this room's pages (a prefill may write them from send_metadata on)
        self.aux = None
        self.revoking = None  # (final state, Background revoke) while a failed room's pages are fenced

    def fail(self, why: str) -> None:
        self.errors.append(f"room {self.room}: {why}")
        self._conclude(KVPoll.Failed)

    def _conclude(self, state: int) -> None:
        """The room ended on this side (SGLang then frees or uses its pages). A failed room whose
        pages a prefill may still write reads Transferring until the agent revoked them (no write
        can land any more: on the Background when it must wait, never on the scheduler loop)."""
        if self.revoking is not None and self.revoking[1] is not None:
            return  # a revoke of this failed room runs: poll() reports the room once it ended
        if state == KVPoll.Failed and self.pages and self.revoking is None:
            if not self._revoke(0):
                self.revoking = (state, self.mgr.bg.submit(self._revoke, None))
                self.state = KVPoll.Transferring
                return
        self.revoking = None
        self.state = self.conclude_state = state
        self.mgr.drop(self.room)

    def _revoke(self, timeout) -> bool:
        """Revoke the room's pages (every KV region) and its aux row; False if a write may still land."""
        agent = self.mgr.link.agent
        try:
            agent.revoke(self.pages, timeout=timeout)
            if self.aux is not None:
                for region in agent.regions:
                    if region.startswith("A"):
                        agent.revoke([self.aux], region=region, timeout=timeout)
            return True
        except FenceTimeoutError:
            if timeout is None:
                raise
            return False

    def _fenced(self) -> None:
        """A Background revoke of a failed room ended: report the room, or try again."""
        state, fut = self.revoking
        if not fut.done():
            return
        if fut.exception() is None:
            self.revoking = (state, None)
            self.state = self.conclude_state = state
            self.mgr.drop(self.room)
        else:  # a write may still land (its prefill stopped mid-copy): the pages stay held
            self.revoking = (state, self.mgr.bg.submit(self._revoke, None))

    def init(self, prefill_dp_rank: int = 0):
        self.started = True
        self._bootstrap()

    def _bootstrap(self) -> None:
        if self.state != KVPoll.Bootstrapping or not self.mgr.try_ensure_parallel_info(self.addr):
            return
        info = self.mgr.info(self.addr)
        if info is None:  # a failed look-up was just dropped: the next poll starts another
            return
        if info.error:
            self.fail(info.error)
            return
        self.plan = list(info.plan)
        self.bootstrap_infos = [{"agent": peer, "heads": heads} for peer, heads in self.plan]
        self.state = KVPoll.WaitingForInput

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, **kw):
        if self.state != KVPoll.WaitingForInput:
            if self.state != KVPoll.Failed:
                self.fail(f"send_metadata in state {self.state}, before the bootstrap ended")
            return
        pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        self.pages, self.aux = pages, aux_index
        link = self.mgr.link
        self.mgr.room(self.room)  # results are kept from now on
        for i, (peer, heads) in enumerate(self.plan):  # the aux row (first-token metadata) from the first only
            self.sent.append((peer, self.mgr.send_async(peer, {
                "t": "want", "room": self.room, "pages": pages, "aux": aux_index if i == 0 else None,
                "heads": list(heads) if heads else None, "dtp": self.mgr.tp_size,
                "dheads": None if heads is None else list(link.own_heads), "v": link.version})))
        self.state = KVPoll.Transferring
        self.since = time.monotonic()

    def poll(self) -> int:
        if self.revoking is not None and self.revoking[1] is not None:
            self._fenced()
            return self.state
        if self.state == KVPoll.Bootstrapping and self.started:
            self._bootstrap()
        if self.state != KVPoll.Transferring:
            return self.state
        for peer, fut in self.sent:
            if fut.done() and fut.exception() is not None:
                self.fail(f"asking {peer}: {fut.exception()}")
                return self.state
        self.mgr.pump()
        results = self.mgr.room(self.room).results
        bad = [r for r in results if not r.get("ok")]
        if bad:
            self.errors.extend(str(r.get("err")) for r in bad)
            self._conclude(KVPoll.Failed)
        elif len(results) >= len(self.plan):
            self._conclude(KVPoll.Success)
        else:
            for peer, _ in self.plan:  # a dead or frozen prefill rank fails the room within TIMEOUT_S
                why = self.mgr.probe(peer)
                if why:
                    self.fail(f"prefill rank {peer} is unreachable: {why}")
                    break
            else:
                limit = sglang_wait_s("SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
                if time.monotonic() - self.since > limit:
                    self.fail(f"no result from the prefill side within {limit:g} s")
        return self.state

    def failure_exception(self):
        raise XferTransferError(f"xfer: room {self.room} failed: " + "; ".join(self.errors or ["aborted"]))

    def abort(self):
        """Tell the prefill ranks (they stop writing into this room's pages), then fail the room."""
        if self.state in (KVPoll.Success, KVPoll.Failed) or self.revoking is not None:
            return
        if self.state == KVPoll.Transferring:
            for peer, _ in self.plan:
                self.mgr.send_async(peer, {"t": "abort", "room": self.room})
            self.abort_notified = True
        self.errors.append("aborted")
        self._conclude(KVPoll.Failed)

    def clear(self):
        self.mgr.drop(self.room)
