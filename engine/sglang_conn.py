"""SGLang PD-disaggregation transfer backend backed by xfer: KVManager, KVSender, KVReceiver and
bootstrap server implementing ``sglang.srt.disaggregation.base.conn``.

SGLang picks a backend from a closed enum (``--disaggregation-transfer-backend``): see
``xfer.engine.sglang_plugin`` for how xfer takes the place of one of its values.

Protocol (decode-driven, as SGLang's own backends): the prefill bootstrap server hosts an xfer
metadata store; prefill ranks publish their agents and a record (TP size, heads, page size). A
decode rank's receiver finds the prefill ranks that hold its kv heads, publishes its own agent,
and sends each one a ``want`` (room, destination pages, aux row, head range). The prefill
sender writes each chunk SGLang hands it straight into those pages, one xfer write per layer,
then the aux (first-token metadata) row, and reports ``done`` (or the failure) per room.
Every transfer has a deadline; a peer that never answers ends in ``KVPoll.Failed``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from sglang.srt.disaggregation.base.conn import (BaseKVBootstrapServer, BaseKVManager, BaseKVReceiver,
                                                 BaseKVSender, KVPoll)

from xfer import KVLayout
from xfer.errors import XferError
from xfer.store import open_store
from xfer.transfer import Op

from .kvlink import KVLink, LinkConfig, TransferGroup, head_plan, rank_heads, readers_of, tensor_from_ptr

__all__ = ["XferKVManager", "XferKVSender", "XferKVReceiver", "XferKVBootstrapServer", "XferTransferError",
           "CLASSES"]

log = logging.getLogger("xfer.engine.sglang")

TIMEOUT_S = float(os.environ.get("XFER_SGLANG_TIMEOUT_S", "30"))  # per transfer, and per handshake step
_TRANSPORTS = tuple(os.environ["XFER_SGLANG_TRANSPORTS"].split(",")) if os.environ.get("XFER_SGLANG_TRANSPORTS") \
    else None  # e.g. "local,ucx": start only these xfer transports
BOOTSTRAP_TIMEOUT_S = float(os.environ.get("XFER_SGLANG_BOOTSTRAP_TIMEOUT_S", "300"))  # sender waiting for D


class XferTransferError(RuntimeError):
    """What ``failure_exception`` raises: the room and every reason it failed."""


def _mode(mode) -> str:
    return str(getattr(mode, "value", mode)).lower()


def _metric(**kw):
    try:
        from sglang.srt.disaggregation.base.conn import KVTransferMetric
        return KVTransferMetric(**kw)
    except ImportError:  # older SGLang: no metrics
        return None


# ---- memory: SGLang's (ptr, len, item_len) lists as xfer layouts ------------------------------------
def _layers_from_args(args, is_mla: bool, device) -> tuple[list[list[torch.Tensor]], list[KVLayout]]:
    """Per layer: base tensors and layout. MHA pools list K buffers then V buffers (target, then draft)."""
    page = int(args.page_size)
    ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
    n_draft = int(getattr(args, "num_draft_entries", 0) or 0)
    parts = [range(0, len(ptrs) - n_draft), range(len(ptrs) - n_draft, len(ptrs))]
    tensors, layouts = [], []
    heads = 1 if is_mla else int(args.kv_head_num)
    for part in parts:
        idx = list(part)
        if not idx:
            continue
        views = []
        for i in idx:
            width = items[i] // (page * heads)  # bytes of one head of one token
            views.append(tensor_from_ptr(ptrs[i], lens[i], device)[: lens[i] // (heads * width) * heads * width]
                         .view(-1, heads, width))
        if is_mla:
            for v in views:
                tensors.append([v])
                layouts.append(KVLayout.from_tensors([v], "THC", block_size=page, num_kv=1, name="sglang_mla"))
        else:
            half = len(views) // 2
            for k, v in zip(views[:half], views[half:]):
                tensors.append([k, v])
                layouts.append(KVLayout.sglang([k], [v], page_size=page))
    return tensors, layouts


@dataclass
class _Want:
    """A decode rank's request for room ``room``: where the prefill rank writes."""

    peer: str
    version: int
    pages: list[int]
    aux: int | None
    heads: tuple[int, int] | None  # absolute kv heads to write (None: the MLA latent)
    dst_heads: tuple[int, int] | None  # all the heads the decode rank holds
    dst_tp: int


