"""SGLang PD-disaggregation transfer backend backed by xfer: KVManager and bootstrap server
implementing ``sglang.srt.disaggregation.base.conn`` (sender and receiver: ``sglang_rooms``).

SGLang picks a backend from a closed enum (``--disaggregation-transfer-backend``): see
``xfer.engine.sglang_plugin`` for how xfer takes the place of one of its values.

Protocol (decode-driven, as SGLang's own backends): the prefill bootstrap server hosts an xfer
metadata store; prefill ranks publish their agents and a record (TP size, heads, page size). A
decode rank finds the prefill ranks that hold its kv heads, publishes its own agent, and sends
each one a ``want`` (room, destination pages, aux row, head range). The prefill sender writes
each chunk SGLang hands it straight into those pages, one xfer write per layer, then the aux
(first-token metadata) row, and reports ``done`` (or the failure) per room. A decode abort sends
``abort``: the prefill stops writing into that room's pages and reports it failed.

Never stalls SGLang's scheduler loop: store look-ups, connects, and every message run on the
manager's ``Background`` threads; the queue-facing calls (``try_ensure_parallel_info``, ``init``,
``send_metadata``, ``send``, ``poll``, ``abort``) only post and poll. One deadline,
``TIMEOUT_S`` (``XFER_SGLANG_TIMEOUT_S``, 30 s), bounds every network step: the bootstrap
look-up, each connect, each message, each layer transfer, and each liveness probe of a prefill
rank a decode request waits on (so a dead, frozen or unknown prefill fails the request within
about ``TIMEOUT_S``). How long a live prefill may take to compute is SGLang's own
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` / ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (300 s).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer, BaseKVManager

from xfer import KVLayout
from xfer import settings
from xfer.errors import LayoutError, XferError
from xfer.store import open_store
from xfer.transfer import Op

from .background import Background
from .kvlink import KVLink, LinkConfig, head_plan, rank_heads, tensor_from_ptr

__all__ = ["XferKVManager", "XferKVSender", "XferKVReceiver", "XferKVBootstrapServer", "XferTransferError",
           "PrefillInfo", "CLASSES"]

log = logging.getLogger("xfer.engine.sglang")

# the connector's knobs, from xfer's settings table (XFER_SGLANG_*), read once when SGLang imports us
_SETTINGS = settings.current().sglang
TIMEOUT_S = _SETTINGS.timeout_s  # every network step (see the module doc)
_TRANSPORTS = _SETTINGS.transports  # e.g. ("local", "ucx"): start only these xfer transports; None: all
_FAILED_INFO_S = 1.0  # a failed bootstrap look-up fails the requests of the next second, then is retried


def _mode(mode) -> str:
    return str(getattr(mode, "value", mode)).lower()


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
class PrefillInfo:
    """A prefill bootstrap address as this decode rank sees it. ``dp_size`` and
    ``follow_bootstrap_room`` are what SGLang's ``DecodePreallocQueue`` reads from
    ``prefill_info_table``; ``plan`` is [(prefill agent, absolute heads or None for MLA)]."""

    dp_size: int = 1
    follow_bootstrap_room: bool = True
    tp: int = 0
    plan: list[tuple[str, tuple[int, int] | None]] = field(default_factory=list)
    error: str | None = None
    since: float = field(default_factory=time.monotonic)


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
    aborted_by: set[str] = field(default_factory=set)  # decode agents that aborted this room


class XferKVManager(BaseKVManager):
    """One per SGLang TP rank: the rank's xfer link over its KV pool and aux (metadata) buffers."""

    supports_host_destination = False
    enable_deferred_decode_kv_release = False  # issue 29's fence: hold aborted pages until writes drained

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        self.kv_args, self.server_args, self.is_mla = args, server_args, bool(is_mla_backend)
        self.mode = _mode(disaggregation_mode)
        self.rank = int(args.engine_rank)
        device = torch.device(f"cuda:{args.gpu_id}") if torch.cuda.is_available() else torch.device("cpu")
        self.total_heads = 1 if self.is_mla else int(getattr(args, "total_kv_head_num", 0) or args.kv_head_num)
        self.tp_size = int(getattr(server_args, "tp_size", 0) or max(1, self.total_heads // max(1, int(
            getattr(args, "kv_head_num", 1) or 1))))
        self.link = KVLink(LinkConfig(name=f"sgl-{self.mode}-{uuid.uuid4().hex[:8]}.tp{self.rank}",
                                      timeout_s=TIMEOUT_S, listen_host=_SETTINGS.host,
                                      enable=_TRANSPORTS))
        self.bg = Background(f"xfer-sgl-{self.mode}.tp{self.rank}")
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
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._info_jobs: dict[str, object] = {}  # bootstrap address -> Background future
        self._connects: dict[str, object] = {}  # decode peer -> Background future (prefill side)
        self._probes: dict[str, tuple[object, float]] = {}  # prefill peer -> (ping future, sent at) (decode side)
        self._published: dict[str, int] = {}
        self._lock = threading.RLock()
        self.bootstrap_addr = f"{getattr(server_args, 'host', '127.0.0.1')}:" \
                              f"{getattr(server_args, 'disaggregation_bootstrap_port', 8998)}"
        if self.mode == "prefill":
            self.register_to_bootstrap()  # start-up, before any request: may wait (bounded) on the store

    def __repr__(self) -> str:
        return f"XferKVManager({self.mode}, tp{self.rank}/{self.tp_size}, {self.link!r})"

    # -- stores and peers (Background threads, or start-up; each bounded by TIMEOUT_S)
    def store(self, addr: str):
        with self._lock:
            s = self.stores.get(addr)
        if s is None:
            s = open_store(f"tcp://{addr}", timeout=TIMEOUT_S)
            with self._lock:
                s = self.stores.setdefault(addr, s)
        return s

    def publish(self, addr: str) -> None:
        """Put this rank's agent in the store at ``addr`` (again when its regions changed)."""
        if self._published.get(addr) != self.link.version:
            self.link.agent.publish(self.store(addr))
            self._published[addr] = self.link.version

    def register_to_bootstrap(self) -> None:
        self.publish(self.bootstrap_addr)
        record = {"agent": self.link.agent.name, "tp": self.tp_size, "total_heads": self.total_heads,
                  "page_size": int(self.kv_args.page_size), "mla": self.is_mla, "layers": self.link.num_layers}
        self.store(self.bootstrap_addr).set(f"sglang/prefill/tp{self.rank}", json.dumps(record).encode())

    def connect(self, addr: str, name: str, version: int) -> str:
        if self.link._connected.get(name, -1) < version or name not in self.link.agent.peers:
            self.link.agent.connect_by_name(self.store(addr), name, timeout=TIMEOUT_S)
            self.link._connected[name] = version
        return name

    def connect_async(self, addr: str, name: str, version: int):
        """A Background connect to ``name`` (one in flight per peer and version); its future."""
        with self._lock:
            fut = self._connects.get(name)
            if fut is None or (fut.done() and (fut.exception() is not None or self.link._connected.get(name, -1)
                                                < version)):
                fut = self._connects[name] = self.bg.submit(self.connect, addr, name, version)
        return fut

    def send_async(self, peer: str, msg: dict):
        """A control message on the Background; its future (raises the typed error if undelivered)."""
        return self.bg.submit(self.link.send, peer, msg)

    def probe(self, peer: str) -> str | None:
        """Why ``peer`` looks dead (its last liveness ping failed: refused, or no answer within
        TIMEOUT_S), else None; pings it again when the last ping is ``PROBE_S`` old. Never waits."""
        from .sglang_rooms import PROBE_S
        now = time.monotonic()
        with self._lock:
            last = self._probes.get(peer)
            why = None
            if last is not None and last[0].done() and last[0].exception() is not None:
                why = str(last[0].exception())
            if last is None or (last[0].done() and now - last[1] >= PROBE_S):
                self._probes[peer] = (self.send_async(peer, {"t": "ping"}), now)
        return why

    # -- what SGLang's DecodePreallocQueue calls (never waits)
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """True once ``prefill_info_table`` holds ``bootstrap_addr`` (found, or failed: the receiver
        then reports the failure); otherwise starts or checks the look-up on the Background."""
        with self._lock:
            if bootstrap_addr in self.prefill_info_table:
                return True
            job = self._info_jobs.get(bootstrap_addr)
            if job is None:
                self._info_jobs[bootstrap_addr] = self.bg.submit(self._fetch_info, bootstrap_addr)
                return False
            if not job.done():
                return False
            del self._info_jobs[bootstrap_addr]
            exc = job.exception()
            self.prefill_info_table[bootstrap_addr] = job.result() if exc is None else PrefillInfo(
                error=f"bootstrap at {bootstrap_addr} failed: {exc}")
            return True

    def info(self, bootstrap_addr: str) -> PrefillInfo | None:
        """The address's info for a receiver; a failure is dropped after ``_FAILED_INFO_S`` (retried)."""
        with self._lock:
            info = self.prefill_info_table.get(bootstrap_addr)
            if info is not None and info.error and time.monotonic() - info.since > _FAILED_INFO_S:
                del self.prefill_info_table[bootstrap_addr]
        return info

    def _fetch_info(self, addr: str) -> PrefillInfo:
        """Background: the prefill's records, this rank's plan, connects to its source ranks."""
        store = self.store(addr)
        rec0 = json.loads(store.get("sglang/prefill/tp0", TIMEOUT_S))
        src_tp = int(rec0["tp"])
        if int(rec0.get("page_size", self.kv_args.page_size)) != int(self.kv_args.page_size):
            raise LayoutError(f"page size mismatch: prefill at {addr} has {rec0['page_size']}, this decode rank "
                            f"{self.kv_args.page_size}")
        if self.is_mla:
            heads_plan = [(self.rank % src_tp, None)]
        else:
            heads_plan = head_plan(self.total_heads, src_tp, self.tp_size, self.rank)
            for _, heads in heads_plan:
                self.link.ensure_heads(heads, publish=False)
            self.link.publish()
        self.publish(addr)  # the prefill finds this rank here to write into it
        plan = []
        for src, heads in heads_plan:
            rec = json.loads(store.get(f"sglang/prefill/tp{src}", TIMEOUT_S))
            plan.append((self.connect(addr, rec["agent"], 1), heads))
        return PrefillInfo(tp=src_tp, plan=plan)

    def _ensure_prefill_recompute_executor(self) -> Background:
        """SGLang submits its prefill DP-rank queries here; the Background has ``submit``."""
        return self.bg

    def submit_prefill_recompute(self, kv_receiver, payload) -> None:
        """PD rebootstrap (retraction) is not supported by this backend: the request fails."""
        kv_receiver.fail("PD rebootstrap (prefill recompute) is not supported by the xfer backend")

    # -- messages
    def room(self, room: int) -> _Room:
        with self._lock:
            return self.rooms.setdefault(int(room), _Room())

    @property
    def timeout_s(self) -> float:
        """The deadline of every network step (``TIMEOUT_S``, read when asked: tests shorten it)."""
        return TIMEOUT_S

    def pump(self) -> None:
        """Sort what peers sent into rooms (prefill: wants and aborts; decode: results)."""
        for peer, op, msg in self.link.messages():
            if op is not Op.MESSAGE:
                continue
            kind = msg.get("t")
            if kind == "want":
                self.room(msg["room"]).wants.append(_Want(
                    peer=peer, version=int(msg.get("v", 0)), pages=[int(p) for p in msg["pages"]], aux=msg.get("aux"),
                    heads=tuple(msg["heads"]) if msg.get("heads") else None,
                    dst_heads=tuple(msg["dheads"]) if msg.get("dheads") else None, dst_tp=int(msg.get("dtp", 1))))
            elif kind == "abort":
                self.room(msg["room"]).aborted_by.add(peer)
            elif kind == "done":
                with self._lock:
                    room = self.rooms.get(int(msg["room"]))  # a room this side ended already: dropped
                if room is not None:
                    room.results.append(msg)
            # "ping": a decode rank's liveness probe; delivery is the answer

    def drop(self, room: int) -> None:
        with self._lock:
            self.rooms.pop(int(room), None)

    def close(self) -> None:
        self.bg.close()
        self.link.close()
        for s in self.stores.values():
            try:
                s.close()
            except XferError:
                pass

    def teardown(self) -> None:
        self.close()


class XferKVBootstrapServer(BaseKVBootstrapServer):
    """Hosts the xfer metadata store (TCPStore) at the prefill bootstrap address."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, int(port)
        self.store = open_store(f"tcp://{host}:{port}", host_if_missing=True, timeout=TIMEOUT_S)

    def close(self) -> None:
        self.store.close()


from .sglang_rooms import XferKVReceiver, XferKVSender, XferTransferError  # noqa: E402  (they use the names above)

CLASSES = {"manager": XferKVManager, "sender": XferKVSender, "receiver": XferKVReceiver,
           "bootstrap_server": XferKVBootstrapServer}
