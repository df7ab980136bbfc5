"""Raw UCX tag calls on ucxx's own ``libucp``: scatter-gather sends straight from a host region's
blocks, probes, and receives, contiguous or scatter-gather straight into the blocks
(UCX's ``UCP_DATATYPE_IOV``).

ucxx's Python API sends and receives one contiguous buffer per message, so a chunk of
non-adjacent blocks would be gathered into a staging slot before it is sent and scattered out of
one after it arrived: one more pass over the bytes on each host, on top of UCX's own copies into
and out of its TCP fragments (or none at all with RDMA). UCX itself takes a list of (address,
length) pairs for one message. This module calls ``ucp_tag_send_nbx``, ``ucp_tag_probe_nb`` and
``ucp_tag_msg_recv_nbx`` through ctypes, on the very ``libucp`` ucxx runs on, with the endpoint
and worker handles ucxx exposes (the engine also sends its contiguous host messages, control and
staged chunks, this way: ucxx's request objects cost ~30-50 us of CPU a send on a slow CPU);
the bytes on the wire are exactly a gathered chunk's, so either side may stage or not. The engine takes every message with the raw probe once this binding is
there (ucxx's probe objects insist on being received through ucxx, which has no IOV receive).

A receive straight into the destination blocks cannot be cancelled once UCX matched it, and
closing the endpoint does not stop it at once either. Measured over TCP: a 256 MiB IOV receive
had 0.5 MiB landed when ``close_blocking`` returned. Further progress landed another 0.5 MiB
before the request ended UCS_ERR_CANCELED. So the engine holds a failed flow's report (its
CANCEL to the peer, its transfer where not already ended) until such a receive has ended, and
closes the connection if that takes longer than ``HOLD_S`` (tables).

Requests are polled like ucxx's (``completed``, ``check_error``) on the engine thread, which
owns the worker; a request's address list (or buffer) stays referenced until UCX completes it,
and one dropped unfinished (engine closing) keeps it for the life of the process.

``XFER_UCX_IOV=0`` turns all of this off (io_ucxx: ucxx's API, every chunk staged both ways);
``XFER_UCX_IOV_RECV=0`` only the receives into the blocks.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

__all__ = ["IovSender", "iov_sender", "RawIO", "RawProbe"]

_FIELD_DATATYPE = 1 << 3
_FIELD_MEMORY_TYPE = 1 << 6
_DATATYPE_IOV = 2
_MEMORY_TYPE_HOST = 0
_INPROGRESS = 1
_ERR_LAST = -100
_PTR_ERR_MIN = (1 << 64) + _ERR_LAST  # UCS_PTR_IS_ERR: (uintptr_t)ptr >= (uintptr_t)UCS_ERR_LAST

_abandoned: list = []  # requests dropped before UCX completed them: their address lists stay alive


class _Param(ctypes.Structure):
    """``ucp_request_param_t`` (ucp.h, UCX 1.12+): the members this module sets, in their ABI order."""

    _fields_ = [("op_attr_mask", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("request", ctypes.c_void_p),
                ("cb", ctypes.c_void_p), ("datatype", ctypes.c_uint64), ("user_data", ctypes.c_void_p),
                ("reply_buffer", ctypes.c_void_p), ("memory_type", ctypes.c_int), ("recv_info", ctypes.c_void_p),
                ("memh", ctypes.c_void_p)]


class IovError(RuntimeError):
    """UCX failed an IOV send (the status name, as ucxx's errors carry it)."""


class IovRequest:
    """One IOV send: ``completed`` polls UCX (and frees the request once done), ``check_error``
    raises :class:`IovError` for a failed one. The address list lives as long as the request."""

    __slots__ = ("_lib", "_ptr", "_iov", "status")

    def __init__(self, lib: "IovSender", ptr, iov: np.ndarray):
        self._lib, self._iov = lib, iov
        if ptr is None or ptr == 0:
            self._ptr, self.status = None, 0  # completed at once
        elif ptr >= _PTR_ERR_MIN:
            self._ptr, self.status = None, ptr - (1 << 64)
        else:
            self._ptr, self.status = ptr, _INPROGRESS
        if self._ptr is None:
            self._iov = None

    @property
    def completed(self) -> bool:
        if self._ptr is None:
            return True
        status = self._lib.check_status(self._ptr)
        if status == _INPROGRESS:
            return False
        self.status = status
        self._lib.free(self._ptr)
        self._ptr, self._iov = None, None
        return True

    def check_error(self) -> None:
        if self.status < 0:
            raise IovError(self._lib.status_string(self.status))

    def abandon(self, *keep) -> None:
        """Forget an unfinished request (its engine is closing): keep its address list alive, and
        ``keep`` (its callback, which holds the flow and so the region's tensors)."""
        if self._ptr is not None:
            _abandoned.append((self._iov, keep))


class IovSender:
    """ctypes entry points of the process's ``libucp`` (the one ucxx loaded)."""

    def __init__(self, ucp: ctypes.CDLL, ucs: ctypes.CDLL):
        self._send = ucp.ucp_tag_send_nbx
        self._send.restype = ctypes.c_void_p
        self._send.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64,
                               ctypes.POINTER(_Param)]
        # ucs_status_t is a packed enum: ONE signed byte (read as an int, UCS_ERR_CANCELED -16 came
        # back as 240, and a failed send looked like a success)
        self.check_status = ucp.ucp_request_check_status
        self.check_status.restype = ctypes.c_int8
        self.check_status.argtypes = [ctypes.c_void_p]
        self.free = ucp.ucp_request_free
        self.free.restype = None
        self.free.argtypes = [ctypes.c_void_p]
        self._string = ucs.ucs_status_string
        self._string.restype = ctypes.c_char_p
        self._string.argtypes = [ctypes.c_int8]
        self._param = _Param(op_attr_mask=_FIELD_DATATYPE | _FIELD_MEMORY_TYPE, datatype=_DATATYPE_IOV,
                             memory_type=_MEMORY_TYPE_HOST)
        self._param_ref = ctypes.byref(self._param)
        self._param_contig = _Param(op_attr_mask=0)  # bytes, memory type detected by UCX
        self._contig_ref = ctypes.byref(self._param_contig)
        self._probe = ucp.ucp_tag_probe_nb
        self._probe.restype = ctypes.c_void_p
        self._probe.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p]
        self._recv = ucp.ucp_tag_msg_recv_nbx
        self._recv.restype = ctypes.c_void_p
        self._recv.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                               ctypes.POINTER(_Param)]

    def probe(self, worker_handle: int, info) -> int | None:
        """Take the worker's next unexpected message of any tag (``ucp_tag_probe_nb``, removed
        from UCX's queue): its message handle, or None; ``info`` receives (sender tag, length)."""
        return self._probe(worker_handle, 0, 0, 1, info) or None

    def recv(self, worker_handle: int, message: int, address: int, nbytes: int, keep) -> IovRequest:
        """Receive a probed message into ``nbytes`` contiguous bytes at ``address`` (host or device
        memory: UCX tells them apart, as for ucxx's own receives); ``keep`` (the buffer) lives as
        long as the request."""
        ptr = self._recv(worker_handle, address, nbytes, message, self._contig_ref)
        return IovRequest(self, ptr, keep)

    def recv_iov(self, worker_handle: int, message: int, iov: np.ndarray) -> IovRequest:
        """Receive a probed message straight into the host addresses ``iov`` names, in order."""
        if iov.dtype != np.uint64 or iov.ndim != 2 or iov.shape[1] != 2 or not iov.flags.c_contiguous:
            raise ValueError(f"iov must be a C-contiguous [n, 2] uint64 array, got {iov.dtype} {iov.shape}")
        ptr = self._recv(worker_handle, iov.ctypes.data, iov.shape[0], message, self._param_ref)
        return IovRequest(self, ptr, iov)

    def send_contig(self, ep_handle: int, address: int, nbytes: int, tag: int, keep) -> IovRequest:
        """Tag-send ``nbytes`` contiguous host bytes at ``address`` on the endpoint ``ep_handle``
        (no memory type given: UCX detects it); ``keep`` (the buffer) lives as long as the request."""
        return IovRequest(self, self._send(ep_handle, address, nbytes, tag, self._contig_ref), keep)

    def status_string(self, status: int) -> str:
        return f"{self._string(status).decode(errors='replace')} (UCS status {status})"

    def send(self, ep_handle: int, iov: np.ndarray, tag: int) -> IovRequest:
        """Tag-send the bytes named by ``iov`` (``[n, 2]`` uint64: address, length) as ONE message
        on the endpoint ``ep_handle`` (a ucxx endpoint's ``handle``); host memory only."""
        if iov.dtype != np.uint64 or iov.ndim != 2 or iov.shape[1] != 2 or not iov.flags.c_contiguous:
            raise ValueError(f"iov must be a C-contiguous [n, 2] uint64 array, got {iov.dtype} {iov.shape}")
        ptr = self._send(ep_handle, iov.ctypes.data, iov.shape[0], tag, self._param_ref)
        return IovRequest(self, ptr, iov)


