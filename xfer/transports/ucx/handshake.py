"""Connecting and accepting UCX connections, and what a peer may cost before it proved the key.

A connection: both sides send a 256-byte hello (UCX stream API: conn id, agent id, nonce, name),
derive the session key (``Conn.on_hello``), send a PROOF (a control message with no body whose
MAC proves the key) and then whatever waited for the hello. A side takes nothing from a peer but
its PROOF before that verified (protocol: ``Conn.authed``).

Limits of the listener (``AgentConfig.settings.control``, the same values as the control port's):
connections accepted at once, per peer address, and still unauthenticated (a new one past that
closes the oldest of those), and the handshake's deadline. A connection request over a limit is
rejected before an endpoint exists (``ucp_listener_reject``). Every rejection is logged with its
reason, rate-limited (``rejections``: xfer.guard.Rejections).
"""

from __future__ import annotations

import time

from ...errors import PeerDisconnectedError, XferError
from ...guard import Rejections
from . import wire
from .conn import Conn

__all__ = ["Gate"]


class Gate:
    """The connections' way in, for one engine (on its thread)."""

    def __init__(self, engine, proto):
        self.e, self.proto, self.ctx = engine, proto, engine.ctx
        self.limits = self.ctx.config.settings.control
        self.rejections = Rejections(self.ctx.log, f"ucx listener of {self.ctx.agent_name!r}")
        self._checked = 0.0

    # ---- connecting --------------------------------------------------------------------------
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
        listener = self.e.listener
        host = listener.client_address(conn_request)
        accepted = [c for c in self.e.conns.all() if not c.outgoing and not c.dead]
        pending = [c for c in accepted if not c.authed]
        lim = self.limits
        if len(pending) >= lim.max_pending:
            self._evict(pending, None)
        if sum(c.host == host for c in accepted) >= lim.max_conns_per_host and not self._evict(pending, host):
            return self._refuse(conn_request, "per-host", f"refused a connection from {host}: it holds "
                                                          f"{lim.max_conns_per_host} (max_conns_per_host)")
        if len(accepted) >= lim.max_conns and not self._evict(pending, None):
            return self._refuse(conn_request, "conns", f"refused a connection from {host}: {len(accepted)} "
                                                       f"connections open (max_conns)")
        try:
            ep = listener.create_endpoint_from_conn_request(conn_request, True)
        except Exception as exc:  # the peer went away while connecting
            self.rejections("accept", "could not accept a connection from %s: %s", host, exc)
            return
        conn = Conn(ep, self.e.conns.new_id(), outgoing=False, address=host, host=host)
        self.e.conns.add(conn)
        self._hello(conn)

    def _refuse(self, conn_request, reason: str, why: str) -> None:
        self.rejections(reason, "%s", why)
        self.e.listener.reject(conn_request)

    def _evict(self, pending: list[Conn], host: str | None) -> bool:
        """Close the oldest unauthenticated accepted connection (from ``host``, or any)."""
        for conn in sorted(pending, key=lambda c: c.opened):
            if not conn.dead and (host is None or conn.host == host):
                self.fail(conn, "evicted", f"closed unauthenticated after {time.monotonic() - conn.opened:.1f} s: "
                                           f"newer connections need the room")
                return True
        return False

    def fail(self, conn: Conn, reason: str, why: str) -> None:
        """Fail ``conn``, logged with its reason (a rejection of the peer)."""
        self.rejections(reason, "dropped peer %r at %s: %s", conn.name or "?", conn.address or "?", why)
        self.e.conns.fail(conn, PeerDisconnectedError(f"UCX connection to {conn.name or '?'} at "
                                                      f"{conn.address or '?'} dropped: {why}"))

    def expire(self, now: float) -> None:
        """Connections that did not prove the key within ``handshake_s`` (checked a few times a second)."""
        if now < self._checked:
            return
        self._checked = now + 0.25
        limit = self.limits.handshake_s
        for conn in self.e.conns.all():
            if not conn.authed and not conn.dead and now - conn.opened > limit:
                self.fail(conn, "handshake", f"no proof of the session key within {limit:g} s (handshake_s)")

    # ---- the hello ---------------------------------------------------------------------------
    def _hello(self, conn: Conn) -> None:
        conn.ep.set_close_callback(self._ep_closed, cb_args=(conn,))
        conn.hello_out = wire.hello(conn.local_id, self.ctx.agent_id, self.ctx.agent_name, conn.nonce)
        self.e.track(conn.ep.stream_send(self.e.ucx.Array(conn.hello_out)), lambda err: self._hello_done(conn, err))
        self.e.track(conn.ep.stream_recv(self.e.ucx.Array(conn.hello_in)), lambda err: self._hello_in(conn, err))

    def _ep_closed(self, conn: Conn) -> None:  # called by UCX inside progress: defer
        conn.closed = True  # at once: no raw (IOV) send may use the endpoint's handle from now on
        self.e.call_soon(self.e.conns.fail, conn, PeerDisconnectedError(
            f"UCX endpoint to peer {conn.name or '?'} at {conn.address or '?'} failed (peer died or the link "
            f"is down); its transfers report no block complete"))

    def _hello_done(self, conn: Conn, err) -> None:
        if err is not None and not conn.dead:
            self.e.conns.fail(conn, PeerDisconnectedError(
                f"could not connect to {conn.name or 'peer'} at {conn.address or '?'} over UCX: {err}"))

    def _hello_in(self, conn: Conn, err) -> None:
        if conn.dead:
            return
        if err is not None:
            return self._hello_done(conn, err)
        try:
            conn.on_hello(self.ctx.auth, self.ctx.agent_id)
        except XferError as exc:
            if conn.outgoing:
                self.e.conns.fail(conn, exc)
            else:
                self.fail(conn, "hello", str(exc))
            return
        self.proto.send_ctrl(conn, wire.Kind.PROOF, {})  # first: the peer takes nothing else before it
        self.proto.pump(conn)  # the peer's messages that came before its hello was in here
        self.e.data.after_hello(conn)
        waiting, conn.waiting = conn.waiting, []
        for msg in waiting:
            self.proto.send_waiting(conn, msg)
        for flow in list(conn.flows):  # their chunks can be tagged now
            self.e.slots.want(flow)
