"""Shared host memory that another process on the same machine can map: POSIX shm files.

``shared_empty`` allocates a CPU tensor in ``/dev/shm``; the local transport exports the file
name and offset of a registered tensor, and a peer process maps the same pages. Files carry the
creator's pid in their name; files of dead creators are removed on the next allocation.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import re
import select
import threading

import torch

from .errors import InvalidArgumentError, TransportError

__all__ = ["shared_empty", "lookup", "open_segment", "pid_alive", "SHM_DIR"]

SHM_DIR = "/dev/shm"
_PREFIX = "xfer-"
_NAME = re.compile(r"^xfer-(\d+)-\d+$")
_lock = threading.Lock()
_counter = itertools.count()
_segments: dict[str, tuple[int, int, mmap.mmap]] = {}  # name -> (address, nbytes, mapping)


def _reap_stale() -> None:
    """Remove segments whose creator process is gone (killed before its atexit ran)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        m = _NAME.match(name)
        if m and not pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass


_PIDFDS: dict[int, tuple[int]] = {}  # pid -> (its pidfd,), for processes found alive (a tuple: replaced whole)
# (peers are checked before every launch: one poll(0) of the pidfd then)
_PIDFDS_MAX = 64
_PIDFDS_LOCK = threading.Lock()  # not _lock: segments are reaped (pid_alive) under _lock


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (killed but not yet reaped).

    A process seen alive keeps a pidfd here (Linux >= 5.3), so a later check is one poll of it,
    not a read of ``/proc`` (tens of microseconds on a slow CPU, before every launch to a peer).
    A pidfd stays with its process: a recycled pid reads as the old process, gone."""
    hit = _PIDFDS.get(pid)  # (a dict read is atomic; entries are replaced whole, under the lock)
    if hit is None:
        alive = _pid_alive_proc(pid)
        if alive and hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                return alive
            with _PIDFDS_LOCK:
                if pid in _PIDFDS or len(_PIDFDS) >= _PIDFDS_MAX:
                    os.close(fd)
                else:
                    _PIDFDS[pid] = (fd,)
            return _pid_alive_proc(pid)  # it may have ended between the two looks
        return alive
    fd = hit[0]
    # a poll object per call: one object polled by two threads at once raises RuntimeError
    # ("concurrent poll() invocation"; launches to one peer check it from several threads)
    poller = select.poll()  # not select.select: it refuses fds above 1023 (UCX opens many)
    poller.register(fd, select.POLLIN)
    if not poller.poll(0):  # (a pidfd another thread closed reads POLLNVAL: its process ended too)
        return True
    with _PIDFDS_LOCK:  # readable: the process has ended
        if _PIDFDS.get(pid) is hit:
            del _PIDFDS[pid]
            os.close(fd)
    return False


def _pid_alive_proc(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


@atexit.register
def _unlink_all() -> None:
    for name in list(_segments):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


def shared_empty(shape, *, dtype: torch.dtype = torch.uint8, device=None) -> torch.Tensor:
    """An uninitialised CPU tensor in shared memory, mappable by other local processes.

    Signature matches ``torch.empty(shape, dtype=, device=)`` so it can be passed to
    :func:`xfer.layout.make_kv_cache` as ``empty``; ``device`` must be None or cpu.
    """
    if device is not None and torch.device(device).type != "cpu":
        raise InvalidArgumentError(f"shared_empty allocates host memory; device {device!r} is not 'cpu'")
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    with _lock:
        if not _segments:
            _reap_stale()
        name = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    with _lock:
        _segments[name] = (flat.data_ptr(), nbytes, mapping)
    return flat[: numel * torch.empty((), dtype=dtype).element_size()].view(dtype).view(shape)


def lookup(tensor: torch.Tensor) -> tuple[str, int] | None:
    """(segment name, byte offset of data_ptr) when ``tensor`` lives in a shared segment, else None."""
    if tensor.device.type != "cpu":
        return None
    ptr = tensor.data_ptr()
    with _lock:
        for name, (base, nbytes, _) in _segments.items():
            if base <= ptr < base + nbytes:
                return name, ptr - base
    return None


def open_segment(name: str) -> torch.Tensor:
    """Map a peer's segment; returns a flat uint8 CPU tensor over all of it."""
    if not _NAME.match(name):
        raise TransportError(f"shared segment name {name!r} is not an xfer segment (xfer-<pid>-<n>)")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise TransportError(f"cannot open peer shared segment {path}: {exc.strerror}") from None
    try:
        nbytes = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
