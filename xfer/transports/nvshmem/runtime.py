"""This process's NVSHMEM PE: bootstrap, symmetric memory, the on-stream operations, teardown.

NVSHMEM is per process: one PE of one fixed group, joined collectively. Every agent of the process
that is configured with the same :class:`~xfer.config.NvshmemGroup` shares the one
:class:`Runtime` (``acquire`` / ``release``, reference-counted).

Bootstrap (:mod:`.join`): rank 0 makes the unique id and publishes it in the agents' metadata
store; the other ranks read it (:mod:`.bootstrap`); every rank calls ``nvshmem.core.init`` on a
helper thread, bounded by ``init_timeout_s``. Then, collectively and in the same order on every
PE, the staging areas and signal words (``proto.StagingPlan``) are allocated on the symmetric
heap (:mod:`.heap`) and zeroed, and a barrier ensures no PE signals a peer that has not zeroed
its words yet. A PE's signals to itself are ordered by events (:mod:`.signals`).

Interface the lanes use (a CPU stand-in in the tests implements the same): ``pe``, ``size``,
``plan``, ``host_id``, ``lanes``, ``bind_thread()``, ``new_stream()``, ``record(stream)`` -> event
with ``query()``, ``gather``, ``scatter``, ``put_signal``, ``wait_data``, ``wait_credit``,
``send_credit``, ``set_own_credit``, ``set_own_data``, ``quiet``. Every NVSHMEM call is made under
``lock`` (the bindings hold the GIL anyway).

Teardown: ``nvshmem_free`` and ``nvshmem_finalize`` are collectives that block with the GIL held, so
a PE whose peer is gone would hang for good. ``close`` first agrees with the other PEs through the
store (``agree_to_finalize``, bounded); only if all PEs are closing does it free and finalize,
otherwise it leaves the memory to the process exit.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from ...errors import InvalidArgumentError, StoreError, TransportError, TransportUnavailableError, XferError
from ...store import open_store
from . import bootstrap
from .join import join
from .lanes import Lanes
from .heap import SymmetricHeap
from .mpg import MpgOps, unmapped
from .proto import StagingPlan
from .signals import SelfSignals

__all__ = ["Runtime", "acquire", "release", "CLOSE_TIMEOUT_S"]

log = logging.getLogger("xfer.nvshmem")

CLOSE_TIMEOUT_S = 10.0  # default wait for the other PEs at teardown (NvshmemGroup.close_timeout_s)

_lock = threading.Lock()
_current: Runtime | None = None
_refs = 0
_spoiled: str | None = None  # why NVSHMEM cannot be initialised again in this process
_abandoned: list = []  # symmetric tensors of a runtime whose teardown was skipped: never freed implicitly


def _same_group(a, b) -> bool:
    keys = ("store", "name", "rank", "size", "device", "staging_bytes")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def acquire(group, host_id: str) -> Runtime:
    """This process's PE for ``group`` (joining the group on first use)."""
    global _current, _refs, _spoiled
    with _lock:
        if _current is None and _spoiled is not None:
            raise TransportUnavailableError(f"NVSHMEM cannot be set up again in this process: {_spoiled}")
        if _current is not None:
            if _same_group(_current.group, group):
                _refs += 1
                return _current
            g = _current.group
            raise TransportUnavailableError(f"this process already is PE {g.rank} of NVSHMEM group {g.name!r}; a "
                                            f"process holds one PE of one group (asked: rank {group.rank} of "
                                            f"{group.name!r})")
        try:
            rt = Runtime(group, host_id)
        except Exception as exc:  # noqa: BLE001 - a CUDA or NVSHMEM error disables the transport, not the agent
            if _Tried.init:  # a half-done nvshmem init cannot be retried in-process
                _spoiled = f"an earlier setup failed after nvshmem.core.init was called ({exc})"
            if isinstance(exc, XferError):
                raise
            raise TransportUnavailableError(f"NVSHMEM setup of PE {group.rank} of group {group.name!r} failed: "
                                            f"{exc!r}") from exc
        _current, _refs = rt, 1
        return _current


