"""Shared machinery of the one-sided transports (``local``, ``ipc``, NVSHMEM's direct path): the
initiator maps the peer's base tensors once, runs ``copy_blocks`` between them, then notifies the
peer over the control channel and completes when the peer acknowledges. The peer is never told
about blocks that were not fully written. Before any byte of a WRITE moves, the initiator asks the
peer for a grant of the transfer's blocks (the peer checks region, layout, ids and the request's
age, and holds the blocks: see :mod:`xfer.transports.completion`); a READ writes only this side's
memory and copies at once (its notice is checked against what the peer changed meanwhile).

A worker thread takes the posted jobs in order, asks for the grants of every WRITE queued to one
peer in one message, prepares their stream copies while the reply travels (the bound copy and the
peer's tensors, the path; for one kernel launch, its block ids uploaded to the device), then
launches them: queued on a CUDA stream (a launch returns at once), or run on the
host in chunks, checking between chunks for a stop (cancel, deadline) and the peer's liveness. The
control channel takes several requests in flight (xfer.control_client), so the next jobs' grant
request leaves before this batch's copies launch. The pipeline moves in turns (take the jobs queued,
ask for their grants, launch the batch granted before), each taken by the worker. A WRITE refused
at its grant releases what its preparation took; nothing of it moved. A completer thread waits for
each job's copy, then notifies the peer (several jobs to one peer in one message under load); a
lone job's caller blocked in ``wait()`` does that itself instead (xfer.transports.onesided.line).
A READ from a peer on this host ends on its own check of the peer's busy counts, without waiting
for the peer's answer to its notice (xfer.transports.onesided.readcheck). A stopped job is
fenced once its copy ended (the chunk in flight, or the kernels queued on the stream); it then ends
its grant at the peer (retried until the peer hears it) and reports the stop."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from abc import abstractmethod

import torch

from ...errors import BlocksBusyError, NotRegisteredError, PeerDisconnectedError, RevokedError, TransportError, XferError
from ...shm import pid_alive
from ...transfer import Op, TransferState
from ..base import Job, Transport
from ..chunking import blocks_per_chunk
from ..grants import read_changed
from ..completion import (ask_grants, await_grants, complete_notified, end_grants, landing_reply, landing_reply_of,
                          open_landing_lane, send_landing_notice, send_notices)
from .line import EMPTY, Line
from .mailbox import Mailbox
from .readcheck import BusyTables

__all__ = ["OneSidedTransport"]

_REQUESTABLE = ("triton", "copy_engine_batch", "copy_engine_2d")  # CopyPath values a copy may be asked for
BATCH_MAX = 32  # transfers' notices in one control message
# a burst's first grant request names this many transfers, each next one twice as many (up to
# BATCH_MAX): the first copy waits for a small grant only, and each batch's grant travels while
# the copies granted before it run (the peer checks and holds each transfer of a request in turn)
RAMP_FIRST = 2
# a landing notice's refusals by the notice's own checks, made once the slot was read: the target
# ended its grant (a WRITE's), and a second notice would only be told the grant is gone
_REFUSED_BY_CHECKS = (RevokedError, NotRegisteredError, BlocksBusyError)
_WARM_S = 0.1  # the completer's wait for a landing connection's handshake (XFER_NOTICE_EARLY)
_log = logging.getLogger("xfer")
# notices of READs that ended on their own check whose answers wait unread: past this many the
# completer takes them (their connection's server reads no further request while its replies wait)
_UNANSWERED_MAX = 32


class OneSidedTransport(Transport):
    """Subclasses say how to reach a peer region's base tensors (``map_peer``).

    Every transfer's copies go by the path ``AgentConfig.copy_path`` requests (None:
    ``settings.copy.path``, i.e. ``XFER_COPY_PATH``, else auto: see :mod:`xfer.kernels`); the path chosen is recorded on
    ``Transfer.copy_path`` and, where ``describe_copy`` is set, in ``Transfer.path`` with the
    reason (``ipc (copy: copy_engine_batch; auto (default table): 32768-byte slices d2h -> ...)``).
    """

    describe_copy = False
    # the completer waits for a copy in cudaEventSynchronize (no poll); not where a copy's stream
    # may wait on memory only this process's later work sets (NVSHMEM: with it, the two-PE
    # deadline test failed on the H200; with the poll it passed)
    spin_wait = False
    # XFER_NOTICE_EARLY unset: whether a lone WRITE's notice leaves at its copy's launch (ipc: its
    # copies launch on a stream and its peers take landing notices)
    notice_early_default = False

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        # (job, its grant request or None), posted and not taken by a turn yet (under _order; _work: one came)
        self._jobs: collections.deque = collections.deque()
        self._mapped: dict[tuple[str, str], list[torch.Tensor]] = {}  # (peer agent id, region) -> tensors
        # a local region's checked copies to and from a peer region (xfer.kernels.BoundCopy) live on
        # the local region (its state), under (this kind, peer agent id, peer region, is a write)
        self._key = self.kind.value
        self._closed = False
        self._order = threading.RLock()  # held while a stream launch runs: launches keep posting order
        self._work = threading.Condition(self._order)  # the worker waits on it for a job or the close
        self._queued = 0  # jobs handed to the worker and not launched (or ended) yet (under _order)
        self._ahead = None  # the batch whose grant requests are out, launched by the next turn
        self._cap = RAMP_FIRST  # the next batch's size: a burst starts small (see RAMP_FIRST)
        # launch_inline off (XFER_LAUNCH_INLINE=0): every launch goes through the worker thread
        self._inline = ctx.config.settings.onesided.launch_inline
        # XFER_ASK_INLINE: a lone WRITE's grant request sent by the posting thread (None: where its copy
        # launches on a stream); XFER_STAGE_IDS: a stream copy prepared while its grant request travels
        # (host copies are prepared at launch)
        self.ask_inline = ctx.config.settings.onesided.ask_inline
        self.stage_ids = ctx.config.settings.onesided.stage_ids
        # XFER_NOTICE_EARLY: a lone WRITE's notice leaves at its launch, naming a landing slot (mailbox);
        # None: where its copy launches on a CUDA stream (after the launch); on: host copies too (before it)
        early = ctx.config.settings.onesided.notice_early
        self.notices_early = self.notice_early_default if early is None else early
        self._early_host = early is True
        self._box = Mailbox() if self.notices_early else None
        # transfer id -> (slot, seq, client, pending, busy): noticed at launch; busy: the peer region's
        # counts a READ's initiator checks itself (readcheck), else None
        self._landing: dict[str, tuple] = {}
        self._tables = BusyTables()
        # READs that ended on their own check: (transfer id, peer name, client, pending, slot, until),
        # their notices' answers not taken yet (:meth:`_sweep`); under _unacked_lock
        self._unacked: collections.deque = collections.deque()
        self._unacked_lock = threading.Lock()
        self._no_landing: set[str] = set()  # agent ids of peers whose landing notices fail (then the usual notice)
        self._cold: set[str] = set()  # agent ids of peers whose landing connection the completer opens next
        self._ends: list[tuple[float, list[Job], bool]] = []  # grant ends to retry: (when, jobs of one peer, by id)
        self._ends_lock = threading.Lock()  # the worker adds to it, the completer retries
        self._grace = ctx.config.settings.fence.grace_s
        config = ctx.config  # the copy path asked for: AgentConfig's, else the settings' (XFER_COPY_PATH)
        self._copy_request = config.copy_path if config.copy_path is not None else config.settings.copy.path
        self._line = Line()  # launched jobs, in order, until finished (by the completer or their caller)
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

    def takes_grant(self, job: Job) -> bool:
        return True

    def post(self, job: Job) -> None:
        job.transfer.assist = self._assist  # a caller blocked in wait() may finish it (see line.py)
        self._queue(job)

    def _queue(self, job: Job) -> None:
        """:meth:`post`'s work: launch ``job``'s copy here or queue it for the pipeline."""
        with self._order:
            if self._closed:
                self._fail(job, TransportError(f"{self.kind.value} transport is closed"))
                return
            # a READ waits for no grant, nor a WRITE granted ahead (xfer.ahead): its stream copy is
            # launched here when nothing posted earlier waits to launch (a launch is asynchronous; a
            # hand-off to the worker costs a wake-up)
            if self._inline and (job.op is Op.READ or job.grant is not None) and self._queued == 0 and \
                    self._launches_async(job):
                t = job.transfer
                if t.cancel_requested:
                    self._fail(job, t.error)
                    return
                t.begin()
                self._start(job)
                return
            # (ask_inline) a WRITE when nothing waits before it: its grant request leaves now
            # (one send, no wait), so the worker's wake-up and the copy's preparation overlap the round trip
            lone = self._inline and self.ask_inline is not False and job.op is Op.WRITE and job.grant is None and \
                self._queued == 0 and (self.ask_inline or self._launches_async(job))
            ask = self._ask_now(job) if lone else None
            self._queued += 1
            self._jobs.append((job, ask))
            self._work.notify()

    def _ask_now(self, job: Job):
        """Send ``job``'s grant request from the posting thread where the channel takes it without
        waiting (a GrantAsk); None: the worker asks; an exception: sending failed (the worker ends it)."""
        if job.transfer.cancel_requested:
            return None
        try:
            ask = ask_grants([job], self.ctx.agent_name, self.ctx.host_id, block=False, packed=self._packs(job))
        except BaseException as exc:  # noqa: BLE001 - reported by the worker, with the grant ended by id
            return exc
        if ask is not None:
            job.transfer.mark("asked")
        return ask

    def _packs(self, job: Job) -> int:
        """The most payload bytes ``job``'s peer takes in a grant request whose block ids travel packed
        (its transport info's ``grant_packed``); 0: it takes them as JSON lists only."""
        limit = (job.peer.metadata.transports.get(self.kind.value) or {}).get("grant_packed")
        return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 0

    def _launches_async(self, job: Job) -> bool:
        """Whether the job's copy is queued on a stream (a launch returns at once) rather than run here."""
        try:
            return self.stream(job) is not None
        except Exception:  # noqa: BLE001 - the worker reports it with the transfer
            return False

    def _busy_export(self, region) -> dict:
        """What a region's export adds for READ initiators on this host: its busy counts' shared
        segment (:mod:`xfer.transports.onesided.readcheck`), where there is one."""
        grants = self.ctx.grants
        name = grants.busy_segment(region) if grants is not None else None
        return {"busy": name} if name else {}

    def _busy_of(self, job: Job):
        """The peer region's busy counts for ``job`` (a READ) to check itself, or None (then the
        peer checks its notice)."""
        export = job.peer_region.exports.get(self.kind.value) or {}
        name = export.get("busy")
        if name is None or job.peer.metadata.host_id != self.ctx.host_id:
            return None
        return self._tables.view(name, job.peer.metadata.pid, job.peer_region.layout.num_blocks)

    def disconnect(self, peer_agent_id: str) -> None:
        for key in [k for k in self._mapped if k[0] == peer_agent_id]:
            del self._mapped[key]
        mine = self._key
        for region in self.ctx.regions():
            region.state.drop(lambda k: k[0] == mine and k[1] == peer_agent_id)

    def release_region(self, region) -> None:
        mine = self._key
        region.state.drop(lambda k: k[0] == mine)

    def close(self) -> None:
        with self._order:
            if self._closed:
                return
            self._closed = True
            self._work.notify_all()
        self._worker.join(timeout=10)
        self._completer.join(timeout=10)
        with self._order:
            left, self._jobs = list(self._jobs), collections.deque()
        for job, _ in left:  # (the worker took every job before it ended: none was asked for)
            job.transfer.fail(TransportError(f"{self.kind.value} transport closed"))
        self._mapped.clear()
        self._sweep(final=True)
        for region in self.ctx.regions():
            self.release_region(region)

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
        """Worker: wait (the GIL released) for a job, or for the grant replies of the batch ahead,
        then take the pipeline's turn (:meth:`_turn`). Ends once the transport closed and every job
        ended."""
        while True:
            if self._turn(self._await_turn()):
                self._line.put(None)
                return

    def _await_turn(self) -> bool:
        """(worker, no lock held) Return once a turn may be due: a job queued with nothing ahead,
        the close, or the batch ahead's grant replies in or their bytes waiting to be read. True:
        the turn waits for the replies (a request's deadline passed: it fails them; or a peer whose
        channel takes one request at a time, sent when awaited)."""
        ahead = self._ahead
        if ahead is None:
            with self._order:
                while not self._jobs and not self._closed and self._ahead is None:
                    self._work.wait()
                ahead = self._ahead
            if ahead is None:
                return False
        for _, ask in ahead[1]:
            if isinstance(ask, BaseException):
                continue
            if ask.pending is None:
                return True
            if not ask.pending.done:
                ask.client.wait_reply(ask.pending, ask.deadline)
                return time.monotonic() >= ask.deadline  # (one wake-up: the turn looks at the others)
        return False

    def _turn(self, wait: bool) -> bool:
        """(worker) One step of the pipeline: take the jobs queued now (at most the ramp's
        batch), send each peer the grant request of their WRITEs and prepare their copies, then
        launch the batch ahead's granted copies, so the next batch's round trip overlaps this
        batch's launch and copies. ``wait`` False: nothing where the batch ahead's grant replies are
        not in yet (their bytes are on their way: the worker waits for them again).
        True once the transport closed and every job ended."""
        ahead = self._ahead
        if ahead is not None and not self._granted(ahead, wait):
            return False
        with self._order:
            if ahead is None:  # nothing granted waits to launch: a burst starts with a small batch
                self._cap = RAMP_FIRST
            items = [self._jobs.popleft() for _ in range(min(self._cap, len(self._jobs)))]
            last = self._closed and not self._jobs
        if items:
            self._cap = min(2 * self._cap, BATCH_MAX)
        batch = self._ask(items) if items else None
        if ahead is not None:
            self._go(ahead)
        self._ahead = batch
        if batch is not None:
            with self._order:  # a worker waiting for a job (it saw none ahead) now waits for these replies
                self._work.notify()
        return last and batch is None

    @staticmethod
    def _granted(batch: tuple, wait: bool) -> bool:
        """Whether every grant reply of ``batch`` is in (read now where it waits on its connection);
        ``wait``: True (the turn waits for those that are not)."""
        if wait:
            return True
        for _, ask in batch[1]:
            if isinstance(ask, BaseException):
                continue
            if ask.pending is None or not ask.client.poll_reply(ask.pending):
                return False
        return True

    def _ask(self, items: list) -> tuple:
        """Begin the jobs of ``items`` ((job, its grant request or None)), send each peer the grant
        request of its WRITEs not asked for yet (one message), and prepare the stream copies while
        the replies travel. Returns the batch for :meth:`_go`."""
        jobs, asks, by_peer, dropped = [], [], {}, set()
        for job, ask in items:
            jobs.append(job)
            t = job.transfer
            if ask is not None:  # asked when posted: its reply is awaited whatever happens next
                t.begin()
                asks.append(([job], ask))
                continue
            if t.cancel_requested:  # a stop before it started (cancel, deadline): nothing of it moves
                self._fail(job, t.error)  # (a grant issued ahead is ended)
                dropped.add(id(job))
                continue
            t.begin()
            # a READ writes only this side's memory: no grant (its notice is checked); a WRITE granted
            # ahead holds its grant already
            if job.op is not Op.READ and job.grant is None:
                by_peer.setdefault(id(job.peer), []).append(job)
        for group in by_peer.values():
            try:
                self._check_alive(group[0])
                asks.append((group, ask_grants(group, self.ctx.agent_name, self.ctx.host_id,
                                               packed=self._packs(group[0]))))
                for job in group:
                    job.transfer.mark("asked")
            except BaseException as exc:  # noqa: BLE001 - the message failed: maybe granted, its reply lost
                asks.append((group, exc))
        preps = {}
        for job in jobs:  # a stream copy's preparation while the replies travel (a host copy's at its launch:
            # on the 2-core CPU VM, preparing it early made the grant's reply come 60-90 us later)
            if id(job) not in dropped and self.stage_ids and self._launches_async(job):
                try:
                    preps[id(job)] = self._prepare(job)
                except BaseException as exc:  # noqa: BLE001 - reported once its grant is known
                    preps[id(job)] = exc
        return jobs, asks, preps, dropped

    def _go(self, batch: tuple) -> None:
        """Take the batch's grant replies, then launch the granted jobs' copies in posting order; the
        others end (their grants ended), nothing of them moved."""
        jobs, asks, preps, dropped = batch
        refused = {}
        for group, ask in asks:
            if not isinstance(ask, BaseException):
                try:
                    self._check_alive(group[0])
                    for job, error in zip(group, await_grants(ask)):
                        refused[id(job)] = error
                        if error is None:
                            job.transfer.mark("granted")
                    continue
                except BaseException as exc:  # noqa: BLE001 - the message failed: maybe granted, its reply lost
                    ask = exc
            self._end_later(group, by_id=True)
            for job in group:
                refused[id(job)] = ask
        for job in jobs:  # in posting order; a stream launch under _order, as a posting thread's
            prep = preps.get(id(job))
            error = refused.get(id(job))
            if id(job) in dropped:
                pass
            elif error is not None or isinstance(prep, BaseException):
                _release(prep)
                self._fail(job, error if error is not None else prep)
            elif self._launches_async(job):
                with self._order:
                    self._start(job, prep)
                    self._queued -= 1
                continue
            else:
                self._start(job, prep)  # a host copy may take long: posts queue behind it, not waiting on it
            with self._order:
                self._queued -= 1

    def _start(self, job: Job, prep=None) -> None:
        """Launch the job's copies and hand it to the completer (a lone WRITE's notice may leave
        now: :meth:`_early`; before a host copy, after a stream copy's launch)."""
        job.started = time.monotonic()
        job.transfer.mark("started")
        early = self._early(job) if self._early_host and not self._launches_async(job) else None
        try:
            event = self._launch(job, prep)
            job.transfer.mark("launched")
            if early is None and event is not None and self._box is not None:
                early = self._early(job)
            if early is not None:
                self._landing[job.transfer.id] = early
            self._line.put((job, event))
            if self._unacked:  # the answers to earlier READs' notices, while this copy runs
                self._sweep()
        except BaseException as exc:  # noqa: BLE001 - every failure ends the transfer (its copy ended)
            _release(prep)
            if early is not None:  # the peer waits for its slot: told the copy stopped short first
                self._answered(job, early, landed=False)
            self._fail(job, exc)

    def _early(self, job: Job):
        """Send a lone granted WRITE's or a lone READ's notice now, naming a landing slot, so that
        it travels while the copy runs (XFER_NOTICE_EARLY): (slot, seq, client, pending), or None:
        the notice goes once the copy ended, as any other (the peer does not take landing notices,
        every slot is taken, the channel is busy, or other transfers wait for the completer). A
        READ's notice is checked (nothing it read was written or revoked since its copy began) when
        the peer reads the slot, after the copy ended, as the usual notice is when it comes."""
        if not (job.op is Op.READ or (job.op is Op.WRITE and job.grant is not None)) or not self._line.empty() or \
                not (job.peer.metadata.transports.get(self.kind.value) or {}).get("landing") or \
                job.peer.metadata.agent_id in self._no_landing:
            return None
        if self._unacked:
            self._sweep()
        got = self._box.take()
        if got is None:
            return None
        slot, seq = got
        busy = self._busy_of(job) if job.op is Op.READ else None
        landing = {"box": self._box.name, "slot": slot, "seq": seq}
        if busy is not None:
            landing["reader_checks"] = True
        try:
            sent = send_landing_notice(job, self.ctx.agent_name, self.ctx.host_id, self._grace, landing)
        except BaseException:  # noqa: BLE001 - not sent: the notice goes after the copy
            sent = None
        if sent is None:
            self._box.give(slot)
            self._cold.add(job.peer.metadata.agent_id)  # its landing connection opens after this transfer
            return None
        job.transfer.mark("noticed")
        return (slot, seq, *sent, busy)

    def _answered(self, job: Job, early: tuple, landed: bool) -> BaseException | None:
        """Write the job's landing slot (every byte landed, or the copy stopped short), then take the
        peer's answer to its notice: None where it delivered, else what it refused."""
        slot, seq, client, pending, _ = early
        self._box.land(slot, seq, landed)
        try:
            landing_reply(job, client, pending, self._grace)
            return None
        except BaseException as exc:  # noqa: BLE001 - reported with the transfer
            return exc
        finally:
            self._box.give(slot)

    def _land(self, job: Job, event, early: tuple) -> None:
        """Completer: a job whose notice left at its launch: once its copy ended, write its slot and
        end the transfer with the peer's answer (a stop: the slot says so, the peer ends the grant)."""
        try:
            self._wait_copy(job, event)
        except BaseException as exc:  # noqa: BLE001 - the copy ended short: nothing is delivered
            _settled(event)
            self._answered(job, early, landed=False)
            self._fail(job, exc)
            if not isinstance(exc, Exception):
                raise  # (an interrupt in a waiting caller's thread: it reaches the caller)
            return
        if early[4] is not None:  # a READ checked here: it ends now, its notice's answer is taken later
            self._end_read(job, early)
            return
        refused = self._answered(job, early, landed=True)
        if refused is None:
            job.transfer.mark("acked")
            job.transfer.complete()
            return
        if isinstance(refused, _REFUSED_BY_CHECKS):  # its own checks refused it (revoked, written; a grant
            job.transfer.mark("acked")  # ended): the usual notice would be refused the same way
            job.transfer.fail(refused)
            self._line.wake()
            return
        # refused otherwise (a peer that cannot map the slot's segment, e.g. no common /dev/shm; late;
        # the reply lost): the notice again, the usual way, now that the copy ended; its checks decide
        complete_notified([job], self.ctx.agent_name, self.ctx.host_id, self._grace, self._end_later)
        if job.transfer.poll() is TransferState.DONE:  # the slot is what failed: no more of them to this peer
            self._no_landing.add(job.peer.metadata.agent_id)

    def _end_read(self, job: Job, early: tuple) -> None:
        """A lone READ whose copy ended, checked against the peer's busy counts here (readcheck):
        refused as the peer would refuse its notice (the slot then says it stopped short: nothing
        delivered), else DONE now, the slot written for the peer to deliver its notice."""
        t = job.transfer
        refused = self._own_check(job, early[4])
        if refused is None:
            slot, seq, client, pending, _ = early
            self._box.land(slot, seq, True)
            self._unanswered((t.id, job.peer.name, client, pending, slot, t.deadline + self._grace))
            t.complete()
            return
        self._answered(job, early, landed=False)
        t.fail(refused)
        self._line.wake()

    def _own_check(self, job: Job, busy) -> BaseException | None:
        """(a READ whose copy ended) Why it may not end DONE, from the peer's busy counts ``busy``
        (the peer's own check: ``grants.read_changed``) and the peer's liveness; None: it may."""
        t = job.transfer
        writes, written, revoked = busy
        changed = read_changed(writes, written, revoked, job.peer_ids, job.started)
        t.mark("checked")
        if changed is not None:
            cls, why = changed
            return cls(f"READ {t.id} from {job.peer.name!r}: {why}; its bytes may be mixed, none is reported "
                       f"complete")
        try:
            self._check_alive(job)  # (a peer gone mid-copy: its memory may have gone with it)
        except PeerDisconnectedError as exc:
            return exc
        return None

    def _checked_reads(self, jobs: list[Job]) -> list[Job]:
        """End the READs of ``jobs`` (one peer, copies ended) that can check themselves against the
        peer's busy counts: refused, or DONE with their notices sent in one message whose answer is
        taken later (:meth:`_sweep`). Returns the others, for the usual notices."""
        rest, ok = [], []
        for job in jobs:
            busy = self._busy_of(job) if job.op is Op.READ and job.started is not None else None
            if busy is None:
                rest.append(job)
                continue
            refused = self._own_check(job, busy)
            if refused is None:
                ok.append(job)
            else:  # no notice: nothing of it is delivered (a READ holds no grant)
                job.transfer.fail(refused)
        if ok:
            try:
                sent = send_notices(ok, self.ctx.agent_name, self.ctx.host_id, self._grace)
            except XferError as exc:  # the bytes are checked whole here; the peer is not told
                sent = None
                _log.warning("the notices of %d READ(s) (ended DONE on their own check) were not delivered by "
                             "%r: %s", len(ok), ok[0].peer.name, exc)
            if sent is not None:
                until = min(j.transfer.deadline for j in ok) + self._grace
                self._unanswered((",".join(j.transfer.id for j in ok), ok[0].peer.name, *sent, None, until))
            for job in ok:
                job.transfer.complete()
        return rest

    def _unanswered(self, item: tuple) -> None:
        """Keep a notice whose answer is taken later (:meth:`_sweep`: by the next launch, the next
        landing notice, or the completer, which is woken once :data:`_UNANSWERED_MAX` wait)."""
        with self._unacked_lock:
            self._unacked.append(item)
            many = len(self._unacked) >= _UNANSWERED_MAX
        if many:
            self._line.kick()

    def _sweep(self, final: bool = False) -> None:
        """Take the answers that came to the notices of READs that ended on their own check (never
        waiting; ``final``: the transport closes, the rest are given up) and give their landing
        slots back. A refusal there (the peer deregistered the region meanwhile, or the notice came
        late) is logged: the READ's bytes were checked whole, the peer was not told."""
        with self._unacked_lock:
            items, self._unacked = list(self._unacked), collections.deque()
        keep = []
        now = time.monotonic()
        for item in items:
            tid, peer, client, pending, slot, until = item
            try:
                if client.poll_reply(pending):
                    landing_reply_of(pending, peer)
                elif not final and now <= until:
                    keep.append(item)
                    continue
                else:  # no answer in time (or the transport closes): given up, the slot is free again
                    try:
                        client.result(pending, now)
                    except XferError:
                        pass
                    _log.info("no answer from %r to the notice of READ %s (ended DONE on its own check)", peer, tid)
            except XferError as exc:
                _log.warning("the notice of READ %s (ended DONE on its own check) was not delivered by %r: %s",
                             tid, peer, exc)
            except Exception as exc:  # noqa: BLE001 - never the completer's end
                _log.warning("the answer to the notice of READ %s could not be read: %r", tid, exc)
            if slot is not None:
                self._box.give(slot)
        if keep:
            with self._unacked_lock:
                self._unacked.extendleft(reversed(keep))

    def _complete(self) -> None:
        """Completer: wait for each job's last copy, then notify the peer and finish the transfer,
        in launch order. Jobs to the same peer whose copies have also ended by then go in the same
        message (``notify_batch``): under load one round trip serves several transfers. A job its
        caller waits for is left to that caller (:meth:`_assist`)."""
        while True:
            item = self._line.take(timeout=0.25 if self._ends or self._unacked else None)
            if self._unacked:
                self._sweep()
            if item is EMPTY:
                late = self._line.overdue()
                if late is not None:  # a caller finishing it waits for its peer: its stop begins now
                    late.poll()
                self._retry_ends()
                continue
            if item is None:
                self._line.close()
                self._retry_ends(final=True)
                return
            try:
                self._finish_item(*item, batch=True)
            finally:
                self._line.finished()
            if self._ends:
                self._retry_ends()

    def _assist(self, transfer) -> None:
        """A caller blocked in ``transfer.wait()``: finish its job in the caller's thread once it is
        alone in the line (see xfer.transports.onesided.line); the caller waits for that until the
        transfer's deadline at most, and the completer finishes whatever the caller did not take."""
        if self._closed:
            return
        item = self._line.claim(transfer, transfer.deadline)
        if item is None:
            return
        try:
            self._finish_item(*item)
        finally:
            self._line.finished()
            if transfer.finished is None:  # an exception in the caller's thread (an interrupt): never left
                _settled(item[1])  # hanging, nor reported ended while its kernel may still write;
                self._end_later([item[0]])  # its grant, if any, is ended by the completer
                transfer.fail(TransportError(f"transfer {transfer.id} was interrupted while its caller finished it"))

    def _finish_item(self, job: Job, event, batch: bool = False) -> None:
        """Wait for ``job``'s copy, then notify its peer (``batch``: with the next jobs to that peer
        whose copies ended too) and end its transfer; or end it with the copy's failure."""
        early = self._landing.pop(job.transfer.id, None)
        if early is not None:  # its notice left at the launch: the peer waits for its slot
            self._land(job, event, early)
            return
        if not self._copied(job, event):
            return
        jobs = [job]
        while batch and len(jobs) < BATCH_MAX and self._batches(job):
            nxt = self._line.take_next(job.peer)
            if nxt is None:
                break
            if self._copied(*nxt):
                jobs.append(nxt[0])
        jobs = self._checked_reads(jobs)
        if jobs:
            complete_notified(jobs, self.ctx.agent_name, self.ctx.host_id, self._grace, self._end_later)
        if self._cold:
            self._warm(job)

    def _warm(self, job: Job) -> None:
        """Completer: open the landing connection of ``job``'s peer, which a lone WRITE found closed
        (never opened, or closed as idle), once that WRITE ended: the next lone one's notice may go
        at its launch."""
        peer_id = job.peer.metadata.agent_id
        if peer_id in self._cold:
            self._cold.discard(peer_id)
            # briefly: a peer on this host shakes hands in ~1 ms; one that does not is tried again later,
            # not waited for (the completer serves every other transfer)
            open_landing_lane(job.peer, time.monotonic() + min(_WARM_S, self.ctx.config.connect_timeout_s))

    def _batches(self, job: Job) -> bool:
        return bool((job.peer.metadata.transports.get(self.kind.value) or {}).get("notify_batch"))

    def _copied(self, job: Job, event) -> bool:
        """Wait for the job's copy (False: it failed or was cancelled, and is finished)."""
        try:
            self._wait_copy(job, event)
            return True
        except BaseException as exc:  # noqa: BLE001
            _settled(event)  # (an interrupt of the wait: the kernel runs on, and may still write)
            self._fail(job, exc)
            if not isinstance(exc, Exception):
                raise  # (an interrupt in a waiting caller's thread: it reaches the caller)
            return False

    def _wait_copy(self, job: Job, event) -> None:
        """Return once the job's copy ended whole; raise (once it ended) when it was stopped."""
        t = job.transfer
        if event is not None and self.spin_wait:
            # a queued kernel cannot be stopped: a cancelled transfer is reported once it landed
            # too. The wait spins in CUDA with the GIL released (a sleeping poll oversleeps by
            # up to ~80 us a copy on the GPU machine, and takes the GIL from the posting thread)
            event.synchronize()
        elif event is not None:
            while not event.query():
                if t.cancel_requested:
                    event.synchronize()  # the kernel may still write; let it land before reporting
                    raise t.error
                time.sleep(20e-6)
        if t.cancel_requested:
            raise t.error
        t.mark("copied")

    def _fail(self, job: Job, exc: BaseException) -> None:
        """End ``job`` with ``exc`` once its copy ended (the caller's promise): its grant first, so
        the peer's blocks are free for the next writer when the transfer reads ended."""
        if not isinstance(exc, XferError):  # never leave a transfer hanging on a bug
            exc = TransportError(f"{self.kind.value} transport failed: {exc!r}")
        if job.grant is not None:
            try:
                end_grants([job], self.ctx.agent_name, time.monotonic() + self._grace)
            except BaseException:  # noqa: BLE001 - retried until the peer hears it
                self._end_later([job])
        job.transfer.fail(exc)
        self._line.wake()  # a caller waiting to finish it stops waiting

    def _end_later(self, jobs: list[Job], by_id: bool = False) -> None:
        """Grants of ``jobs`` (one peer) to end by a later message (the last one failed)."""
        if by_id or any(j.grant is not None for j in jobs):
            with self._ends_lock:
                self._ends.append((time.monotonic() + 0.2, jobs, by_id))
            self._line.kick()  # the completer retries them (it may be waiting for the line alone)

    def _retry_ends(self, final: bool = False) -> None:
        """Send the grant ends that are due (at close: once more, whatever the outcome)."""
        with self._ends_lock:
            due, self._ends = self._ends, []
        now, keep = time.monotonic(), []
        for when, jobs, by_id in due:
            if when > now and not final:
                keep.append((when, jobs, by_id))
                continue
            try:
                end_grants(jobs, self.ctx.agent_name, time.monotonic() + self._grace, by_id)
            except BaseException:  # noqa: BLE001 - the peer is frozen or gone: later (a dead one's holds end)
                if not final and not self._gone(jobs[0]):
                    keep.append((now + 0.5, jobs, by_id))
        with self._ends_lock:
            self._ends += keep

    def _gone(self, job: Job) -> bool:
        try:
            self._check_alive(job)
            return False
        except PeerDisconnectedError:
            return True

    def _bound_copy(self, job: Job):
        """The checked copy between the local region and the peer's (mapped once), per direction."""
        write = job.op is Op.WRITE
        return job.local.state.get((self._key, job.peer.metadata.agent_id, job.peer_region.name, write),
                                   lambda: self._bind(job, write))

    def _bind(self, job: Job, write: bool):
        from xfer.kernels import BoundCopy

        peer_tensors = self._peer_tensors(job)
        local, rec = job.local, job.peer_region
        if write:
            return BoundCopy(local.layout, local.tensors, rec.layout, peer_tensors)
        return BoundCopy(rec.layout, peer_tensors, local.layout, local.tensors)

    def _prepare(self, job: Job) -> "_Prep":
        """What a job's copy needs besides the peer's permission: the bound copy (the peer's
        tensors mapped once), the path, the stream, the chunking; for one stream launch of the
        kernel, its block ids already uploaded to the device (on the copy's stream), so the launch
        after the grant is only the kernel's. Writes nothing of either side's blocks."""
        bound = self._bound_copy(job)
        t = job.transfer
        src_ids, dst_ids = (job.local_ids, job.peer_ids) if job.op is Op.WRITE else (job.peer_ids, job.local_ids)
        request = self._copy_request
        chosen, why = bound.select_path(request)
        t.copy_path = chosen.value
        if self.describe_copy:
            t.path = f"{self.kind.value} (copy: {chosen.value}; {why})"
        stream = self.stream(job)
        if stream is None:  # copies on this thread: chunks let cancel, deadline and peer death stop it
            per_chunk = blocks_per_chunk(len(src_ids), job.local.layout.bytes_per_block, self.ctx.config.chunk_bytes)
        else:  # queued on a stream, a copy runs on regardless: one launch moves every block
            per_chunk = max(1, len(src_ids))
        prep = _Prep(bound, src_ids, dst_ids, chosen if chosen.value in _REQUESTABLE else request, stream, per_chunk)
        if stream is not None and len(src_ids) and chosen.value == "triton" and self.stage_ids:
            prep.staged = bound.stage(prep.src_ids, prep.dst_ids, stream)
        return prep

    def _launch(self, job: Job, prep: "_Prep | None" = None):
        """Queue every chunk's copy; returns the last chunk's event (None when copies ran synchronously)."""
        if prep is None:
            prep = self._prepare(job)
        t = job.transfer
        bound, src_ids, dst_ids, stream, per_chunk = prep.bound, prep.src_ids, prep.dst_ids, prep.stream, prep.per_chunk
        event, ready = None, job.ready
        for start in range(0, len(src_ids), per_chunk):
            if t.cancel_requested:
                if event is not None:
                    event.synchronize()
                raise t.error
            self._check_alive(job)
            if prep.staged is not None:  # one launch, its ids on the device already
                event, prep.staged = bound.launch_staged(prep.staged, ready), None
                break
            end = start + per_chunk
            # the completer holds the event (and through it every tensor) until the copy ended:
            # no record_stream per call; the agent checked the ids when the transfer was posted
            event = bound.copy(src_ids[start:end], dst_ids[start:end], stream=stream, wait_event=ready,
                               record_stream=False, checked=True, path=prep.path)
            ready = None
        return event


class _Prep:
    """A job's copy, prepared (:meth:`OneSidedTransport._prepare`); ``staged``: the ids of its one
    stream launch on the device (``BoundCopy.stage``), until launched or released."""

    __slots__ = ("bound", "src_ids", "dst_ids", "path", "stream", "per_chunk", "staged")

    def __init__(self, bound, src_ids, dst_ids, path, stream, per_chunk):
        self.bound, self.src_ids, self.dst_ids, self.path = bound, src_ids, dst_ids, path
        self.stream, self.per_chunk, self.staged = stream, per_chunk, None


def _settled(event) -> None:
    """Return once a queued copy (its CUDA event; None: nothing queued) ended, whatever interrupts
    the wait: a kernel cannot be stopped, and a transfer is never reported ended while it may still
    write. A CUDA error ends the wait (the context then runs nothing more)."""
    while event is not None:
        try:
            event.synchronize()
            return
        except KeyboardInterrupt:
            continue
        except Exception:  # noqa: BLE001
            return


def _release(prep) -> None:
    """Give back what a prepared copy that will not launch holds (its staged ids; see
    ``BoundCopy.unstage``). Once only; a failed preparation (an exception) or None holds nothing."""
    staged = getattr(prep, "staged", None)
    if staged is None:
        return
    prep.staged = None
    prep.bound.unstage(staged)
