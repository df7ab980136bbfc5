"""Shared machinery of the one-sided transports (``local``, ``ipc``, NVSHMEM's direct path): the
initiator maps the peer's base tensors once, runs ``copy_blocks`` between them, then notifies the
peer over the control channel and completes when the peer acknowledges. The peer is never told
about blocks that were not fully written.

Copies queued on a CUDA stream are launched by the posting thread itself when nothing posted
earlier is still waiting to launch (a launch is asynchronous and takes ~0.1 ms of host time;
handing it to a thread costs a wake-up and, under load, the GIL); otherwise, and for copies
that run on the host in chunks (checking the deadline, cancellation and the peer's liveness
between chunks), a worker thread launches them in posting order.

Merged launches (transports with ``merges``: ``ipc``). When ``XFER_MERGE_AHEAD`` (2) launches are
already queued on the copy stream, a later post does not launch: the worker waits until the
stream has room and then launches every transfer queued behind it to the same peer region, in the
same direction, as ONE copy (up to ``XFER_MERGE_MAX_BLOCKS``, 8192 blocks), as long as no two of
them write the same block (a later transfer's write must land after an earlier one's) and none
but the first still waits for its caller's stream (``after``). Each
transfer keeps its own ids, deadline, cancellation and notification; their notices go in one
message. Under load the host then spends one launch and one round trip on many transfers, and
the GPU always has the next launch queued. ``XFER_MERGE_AHEAD=0`` turns this off."""

from __future__ import annotations

import collections
import os
import queue
import threading
from abc import abstractmethod

import numpy as np
import torch

from ..errors import PeerDisconnectedError, TransferTimeoutError, TransportError, XferError
from ..shm import pid_alive
from ..transfer import Op, TransferState
from .base import Job, Transport
from .notify import notify_peer, notify_peer_batch

__all__ = ["OneSidedTransport"]

_REQUESTABLE = ("triton", "copy_engine_batch", "copy_engine_2d")  # CopyPath values a copy may be asked for
BATCH_MAX = 32  # transfers' notices in one control message
_NOTHING = object()


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


MERGE_AHEAD = max(0, _env_int("XFER_MERGE_AHEAD", 2))  # launches queued on a stream before posts are merged
MERGE_MAX_BLOCKS = max(1, _env_int("XFER_MERGE_MAX_BLOCKS", 8192))


def merge_key(job: Job) -> tuple:
    """Transfers with equal keys copy between the same two regions in the same direction."""
    return job.peer.metadata.agent_id, job.peer_region.name, id(job.local), job.op


def written_ids(job: Job) -> np.ndarray:
    """The blocks a transfer writes: the peer's for a WRITE, the local ones for a READ."""
    return job.peer_ids if job.op is Op.WRITE else job.local_ids


def joins(batch: list[Job], written: set, job: Job) -> bool:
    """Whether ``job`` can join ``batch`` in one launch: same regions and direction, under the
    size cap, and writing none of the blocks the batch writes (``written``: their ids). Two
    writes of one block in one launch would land in no defined order."""
    if merge_key(job) != merge_key(batch[0]):
        return False
    if sum(len(j.local_ids) for j in batch) + len(job.local_ids) > MERGE_MAX_BLOCKS:
        return False
    return written.isdisjoint(written_ids(job).tolist())


