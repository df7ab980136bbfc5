"""The engine-neutral core of the drop-in KV layers (vLLM connector, SGLang backend).

Both adapters need the same few things, and nothing engine-specific lives here:

- ``KVLink``: one xfer agent per engine rank, one region per layer (``L<i>``) plus, for a
  tensor-parallel mismatch, per-layer regions restricted to an absolute kv-head range
  (``L<i>.h<a>-<b>``); peers found by name through the metadata store; one transfer per layer
  (layer-wise posting); small JSON control messages between ranks.
- ``TransferGroup``: the per-layer transfers of one request, waitable per layer, with one outcome.
- ``LeaseTable``: source blocks held for a reader that may never come; they free on the last
  release or when the lease runs out.
- ``LoadErrors``: destination block ids whose load failed, taken once by the engine.
- ``head_plan``: which source rank serves which kv heads of a destination rank (TP mismatch).
- ``tensor_from_ptr``: a tensor over raw engine memory (SGLang hands out pointers).
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from xfer import Agent, AgentConfig, KVLayout, TransferState
from xfer.errors import InvalidArgumentError, XferError
from xfer.transfer import Op, Transfer

from .kv_pool import head_layout

__all__ = ["LinkConfig", "KVLink", "TransferGroup", "LeaseTable", "LoadErrors", "head_plan", "rank_heads",
           "region_name", "tensor_from_ptr"]

log = logging.getLogger("xfer.engine.kvlink")

Heads = tuple[int, int]  # absolute kv-head range [h0, h1) of the whole model


@dataclass(frozen=True)
class LinkConfig:
    """Settings of one engine rank's link.

    name: agent name, unique in the deployment (e.g. ``"prefill-a.tp0"``).
    store_url: metadata store where agents publish themselves (``tcp://HOST:PORT``, ``etcd://...``);
        ``None`` for in-process tests that connect by metadata bytes (``KVLink.connect``).
    host_store: host the ``tcp://`` store when nobody does yet (one process per deployment may).
    timeout_s: deadline of every layer transfer and of finding a peer, in seconds.
    listen_host: the address peers reach this agent's control port on.
    transport: pin an xfer transport (``"local"``, ``"ipc"``, ``"ucx"``...); ``None`` lets xfer pick.
    enable: start only these transports (``None``: every one that can run here).
    """

    name: str
    store_url: str | None = None
    host_store: bool = False
    timeout_s: float = 30.0
    listen_host: str = "127.0.0.1"
    transport: str | None = None
    enable: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise InvalidArgumentError(f"LinkConfig.name must be a non-empty str without '/', got {self.name!r}")
        if not isinstance(self.timeout_s, (int, float)) or not 0 < self.timeout_s < float("inf"):
            raise InvalidArgumentError(f"LinkConfig.timeout_s must be a finite number > 0, got {self.timeout_s!r}")
        if self.store_url is not None and not str(self.store_url).startswith(("tcp://", "etcd://")):
            raise InvalidArgumentError(f"LinkConfig.store_url must be tcp://HOST:PORT or etcd://HOST:PORT, "
                                       f"got {self.store_url!r}")


def region_name(layer: int, heads: Heads | None = None) -> str:
    """Region of layer ``layer`` (all of this rank's heads) or of absolute kv-heads ``heads``."""
    return f"L{layer}" if heads is None else f"L{layer}.h{heads[0]}-{heads[1]}"


def rank_heads(total_heads: int, tp_size: int, rank: int) -> Heads:
    """The absolute kv heads TP rank ``rank`` holds (replicated, one each, when heads < ranks)."""
    if not 0 <= rank < tp_size:
        raise InvalidArgumentError(f"rank {rank} is not in 0..{tp_size - 1}")
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise InvalidArgumentError(f"{total_heads} kv heads do not split over {tp_size} ranks")
        per = total_heads // tp_size
        return rank * per, (rank + 1) * per
    h = rank * total_heads // tp_size
    return h, h + 1


def head_plan(total_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[tuple[int, Heads]]:
    """For destination rank ``dst_rank``: [(source rank, absolute heads)] covering its heads once.

    A head held by several source ranks (replicated) is taken from the first of them.
    """
    d0, d1 = rank_heads(total_heads, dst_tp, dst_rank)
    plan: list[tuple[int, Heads]] = []
    for h in range(d0, d1):
        src = next(r for r in range(src_tp) if rank_heads(total_heads, src_tp, r)[0] <= h
                   < rank_heads(total_heads, src_tp, r)[1])
        if plan and plan[-1][0] == src and plan[-1][1][1] == h:
            plan[-1] = (src, (plan[-1][1][0], h + 1))
        else:
            plan.append((src, (h, h + 1)))
    return plan


def readers_of(total_heads: int, src_tp: int, dst_tp: int, src_rank: int) -> list[int]:
    """Destination ranks whose ``head_plan`` names ``src_rank``."""
    return [d for d in range(dst_tp) if any(s == src_rank for s, _ in head_plan(total_heads, src_tp, dst_tp, d))]


def tensor_from_ptr(ptr: int, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` of engine memory at address ``ptr`` (no copy, not owned)."""
    device = torch.device(device)
    if device.type == "cpu":
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)

    class _Cuda:  # torch.as_tensor reads __cuda_array_interface__
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}
    return torch.as_tensor(_Cuda(), device=device)


class TransferGroup:
    """The transfers of one request, by layer. ``wait_layer`` / ``poll`` never raise transfer errors:
    they report them (``errors``) so the engine can recompute instead of crashing."""

    __slots__ = ("key", "by_layer", "errors", "expected_layers", "created", "_outcome")

    def __init__(self, key: str, expected_layers: int):
        self.key, self.expected_layers = key, expected_layers
        self.by_layer: dict[int, list[Transfer]] = {}
        self.errors: list[str] = []
        self.created = time.monotonic()
        self._outcome: bool | None = None

    def __repr__(self) -> str:
        return f"TransferGroup({self.key!r}, layers={len(self.by_layer)}/{self.expected_layers}, ok={self._outcome})"

    def add(self, layer: int, transfer: Transfer) -> None:
        self.by_layer.setdefault(layer, []).append(transfer)

    def fail(self, why: str) -> None:
        self.errors.append(why)

    def _transfers(self):
        return [t for ts in self.by_layer.values() for t in ts]

    def wait_layer(self, layer: int) -> bool:
        """Block until layer ``layer``'s transfers ended (each by its deadline); True if all succeeded."""
        for t in self.by_layer.get(layer, ()):
            try:
                t.wait()
            except XferError:
                pass  # reported by poll()
        return not self.errors and all(t.poll() is TransferState.DONE for t in self.by_layer.get(layer, ()))

    def wait(self) -> bool:
        """Block until every transfer ended; the outcome (see ``poll``)."""
        for layer in list(self.by_layer):
            self.wait_layer(layer)
        return bool(self.poll())

    def poll(self) -> bool | None:
        """None while a transfer runs; True when every layer landed; False once all ended and anything failed."""
        if self._outcome is not None:
            return self._outcome
        ts = self._transfers()
        if any(not t.poll().terminal for t in ts):
            return None
        for t in ts:
            if t.poll() is not TransferState.DONE:
                self.errors.append(f"{t!r}: {t.error}")
        if not self.errors and len(self.by_layer) < self.expected_layers:
            self.errors.append(f"only {len(self.by_layer)} of {self.expected_layers} layers were posted")
        self._outcome = not self.errors
        return self._outcome

    def cancel(self) -> None:
        for t in self._transfers():
            t.cancel()


@dataclass
class Lease:
    blocks: list[int]
    deadline: float  # time.monotonic()
    readers: int  # releases still expected


class LeaseTable:
    """Source blocks held for readers: ``hold`` then ``release`` per reader; ``expired`` frees the rest."""

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, key: str) -> bool:
        return key in self._leases

    def hold(self, key: str, blocks: Sequence[int], *, ttl: float, readers: int = 1) -> None:
        with self._lock:
            self._leases[key] = Lease(list(blocks), time.monotonic() + ttl, max(readers, 1))

    def release(self, key: str) -> bool:
        """One reader is done; True when that was the last one (the lease is gone)."""
        with self._lock:
            lease = self._leases.get(key)
            if lease is None:
                return False
            lease.readers -= 1
            if lease.readers > 0:
                return False
            del self._leases[key]
            return True

    def expired(self, now: float | None = None) -> list[str]:
        """Keys whose lease ran out (removed)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [k for k, lease in self._leases.items() if lease.deadline <= now]
            for k in gone:
                del self._leases[k]
        return gone


class LoadErrors:
    """Destination block ids whose load failed since the engine last asked."""

    def __init__(self) -> None:
        self._ids: set[int] = set()
        self._lock = threading.Lock()

    def add(self, blocks: Sequence[int]) -> None:
        with self._lock:
            self._ids.update(int(b) for b in blocks)

    def take(self) -> set[int]:
        with self._lock:
            ids, self._ids = self._ids, set()
        return ids


class KVLink:
    """One engine rank's xfer agent with per-layer regions.

    ``register_layers(tensors_by_layer, layouts)`` registers region ``L<i>`` for layer ``i``;
    ``ensure_heads(heads)`` adds the head-restricted regions a TP mismatch needs (this rank holds
    absolute heads ``own_heads``). ``post`` moves one layer; ``send`` / ``messages`` carry JSON.
    """

    def __init__(self, config: LinkConfig):
        self.config = config
        self.agent = Agent(config.name, AgentConfig(default_timeout_s=config.timeout_s,
                                                    connect_timeout_s=config.timeout_s,
                                                    listen_host=config.listen_host, transport=config.transport,
                                                    enable=config.enable))
        self.store = None  # this rank's own store (config.store_url)
        self._stores: dict[str, object] = {}  # other stores peers were found in, by URL
        self._peer_locks: dict[str, threading.Lock] = {}  # one connect at a time per peer or store URL
        self.layouts: list[KVLayout] = []
        self._tensors: list[list[torch.Tensor]] = []
        self.own_heads: Heads | None = None
        self._head_regions: set[Heads] = set()
        self._connected: dict[str, int] = {}  # peer name -> metadata version connected
        self._pending: list[tuple[str, dict]] = []
        self.version = 0  # bumped on every publish: a peer reconnects when it sees a newer one
        self._lock = threading.RLock()
        self._closed = False

    def __repr__(self) -> str:
        return f"KVLink({self.config.name!r}, layers={len(self.layouts)}, heads={self.own_heads}, v{self.version})"

    def __enter__(self) -> "KVLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def num_layers(self) -> int:
        return len(self.layouts)

    # ---- memory --------------------------------------------------------------------------------
    def register_layers(self, tensors: Sequence[Sequence[torch.Tensor]], layouts: Sequence[KVLayout], *,
                        own_heads: Heads | None = None) -> None:
        """Layer ``i`` is ``layouts[i]`` over base tensors ``tensors[i]`` (registered as ``L<i>``)."""
        if len(tensors) != len(layouts) or not layouts:
            raise InvalidArgumentError(f"need one layout per layer: {len(tensors)} tensor lists, {len(layouts)} layouts")
        with self._lock:
            for i, (ts, layout) in enumerate(zip(tensors, layouts)):
                self.agent.register(region_name(i), list(ts), layout)
            self.layouts, self._tensors = list(layouts), [list(ts) for ts in tensors]
            self.own_heads = own_heads or (0, layouts[0].num_heads)
        self.publish()

    def ensure_heads(self, heads: Heads, *, publish: bool = True) -> str:
        """Register the regions of absolute heads ``heads`` (a subset of ``own_heads``); returns the
        region name stem for layer 0 (``region_name(i, heads)`` names layer ``i``)."""
        h0, h1 = self.own_heads
        if heads == (h0, h1):
            return region_name(0)
        if not h0 <= heads[0] < heads[1] <= h1:
            raise InvalidArgumentError(f"heads {heads} are not inside this rank's heads {self.own_heads}")
        with self._lock:
            if heads not in self._head_regions:
                for i, (ts, layout) in enumerate(zip(self._tensors, self.layouts)):
                    self.agent.register(region_name(i, heads), ts, head_layout(layout, (heads[0] - h0, heads[1] - h0)))
                self._head_regions.add(heads)
                if publish:
                    self.publish()
        return region_name(0, heads)

    def region(self, layer: int, heads: Heads | None) -> str:
        return region_name(layer, None if heads is None or heads == self.own_heads else heads)

    # ---- peers ---------------------------------------------------------------------------------
    # Finding and connecting to a peer waits on the network (the store, the peer's control port):
    # the drop-ins call these from a Background thread, never from the engine's scheduler thread.
    # Each is bounded by timeout_s; the link's lock is never held across the wait (per-name locks).
    def _keyed_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._peer_locks.setdefault(key, threading.Lock())

    def open_store(self, url: str | None = None):
        """The store at ``url`` (default: this rank's own ``store_url``), opened once; None without one."""
        from xfer.store import open_store
        own = url is None or url == self.config.store_url
        url = self.config.store_url if url is None else url
        if url is None:
            return None
        if not str(url).startswith(("tcp://", "etcd://")):
            raise InvalidArgumentError(f"store URL must be tcp://HOST:PORT or etcd://HOST:PORT, got {url!r}")
        with self._keyed_lock("store:" + url):
            store = self.store if own else self._stores.get(url)
            if store is None:
                store = open_store(url, host_if_missing=own and self.config.host_store, timeout=self.config.timeout_s)
                with self._lock:
                    if own:
                        self.store = store
                    else:
                        self._stores[url] = store
        return store

    def publish(self) -> None:
        with self._lock:
            self.version += 1
        store = self.open_store()
        if store is not None:
            self.agent.publish(store)

    def peer(self, name: str, version: int = 0, store_url: str | None = None) -> str:
        """Connect to ``name`` found in the store at ``store_url`` (default: this rank's store), once,
        or again when it published ``version`` since. Bounded by ``timeout_s``: call it off the engine thread."""
        with self._keyed_lock("peer:" + name):
            if self._connected.get(name, -1) >= version and name in self.agent.peers:
                return name
            store = self.open_store(store_url)
            if store is None:
                raise InvalidArgumentError(f"peer {name!r} is not connected and no store_url is configured")
            self.agent.connect_by_name(store, name, timeout=self.config.timeout_s)
            with self._lock:
                self._connected[name] = max(version, 1)
        return name

    def connected(self, name: str) -> bool:
        """True if ``name`` is connected (a local check, never waits)."""
        return name in self._connected and name in self.agent.peers

    def connect(self, metadata: bytes) -> str:
        """Connect by metadata bytes (in-process tests, or a caller that exchanged them itself)."""
        with self._lock:
            name = self.agent.connect(metadata)
            self._connected[name] = 1 << 30
        return name

    # ---- moving layers -------------------------------------------------------------------------
    def post(self, op: Op, peer: str, layer: int, local_blocks, peer_blocks, *, heads: Heads | None = None,
             peer_heads: Heads | None = None, note: dict | None = None, timeout: float | None = None) -> Transfer:
        """Move layer ``layer`` of ``local_blocks`` to (WRITE) or from (READ) the peer's ``peer_blocks``.

        heads: absolute kv-head range moved (``None``: this rank's heads, all of them); the peer's
        region is the same range unless ``peer_heads`` says the peer holds exactly those.
        """
        local = self.region(layer, heads)
        remote = region_name(layer, None if heads is None or heads == peer_heads else heads)
        payload = json.dumps(note or {}, separators=(",", ":")).encode()
        if op is Op.WRITE:
            return self.agent.write(peer, local_blocks, peer_blocks, region=local, peer_region=remote,
                                    notify=payload, timeout=timeout)
        return self.agent.read(peer, peer_blocks, local_blocks, region=local, peer_region=remote,
                               notify=payload, timeout=timeout)

    def send(self, peer: str, msg: dict) -> None:
        """A JSON control message to a connected peer (raises the typed error if it cannot be delivered)."""
        self.agent.send(peer, json.dumps(msg, separators=(",", ":")).encode(), timeout=self.config.timeout_s)

    def messages(self) -> list[tuple[str, Op, dict]]:
        """Drain what peers sent: (peer, op, message); op MESSAGE for ``send``, READ/WRITE for notes
        of transfers they ran against this agent's blocks."""
        out = []
        for n in self.agent.notifications():
            try:
                msg = json.loads(n.payload) if n.payload else {}
            except ValueError:
                log.warning("kvlink %s: dropped a non-JSON payload from %s", self.config.name, n.peer)
                continue
            out.append((n.peer, n.op, msg))
        return out

    def close(self) -> None:
        """Close the agent (cancelling in-flight transfers) and the store connection. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.agent.close()
        for store in [self.store, *self._stores.values()]:
            if store is not None:
                try:
                    store.close()
                except XferError:
                    pass
