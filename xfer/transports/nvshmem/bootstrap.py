"""NVSHMEM group bootstrap and teardown agreement through the agents' metadata store.

Keys (under the store's prefix):

    nvshmem/<group>/uid                       rank 0's record: session id, group size, staging
                                              bytes (removed by rank 0 once the group formed)
    nvshmem/<group>/<session>/uid             the 128-byte NVSHMEM unique id, base64 (removed too)
    nvshmem/<group>/<session>/joined          how many PEs reached ``nvshmem.core.init``
    nvshmem/<group>/<session>/gpu/<rank>      each PE's host and GPU, before init (``exchange_gpus``)
    nvshmem/<group>/<session>/close/...       the bounded teardown agreement (``agree_to_finalize``)

Group names must be unique per run (include a job id): a record left by a crashed rank 0 of an
earlier run with the same name would be read as the current one.
"""

from __future__ import annotations

import base64
import json
import time
import uuid

from ...errors import StoreError, StoreTimeoutError, TransportUnavailableError

__all__ = ["publish_session", "fetch_session", "publish_uid", "fetch_uid", "forget", "uid_key", "mark_joined",
           "exchange_gpus", "shared_gpus", "heap_choice", "agree_to_finalize"]

VMM_ENV = "NVSHMEM_DISABLE_CUDA_VMM"


def uid_key(group) -> str:
    """The key of rank 0's session record."""
    return f"nvshmem/{group.name}/uid"


def publish_session(store, group) -> str:
    """Rank 0: publish a new session (group size, staging bytes); returns its id. The unique id
    follows (:func:`publish_uid`) once every PE has said which GPU it uses: NVSHMEM reads its
    heap settings on the first call, so no PE may make one before the heap is decided."""
    session = uuid.uuid4().hex[:16]
    record = {"session": session, "size": group.size, "staging_bytes": group.staging_bytes}
    store.set(uid_key(group), json.dumps(record).encode())
    return session


def fetch_session(store, group, timeout: float) -> str:
    """Ranks > 0: wait up to ``timeout`` s for rank 0's session record; returns the session id.

    Raises :class:`TransportUnavailableError` naming what differs when rank 0 was configured
    with another group size or staging size (symmetric allocations must match on every PE).
    """
    try:
        blob = store.get(uid_key(group), timeout)
    except StoreTimeoutError:
        raise TransportUnavailableError(f"NVSHMEM group {group.name!r}: rank 0 did not publish the session in "
                                        f"store {store.endpoint} within {timeout:g} s") from None
    try:
        record = json.loads(blob)
        session, size, staging = record["session"], record["size"], record["staging_bytes"]
    except (ValueError, KeyError, TypeError) as exc:
        raise TransportUnavailableError(f"NVSHMEM group {group.name!r}: malformed session record in store "
                                        f"{store.endpoint}: {exc!r}") from None
    if size != group.size:
        raise TransportUnavailableError(f"NVSHMEM group {group.name!r}: rank 0 has size {size}, rank {group.rank} "
                                        f"was configured with size {group.size}")
    if staging != group.staging_bytes:
        raise TransportUnavailableError(f"NVSHMEM group {group.name!r}: rank 0 has staging_bytes {staging}, rank "
                                        f"{group.rank} has {group.staging_bytes}; they must match")
    return str(session)


def publish_uid(store, group, session: str, uid: bytes) -> None:
    """Rank 0: the session's NVSHMEM unique id."""
    store.set(f"nvshmem/{group.name}/{session}/uid", base64.b64encode(uid))


def fetch_uid(store, group, session: str, timeout: float) -> bytes:
    """Ranks > 0: wait up to ``timeout`` s for the session's unique id."""
    try:
        blob = store.get(f"nvshmem/{group.name}/{session}/uid", timeout)
    except StoreTimeoutError:
        raise TransportUnavailableError(f"NVSHMEM group {group.name!r}: rank 0 did not publish the unique id in "
                                        f"store {store.endpoint} within {timeout:g} s") from None
    try:
        return base64.b64decode(blob, validate=True)
    except ValueError as exc:
        raise TransportUnavailableError(f"NVSHMEM group {group.name!r}: malformed unique id in store "
                                        f"{store.endpoint}: {exc!r}") from None


def forget(store, group, session: str) -> None:
    """Rank 0, once the group formed: every PE has read the records; a later group must not."""
    store.delete(uid_key(group))
    store.delete(f"nvshmem/{group.name}/{session}/uid")
    for rank in range(group.size):
        store.delete(f"nvshmem/{group.name}/{session}/gpu/{rank}")


def mark_joined(store, group, session: str) -> int:
    """Count this PE in (for the message when init times out); returns the count so far."""
    return store.add(f"nvshmem/{group.name}/{session}/joined", 1)