def _loaded(name: str) -> str | None:
    """Path of the shared library ``name`` (e.g. ``libucp.so``) as mapped in this process."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if os.path.basename(path).startswith(name):
                    return path
    except OSError:
        pass
    return None


@functools.cache
def iov_sender() -> tuple[IovSender | None, str | None]:
    """(the binding, None), or (None, why it cannot be made): one per process. Call after ucxx
    is imported (its ``libucp`` must be the one mapped here; a second copy would not know its
    endpoints)."""
    ucp_path, ucs_path = _loaded("libucp.so"), _loaded("libucs.so")
    if ucp_path is None or ucs_path is None:
        return None, "libucp/libucs are not mapped in this process (ucxx not imported?)"
    try:
        return IovSender(ctypes.CDLL(ucp_path), ctypes.CDLL(ucs_path)), None
    except (OSError, AttributeError) as exc:
        return None, f"cannot bind UCX's tag send from {ucp_path}: {exc}"


class RawProbe:
    """A message taken by the raw probe: UCX's message handle and its length."""

    __slots__ = ("handle", "length")

    def __init__(self, handle: int, length: int):
        self.handle, self.length = handle, length


def _address(buf) -> tuple[int, int]:
    """(address, bytes) of a contiguous numpy array or torch tensor (host or CUDA)."""
    if isinstance(buf, np.ndarray):
        return buf.ctypes.data, buf.nbytes
    return buf.data_ptr(), buf.numel() * buf.element_size()