def release(rt) -> None:
    """Drop one reference; the last one tears the PE down."""
    global _current, _refs, _spoiled
    with _lock:
        if rt is not _current:
            return
        _refs -= 1
        if _refs > 0:
            return
        _current = None
        rt.close()
        if not rt.teardown.startswith("finalized"):
            _spoiled = f"the last PE was not finalized ({rt.teardown})"
        _Tried.init = False


class _Tried:
    init = False  # nvshmem.core.init was called by the runtime being set up

    @classmethod
    def calling_init(cls) -> None:
        cls.init = True


class Runtime:
    """One NVSHMEM PE: ``pe`` of ``size``, its device, staging areas, signal words and lanes."""

    def __init__(self, group, host_id: str):
        try:
            import nvshmem.bindings as nvb
            import nvshmem.core as nvc
            from cuda.core import Device
        except ImportError as exc:
            raise TransportUnavailableError(f"nvshmem4py cannot be imported: {exc}") from None
        self._nvc, self._nvb = nvc, nvb
        self._GE, self._SET = int(nvb.Cmp_type.CMP_GE), int(nvb.Signal_op.SIGNAL_SET)
        self.group, self.pe, self.size, self.host_id = group, group.rank, group.size, host_id
        index = torch.cuda.current_device() if group.device is None else group.device
        if not 0 <= index < torch.cuda.device_count():
            raise InvalidArgumentError(f"NvshmemGroup.device={index} but this process sees "
                                       f"{torch.cuda.device_count()} CUDA devices")
        self.index, self.device = index, torch.device("cuda", index)
        self.plan = StagingPlan(group.size, group.staging_bytes)
        self.lock = threading.RLock()
        self.session, self.status = "", "unknown"
        self.heap = "not set up"  # which symmetric heap NVSHMEM was told to use, and why
        self._mpg = None  # nvshmem_mpg.MpgOps when NVSHMEM runs in limited MPG mode
        self._self = SelfSignals()  # a self put's order, as events (see SelfSignals)
        self._limited_mpg = False
        self.teardown = "open"  # then "finalized: why" or "skipped: why"
        self.sym = SymmetricHeap(nvc, self.lock, self.pe, self.device)  # what this PE allocated or registered
        self._direct_stream = None
        self._closed = False
        try:
            self.store = open_store(group.store, timeout=group.init_timeout_s)
        except StoreError as exc:
            raise TransportUnavailableError(f"NVSHMEM group {group.name!r}: cannot open store {group.store}: "
                                            f"{exc}") from None
        try:
            with torch.cuda.device(index):
                joined = join(self.store, group, host_id, index, Device(index), nvc, nvb, _Tried.calling_init)
                self.session, self.heap, self.status = joined.session, joined.heap, joined.status
                self._limited_mpg = joined.limited_mpg
                self._allocate()
        except BaseException:
            self.store.close()
            raise
        self.lanes = Lanes(self)
        log.info("NVSHMEM PE %d of %d (group %r, session %s) on %s: %r, status %s, heap: %s", self.pe, self.size,
                 group.name, self.session, self.device, self.plan, self.status, self.heap)

    def __repr__(self) -> str:
        return (f"Runtime(pe={self.pe}/{self.size}, group={self.group.name!r}, session={self.session}, "
                f"device={self.device}, {'closed' if self._closed else 'open'})")

    def _allocate(self) -> None:
        w = self.plan.words
        with torch.cuda.device(self.index):
            self.recv = self.sym.alloc(self.plan.area_bytes)  # [src, role] slots this PE receives into
            self.send = self.sym.alloc(self.plan.area_bytes)  # [dst, role] slots this PE gathers into
            # uint64 for NVSHMEM; values stay < 2**63; one scratch word last (the MPG self-test)
            words = self.sym.alloc(16 * w + 8).view(torch.int64)
            words.zero_()
            self.data_words, self.credit_words = words[:w], words[w:2 * w]
            stream = torch.cuda.Stream(self.index)
            stream.wait_stream(torch.cuda.current_stream(self.index))
            with self.lock:
                self._nvb.barrier_all_on_stream(stream.cuda_stream)
            event = self.record(stream)
        end = time.monotonic() + self.group.init_timeout_s
        while not event.query():
            if time.monotonic() > end:
                raise TransportUnavailableError(f"NVSHMEM barrier after allocating the staging areas did not "
                                                f"complete within {self.group.init_timeout_s:g} s")
            time.sleep(1e-3)
        self._recv_ptr, self._send_ptr = self.recv.data_ptr(), self.send.data_ptr()
        self._data_ptr, self._credit_ptr = self.data_words.data_ptr(), self.credit_words.data_ptr()
        if self._limited_mpg:
            with torch.cuda.device(self.index):
                self._mpg = MpgOps(words, timeout_s=self.group.init_timeout_s)
            self._check_peer_mappings()

    def _check_peer_mappings(self) -> None:
        """Limited MPG: every peer's words and receive area must be mapped here (stores to them
        come from this process), or the first transfer would fault; say so at start-up instead."""
        wanted = [("signal words", self._data_ptr, 2 * self.plan.words * 8), ("receive area", self._recv_ptr,
                                                                              self.plan.area_bytes)]
        for pe in range(self.size):
            if pe == self.pe:
                continue
            for what, addr, nbytes in wanted:
                with self.lock:
                    mapped = int(self._nvb.ptr(addr, pe) or 0)
                why = unmapped(mapped, nbytes) if mapped else None  # NULL: not a P2P peer, not stored to
                if why:
                    raise TransportUnavailableError(
                        f"NVSHMEM PE {pe}'s {what} (nvshmem_ptr {why}) is not reachable from PE {self.pe}, which "
                        f"shares its GPU; heap: {self.heap}. Set NVSHMEM_DISABLE_CUDA_VMM=1 on every PE (static "
                        f"heap) or give each PE its own GPU")

    def describe(self) -> str:
        """The signal words as they are now (a copy on a stream of its own, so it never waits
        behind a lane that is stuck): for a report when a transfer stops."""
        try:
            stream = torch.cuda.Stream(self.index)
            with torch.cuda.stream(stream):
                data, credit = self.data_words.to("cpu", non_blocking=False), self.credit_words.to("cpu")
            return (f"PE {self.pe}/{self.size} status {self.status} mpg={getattr(self._mpg, 'mode', None)}: "
                    f"data words {data.tolist()}, credit words {credit.tolist()} (index 2*peer+role)")
        except Exception as exc:  # noqa: BLE001 - a report must not raise
            return f"signal words unreadable: {exc!r}"

    # ---- streams and the on-stream operations the lanes use -----------------------------------------
    def bind_thread(self) -> None:
        torch.cuda.set_device(self.index)

    def new_stream(self):
        return torch.cuda.Stream(device=self.index)

    def record(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def gather(self, stream, layout, tensors, ids, dst: int, role: int, seq: int, nbytes: int, bounds=None):
        """Blocks ``ids`` into my send position (dst, role, seq). ``bounds``: the region's
        ``xfer.kernels.StagingCopies`` (the staging areas live as long as the PE); None: a plain gather."""
        from xfer.kernels import gather, staging_layout

        off = self.plan.position(dst, role, seq)
        if bounds is None:
            return gather(layout, tensors, ids, self.send[off:off + nbytes], stream=stream)
        n = len(ids)
        bound = bounds.gather(layout, tensors, staging_layout(layout, n), self.send[off:off + nbytes])
        # the lane keeps the returned event (and through it the tensors) until the GPU is done
        return bound.copy(ids, np.arange(n, dtype=np.int64), stream=stream, record_stream=False)

    def scatter(self, stream, src: int, role: int, seq: int, nbytes: int, layout, tensors, ids, staging_layout,
                bounds=None):
        """My receive position (src, role, seq) onto blocks ``ids`` (``bounds``: as for gather)."""
        from xfer.kernels import scatter

        off = self.plan.position(src, role, seq)
        if bounds is None:
            return scatter(self.recv[off:off + nbytes], layout, tensors, ids, staging_layout=staging_layout,
                           stream=stream)
        bound = bounds.scatter(staging_layout, self.recv[off:off + nbytes], layout, tensors)
        return bound.copy(np.arange(len(ids), dtype=np.int64), ids, stream=stream, record_stream=False)

    def preload(self, stream, sending: bool, peer: int, role: int, seq: int, layout, tensors, n: int,
                bounds=None, sender_layout=None) -> None:
        """Before a lane queues the waits of a transfer: have the gather (``sending``) or scatter
        kernel of its ``n``-block chunks run once in this process (``BoundCopy.preload``). A
        kernel's first launch may synchronize the whole context (CUDA lazy loading); behind a
        signal wait that only this process's drain releases, it would never return. Best effort:
        a failure here is logged, the transfer goes on."""
        if bounds is None or n <= 0:
            return
        from xfer.kernels import staging_layout

        try:
            off, nbytes = self.plan.position(peer, role, seq), n * layout.bytes_per_block
            if sending:
                bound = bounds.gather(layout, tensors, staging_layout(layout, n), self.send[off:off + nbytes])
            else:
                bound = bounds.scatter(staging_layout(sender_layout, n), self.recv[off:off + nbytes], layout, tensors)
            bound.preload(n, stream)
        except Exception:  # noqa: BLE001 - only a safeguard; the copy itself reports real errors
            log.warning("NVSHMEM PE %d: preloading the %s kernel of %d-block chunks failed", self.pe,
                        "gather" if sending else "scatter", n, exc_info=True)

    def put_signal(self, stream, dst: int, role: int, seq: int, nbytes: int) -> None:
        """My send position (dst, role, seq) -> dst's receive position (me, role, seq); dst's data word := seq."""
        p = self.plan
        with self.lock:
            self._nvb.putmem_signal_on_stream(self._recv_ptr + p.position(self.pe, role, seq),
                                              self._send_ptr + p.position(dst, role, seq), nbytes,
                                              self._data_ptr + 8 * p.word(self.pe, role), seq, self._SET, dst,
                                              stream.cuda_stream)
        if dst == self.pe:
            self._self.post(("data", p.word(self.pe, role)), seq, self.record(stream))

    def _wait(self, stream, addr: int, value: int) -> None:
        if self._mpg is not None:  # limited MPG: NVSHMEM exits the process on its own wait
            self._mpg.wait(stream, addr, value)
            return
        with self.lock:
            self._nvb.signal_wait_until_on_stream(addr, self._GE, value, stream.cuda_stream)

    def _set(self, stream, addr: int, value: int, pe: int) -> None:
        if self._mpg is not None:  # NVSHMEM's cuStreamWriteValue64 fails in limited MPG and exits
            if pe == self.pe:
                self._mpg.set_own(stream, addr, value)
                return
            with self.lock:
                mapped = int(self._nvb.ptr(addr, pe) or 0)
            if not mapped:
                raise TransportError(f"PE {pe}'s signal word is not mapped here (nvshmem_ptr returned NULL)")
            self._mpg.set_remote(stream, mapped, value)
            return
        with self.lock:
            self._nvb.signal_op_on_stream(addr, value, self._SET, pe, stream.cuda_stream)

    def _wait_self(self, stream, key: tuple, value: int, check) -> None:
        event = self._self.wait(key, value, check)
        if event is not None:
            stream.wait_event(event)

    def wait_data(self, stream, src: int, role: int, value: int, check=None) -> None:
        """Queue: go on once src's data word for ``role`` is >= value (``check``: see SelfSignals)."""
        if src == self.pe:
            return self._wait_self(stream, ("data", self.plan.word(src, role)), value, check)
        self._wait(stream, self._data_ptr + 8 * self.plan.word(src, role), value)

    def wait_credit(self, stream, dst: int, role: int, value: int, check=None) -> None:
        if dst == self.pe:
            return self._wait_self(stream, ("credit", self.plan.word(dst, role)), value, check)
        self._wait(stream, self._credit_ptr + 8 * self.plan.word(dst, role), value)

    def send_credit(self, stream, src: int, role: int, value: int) -> None:
        """src's credit word for (me, role) := value."""
        self._set(stream, self._credit_ptr + 8 * self.plan.word(self.pe, role), value, src)
        if src == self.pe:
            self._self.post(("credit", self.plan.word(self.pe, role)), value, self.record(stream))

    def set_own_credit(self, stream, dst: int, role: int, value: int) -> None:
        self._set(stream, self._credit_ptr + 8 * self.plan.word(dst, role), value, self.pe)
        if dst == self.pe:
            self._self.floor(("credit", self.plan.word(dst, role)), value)

    def set_own_data(self, stream, src: int, role: int, value: int) -> None:
        self._set(stream, self._data_ptr + 8 * self.plan.word(src, role), value, self.pe)
        if src == self.pe:
            self._self.floor(("data", self.plan.word(src, role)), value)

    def quiet(self, stream) -> None:
        with self.lock:
            self._nvb.quiet_on_stream(stream.cuda_stream)

    # ---- symmetric KV pools (the direct path) ------------------------------------------------------
    def symmetric_empty(self, shape, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """Collective: an uninitialised tensor on the symmetric heap (same call order on every PE)."""
        return self.sym.empty(shape, dtype, device)

    def register_external(self, tensors) -> list[torch.Tensor]:
        """Collective: put existing device tensors on the symmetric heap; returns their aliases."""
        return self.sym.register(tensors)

    def symmetric_offsets(self, tensors, layout) -> list[int] | None:
        """Where each base tensor sits on the symmetric heap (relative to the receive area), or None."""
        return self.sym.offsets(tensors, layout, self._recv_ptr)

    def peer_views(self, offsets, layout, pe: int) -> list[torch.Tensor] | None:
        """PE ``pe``'s base tensors at ``offsets``, mapped for kernels here; None if not reachable.

        Built like ``nvshmem.core.get_peer_tensor``: a cuda.core Buffer over the ``nvshmem_ptr``
        address, owned by NVSHMEM's memory resource (so torch sees a tensor of this PE's device),
        exported through DLPack. Dropping it frees nothing (the address is not an allocation).
        """
        from cuda.core import Buffer

        mr = self._nvc.tensor_get_buffer(self.recv)[0].memory_resource
        views = []
        for i, off in enumerate(offsets):
            with self.lock:
                ptr = int(self._nvb.ptr(self._recv_ptr + int(off), pe))
            if not ptr:
                return None
            need = layout.tensor_numel[i] * layout.itemsize
            flat = self.sym.own_bytes(ptr, need)  # this PE's own memory (a put to itself): no foreign Buffer
            if flat is None:
                why = unmapped(ptr, need)
                if why:  # a kernel storing there would fault and take this process's CUDA context with it
                    raise TransportError(f"PE {pe}'s symmetric tensor {i} (nvshmem_ptr {why}) is not reachable "
                                         f"from PE {self.pe}; heap: {self.heap}")
                flat = torch.utils.dlpack.from_dlpack(Buffer.from_handle(ptr=ptr, size=need, mr=mr)).view(torch.uint8)
            views.append(flat.view(layout.dtype))
        return views

    def direct_stream(self):
        if self._direct_stream is None:
            self._direct_stream = torch.cuda.Stream(device=self.index)
        return self._direct_stream

    # ---- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        clean = self.lanes.close()
        timeout = float(getattr(self.group, "close_timeout_s", CLOSE_TIMEOUT_S))
        go, why = bootstrap.agree_to_finalize(self.store, self.group, self.session, vote=clean, timeout=timeout)
        if go:
            try:
                with torch.cuda.device(self.index), self.lock:
                    torch.cuda.synchronize(self.index)
                    self.sym.free()
                    self._nvc.finalize()
                self.teardown = f"finalized: {why}"
                log.info("NVSHMEM PE %d of group %r finalized (%s)", self.pe, self.group.name, why)
            except Exception as exc:  # noqa: BLE001 - logged; close never raises
                self.teardown = f"failed: {exc!r}"
                log.exception("NVSHMEM PE %d of group %r: teardown failed", self.pe, self.group.name)
        else:
            self.teardown = f"skipped: {why}"
            _abandoned.extend(self.sym.forget())
            log.warning("NVSHMEM PE %d of group %r skipped nvshmem_free/nvshmem_finalize (%s); the memory is "
                        "released when the process exits", self.pe, self.group.name, why)
        self.sym.forget()
        self.store.close()