@dataclass
class _Room:
    wants: list[_Want] = field(default_factory=list)
    results: list[dict] = field(default_factory=list)


class XferKVManager(BaseKVManager):
    """One per SGLang TP rank: the rank's xfer link over its KV pool and aux (metadata) buffers."""

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        self.kv_args, self.server_args, self.is_mla = args, server_args, bool(is_mla_backend)
        self.mode = _mode(disaggregation_mode)
        self.rank = int(args.engine_rank)
        device = torch.device(f"cuda:{args.gpu_id}") if torch.cuda.is_available() else torch.device("cpu")
        self.total_heads = 1 if self.is_mla else int(getattr(args, "total_kv_head_num", 0) or args.kv_head_num)
        self.tp_size = int(getattr(server_args, "tp_size", 0) or max(1, self.total_heads // max(1, int(
            getattr(args, "kv_head_num", 1) or 1))))
        self.link = KVLink(LinkConfig(name=f"sgl-{self.mode}-{uuid.uuid4().hex[:8]}.tp{self.rank}",
                                      timeout_s=TIMEOUT_S, listen_host=os.environ.get("XFER_SGLANG_HOST", "127.0.0.1"),
                                      enable=_TRANSPORTS))
        tensors, layouts = _layers_from_args(args, self.is_mla, device)
        own = (0, 1) if self.is_mla else rank_heads(self.total_heads, self.tp_size, self.rank)
        self.link.register_layers(tensors, layouts, own_heads=own)
        self.aux_regions = []
        for i, (ptr, n, item) in enumerate(zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)):
            t = tensor_from_ptr(ptr, n, "cpu" if device.type == "cpu" else device)[: n // item * item].view(-1, 1, item)
            self.link.agent.register(f"A{i}", [t], KVLayout.from_tensors([t], "BNC", num_kv=1, name="sglang_aux"))
            self.aux_regions.append(f"A{i}")
        self.rooms: dict[int, _Room] = {}
        self.stores: dict[str, object] = {}
        self._published: dict[str, int] = {}
        self._lock = threading.RLock()
        self.bootstrap_addr = f"{getattr(server_args, 'host', '127.0.0.1')}:" \
                              f"{getattr(server_args, 'disaggregation_bootstrap_port', 8998)}"
        if self.mode == "prefill":
            self.register_to_bootstrap()

    def __repr__(self) -> str:
        return f"XferKVManager({self.mode}, tp{self.rank}/{self.tp_size}, {self.link!r})"

    # -- stores and peers
    def store(self, addr: str):
        with self._lock:
            if addr not in self.stores:
                self.stores[addr] = open_store(f"tcp://{addr}", timeout=TIMEOUT_S)
            return self.stores[addr]

    def publish(self, addr: str) -> None:
        """Put this rank's agent in the store at ``addr`` (again when its regions changed)."""
        with self._lock:
            if self._published.get(addr) != self.link.version:
                self.link.agent.publish(self.store(addr))
                self._published[addr] = self.link.version

    def register_to_bootstrap(self) -> None:
        import json
        self.publish(self.bootstrap_addr)
        record = {"agent": self.link.agent.name, "tp": self.tp_size, "total_heads": self.total_heads,
                  "page_size": int(self.kv_args.page_size), "mla": self.is_mla, "layers": self.link.num_layers}
        self.store(self.bootstrap_addr).set(f"sglang/prefill/tp{self.rank}", json.dumps(record).encode())

    def connect(self, addr: str, name: str, version: int) -> str:
        with self._lock:
            if self.link._connected.get(name, -1) < version or name not in self.link.agent.peers:
                self.link.agent.connect_by_name(self.store(addr), name, timeout=TIMEOUT_S)
                self.link._connected[name] = version
        return name

    # -- messages
    def room(self, room: int) -> _Room:
        with self._lock:
            return self.rooms.setdefault(int(room), _Room())

    def pump(self) -> None:
        """Sort what peers sent into rooms (prefill: wants; decode: results)."""
        for peer, op, msg in self.link.messages():
            if op is not Op.MESSAGE:
                continue
            kind = msg.get("t")
            if kind == "want":
                self.room(msg["room"]).wants.append(_Want(
                    peer=peer, version=int(msg.get("v", 0)), pages=[int(p) for p in msg["pages"]], aux=msg.get("aux"),
                    heads=tuple(msg["heads"]) if msg.get("heads") else None,
                    dst_heads=tuple(msg["dheads"]) if msg.get("dheads") else None, dst_tp=int(msg.get("dtp", 1))))
            elif kind == "done":
                self.room(msg["room"]).results.append(msg)

    def drop(self, room: int) -> None:
        with self._lock:
            self.rooms.pop(int(room), None)

    def close(self) -> None:
        self.link.close()
        for s in self.stores.values():
            try:
                s.close()
            except XferError:
                pass

    def teardown(self) -> None:
        self.close()


class XferKVSender(BaseKVSender):
    """Prefill side of one request (room): waits for the decode ranks' wants, writes each chunk."""

    def __init__(self, mgr: XferKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        self.mgr, self.addr, self.room = mgr, bootstrap_addr, int(bootstrap_room)
        self.num_pages, self.aux_index, self.cursor = 0, None, 0
        self.groups: list[TransferGroup] = []
        self.errors: list[str] = []
        self.sent_last = self.reported = self.aborted = False
        self.created = time.monotonic()
        self.bytes = 0

    def init(self, num_kv_indices: int, aux_index=None):
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index

    def _expected(self, want: _Want) -> int:
        if self.mgr.is_mla:
            return len([d for d in range(want.dst_tp) if d % self.mgr.tp_size == self.mgr.rank])
        return len(readers_of(self.mgr.total_heads, self.mgr.tp_size, want.dst_tp, self.mgr.rank))

    def _wants(self) -> list[_Want]:
        self.mgr.pump()
        wants = self.mgr.room(self.room).wants
        return wants if wants and len(wants) >= self._expected(wants[0]) else []

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None):
        pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        wants = self._wants()
        if not wants:
            self.errors.append(f"room {self.room}: send() before every decode rank asked for the KV")
            return
        last = self.cursor + len(pages) >= self.num_pages
        for w in wants:
            try:
                peer = self.mgr.connect(self.addr, w.peer, w.version)
                group = TransferGroup(f"{self.room}", self.mgr.link.num_layers if pages else 0)
                dst = w.pages[self.cursor:self.cursor + len(pages)]
                if pages:
                    if w.heads is not None:
                        self.mgr.link.ensure_heads(w.heads, publish=False)
                    for layer in range(self.mgr.link.num_layers):
                        group.add(layer, self.mgr.link.post(Op.WRITE, peer, layer, pages, dst, heads=w.heads,
                                                            peer_heads=w.dst_heads,
                                                            note={"room": self.room, "l": layer}))
                if last and self.aux_index is not None and w.aux is not None:
                    for i, region in enumerate(self.mgr.aux_regions):
                        group.add(10_000 + i, self.mgr.link.agent.write(peer, [int(self.aux_index)], [int(w.aux)],
                                                                       region=region, peer_region=region))
                self.groups.append(group)
            except XferError as exc:
                self.errors.append(f"room {self.room} -> {w.peer}: {exc}")
        self.cursor += len(pages)
        self.sent_last = self.sent_last or last

    def poll(self) -> int:
        if self.aborted or self.errors:
            return self._conclude(False)
        if not self.sent_last:
            if self._wants():
                return KVPoll.WaitingForInput
            if time.monotonic() - self.created > BOOTSTRAP_TIMEOUT_S:
                self.errors.append(f"room {self.room}: no decode rank asked for the KV in {BOOTSTRAP_TIMEOUT_S} s")
                return self._conclude(False)
            return KVPoll.Bootstrapping
        outcomes = [g.poll() for g in self.groups]
        if any(o is None for o in outcomes):
            return KVPoll.Transferring
        for g in self.groups:
            self.errors.extend(g.errors)
        return self._conclude(all(outcomes))

    def _conclude(self, ok: bool) -> int:
        if not self.reported:
            self.reported = True
            for w in self.mgr.room(self.room).wants:
                try:
                    self.mgr.connect(self.addr, w.peer, w.version)
                    self.mgr.link.send(w.peer, {"t": "done", "room": self.room, "src": self.mgr.rank, "ok": ok,
                                                "err": "; ".join(self.errors)[:2000]})
                except XferError as exc:  # the decode side times out on its own
                    log.info("xfer: result of room %s not delivered to %s: %s", self.room, w.peer, exc)
            self.mgr.drop(self.room)
        return KVPoll.Success if ok else KVPoll.Failed

    def get_transfer_metric(self):
        return _metric(transfer_total_bytes=sum(t.nbytes for g in self.groups for ts in g.by_layer.values()
                                                for t in ts) or None)

    def failure_exception(self):
        raise XferTransferError(f"xfer: room {self.room} failed: " + "; ".join(self.errors or ["aborted"]))

    def abort(self):
        self.aborted = True
        for g in self.groups:
            g.cancel()

    def clear(self):
        self.mgr.drop(self.room)


class XferKVReceiver(BaseKVReceiver):
    """Decode side of one request (room): asks the prefill ranks holding its heads for the KV."""

    def __init__(self, mgr: XferKVManager, bootstrap_addr: str, bootstrap_room=None):
        self.mgr, self.addr, self.room = mgr, bootstrap_addr, int(bootstrap_room or 0)
        self.plan: list[tuple[str, tuple[int, int] | None]] = []
        self.errors: list[str] = []
        self.state = KVPoll.Bootstrapping
        self.deadline: float | None = None

    def init(self, prefill_dp_rank: int = 0):
        import json
        try:
            store = self.mgr.store(self.addr)
            rec0 = json.loads(store.get("sglang/prefill/tp0", TIMEOUT_S))
            src_tp = int(rec0["tp"])
            if self.mgr.is_mla:
                plan = [(self.mgr.rank % src_tp, None)]
            else:
                plan = head_plan(self.mgr.total_heads, src_tp, self.mgr.tp_size, self.mgr.rank)
                for _, heads in plan:
                    self.mgr.link.ensure_heads(heads, publish=False)
                self.mgr.link.publish()
            self.mgr.publish(self.addr)
            for src, heads in plan:
                rec = json.loads(store.get(f"sglang/prefill/tp{src}", TIMEOUT_S))
                self.plan.append((self.mgr.connect(self.addr, rec["agent"], 1), heads))
            self.state = KVPoll.WaitingForInput
        except (XferError, KeyError, ValueError) as exc:
            self.errors.append(f"room {self.room}: bootstrap at {self.addr} failed: {exc}")
            self.state = KVPoll.Failed

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, **kw):
        if self.state == KVPoll.Failed:
            return
        pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        for i, (peer, heads) in enumerate(self.plan):
            try:  # the aux row (first-token metadata) comes from the first source only
                self.mgr.link.send(peer, {"t": "want", "room": self.room, "pages": pages,
                                          "aux": aux_index if i == 0 else None,
                                          "heads": list(heads) if heads else None, "dtp": self.mgr.tp_size,
                                          "dheads": None if heads is None else list(self.mgr.link.own_heads),
                                          "v": self.mgr.link.version})
            except XferError as exc:
                self.errors.append(f"room {self.room}: asking {peer}: {exc}")
                self.state = KVPoll.Failed
                return
        self.state = KVPoll.Transferring
        self.deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S

    def poll(self) -> int:
        if self.state != KVPoll.Transferring:
            return self.state
        self.mgr.pump()
        results = self.mgr.room(self.room).results
        bad = [r for r in results if not r.get("ok")]
        if bad:
            self.errors.extend(str(r.get("err")) for r in bad)
            self.state = KVPoll.Failed
        elif len(results) >= len(self.plan):
            self.state = KVPoll.Success
        elif time.monotonic() > self.deadline:
            self.errors.append(f"room {self.room}: no result from the prefill side within {BOOTSTRAP_TIMEOUT_S} s")
            self.state = KVPoll.Failed
        if self.state in (KVPoll.Success, KVPoll.Failed):
            self.mgr.drop(self.room)
        return self.state

    def failure_exception(self):
        raise XferTransferError(f"xfer: room {self.room} failed: " + "; ".join(self.errors or ["aborted"]))

    def abort(self):
        self.errors.append("aborted")
        self.state = KVPoll.Failed

    def clear(self):
        self.mgr.drop(self.room)


class XferKVBootstrapServer(BaseKVBootstrapServer):
    """Hosts the xfer metadata store (TCPStore) at the prefill bootstrap address."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, int(port)
        self.store = open_store(f"tcp://{host}:{port}", host_if_missing=True, timeout=TIMEOUT_S)

    def close(self) -> None:
        self.store.close()


CLASSES = {"manager": XferKVManager, "sender": XferKVSender, "receiver": XferKVReceiver,
           "bootstrap_server": XferKVBootstrapServer}