class OneSidedTransport(Transport):
    """Subclasses say how to reach a peer region's base tensors (``map_peer``).

    Every transfer's copies go by the path ``AgentConfig.copy_path`` requests (None:
    ``XFER_COPY_PATH``, else auto: see :mod:`xfer.kernels`); the path chosen is recorded on
    ``Transfer.copy_path`` and, where ``describe_copy`` is set, in ``Transfer.path`` with the
    reason (``ipc (copy: copy_engine_batch; auto (default table): 32768-byte slices d2h -> ...)``).
    """

    describe_copy = False
    merges = False  # launches may be merged (see the module doc): only where the two sides never share memory

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._jobs: queue.Queue = queue.Queue()
        self._mapped: dict[tuple[str, str], list[torch.Tensor]] = {}  # (peer agent id, region) -> tensors
        # (peer agent id, peer region, id of the local region, op) -> (local region, xfer.kernels.BoundCopy)
        self._bound: dict[tuple, tuple] = {}
        self._closed = False
        self._order = threading.RLock()  # held while a stream launch runs: launches keep posting order
        self._queued = 0  # jobs handed to the worker and not launched yet (under _order)
        # XFER_LAUNCH_INLINE=0: every launch goes through the worker thread (the posting thread
        # then never runs a launch, e.g. one that opens a new peer's IPC handles)
        self._inline = os.environ.get("XFER_LAUNCH_INLINE", "1").strip().lower() not in ("0", "false", "off", "no")
        self._merge = self.merges and MERGE_AHEAD > 0
        self._ahead: dict = {}  # stream -> events of its launches not yet seen complete (merging only)
        self._done: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name=f"xfer-{self.kind.value}-{ctx.agent_name}",
                                        daemon=True)
        self._completer = threading.Thread(target=self._complete, daemon=True,
                                           name=f"xfer-{self.kind.value}-done-{ctx.agent_name}")
        self._worker.start()
        self._completer.start()

    @abstractmethod
    def map_peer(self, job: Job) -> list[torch.Tensor]:
        """Base tensors of the peer region, usable by a kernel in this process."""

    def stream(self, job: Job) -> torch.cuda.Stream | None:
        """The stream copies run on (None: the current one / CPU)."""
        return None

    def post(self, job: Job) -> None:
        with self._order:
            if self._closed:
                job.transfer._finish(TransferState.FAILED, TransportError(f"{self.kind.value} transport is closed"))
                return
            if self._inline and self._queued == 0 and self._launches_async(job) and not self._crowded(job):
                self._start(job)  # on this thread: nothing posted earlier waits to launch
                return
            self._queued += 1
            self._jobs.put(job)

    def _launches_async(self, job: Job) -> bool:
        """Whether the job's copy is queued on a stream (a launch returns at once) rather than run here."""
        try:
            return self.stream(job) is not None
        except Exception:  # noqa: BLE001 - the worker reports it with the transfer
            return False

    def _crowded(self, job: Job) -> bool:
        """Merging: the job's stream already holds MERGE_AHEAD launches not yet complete (under ``_order``)."""
        if not self._merge:
            return False
        q = self._ahead.get(self.stream(job))
        while q and q[0].query():
            q.popleft()
        return bool(q) and len(q) >= MERGE_AHEAD

    def _wait_room(self, stream) -> None:
        """Block (GIL released) until ``stream`` holds fewer than MERGE_AHEAD unfinished launches."""
        while True:
            with self._order:
                q = self._ahead.get(stream)
                while q and q[0].query():
                    q.popleft()
                if not q or len(q) < MERGE_AHEAD:
                    return
                event = q[0]
            event.synchronize()

    def _mergeable(self, job: Job) -> bool:
        return self._merge and job.peer.metadata.pid != os.getpid() and self._launches_async(job)

    def disconnect(self, peer_agent_id: str) -> None:
        for key in [k for k in self._mapped if k[0] == peer_agent_id]:
            del self._mapped[key]
        for key in [k for k in self._bound if k[0] == peer_agent_id]:
            self._bound.pop(key, None)

    def release_region(self, region) -> None:
        for key in [k for k, v in self._bound.items() if v[0] is region]:
            self._bound.pop(key, None)

    def close(self) -> None:
        with self._order:  # a launch on a posting thread ends (its job reaches the completer) first
            if self._closed:
                return
            self._closed = True
        self._jobs.put(None)
        self._worker.join(timeout=10)
        self._completer.join(timeout=10)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.transfer._finish(TransferState.FAILED, TransportError(f"{self.kind.value} transport closed"))
        self._mapped.clear()
        self._bound.clear()
        self._ahead.clear()

    def _peer_tensors(self, job: Job) -> list[torch.Tensor]:
        key = (job.peer.metadata.agent_id, job.peer_region.name)
        if key not in self._mapped:
            self._check_alive(job)
            self._mapped[key] = self.map_peer(job)
        return self._mapped[key]

    def _check_alive(self, job: Job) -> None:
        md = job.peer.metadata
        if md.pid != os.getpid() and md.host_id == self.ctx.host_id and not pid_alive(md.pid):
            raise PeerDisconnectedError(f"peer {md.name!r} (pid {md.pid}) is gone; transfer {job.transfer.id} "
                                        f"reports no block complete")

    def _run(self) -> None:
        """Launcher: queue each job's copies, then hand it to the completer and take the next job,
        so the copy of one transfer overlaps the completion round trip of the previous one.
        Merging (see the module doc): wait for room on the stream, then launch the job with every
        job queued right behind it that can join it."""
        carry = _NOTHING
        while True:
            job = self._jobs.get() if carry is _NOTHING else carry
            carry = _NOTHING
            if job is None:
                self._done.put(None)
                return
            if self._mergeable(job):
                try:
                    self._wait_room(self.stream(job))
                except BaseException as exc:  # noqa: BLE001 - a failed wait ends the job, never the worker
                    with self._order:
                        self._queued -= 1
                    self._fail(job, exc)
                    continue
                batch, written = [job], set(written_ids(job).tolist())
                while True:
                    try:
                        nxt = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    # a job still waiting for its caller's work would hold up every copy merged
                    # with it (unmerged, the ones before it run meanwhile): it starts the next launch
                    if nxt is None or not self._mergeable(nxt) or not joins(batch, written, nxt) or \
                            (nxt.ready is not None and not nxt.ready.query()):
                        carry = nxt  # launched next, in order
                        break
                    batch.append(nxt)
                    written.update(written_ids(nxt).tolist())
                with self._order:
                    self._queued -= len(batch)
                    self._start_batch(batch)
            elif self._launches_async(job):
                with self._order:
                    self._queued -= 1
                    self._start(job)
            else:  # a copy on this thread may take long: posts queue behind it without waiting for it
                self._start(job)
                with self._order:
                    self._queued -= 1

    def _start(self, job: Job) -> None:
        """Launch the job's copies and hand it to the completer (a stream launch holds ``_order``)."""
        if job.transfer.poll().terminal:
            return
        job.transfer._start()
        job.transfer._mark("started")
        try:
            event = self._launch(job)
            job.transfer._mark("launched")
            self._done.put((job, event))
        except BaseException as exc:  # noqa: BLE001 - every failure ends the transfer
            self._fail(job, exc)

    def _start_batch(self, batch: list[Job]) -> None:
        """Launch ``batch`` (jobs that ``joins`` accepted, in posting order) as one copy."""
        live = [j for j in batch if not j.transfer.poll().terminal]
        if len(live) <= 1:
            for job in live:
                self._start(job)
            return
        for job in live:
            job.transfer._start()
            job.transfer._mark("started")
        try:
            event = self._launch(live[0], merged=live)
        except BaseException as exc:  # noqa: BLE001 - every failure ends the transfers
            for job in live:
                self._fail(job, exc)
            return
        for job in live:
            job.transfer._mark("launched")
            self._done.put((job, event))

    def _complete(self) -> None:
        """Completer: wait for each job's last copy, then notify the peer and finish the transfer.
        Jobs to the same peer whose copies have also ended by then go in the same message
        (``notify_batch``): under load one round trip serves several transfers."""
        carry = _NOTHING
        while True:
            item = self._done.get() if carry is _NOTHING else carry
            carry = _NOTHING
            if item is None:
                return
            job, event = item
            if not self._copied(job, event):
                continue
            batch = [job]
            while len(batch) < BATCH_MAX and self._batches(job):
                try:
                    nxt = self._done.get_nowait()
                except queue.Empty:
                    break
                if nxt is None or nxt[0].peer is not job.peer or (nxt[1] is not None and not nxt[1].query()):
                    carry = nxt  # handled next, in order
                    break
                if self._copied(*nxt):
                    batch.append(nxt[0])
            self._notify(batch)

    def _batches(self, job: Job) -> bool:
        return bool((job.peer.metadata.transports.get(self.kind.value) or {}).get("notify_batch"))

    def _copied(self, job: Job, event) -> bool:
        """Wait for the job's copy (False: it failed or was cancelled, and is finished)."""
        t = job.transfer
        try:
            if event is not None:
                # a queued kernel cannot be stopped: a cancelled transfer is reported once it landed
                # too. The wait spins in CUDA with the GIL released (a sleeping poll overslept by up
                # to ~80 us a copy on the GPU machine, and took the GIL from the posting thread)
                event.synchronize()
            if t.cancel_requested:
                raise t.error
            t._mark("copied")
            return True
        except BaseException as exc:  # noqa: BLE001
            self._fail(job, exc)
            return False

    def _notify(self, batch: list[Job]) -> None:
        try:
            if len(batch) == 1:
                notify_peer(batch[0], self.ctx.agent_name)
                refused = [None]
            else:
                refused = notify_peer_batch(batch, self.ctx.agent_name)
        except BaseException as exc:  # noqa: BLE001
            for job in batch:
                self._fail(job, exc)
            return
        for job, error in zip(batch, refused):
            job.transfer._mark("acked")
            if error is None:
                job.transfer._finish(TransferState.DONE)
            else:
                self._fail(job, error)

    def _fail(self, job: Job, exc: BaseException) -> None:
        if isinstance(exc, TransferTimeoutError):
            job.transfer._finish(TransferState.TIMED_OUT, exc)
        elif isinstance(exc, XferError):
            job.transfer._finish(TransferState.FAILED, exc)
        else:  # never leave a transfer hanging on a bug
            job.transfer._finish(TransferState.FAILED, TransportError(f"{self.kind.value} transport failed: {exc!r}"))

    def _bound_copy(self, job: Job):
        """The checked copy between the local region and the peer's (mapped once), per direction."""
        key = (job.peer.metadata.agent_id, job.peer_region.name, id(job.local), job.op)
        hit = self._bound.get(key)
        if hit is None or hit[0] is not job.local:
            from xfer.kernels import BoundCopy

            peer_tensors = self._peer_tensors(job)
            local, rec = job.local, job.peer_region
            if job.op is Op.WRITE:
                bound = BoundCopy(local.layout, local.tensors, rec.layout, peer_tensors)
            else:
                bound = BoundCopy(rec.layout, peer_tensors, local.layout, local.tensors)
            hit = self._bound[key] = (job.local, bound)
        return hit[1]

    def _launch(self, job: Job, merged: list[Job] | None = None):
        """Queue every chunk's copy; returns the last chunk's event (None when copies ran synchronously).
        ``merged``: jobs (``job`` first) launched as ONE copy on the job's stream (see ``_start_batch``)."""
        bound = self._bound_copy(job)
        t = job.transfer
        jobs = merged or [job]
        request = self.ctx.config.copy_path
        chosen, why = bound.select_path(request)
        for j in jobs:
            j.transfer.copy_path = chosen.value
            if self.describe_copy:
                j.transfer.path = f"{self.kind.value} (copy: {chosen.value}; {why})"
        path = chosen if chosen.value in _REQUESTABLE else request
        stream = self.stream(job)
        if merged:
            if stream is None:  # never merged (see _mergeable): host copies go in chunks
                raise TransportError(f"{self.kind.value}: a merged launch needs a stream")
            self._check_alive(job)
            local = np.concatenate([j.local_ids for j in jobs])
            peer = np.concatenate([j.peer_ids for j in jobs])
            src_ids, dst_ids = (local, peer) if job.op is Op.WRITE else (peer, local)
            for j in jobs[:-1]:
                if j.ready is not None:
                    stream.wait_event(j.ready)
            event = bound.copy(src_ids, dst_ids, stream=stream, wait_event=jobs[-1].ready, record_stream=False,
                               checked=True, path=path)
            self._track(stream, event)
            return event
        src_ids, dst_ids = (job.local_ids, job.peer_ids) if job.op is Op.WRITE else (job.peer_ids, job.local_ids)
        if stream is None:  # copies on this thread: chunks let cancel, deadline and peer death stop it
            per_chunk = max(1, self.ctx.config.chunk_bytes // max(1, job.local.layout.bytes_per_block))
        else:  # queued on a stream, a copy runs on regardless: one launch moves every block
            per_chunk = max(1, len(src_ids))
        event, ready = None, job.ready
        for start in range(0, len(src_ids), per_chunk):
            if t.cancel_requested:
                if event is not None:
                    event.synchronize()
                raise t.error
            self._check_alive(job)
            end = start + per_chunk
            # the completer holds the event (and through it every tensor) until the copy ended:
            # no record_stream per call; the agent checked the ids when the transfer was posted
            event = bound.copy(src_ids[start:end], dst_ids[start:end], stream=stream, wait_event=ready,
                               record_stream=False, checked=True, path=path)
            ready = None
        if self._merge and stream is not None:
            self._track(stream, event)
        return event

    def _track(self, stream, event) -> None:
        """Merging: remember a launch on ``stream`` until it is seen complete (under ``_order``)."""
        if event is not None:
            self._ahead.setdefault(stream, collections.deque()).append(event)
