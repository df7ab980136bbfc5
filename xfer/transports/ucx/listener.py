"""The UCX engine's listener, bound to one address, and the endpoints it accepts.

ucxx's listener takes only a port and listens on every interface (``INADDR_ANY``); its endpoints
from connection requests need that listener. So where the raw ``libucp`` binding exists (io_raw),
the listener is made by ``ucp_listener_create`` on the address the agent was told to listen on
(``listen_host``), and each accepted connection is a raw ``ucp_ep_create`` endpoint
(:class:`RawEndpoint`) offering what the engine uses of ucxx's: ``handle``, ``alive``,
``close()``, ``set_close_callback``, ``stream_send``/``stream_recv`` (the hello) and
``tag_send``. A connection request names its client's address before any endpoint exists: the
engine refuses one over its limits with ``reject`` (UCX closes it; no endpoint, no hello).

Without the binding the engine falls back to ucxx's listener on every interface
(:class:`AnyListener`), and says so at start-up.

Every call here runs on the engine thread (UCX calls the connection and error handlers from
inside ``progress``).
"""

from __future__ import annotations

import ctypes
import socket
import struct

import numpy as np

from .io_raw import IovRequest, _loaded

__all__ = ["make_listener", "RawListener", "RawEndpoint", "AnyListener"]

_LISTENER_SOCK_ADDR, _LISTENER_CONN_HANDLER = 1 << 0, 1 << 2
_EP_ERR_MODE, _EP_ERR_HANDLER, _EP_FLAGS, _EP_CONN_REQUEST = 1 << 1, 1 << 2, 1 << 5, 1 << 6
_ERR_MODE_PEER, _NO_LOOPBACK = 1, 1 << 1
_OP_FLAGS, _STREAM_WAITALL, _CLOSE_FORCE = 1 << 4, 1 << 0, 1 << 0
_CLOSED = (1 << 64) - 16  # a request pointer that reads UCS_ERR_CANCELED: what a closed endpoint's calls return


class _SockAddr(ctypes.Structure):  # ucs_sock_addr_t
    _fields_ = [("addr", ctypes.c_void_p), ("addrlen", ctypes.c_uint32)]


class _Handler(ctypes.Structure):  # ucp_listener_conn_handler_t, ucp_err_handler_t
    _fields_ = [("cb", ctypes.c_void_p), ("arg", ctypes.c_void_p)]


class _ListenerParams(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("sockaddr", _SockAddr), ("accept_handler", _Handler),
                ("conn_handler", _Handler)]


class _Storage(ctypes.Structure):  # uint64_t field_mask; struct sockaddr_storage (128 bytes)
    _fields_ = [("field_mask", ctypes.c_uint64), ("addr", ctypes.c_ubyte * 128), ("client_id", ctypes.c_uint64)]


class _EpParams(ctypes.Structure):  # ucp_ep_params_t (UCX 1.12+)
    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p), ("err_mode", ctypes.c_int),
                ("err_handler", _Handler), ("user_data", ctypes.c_void_p), ("flags", ctypes.c_uint),
                ("sockaddr", _SockAddr), ("conn_request", ctypes.c_void_p), ("name", ctypes.c_char_p),
                ("local_sockaddr", _SockAddr)]


class _Param(ctypes.Structure):  # ucp_request_param_t, as io_raw's
    _fields_ = [("op_attr_mask", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("request", ctypes.c_void_p),
                ("cb", ctypes.c_void_p), ("datatype", ctypes.c_uint64), ("user_data", ctypes.c_void_p),
                ("reply_buffer", ctypes.c_void_p), ("memory_type", ctypes.c_int), ("recv_info", ctypes.c_void_p),
                ("memh", ctypes.c_void_p)]


_CONN_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_ERR_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int8)


def _sockaddr(host: str, port: int) -> bytes:
    """``struct sockaddr_in`` / ``sockaddr_in6`` of ``host`` (a name is resolved; '' means any)."""
    family, _, _, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                               flags=socket.AI_PASSIVE)[0]
    if family == socket.AF_INET:
        return struct.pack("=H", socket.AF_INET) + struct.pack("!H", addr[1]) + socket.inet_aton(addr[0]) + bytes(8)
    if family == socket.AF_INET6:
        return (struct.pack("=H", socket.AF_INET6) + struct.pack("!HI", addr[1], addr[2])
                + socket.inet_pton(socket.AF_INET6, addr[0]) + struct.pack("=I", addr[3]))
    raise OSError(f"cannot listen on {host!r}: address family {family}")


