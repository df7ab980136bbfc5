"""Joining an NVSHMEM group: what every PE does, in order, before its first symmetric allocation.

The session, then every PE's GPU, then the heap setting, and only then NVSHMEM calls: NVSHMEM reads
its settings on the first call (``get_unique_id``), and they must agree on every PE. The records go
through the agents' metadata store (:mod:`~xfer.transports.nvshmem.bootstrap`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import TransportUnavailableError, XferError
from . import bootstrap
from .mpg import is_limited_mpg

__all__ = ["Joined", "join"]


@dataclass(frozen=True, slots=True)
class Joined:
    """What joining settled: the session id, the heap NVSHMEM was told to use (and why), NVSHMEM's
    init status name, and whether that is limited MPG (several PEs on one GPU without MPS)."""

    session: str
    heap: str
    status: str
    limited_mpg: bool


def join(store, group, host_id: str, index: int, device, nvc, nvb, on_init) -> Joined:
    """Join ``group`` as PE ``group.rank`` on CUDA device ``index`` (``device``: its cuda.core
    Device): the session through ``store``, every PE's GPU (which decides the heap setting), the
    unique id, then ``nvshmem.core.init`` on a helper thread bounded by ``init_timeout_s``.
    ``on_init()`` is called right before init (a failure after it leaves NVSHMEM unusable in this
    process). Raises TransportUnavailableError naming what failed."""
    g, start = group, time.monotonic()
    try:
        if g.rank == 0:
            session = bootstrap.publish_session(store, g)
        else:
            session = bootstrap.fetch_session(store, g, g.init_timeout_s)
        gpus = bootstrap.exchange_gpus(store, g, session, host_id, str(torch.cuda.get_device_properties(index).uuid),
                                       max(1.0, g.init_timeout_s - (time.monotonic() - start)))
        setting, heap = bootstrap.heap_choice(bootstrap.shared_gpus(gpus), os.environ)
        if setting is not None:
            os.environ[bootstrap.VMM_ENV] = setting
        if g.rank == 0:
            uid = nvc.get_unique_id()
            bootstrap.publish_uid(store, g, session, uid._data.view(np.int8).tobytes())
        else:
            raw = bootstrap.fetch_uid(store, g, session, max(1.0, g.init_timeout_s - (time.monotonic() - start)))
            uid = nvc.get_unique_id(empty=True)
            view = uid._data.view(np.int8)
            if len(raw) != view.size:
                raise TransportUnavailableError(f"NVSHMEM unique id from the store has {len(raw)} bytes, this "
                                                f"nvshmem4py expects {view.size}")
            view[:] = np.frombuffer(raw, dtype=np.int8)
        bootstrap.mark_joined(store, g, session)
    except XferError as exc:
        if isinstance(exc, TransportUnavailableError):
            raise
        raise TransportUnavailableError(f"NVSHMEM group {g.name!r}: store {g.store}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - no libnvshmem_host, a driver error: report, keep the agent
        raise TransportUnavailableError(f"NVSHMEM unique id failed on rank {g.rank}: {exc!r}") from None
    failure, done = [], threading.Event()

    def run():
        try:
            device.set_current()
            nvc.init(device=device, uid=uid, rank=g.rank, nranks=g.size, initializer_method="uid")
        except BaseException as exc:  # noqa: BLE001 - reported below
            failure.append(exc)
        finally:
            done.set()

    on_init()
    threading.Thread(target=run, name="xfer-nvshmem-init", daemon=True).start()
    if not done.wait(max(1.0, g.init_timeout_s - (time.monotonic() - start))):
        try:
            n = bootstrap.joined(store, g, session)
        except XferError:
            n = "?"
        raise TransportUnavailableError(f"NVSHMEM init of group {g.name!r} (rank {g.rank} of {g.size}) did not "
                                        f"complete within {g.init_timeout_s:g} s; {n} of {g.size} PEs reached init")
    if failure:
        raise TransportUnavailableError(f"NVSHMEM init failed on rank {g.rank} of group {g.name!r}: "
                                        f"{failure[0]!r} (set NVSHMEM_DEBUG=INFO for NVSHMEM's own log)")
    mine, n = int(nvb.my_pe()), int(nvb.n_pes())
    if (mine, n) != (g.rank, g.size):
        raise TransportUnavailableError(f"NVSHMEM made this process PE {mine} of {n}; configured rank {g.rank} "
                                        f"of {g.size}")
    status = int(nvc.init_status())
    try:
        name = nvc.InitStatus(status).name  # e.g. STATUS_LIMITED_MPG: several PEs share a GPU
    except ValueError:
        name = str(status)
    if g.rank == 0:
        try:  # every PE has read it (init is collective); a later group must not read a stale id
            bootstrap.forget(store, g, session)
        except XferError:
            pass
    return Joined(session=session, heap=heap, status=name, limited_mpg=is_limited_mpg(name, status))