def exchange_gpus(store, group, session: str, host_id: str, gpu: str, timeout: float) -> dict[int, tuple[str, str]]:
    """Publish this PE's (host, GPU uuid) and wait up to ``timeout`` s for every PE's: rank -> (host, gpu).

    Before ``nvshmem.core.init`` (whose heap settings must agree on every PE): each PE decides
    from the same records (:func:`heap_choice`)."""
    prefix = f"nvshmem/{group.name}/{session}/gpu/"
    store.set(prefix + str(group.rank), json.dumps([host_id, gpu]).encode())
    out, end = {}, time.monotonic() + timeout
    for rank in range(group.size):
        try:
            blob = store.get(prefix + str(rank), max(0.0, end - time.monotonic()))
        except StoreTimeoutError:
            raise TransportUnavailableError(f"NVSHMEM group {group.name!r}: rank {rank} did not say which GPU it "
                                            f"uses within {timeout:g} s (rank {group.rank} waited)") from None
        try:
            host, dev = json.loads(blob)
            out[rank] = (str(host), str(dev))
        except (ValueError, TypeError) as exc:
            raise TransportUnavailableError(f"NVSHMEM group {group.name!r}: malformed GPU record of rank {rank}: "
                                            f"{exc!r}") from None
    return out


def shared_gpus(gpus: dict[int, tuple[str, str]]) -> list[list[int]]:
    """Groups of ranks that share one GPU of one host (NVSHMEM's multiple PEs per GPU), sorted."""
    by_gpu: dict[tuple[str, str], list[int]] = {}
    for rank, key in sorted(gpus.items()):
        by_gpu.setdefault(key, []).append(rank)
    return [ranks for ranks in by_gpu.values() if len(ranks) > 1]


def heap_choice(shared: list[list[int]], environ) -> tuple[str | None, str]:
    """The ``NVSHMEM_DISABLE_CUDA_VMM`` value to set before init (None: leave it) and what the heap is.

    Where PEs share a GPU, NVSHMEM 3.4's growing (VMM) heap was seen leaving a chunk of one PE's
    heap unmapped in the other (H200, two PEs, a 2.5 GiB heap: the third 512 MiB chunk): stores
    to that peer then fault. The static heap (one ``cudaMalloc`` of ``NVSHMEM_SYMMETRIC_SIZE``,
    mapped once at init) has no growth: it is chosen there unless the user set the variable."""
    user = environ.get(VMM_ENV)
    if not shared:
        return None, "NVSHMEM's default heap" + (f" ({VMM_ENV}={user})" if user is not None else "")
    who = "; ".join("ranks " + ", ".join(map(str, ranks)) for ranks in shared)
    if user is not None:
        return None, (f"{VMM_ENV}={user} as set by the user, with PEs sharing a GPU ({who})"
                      + ("" if user.strip() not in ("0", "") else
                         ": NVSHMEM 3.4's growing heap can leave peer chunks unmapped there"))
    return "1", (f"static ({VMM_ENV}=1: PEs share a GPU ({who}), where NVSHMEM 3.4's growing heap left peer "
                 f"chunks unmapped; NVSHMEM_SYMMETRIC_SIZE is reserved at init)")


def joined(store, group, session: str) -> int:
    return store.add(f"nvshmem/{group.name}/{session}/joined", 0)


def agree_to_finalize(store, group, session: str, *, vote: bool, timeout: float,
                      poll: float = 0.01) -> tuple[bool, str]:
    """Bounded teardown barrier: True when every PE may free symmetric memory and finalize.

    ``nvshmem_free`` and ``nvshmem_finalize`` are collectives that block (holding the GIL) until
    every PE joins, so a PE that calls them while a peer is gone hangs its whole process. Every PE
    that can tear down votes by counting itself in; the first PE to see all ``size`` votes, or to
    reach ``timeout``, takes the single ticket and writes the verdict every PE then follows:
    ``go`` only if all voted. A PE that cannot tear down (``vote=False``) settles ``abort``
    at once when it gets the ticket. Returns (go, why).
    """
    prefix = f"nvshmem/{group.name}/{session}/close/"
    try:
        if vote:
            store.add(prefix + "arrived", 1)
        end = time.monotonic() + timeout
        while True:
            verdict = store.try_get(prefix + "verdict")
            if verdict is not None:
                return verdict == b"go", f"verdict {verdict.decode()!r} from the PE that decided"
            arrived = store.add(prefix + "arrived", 0)
            late = time.monotonic() >= end
            if not vote or arrived >= group.size or late:
                break
            time.sleep(poll)
        if store.add(prefix + "ticket", 1) == 1:  # this PE decides
            go = vote and arrived >= group.size
            store.set(prefix + "verdict", b"go" if go else b"abort")
            why = (f"all {group.size} PEs arrived" if go else
                   "this PE could not tear down cleanly" if not vote else
                   f"only {arrived} of {group.size} PEs arrived within {timeout:g} s")
            return go, why
        try:  # another PE holds the ticket: it writes the verdict right away
            verdict = store.get(prefix + "verdict", max(1.0, min(timeout, 10.0)))
        except StoreTimeoutError:
            return False, "the PE that took the decision did not write it (gone?)"
        return verdict == b"go", f"verdict {verdict.decode()!r} from the PE that decided"
    except StoreError as exc:
        return False, f"the metadata store failed during teardown: {exc}"