def _address(raw: bytes) -> tuple[str, int]:
    family = struct.unpack_from("=H", raw)[0]
    if family == socket.AF_INET:
        return socket.inet_ntoa(raw[4:8]), struct.unpack_from("!H", raw, 2)[0]
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), struct.unpack_from("!H", raw, 2)[0]
    return "?", 0


class _Lib:
    """The libucp entry points this module calls, typed once."""

    def __init__(self, ucp: ctypes.CDLL):
        def fn(name, res, *args):
            f = getattr(ucp, name)
            f.restype, f.argtypes = res, list(args)
            return f
        p, st = ctypes.c_void_p, ctypes.c_int8
        self.listener_create = fn("ucp_listener_create", st, p, ctypes.POINTER(_ListenerParams), ctypes.POINTER(p))
        self.listener_destroy = fn("ucp_listener_destroy", None, p)
        self.listener_query = fn("ucp_listener_query", st, p, ctypes.POINTER(_Storage))
        self.listener_reject = fn("ucp_listener_reject", st, p, p)
        self.conn_request_query = fn("ucp_conn_request_query", st, p, ctypes.POINTER(_Storage))
        self.ep_create = fn("ucp_ep_create", st, p, ctypes.POINTER(_EpParams), ctypes.POINTER(p))
        self.ep_close = fn("ucp_ep_close_nbx", p, p, ctypes.POINTER(_Param))
        self.stream_send = fn("ucp_stream_send_nbx", p, p, p, ctypes.c_size_t, ctypes.POINTER(_Param))
        self.stream_recv = fn("ucp_stream_recv_nbx", p, p, p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                              ctypes.POINTER(_Param))
        self.tag_send = fn("ucp_tag_send_nbx", p, p, p, ctypes.c_size_t, ctypes.c_uint64, ctypes.POINTER(_Param))


def _buffer(buf) -> tuple[int, int, object]:
    """(address, bytes, what keeps it alive) of a numpy array or a ucxx ``Array``."""
    if isinstance(buf, np.ndarray):
        return buf.ctypes.data, buf.nbytes, buf
    return int(buf.ptr), int(buf.nbytes), buf


class RawEndpoint:
    """An accepted connection's endpoint (the subset of ucxx's ``UCXEndpoint`` the engine uses)."""

    __slots__ = ("_owner", "handle", "alive", "_on_close", "_key")

    def __init__(self, owner: "RawListener", handle: int, key: int):
        self._owner, self.handle, self.alive, self._key = owner, handle, True, key
        self._on_close = None

    def set_close_callback(self, fn, cb_args=()) -> None:
        self._on_close = (fn, tuple(cb_args))

    def _failed(self) -> None:  # UCX's error handler (inside progress): the peer is gone or the link is down
        if self._on_close is not None:
            fn, args = self._on_close
            fn(*args)

    def _dead(self) -> IovRequest:
        return IovRequest(self._owner.binding, _CLOSED, None)

    def stream_send(self, buf) -> IovRequest:
        if not self.alive:
            return self._dead()
        addr, n, keep = _buffer(buf)
        lib = self._owner.lib
        return IovRequest(self._owner.binding, lib.stream_send(self.handle, addr, n, ctypes.byref(_Param())), keep)

    def stream_recv(self, buf) -> IovRequest:
        """Receive exactly ``len(buf)`` bytes of the stream."""
        if not self.alive:
            return self._dead()
        addr, n, keep = _buffer(buf)
        length = ctypes.c_size_t()
        param = _Param(op_attr_mask=_OP_FLAGS, flags=_STREAM_WAITALL)
        req = self._owner.lib.stream_recv(self.handle, addr, n, ctypes.byref(length), ctypes.byref(param))
        return IovRequest(self._owner.binding, req, (keep, length))

    def tag_send(self, buf, tag) -> IovRequest:
        """Tag-send ``buf``; ``tag`` an int or a ucxx ``UCXXTag`` (what io_ucxx passes)."""
        if not self.alive:
            return self._dead()
        addr, n, keep = _buffer(buf)
        tag = int(getattr(tag, "value", tag))
        return self._owner.binding.send_contig(self.handle, addr, n, tag, keep)

    def close(self) -> None:
        """Close now (``UCP_EP_CLOSE_FLAG_FORCE``); idempotent. The close request is reaped later."""
        if not self.alive:
            return
        self.alive = False
        self._owner.closed(self)