class RawIO:
    """The engine's I/O back end on the raw binding (the interface: io_ucxx). Every message is
    probed and received by raw calls; host chunks may be sent from and received into the blocks
    (``send_iov`` / ``recv_iov``); contiguous sends (control messages, host slots: ~30-50 us of CPU
    less a send than ucxx's request objects on the 2-core VM; device slots: ~0.1 ms on the H200
    VM) go raw too, but on an endpoint UCX reported closed, whose handle may be freed: those go
    through ucxx (``fallback``), which fails a dead one cleanly."""

    name = "raw libucp"
    sends_in_place = True

    def __init__(self, binding: IovSender, worker, fallback, receives_in_place: bool):
        self._b, self._fallback = binding, fallback
        self._worker = worker.handle
        self._info = (ctypes.c_uint64 * 2)()  # a raw probe's (sender tag, length)
        self._scratch = np.zeros(8, dtype=np.uint8)  # where a drained message's (zero) bytes go
        self.receives_in_place = receives_in_place

    def probe(self):
        handle = self._b.probe(self._worker, self._info)
        if handle is None:
            return None
        return self._info[0], RawProbe(handle, self._info[1])

    def send(self, conn, buf, tag: int):
        if conn.closed or conn.dead:
            return self._fallback.send(conn, buf, tag)
        return self._b.send_contig(conn.ep.handle, *_address(buf), tag, buf)  # UCX detects the memory type

    def recv(self, buf, probe):
        return self._b.recv(self._worker, probe.handle, *_address(buf), buf)

    def drain(self, probe):
        """Consume a probed message unreceived: a zero-length receive, which UCX completes as
        truncated (a rendezvous message's data is never fetched: 100 MB drained in ~0.3 ms, no
        allocation, the endpoint fine afterwards)."""
        return self._b.recv(self._worker, probe.handle, self._scratch.ctypes.data, 0, None)

    def send_iov(self, conn, iov: np.ndarray, tag: int):
        """One message from the host addresses ``iov`` names (the caller checked the endpoint lives)."""
        return self._b.send(conn.ep.handle, iov, tag)

    def recv_iov(self, probe, iov: np.ndarray):
        return self._b.recv_iov(self._worker, probe.handle, iov)
