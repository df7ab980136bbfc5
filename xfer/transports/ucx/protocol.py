"""The UCX transport's control protocol, run on the engine thread: connecting and accepting,
the hello, and the REQ / REFUSE / ACK / FIN / CANCEL / STOPPED messages (see wire).

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
from ...layout import KVLayout
from ...transfer import Notification, Op
from . import wire
from .conn import Conn
from .flow import Flow, in_place, peer_in_place
from ..chunking import chunk_list, plan_chunks
from ..incoming import check_request, check_ttl, local_deadline
from .staging import BlockCopier

__all__ = ["Protocol"]



class Protocol:
    """The control messages of one engine; it reads and changes the engine's tables only through
    their methods (``engine.conns``, ``engine.flows``, ``engine.slots``, ``engine.data``)."""

    def __init__(self, engine):
        self.e = engine
        self.ctx = engine.ctx

    # ---- connections -------------------------------------------------------------------------
    def connect(self, md) -> Conn:
        conn = self.e.conns.outgoing(md.agent_id)
        if conn is not None and not conn.dead:
            return conn
        info = md.transports.get("ucx") or {}
        address, port = info.get("address"), info.get("port")
        try:
            ep = self.e.u.UCXEndpoint.create(self.e.worker, address, int(port), True)
        except Exception as exc:
            raise PeerDisconnectedError(f"cannot reach the UCX listener of {md.name!r} at {address}:{port}: {exc}") \
                from None
        conn = Conn(ep, self.e.conns.new_id(), outgoing=True, agent_id=md.agent_id, name=md.name,
                    address=f"{address}:{port}")
        self.e.conns.add(conn)
        self._hello(conn)
        return conn

    def accept(self, conn_request) -> None:
        try:
            ep = self.e.listener.create_endpoint_from_conn_request(conn_request, True)
        except Exception as exc:  # the peer went away while connecting
            self.e.log.warning("xfer ucx: could not accept a connection: %s", exc)
            return
        conn = Conn(ep, self.e.conns.new_id(), outgoing=False)
        self.e.conns.add(conn)
        self._hello(conn)

    def _hello(self, conn: Conn) -> None:
        conn.ep.set_close_callback(self._ep_closed, cb_args=(conn,))
        conn.hello_out = wire.hello(conn.local_id, self.ctx.agent_id, self.ctx.agent_name)
        self.e.track(conn.ep.stream_send(self.e.ucx.Array(conn.hello_out)), lambda err: self._hello_done(conn, err))
        self.e.track(conn.ep.stream_recv(self.e.ucx.Array(conn.hello_in)), lambda err: self._hello_in(conn, err))

    def _ep_closed(self, conn: Conn) -> None:  # called by UCX inside progress: defer
        conn.closed = True  # at once: no raw (IOV) send may use the endpoint's handle from now on
        self.e.call_soon(self.e.conns.fail, conn, PeerDisconnectedError(
            f"UCX endpoint to peer {conn.name or '?'} at {conn.address or '?'} failed (peer died or the link "
            f"is down); its transfers report no block complete"))

    def _hello_done(self, conn: Conn, err) -> None:
        if err is not None:
            self.e.conns.fail(conn, PeerDisconnectedError(
                f"could not connect to {conn.name or 'peer'} at {conn.address or '?'} over UCX: {err}"))

    def _hello_in(self, conn: Conn, err) -> None:
        if conn.dead:
            return
        if err is not None:
            return self._hello_done(conn, err)
        try:
            conn.on_hello()
        except XferError as exc:
            self.e.conns.fail(conn, exc)
            return
        waiting, conn.waiting = conn.waiting, []
        for msg in waiting:
            if msg[0] is wire.Kind.REQ:
                flow = self.e.flows.initiator(msg[1].get("k"))
                if flow is not None:
                    flow.requested = True
            self._send(conn, self._encode(*msg))
        for flow in list(conn.flows):  # their chunks can be tagged now
            self.e.slots.want(flow)

    def close(self) -> None:
        self.e.conns.fail_all(PeerDisconnectedError("transport closed"))

    # ---- control messages --------------------------------------------------------------------
    def send_ctrl(self, conn: Conn, kind: wire.Kind, header: dict, ids=None, payload: bytes = b"") -> None:
        if conn.ready:
            self._send(conn, self._encode(kind, header, ids, payload))
        else:  # encoded once the hello round is over: a REQ's send time is when it leaves
            conn.waiting.append((kind, header, ids, payload))

    def _encode(self, kind: wire.Kind, header: dict, ids, payload: bytes) -> np.ndarray:
        if kind is wire.Kind.REQ:  # time left and send time as it leaves (the target judges how long it
            now = time.monotonic()  # waited: Conn.req_delay); the deadline itself means nothing there
            header["ttl"], header["sent"] = max(header.pop("deadline") - now, 0.0), now
        if self.ctx.auth is not None:  # the MAC covers the header and the binary part (ids, payload)
            binary = (b"" if ids is None else np.ascontiguousarray(ids, dtype="<i8").tobytes()) + payload
            header = self.ctx.auth.stamp(header, binary)
        return wire.encode(kind, header, ids, payload)

    def _send(self, conn: Conn, msg: np.ndarray) -> None:
        def sent(err, msg=msg):  # holds ``msg`` until UCX is done with it
            if err is not None:
                self.e.conns.fail(conn, PeerDisconnectedError(f"control message to {conn.name!r} failed: {err}"))
        self.e.data.send(conn, msg, wire.ctrl_tag(conn.remote_id), sent)

    def on_ctrl_probe(self, conn_id: int, probe) -> None:
        """A probed control message (the engine's probe takes every message): receive it, and
        handle it once it and every control message of its connection probed before it landed."""
        buf = np.empty(max(probe.length, 1), dtype=np.uint8)
        conn = self.e.conns.get(conn_id)
        entry = [buf[:probe.length], None, False]
        if conn is not None and not conn.dead:
            conn.ctrl_in.append(entry)
        self.e.data.recv(buf, probe, lambda err: self._ctrl_landed(conn_id, entry, err))

    def _ctrl_landed(self, conn_id: int, entry: list, err) -> None:
        entry[1], entry[2] = err, True
        conn = self.e.conns.get(conn_id)
        if conn is None or conn.dead:
            return
        queue = conn.ctrl_in
        while queue and queue[0][2]:
            buf, error, _ = queue.popleft()
            self._on_ctrl(conn_id, buf, error)

    def _on_ctrl(self, conn_id: int, buf: np.ndarray, err) -> None:
        conn = self.e.conns.get(conn_id)
        if conn is None or conn.dead or err is not None:
            return
        try:
            kind, header, binary = wire.decode(buf)
            if self.ctx.auth is not None:
                self.ctx.auth.check(header, binary)
        except AuthenticationError as exc:
            self.ctx.log.warning("ucx: rejected peer %r at %s: %s", conn.name, conn.address or "?", exc)
            self.e.conns.fail(conn, exc)
            return
        except (XferError, ValueError) as exc:
            self.e.conns.fail(conn, PeerDisconnectedError(f"peer {conn.name!r} sent a bad control message: {exc}"))
            return
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
        except XferError as exc:
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
        fresh = isinstance(xid, int) and 0 < xid < wire.XID_MOD and wire.xid_after(xid, conn.xid)
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
                                        owner=("ucx", conn.local_id))  # another's unfenced blocks: refused
        except (XferError, ValueError, KeyError, TypeError) as exc:
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
