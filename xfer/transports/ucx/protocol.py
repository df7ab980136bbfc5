"""The UCX transport's control protocol, run on the engine thread: the REQ / REFUSE / ACK / FIN /
CANCEL / STOPPED messages (see wire); connecting, accepting and the hello are handshake.py's.

Every control message is checked before it is received and before it is decoded: its size from
the probe (at most ``max_ctrl_bytes``, and only a PROOF before the peer proved the key: bigger
ones are drained unreceived), then its MAC and sequence number against its connection's session
(wire.open_message). A message that fails them may be anyone's (UCX does not say which endpoint
it came on; its tag names a connection): it is dropped and logged, and its connection lives on.
A connection is failed only for what its authenticated peer (a MAC made with the secret's key)
sent wrong; every failure and drop is logged with its reason.

A stop (tables.Flows): the initiator sends CANCEL(init) and the target answers STOPPED once its
side settled (or its own CANCEL, REFUSE or ACK crossed it). The target checks a REQ before any
byte lands (incoming.check_request, its ttl and send time: incoming.check_ttl / local_deadline)
and holds its blocks (grants: a transfer into blocks an unfenced one holds is refused); it
delivers nothing past its deadline (earlier than the initiator's) or of a revoked hold."""

from __future__ import annotations

import time

import numpy as np

from ... import error_codec
from ...errors import (AuthenticationError, InvalidArgumentError, LayoutMismatchError, PeerDisconnectedError,
                       RevokedError, TransferCancelledError, TransferTimeoutError, XferError)
from .handshake import Gate
from ...layout import KVLayout
from ...transfer import Notification, Op
from . import wire
from .conn import Conn
from .flow import Flow, in_place, peer_in_place
from ..chunking import chunk_list, plan_chunks
from ..completion import end_grants_soon
from ..incoming import check_request, check_ttl, local_deadline
from .staging import BlockCopier

__all__ = ["Protocol"]

CTRL_QUEUE = 64  # control messages of one connection landing at once (more are drained and logged)