class RawListener:
    """``ucp_listener_create`` on ``(host, port)``; connection requests go to ``on_request(handle)``."""

    def __init__(self, binding, worker, host: str, port: int, on_request):
        self.binding, self.lib = binding, _Lib(ctypes.CDLL(_loaded("libucp.so")))
        self._worker = worker.handle
        self._on_request = on_request
        self._conn_cb = _CONN_CB(lambda req, arg: self._on_request(req))  # kept alive as long as the listener
        self._err_cb = _ERR_CB(self._ep_error)
        self._eps: dict[int, RawEndpoint] = {}  # key -> endpoint, for the error handler
        self._keys = 0
        self._closing: list[IovRequest] = []
        raw = _sockaddr(host, port)
        self._addr = (ctypes.c_ubyte * len(raw)).from_buffer_copy(raw)
        params = _ListenerParams(field_mask=_LISTENER_SOCK_ADDR | _LISTENER_CONN_HANDLER,
                                 sockaddr=_SockAddr(ctypes.addressof(self._addr), len(raw)),
                                 conn_handler=_Handler(ctypes.cast(self._conn_cb, ctypes.c_void_p), None))
        handle = ctypes.c_void_p()
        status = self.lib.listener_create(self._worker, ctypes.byref(params), ctypes.byref(handle))
        if status != 0:
            raise OSError(f"UCX cannot listen on {host}:{port}: {binding.status_string(status)}")
        self._handle = handle.value
        attr = _Storage(field_mask=1)
        status = self.lib.listener_query(self._handle, ctypes.byref(attr))
        self.ip, self.port = _address(bytes(attr.addr)) if status == 0 else (host, port)

    def __repr__(self) -> str:
        return f"RawListener({self.ip}:{self.port})"

    def client_address(self, conn_request: int) -> str:
        attr = _Storage(field_mask=1)
        if self.lib.conn_request_query(conn_request, ctypes.byref(attr)) != 0:
            return "?"
        return _address(bytes(attr.addr))[0]

    def reject(self, conn_request: int) -> None:
        self.lib.listener_reject(self._handle, conn_request)

    def create_endpoint_from_conn_request(self, conn_request: int, error_handling: bool = True) -> RawEndpoint:
        self._keys += 1
        params = _EpParams(field_mask=_EP_ERR_MODE | _EP_ERR_HANDLER | _EP_FLAGS | _EP_CONN_REQUEST,
                           err_mode=_ERR_MODE_PEER, flags=_NO_LOOPBACK, conn_request=conn_request,
                           err_handler=_Handler(ctypes.cast(self._err_cb, ctypes.c_void_p), self._keys))
        handle = ctypes.c_void_p()
        status = self.lib.ep_create(self._worker, ctypes.byref(params), ctypes.byref(handle))
        if status != 0:
            raise OSError(f"UCX cannot accept the connection: {self.binding.status_string(status)}")
        ep = self._eps[self._keys] = RawEndpoint(self, handle.value, self._keys)
        return ep

    def _ep_error(self, key, ep_handle, status) -> None:
        ep = self._eps.get(key or 0)
        if ep is not None:
            ep._failed()

    def closed(self, ep: RawEndpoint) -> None:
        """``ep.close()``: release its handle (forced close), reap finished close requests."""
        self._eps.pop(ep._key, None)
        req = IovRequest(self.binding, self.lib.ep_close(ep.handle, ctypes.byref(_Param(op_attr_mask=_OP_FLAGS,
                                                                                         flags=_CLOSE_FORCE))), None)
        self._closing = [r for r in self._closing if not r.completed]
        if not req.completed:
            self._closing.append(req)

    def close(self) -> None:
        """Close every endpoint it accepted and the listener (before the worker goes)."""
        for ep in list(self._eps.values()):
            ep.close()
        if self._handle is not None:
            self.lib.listener_destroy(self._handle)
            self._handle = None


class AnyListener:
    """ucxx's own listener (every interface): the fallback without the raw binding."""

    def __init__(self, u, worker, port: int, on_request):
        self._l = u.UCXListener.create(worker, port, on_request)
        self.ip, self.port = "0.0.0.0", self._l.port

    def client_address(self, conn_request) -> str:
        return "?"

    def reject(self, conn_request) -> None:  # ucxx offers no reject: accepted, then closed by the caller
        pass

    def create_endpoint_from_conn_request(self, conn_request, error_handling: bool = True):
        return self._l.create_endpoint_from_conn_request(conn_request, error_handling)

    def close(self) -> None:
        self._l = None


def make_listener(ucx, worker, binding, host: str, port: int, on_request):
    """(the listener, why it listens on every interface or None): bound to ``host`` through
    the raw binding where there is one."""
    if binding is None:
        return AnyListener(ucx.libucxx, worker, port, on_request), "the raw libucp binding is unavailable"
    return RawListener(binding, worker, host, port, on_request), None
