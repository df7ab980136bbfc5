"""NVSHMEM transport: the staging plan (where chunks and signal words sit) and the control messages.

Pure Python: no NVSHMEM, no GPU. Every parse function checks what a peer sent and raises a typed
:class:`~xfer.errors.XferError` naming the value received and the value expected; the control
server hands that error back to the initiator.

Lanes and roles: traffic from PE ``src`` to PE ``dst`` runs on two independent lanes, one per
initiator, so each lane has a single owner of its sequence numbers:

    ROLE_WRITE  ``src`` initiated it (a WRITE); ``src`` numbers the chunks
    ROLE_READ   ``dst`` initiated it (a READ);  ``dst`` numbers the chunks

Sequence numbers count chunks, start at 1 and only grow on a lane; a transfer takes ``chunks``
consecutive numbers ``seq0 .. seq0 + chunks - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import InvalidArgumentError, LayoutError
from ...layout import KVLayout
from ...transfer import Op
from ..chunking import ChunkPlan, plan_blocks
from ..incoming import check_request, check_ttl

__all__ = ["ROLE_WRITE", "ROLE_READ", "ROLE_NAMES", "DEPTH", "StagingPlan", "ChunkPlan", "plan_chunks",
           "Begin", "ReadRequest", "parse_begin", "parse_read", "parse_member", "parse_abort"]

ROLE_WRITE, ROLE_READ = 0, 1
ROLE_NAMES = {ROLE_WRITE: "write", ROLE_READ: "read"}
DEPTH = 4  # chunk positions per lane slot: up to DEPTH chunks of a lane in flight
_ALIGN = 256


class StagingPlan:
    """Byte offsets in the symmetric buffers, identical on every PE.

    Each PE holds a *receive* area and a *send* area of ``2 * size`` slots of ``slot_bytes``
    (one per peer PE and role; ``staging_bytes`` per peer in all), each slot cut into ``DEPTH``
    chunk positions of ``chunk_cap`` bytes; and ``2 * size`` uint64 *data* words (indexed by
    source PE and role, set by the sender's put-with-signal) and as many *credit* words (indexed
    by destination PE and role, set by the receiver once it scattered a chunk).
    """

    __slots__ = ("size", "depth", "slot_bytes", "chunk_cap", "area_bytes", "words")

    def __init__(self, size: int, staging_bytes: int, depth: int = DEPTH):
        self.size, self.depth = size, depth
        self.slot_bytes = staging_bytes // 2 // _ALIGN * _ALIGN
        self.chunk_cap = self.slot_bytes // depth // _ALIGN * _ALIGN
        self.area_bytes = 2 * size * self.slot_bytes
        self.words = 2 * size
        if self.chunk_cap < _ALIGN:
            raise InvalidArgumentError(f"staging_bytes={staging_bytes} leaves chunks of {self.chunk_cap} bytes")

    def __repr__(self) -> str:
        return (f"StagingPlan(size={self.size}, slot={self.slot_bytes} B, chunk_cap={self.chunk_cap} B, "
                f"depth={self.depth})")

    def word(self, peer: int, role: int) -> int:
        """Index of the data word (peer = source) or credit word (peer = destination)."""
        return 2 * peer + role

    def position(self, peer: int, role: int, seq: int) -> int:
        """Byte offset of the chunk position sequence number ``seq`` uses in slot (peer, role)."""
        return self.word(peer, role) * self.slot_bytes + (seq % self.depth) * self.chunk_cap


def plan_chunks(n: int, bytes_per_block: int, chunk_cap: int, chunk_bytes: int) -> ChunkPlan:
    """Whole blocks per chunk: as many as fit ``min(chunk_cap, chunk_bytes)``, at least one."""
    return plan_blocks(n, bytes_per_block, chunk_cap, chunk_bytes, "an NVSHMEM staging chunk",
                       f"; raise NvshmemGroup.staging_bytes to at least {2 * DEPTH * bytes_per_block}")


# ---- messages ----------------------------------------------------------------------------------
def _field(h: dict, key: str, kind, what: str):
    value = h.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InvalidArgumentError(f"{what}: field {key!r} must be {getattr(kind, '__name__', kind)}, got {value!r}"[:300])
    return value


def parse_member(h: dict, *, group: str, session: str, size: int) -> int:
    """Check that a message comes from a PE of this NVSHMEM group and session; returns its PE."""
    what = f"control message {h.get('type')!r}"
    if h.get("group") != group:
        raise InvalidArgumentError(f"{what} is for NVSHMEM group {h.get('group')!r}; this agent is in {group!r}")
    if h.get("session") != session:
        raise InvalidArgumentError(f"{what} comes from NVSHMEM session {h.get('session')!r}, this PE is in "
                                   f"session {session!r} (stale metadata, or a peer from another run)")
    pe = _field(h, "pe", int, what)
    if not 0 <= pe < size:
        raise InvalidArgumentError(f"{what}: PE {pe} is outside the group's 0..{size - 1}")
    return pe


def _counts(h: dict, what: str, n: int, bytes_per_block: int, chunk_cap: int) -> tuple[ChunkPlan, int]:
    per, seq0, chunks = (_field(h, k, int, what) for k in ("per_chunk", "seq0", "chunks"))
    if per < 1 or per * bytes_per_block > chunk_cap:
        raise InvalidArgumentError(f"{what}: {per} blocks of {bytes_per_block} bytes per chunk exceed this PE's "
                                   f"staging chunk of {chunk_cap} bytes (NvshmemGroup.staging_bytes differs?)")
    plan = ChunkPlan(n=n, per=per)
    if n < 1 or chunks != plan.chunks:
        raise InvalidArgumentError(f"{what}: {n} blocks at {per} per chunk make {plan.chunks} chunks, "
                                   f"the message says {chunks}")
    if seq0 < 1:
        raise InvalidArgumentError(f"{what}: seq0 must be >= 1, got {seq0}")
    return plan, seq0


def _timeout(h: dict, what: str) -> float:
    t = check_ttl(h.get("timeout"), what=f"{what}: timeout")  # the one check of a peer's time (NaN, inf refused)
    if not t > 0:
        raise InvalidArgumentError(f"{what}: timeout must be seconds > 0, got {t!r}")
    return t


@dataclass(frozen=True)
class Begin:
    """A WRITE announced to its receiver: where the blocks go and how they are numbered."""

    pe: int
    sender: str
    transfer_id: str
    region: str
    ids: np.ndarray  # receiver's block ids, unique
    sender_layout: KVLayout
    plan: ChunkPlan
    seq0: int
    timeout: float
    dead_upto: int
    pid: int
    host_id: str


def parse_begin(h: dict, *, pe: int, region_lookup, chunk_cap: int, agent: str = "this agent") -> tuple[Begin, object]:
    """Validate ``nvshmem.begin``; returns the request and the local region it writes into."""
    what = "nvshmem.begin"
    name = _field(h, "region", str, what)
    try:
        sender_layout = KVLayout.from_dict(h.get("layout"))
    except LayoutError as exc:
        raise InvalidArgumentError(f"{what}: the sender's layout is malformed: {exc}") from None
    region, ids = check_request(region_lookup, region=name, op=Op.WRITE, ids=h.get("blocks"),
                                what="destination block ids", agent=agent, initiator=str(h.get("from")),
                                sender_layout=sender_layout)
    plan, seq0 = _counts(h, what, ids.size, region.layout.bytes_per_block, chunk_cap)
    begin = Begin(pe=pe, sender=str(h.get("from")), transfer_id=_field(h, "transfer_id", str, what),
                  region=region.name, ids=ids, sender_layout=sender_layout, plan=plan, seq0=seq0,
                  timeout=_timeout(h, what), dead_upto=_field(h, "dead_upto", int, what),
                  pid=_field(h, "pid", int, what), host_id=str(h.get("host_id")))
    return begin, region


@dataclass(frozen=True)
class ReadRequest:
    """A READ asked of the PE that holds the blocks: it gathers and puts them to the initiator."""

    pe: int
    initiator: str
    transfer_id: str
    region: str
    ids: np.ndarray  # this PE's block ids (may repeat)
    plan: ChunkPlan
    seq0: int
    timeout: float
    dead_upto: int
    pid: int
    host_id: str


def parse_read(h: dict, *, pe: int, region_lookup, chunk_cap: int, agent: str = "this agent") -> tuple[ReadRequest, object]:
    """Validate ``nvshmem.read``; returns the request and the local region it reads from."""
    what = "nvshmem.read"
    region, ids = check_request(region_lookup, region=_field(h, "region", str, what), op=Op.READ, ids=h.get("blocks"),
                                what="source block ids", agent=agent, initiator=str(h.get("from")),
                                fingerprint=str(h.get("fingerprint")))
    plan, seq0 = _counts(h, what, ids.size, region.layout.bytes_per_block, chunk_cap)
    req = ReadRequest(pe=pe, initiator=str(h.get("from")), transfer_id=_field(h, "transfer_id", str, what),
                      region=region.name, ids=ids, plan=plan, seq0=seq0, timeout=_timeout(h, what),
                      dead_upto=_field(h, "dead_upto", int, what), pid=_field(h, "pid", int, what),
                      host_id=str(h.get("host_id")))
    return req, region


def parse_abort(h: dict) -> tuple[int, int]:
    """``nvshmem.abort``: (role, upto): every transfer of that lane numbered up to ``upto`` is dead."""
    role = {"write": ROLE_WRITE, "read": ROLE_READ}.get(h.get("role"))
    if role is None:
        raise InvalidArgumentError(f"nvshmem.abort: role must be 'write' or 'read', got {h.get('role')!r}")
    return role, _field(h, "upto", int, "nvshmem.abort")