class Protocol:
    """The control messages of one engine; it reads and changes the engine's tables only through
    their methods (``engine.conns``, ``engine.flows``, ``engine.slots``, ``engine.data``)."""

    def __init__(self, engine):
        self.e = engine
        self.ctx = engine.ctx
        self.gate = Gate(engine, self)
        self.rejections = self.gate.rejections

    # ---- connections (handshake.py) ----------------------------------------------------------
    def connect(self, md) -> Conn:
        return self.gate.connect(md)

    def accept(self, conn_request) -> None:
        self.gate.accept(conn_request)

    def close(self) -> None:
        self.e.conns.fail_all(PeerDisconnectedError("transport closed"))

    # ---- control messages --------------------------------------------------------------------
    def send_ctrl(self, conn: Conn, kind: wire.Kind, header: dict, ids=None, payload: bytes = b"") -> None:
        if conn.ready:
            self._send(conn, self._encode(conn, kind, header, ids, payload))
        else:  # encoded once the hello round is over: a REQ's send time is when it leaves
            conn.waiting.append((kind, header, ids, payload))

    def send_waiting(self, conn: Conn, msg: tuple) -> None:
        """A message that waited for the hello round (after our PROOF)."""
        if msg[0] is wire.Kind.REQ:
            flow = self.e.flows.initiator(msg[1].get("k"))
            if flow is not None:
                flow.requested = True
        self._send(conn, self._encode(conn, *msg))

    def _encode(self, conn: Conn, kind: wire.Kind, header: dict, ids, payload: bytes) -> np.ndarray:
        if kind is wire.Kind.REQ:  # time left and send time as it leaves (the target judges how long it
            now = time.monotonic()  # waited: Conn.req_delay); the deadline itself means nothing there
            header["ttl"], header["sent"] = max(header.pop("deadline") - now, 0.0), now
        return wire.encode(kind, header, ids, payload, conn.session)

    def _send(self, conn: Conn, msg: np.ndarray) -> None:
        def sent(err, msg=msg):  # holds ``msg`` until UCX is done with it
            if err is not None:
                self.e.conns.fail(conn, PeerDisconnectedError(f"control message to {conn.name!r} failed: {err}"))
        self.e.data.send(conn, msg, wire.ctrl_tag(conn.remote_id), sent)

    def on_ctrl_probe(self, conn_id: int, probe) -> None:
        """A probed control message (the engine's probe takes every message): queued on its
        connection, received once its size passed (``pump``) and handled in arrival order."""
        conn = self.e.conns.get(conn_id)
        if conn is None or conn.dead:
            return self.e.data.drain(probe, "unknown", f"a {probe.length}-byte control message for connection "
                                                       f"{conn_id}, which is not open here")
        if len(conn.ctrl_in) >= CTRL_QUEUE:
            return self.e.data.drain(probe, "queue", f"a control message on connection {conn_id} "
                                                     f"({conn.name or '?'} at {conn.address or '?'}): {CTRL_QUEUE} "
                                                     f"already waiting")
        conn.ctrl_in.append([probe, None, False, None])  # probe, buffer once received, landed, error
        self.pump(conn)

    def pump(self, conn: Conn) -> None:
        """Receive and handle ``conn``'s queued control messages in order, as far as they may go: none
        before its hello arrived (no session yet), only the first (its PROOF) before that verified;
        each one's size checked from its probe before a buffer exists (oversized: drained)."""
        if conn.pumping:  # a receive that completed at once calls back in here: the loop below goes on
            return
        conn.pumping = True
        try:
            queue, moved = conn.ctrl_in, True
            while moved and not conn.dead:
                moved = False
                while queue and queue[0][2]:
                    _, buf, _, err = queue.popleft()
                    if err is None:
                        self._on_ctrl(conn, buf)
                    moved = True
                for i, entry in enumerate(queue):
                    if conn.session is None or (not conn.authed and i > 0):
                        break
                    if entry[1] is not None:
                        continue
                    probe = entry[0]
                    limit = self.e.settings.max_ctrl_bytes if conn.authed else wire.PREFIX_BYTES
                    if not wire.PREFIX_BYTES <= probe.length <= limit:
                        del queue[i]
                        self.e.data.drain(probe, "size", f"a {probe.length}-byte control message from "
                                          f"{conn.name or '?'} at {conn.address or '?'}: over {limit} bytes ("
                                          + ("max_ctrl_bytes)" if conn.authed else "before its PROOF only the "
                                                                                    "PROOF is taken)"))
                    else:
                        entry[1] = np.empty(probe.length, dtype=np.uint8)
                        self.e.data.recv_now(entry[1], probe, lambda err, e=entry: self._landed(conn, e, err))
                    moved = True
                    break
        finally:
            conn.pumping = False

    def _landed(self, conn: Conn, entry: list, err) -> None:
        entry[2], entry[3] = True, err
        self.pump(conn)

    def _on_ctrl(self, conn: Conn, buf: np.ndarray) -> None:
        try:
            kind, header, binary = wire.open_message(buf, conn.session)
        except AuthenticationError as exc:  # anyone's: dropped, the connection lives on
            self.rejections("forged", "dropped a control message on connection %d (%s at %s): %s", conn.local_id,
                            conn.name or "?", conn.address or "?", exc)
            return
        except XferError as exc:  # MAC'd (by the secret's key: the peer itself) or no secret at all
            return self._malformed(conn, str(exc))
        if not conn.authed:
            if kind is wire.Kind.PROOF:
                conn.authed = True
            else:
                self.rejections("unauthenticated", "dropped a %s from %r at %s before its PROOF", kind.name,
                                conn.name or "?", conn.address or "?")
            return
        try:
            self._dispatch(conn, kind, header, binary)
        except Exception as exc:  # noqa: BLE001 - whatever a message makes happen, the engine goes on
            self._malformed(conn, f"{kind.name} failed here: {exc!r}"[:300])

    def _malformed(self, conn: Conn, why: str) -> None:
        """A message that passed its MAC but not its checks: from the peer itself when the key is the
        secret's (its connection is failed), from anyone without a secret (dropped)."""
        if conn.keyed:
            self.gate.fail(conn, "malformed", f"it sent a bad control message: {why}")
        else:
            self.rejections("malformed", "dropped a bad control message from %r at %s: %s", conn.name or "?",
                            conn.address or "?", why)

    def _dispatch(self, conn: Conn, kind: wire.Kind, header: dict, binary: bytes) -> None:
        if kind is wire.Kind.PROOF:
            return  # a second one: nothing to do
        if kind is wire.Kind.REQ:
            return self._on_req(conn, header, binary)
        if kind is wire.Kind.FIN:
            return self._on_fin(conn, header)
        init_side = kind in (wire.Kind.REFUSE, wire.Kind.ACK, wire.Kind.STOPPED) or \
            (kind is wire.Kind.CANCEL and not header.get("init"))
        flow = self.e.flows.initiator(header.get("k")) if init_side else self.e.flows.target(conn.local_id, header.get("k"))
        if flow is None or flow.dead or flow.conn is not conn:
            if kind is wire.Kind.ACK:  # the peer delivered a transfer we already ended: say so
                self.ctx.log.warning("ucx: peer %r acknowledged transfer k=%s after it had ended here; the peer "
                                     "may hold and have been notified of blocks reported failed", conn.name,
                                     header.get("k"))
            elif kind is wire.Kind.CANCEL:  # the initiator stops a transfer this side no longer runs
                self.e.flows.confirm_stopped(conn, header.get("k"))
            return  # late message of a dropped transfer
        if kind is wire.Kind.REFUSE:
            self.e.flows.fail(flow, error_codec.decode(header.get("error"), header.get("message"),
                                                 f"peer {conn.name!r} refused transfer {flow.tid}"), notify_peer=False)
        elif kind is wire.Kind.ACK:  # every byte landed and the peer delivered: DONE, a stop under way or not
            self.e.flows.drop(flow)
            flow.transfer.complete()
        elif kind is wire.Kind.STOPPED:
            if flow.stopping is not None:
                flow.peer_fenced = True
                self.e.flows.check_stopped(flow)
        elif kind is wire.Kind.CANCEL:
            why = header.get("why")  # the peer's reason, by name: its deadline, its caller's cancel or its
            cls = error_codec.error_class(why)  # revocation stand, anything else is the peer dropping it
            if not issubclass(cls, (TransferTimeoutError, TransferCancelledError, RevokedError)):
                cls = PeerDisconnectedError
            who = "initiator" if header.get("init") else "target"
            flow.confirm = bool(header.get("init"))  # the initiator waits for this side's STOPPED
            self.e.flows.fail(flow, cls(f"the {who} {conn.name!r} dropped transfer {flow.tid or flow.key} ({why}); no "
                                  f"block is reported complete"), notify_peer=False)

    # ---- initiator ---------------------------------------------------------------------------
    def start(self, job) -> None:
        t = job.transfer
        if t.cancel_requested:  # a stop before it started (cancel, deadline): nothing of it moves
            end_grants_soon(job, self.ctx.agent_name)  # (a grant issued ahead: its target hears it)
            t.fail(t.error)
            return
        t.mark("started")  # the engine thread took the posted job
        try:
            conn = self.connect(job.peer.metadata)
            copier, pool = self._copier(job.local), self.e.slots.pool(self._pool_kind(job.local))
            sender = job.local.layout if job.op is Op.WRITE else job.peer_region.layout
            n = int(job.local_ids.size)
            peer_slot, peer_device = self._peer_slot(job.peer.metadata, job.peer_region)
            moves_in_place = in_place(self.e, job.op is Op.WRITE, copier, pool, sender) or peer_in_place(
                job.peer.metadata.transports.get("ucx") or {}, job.peer_region, job.op is Op.READ, sender)
            st = self.e.settings  # cut into about min_chunks chunks so gather, wire and scatter overlap
            if pool.kind.startswith("cuda") and peer_device:
                min_chunks = st.min_chunks_device
            else:
                min_chunks = st.min_chunks_in_place if moves_in_place else st.min_chunks
            bpc, lpc = plan_chunks(job.local.layout, n, min(pool.nbytes, peer_slot), min_chunks, st.min_chunk_bytes)
            chunks = chunk_list(job.local.layout, n, bpc, lpc)
            if 8 * n + len(job.notify) + 4096 > st.max_ctrl_bytes:  # 4 KiB: the header, its layout included
                raise InvalidArgumentError(f"a UCX request for {n} blocks with a {len(job.notify)}-byte notification "
                                           f"would exceed max_ctrl_bytes={st.max_ctrl_bytes} (XFER_UCX_MAX_CTRL_BYTES)"
                                           f": split the transfer")
        except XferError as exc:
            end_grants_soon(job, self.ctx.agent_name)
            t.fail(exc)
            return
        flow = Flow(self.e, key=self.e.flows.new_key(), initiator=True, op=job.op, conn=conn, deadline=t.deadline,
                    copier=copier, ids=job.local_ids, sender_layout=sender, chunks=chunks, pool=pool, transfer=t,
                    tid=t.id, region=job.peer_region.name, notify=job.notify, peer_name=job.peer.name)
        flow.ready = job.ready
        md = job.peer.metadata
        flow.peer_pid = md.pid if md.host_id == self.ctx.host_id else None
        flow.xid = conn.xid = wire.next_xid(conn.xid)  # names the transfer's chunks, either way
        t.path = self.describe(job.local, copier, pool, flow.iov, flow.iov_rx)
        t.begin(on_cancel=lambda _t: self.e.call_soon(self._cancelled, flow))
        self.e.flows.add(flow)
        header = {"k": flow.key, "op": job.op.value, "region": job.peer_region.name, "n": n, "bpc": bpc, "lpc": lpc,
                  "xid": flow.xid, "deadline": t.deadline, "tid": t.id,
                  "from": self.ctx.agent_name, "order": sender.inner_order}
        lid = conn.layout_ids.get(job.local.layout)
        if lid is None:  # described once per connection (REQs are handled in order), then named
            lid = conn.layout_ids[job.local.layout] = len(conn.layout_ids) + 1
            header["layout"] = job.local.layout.to_dict()
        header["lid"] = lid
        if job.grant is not None:  # issued ahead: the target ends it as it takes this transfer's hold
            header["grant"] = job.grant
        self.send_ctrl(conn, wire.Kind.REQ, header, job.peer_ids, job.notify)
        flow.requested = conn.ready
        t.mark("requested")
        self.e.slots.want(flow)  # a WRITE sends right behind its REQ (the target holds early chunks)

    def _cancelled(self, flow: Flow) -> None:
        """The transfer's stop began (cancel, deadline, agent closing): stop its flow."""
        if not flow.dead:
            self.e.flows.stop(flow, flow.transfer.error)

    def _revoked(self, flow: Flow) -> None:
        """This side revoked the blocks of an incoming transfer (Agent.revoke): drop it, tell the
        initiator once it settled (the revocation returns when its hold ends)."""
        if not flow.dead:
            self.e.flows.fail(flow, RevokedError(f"agent {self.ctx.agent_name!r} revoked the blocks of transfer "
                                                 f"{flow.tid}"))

    # ---- target ------------------------------------------------------------------------------
    def _on_req(self, conn: Conn, h: dict, binary: bytes) -> None:
        key, xid = h.get("k"), h.get("xid")
        fresh = isinstance(xid, int) and 0 < xid < wire.XID_MOD and xid & 0xFFFF and wire.xid_after(xid, conn.xid)
        if fresh:
            conn.xid = xid  # chunks of this xid and older ones no longer wait for a REQ
        now = time.monotonic()
        try:
            theirs = self._their_layout(conn, h)  # first: later REQs name it even when this one is refused
            if not fresh:
                raise InvalidArgumentError(f"transfer id {xid!r} is not a new one on this connection")
            # what is left of the initiator's deadline: its ttl, less how long this REQ waited beyond
            # the connection's usual delay (this process stopped, a congested link): a REQ that
            # waited past its deadline is refused before any byte lands, whatever its CANCEL's fate
            what = f"transfer {h.get('tid')} from {h.get('from')!r}"
            check_ttl(h.get("ttl"), h.get("sent"), what=what)  # NaN, inf: refused (a NaN never expires)
            deadline = local_deadline(h["ttl"], conn.req_delay(float(h["sent"]), now), now, what=what)
            op = Op(h.get("op"))
            ids, notify = wire.split_ids(binary, int(h.get("n", -1)))
            region, ids = check_request(self.ctx.region, region=h.get("region"), op=op, ids=ids,
                                        what="requested block ids", agent=f"agent {self.ctx.agent_name!r}",
                                        initiator=h.get("from"), sender_layout=theirs,
                                        order=h.get("order") if op is Op.READ else None)
            chunks = chunk_list(region.layout, ids.size, int(h["bpc"]), int(h["lpc"]))
            biggest = max((c.nbytes for c in chunks), default=0)
            kind = self._pool_kind(region)
            if biggest > self.e.settings.slot_bytes(kind):
                raise InvalidArgumentError(
                    f"initiator's chunks of {biggest} bytes exceed this side's UCX slots of "
                    f"{self.e.settings.slot_bytes(kind)} bytes for {kind} memory (XFER_UCX_CHUNK_BYTES or "
                    f"XFER_UCX_DEVICE_CHUNK_BYTES differs)")
            copier, pool = self._copier(region), self.e.slots.pool(kind)
            hold = self.ctx.grants.hold(region, ids, writes=op is Op.WRITE, peer=str(h.get("from")), tid=str(h.get("tid")),
                                        owner=("ucx", conn.local_id),  # another's unfenced blocks: refused
                                        replaces=h.get("grant"))  # a grant issued ahead (xfer.ahead): ended
        except (XferError, ValueError, KeyError, TypeError) as exc:
            if h.get("grant") is not None:  # refused before any byte landed: its grant issued ahead ends
                self.ctx.grants.end_ahead(h.get("grant"), str(h.get("from")))
            name, message = error_codec.encode(exc if isinstance(exc, XferError) else InvalidArgumentError(str(exc)))
            self.send_ctrl(conn, wire.Kind.REFUSE, {"k": key, "error": name, "message": message})
            if fresh:
                self.e.data.adopt_early(conn, xid, None)  # a refused WRITE's chunks: discarded
            return
        flow = Flow(self.e, key=key, initiator=False, op=op, conn=conn, deadline=deadline, copier=copier, ids=ids,
                    sender_layout=theirs if op is Op.WRITE else region.layout, chunks=chunks, pool=pool,
                    tid=str(h.get("tid")), region=region.name, notify=notify, peer_name=str(h.get("from")))
        flow.xid, flow.hold = xid, hold
        hold.on_revoke = lambda _h, f=flow: self.e.call_soon(self._revoked, f)
        self.e.flows.add(flow)
        if op is Op.WRITE:
            self.e.data.adopt_early(conn, xid, flow)
            if not chunks:
                self.landed(flow)
        self.e.slots.want(flow)

    def _their_layout(self, conn: Conn, h: dict) -> KVLayout:
        """The initiator's layout: described in this REQ (kept under its id), or named by an id an
        earlier REQ of this connection described."""
        lid = h.get("lid")
        if not isinstance(lid, int) or isinstance(lid, bool):
            raise InvalidArgumentError(f"request names layout id {lid!r}, not an int")
        if "layout" in h:
            theirs = KVLayout.from_dict(h["layout"])
            if lid not in conn.layouts and len(conn.layouts) >= wire.LAYOUTS_MAX:
                raise InvalidArgumentError(f"peer described more than {wire.LAYOUTS_MAX} layouts on one connection")
            conn.layouts[lid] = theirs
            return theirs
        theirs = conn.layouts.get(lid)
        if theirs is None:
            raise LayoutMismatchError(f"request names layout id {lid}, which no earlier request on this connection "
                                      f"described")
        return theirs

    def landed(self, flow: Flow) -> None:
        """Every chunk of a receiving flow is scattered."""
        if flow.initiator:  # READ: tell the data owner, finish on its ACK
            flow.fin_sent = True  # from now on the target may deliver it
            self.send_ctrl(flow.conn, wire.Kind.FIN, {"k": flow.key})
            return
        self._deliver(flow, Op.WRITE)

    def _on_fin(self, conn: Conn, h: dict) -> None:
        flow = self.e.flows.target(conn.local_id, h.get("k"))
        if flow is None or flow.dead:
            return
        self._deliver(flow, Op.READ)

    def _deliver(self, flow: Flow, op: Op) -> None:
        """A target flow ended: every byte landed (WRITE) or was read (READ, the initiator's FIN).
        Delivered and acknowledged unless it is past its deadline (earlier than the initiator's:
        the ACK has time to get there) or its blocks were revoked: one step with the revocation."""
        grants = self.ctx.grants
        with grants.closing():
            if flow.hold.revoked:
                error = RevokedError(f"agent {self.ctx.agent_name!r} revoked the blocks of transfer {flow.tid}")
            elif time.monotonic() >= flow.deadline:
                error = TransferTimeoutError(f"incoming transfer {flow.tid} ended after its deadline; not delivered")
            else:
                error = None
                self.e.flows.drop(flow)
                self.ctx.deliver(Notification(peer=flow.peer_name, transfer_id=flow.tid, op=op, region=flow.region,
                                              blocks=flow.ids, payload=flow.notify))
                grants.end_locked(flow.hold)
        if error is not None:
            self.e.flows.fail(flow, error)
            return
        self.send_ctrl(flow.conn, wire.Kind.ACK, {"k": flow.key})

    # ---- memory ------------------------------------------------------------------------------
    @staticmethod
    def _copier(region) -> BlockCopier:
        """The region's gathers and scatters (kept on the region: they die with it)."""
        return region.state.get(("ucx", "copier"), lambda: BlockCopier(region.layout, region.tensors))

    @staticmethod
    def _peer_slot(metadata, peer_region) -> tuple[int, bool]:
        """(slot bytes of the pool the peer stages ``peer_region`` in, whether that pool is device
        memory), from the peer's published UCX info and the region's device."""
        info = metadata.transports.get("ucx") or {}
        host = int(info.get("chunk_bytes") or 1 << 62)
        if str(peer_region.device).startswith("cuda") and info.get("cuda"):
            return int(info.get("device_chunk_bytes") or host), True
        return host, False

    def _pool_kind(self, region) -> str:
        dev = region.device
        if dev.type == "cpu":
            return "host"
        if dev.type == "cuda":
            return f"cuda:{dev.index or 0}" if self.e.context.cuda_support else "pinned"
        raise InvalidArgumentError(f"the UCX transport moves host or CUDA memory, region {region.name!r} is on {dev}")

    def describe(self, region, copier: BlockCopier, pool, iov: bool = False, iov_rx: bool = False) -> str:
        tls = self.e.context.config.get("TLS", "?")
        if iov:
            where = "host blocks sent in place (UCX scatter-gather), no staging copy"
        elif iov_rx:
            where = "host blocks received in place (UCX scatter-gather), no staging copy"
        elif pool.kind == "pinned":
            where = "CUDA blocks staged through pinned host memory (this UCX has no CUDA support)"
        elif pool.kind.startswith("cuda"):
            where = f"GPU-direct from {pool.kind} staging"
        else:
            where = "host staging"
        return f"ucx ({where}; copy: {copier.path}; UCX_TLS={tls})"
