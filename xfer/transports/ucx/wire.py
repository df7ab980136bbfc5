"""The UCX transport's wire format: settings, tags, the connection hello and control messages.

Tags (64 bits; UCX matches tags per worker, so every tag names the receiving connection):

    control message   (conn << 32) | 0
    data chunk        (conn << 32) | (xid << 8) | (seq & 0xFF)      xid in 1 .. 2**24-1

``conn`` is the id the *receiving* side gave the connection in its hello; ``xid`` is the id the
initiator gave the transfer in its REQ (increasing per connection, wrapping past 2**24-1 to 1).
Chunks of one transfer are sent in ``seq`` order over one endpoint, and UCX keeps that order, so
the receiver names the k-th arrival chunk k and checks ``seq & 0xFF``.

Hello (UCX stream API, both directions, fixed 256 bytes): ``!4sHI32s`` magic, version, the conn
id the peer must put in its tags, agent id (32 ASCII hex), then the agent name (UTF-8, NUL padded).

Control message: ``!BII`` kind, header length, binary length · header · binary part (block ids
as little-endian int64, then the notification payload). The header holds the fields its kind
always carries in binary (``_FIELDS``: fixed-size numbers, then length-prefixed UTF-8 strings),
then anything else as JSON (a REQ's layout on first use, the authentication stamp), or nothing.
JSON was the whole header up to version 3: encoding and decoding it cost 15-25 us each on a cold
cache (the 2-core VM, after a transfer streamed through it), against 1-3 us for ``struct``, four
times on a lone write's critical path (its REQ and ACK, each end).
"""

from __future__ import annotations

import enum
import json
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from ...config import env_on
from ...errors import InvalidArgumentError, PeerDisconnectedError

__all__ = ["UcxSettings", "Kind", "encode", "decode", "hello", "parse_hello", "ctrl_tag", "data_tag",
           "CTRL_MASK", "HELLO_BYTES", "VERSION"]

# 2: the initiator names the transfer (xid) and sends at once, no ACCEPT
# 3: a REQ names its layout by a per-connection id ("lid"); only the first REQ with it carries it
# 4: binary control headers (JSON only for the rare fields); a REQ carries its send time ("sent")
VERSION = 4
LAYOUTS_MAX = 1024  # layouts one connection may describe (a peer that sends more is failed)
MAGIC = b"XFUC"
HELLO_BYTES = 256
_HELLO = struct.Struct("!4sHI32s")
_MSG = struct.Struct("!BII")
CTRL_MASK = 0xFFFFFFFF  # probe mask: the low 32 bits (0 = control) of any connection

# UCX defaults that cost us two thirds of the wire over TCP (measured, see the design notes in
# transport.py): 8 KiB TCP segments turn a rendezvous into thousands of small bcopy fragments; and a
# scatter-gather rendezvous moves at most TCP_MAX_IOV entries (6 by default) per zero-copy
# fragment, so a chunk of 4 KiB blocks went in 20 KiB fragments (CPU VM, loopback, 32 x 256 x
# 4 KiB: 0.62-0.70 of a contiguous ucxx send with 6, 0.72-0.89 with 64; 32 KiB blocks 0.74-1.03
# -> 1.08-1.22; 256 was no better than 64). A user's own UCX_* variable always wins over these.
TUNED_UCX = {
    "TCP_TX_SEG_SIZE": "512K",
    "TCP_RX_SEG_SIZE": "512K",
    "TCP_MAX_IOV": "64",
}


def _env_int(name: str, default: int) -> int:
    """An integer environment setting; a K or M suffix multiplies by 1024 or 1024**2."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    text, scale = raw.strip().upper(), 1
    if text[-1] in "KM":
        text, scale = text[:-1], 1024 if text[-1] == "K" else 1 << 20
    try:
        return int(text) * scale
    except ValueError:
        raise InvalidArgumentError(f"{name} must be an integer (optionally with K or M), got {raw!r}") from None


@dataclass(frozen=True)
class UcxSettings:
    """Knobs of the UCX transport, each with an ``XFER_UCX_*`` environment variable.

    chunk_bytes (XFER_UCX_CHUNK_BYTES): bytes per host staging slot (host and pinned pools) and
        wire message; a transfer is cut into chunks of whole blocks (or whole layers of one block
        when a block is bigger). Published to peers (``chunk_bytes`` in ``info()``): the initiator
        plans with the smaller of the two sides' slots and the target refuses bigger chunks.
    device_chunk_bytes (XFER_UCX_DEVICE_CHUNK_BYTES): the same for device staging (CUDA regions
        sent GPU-direct), published as ``device_chunk_bytes``. Larger: each chunk costs ~0.1-0.2 ms
        of host work on each side (a launch, a message, completions) against ~0.06 ms of HBM
        time for 64 MiB, so device transfers move in as few chunks as fit (one chunk for a
        transfer that fits in a slot between two device regions).
    device_slots (XFER_UCX_DEVICE_SLOTS): slots of the device pool (footprint
        ``device_slots * device_chunk_bytes`` of GPU memory per device, allocated on first use).
    depth (XFER_UCX_DEPTH): chunks of one transfer in flight at once (gathered, on the wire or
        being scattered); <= 255.
    slots (XFER_UCX_SLOTS): staging slots per memory kind shared by all transfers (>= 2; sends
        hold at most ``slots - slots // 2``, the rest is kept for receives: see loop); the
        staging footprint is ``slots * chunk_bytes`` per kind whatever the transfers' sizes.
    port (XFER_UCX_PORT): listener port (0: any free one).
    address (XFER_UCX_ADDRESS): the address published to peers (default: the agent's control
        ``listen_host``, or this host's name resolved when that is a wildcard).
    keepalive_s (XFER_UCX_KEEPALIVE_S): UCX endpoint keepalive, how soon a silent dead peer is noticed.
    inline_bytes (XFER_UCX_INLINE_BYTES): chunks up to this size are gathered / scattered on the
        engine thread itself (two thread hand-offs fewer a chunk: what small transfers wait on);
        larger ones on the copy thread, overlapping the wire.
    iov_min_bytes (XFER_UCX_IOV_MIN_BYTES): host regions whose blocks are at least this many bytes
        send each chunk straight from the blocks as one UCX scatter-gather message (no gather
        into a slot; ``XFER_UCX_IOV=0`` turns that off). Below it each address costs UCX more
        than the copy saves. Over TCP (CPU VM, loopback, one core a side): 512 B blocks went 1.6x
        slower, 32 KiB blocks 10 % faster; 4 KiB blocks 0.49-0.64 of a contiguous ucxx send in
        place against 0.65-0.76 gathered (2026-12-05, interleaved runs; sampled with perf, the
        sender's core spent the same time copying either way: the kernel reading 4 KiB pieces
        in place, or the gather plus the kernel reading one slot; UCX's scatter-gather path
        costs the rest). 8 and 16 KiB blocks were not measured.
    iov_recv (XFER_UCX_IOV_RECV): chunks are also received straight into the blocks where both
        sides use the same block order (no slot, no scatter); off: they land in a slot.
    iov_recv_min_bytes (XFER_UCX_IOV_RECV_MIN_BYTES): the block size from which a host region
        receives in place. A receive has no such limit as a send: UCX unpacks the arriving
        fragments into the address list in C, where a staged chunk would be scattered by one
        numpy call per layer, K and V (CPU VM, loopback, 32 x 64 blocks of 512 B, both processes on
        their own core: 1.8-2.0 ms a lone write with the scatter, 1.3-1.46 ms in place).
    """

    chunk_bytes: int = 16 << 20
    depth: int = 4
    slots: int = 8
    device_chunk_bytes: int = 64 << 20
    device_slots: int = 4
    port: int = 0
    address: str | None = None
    keepalive_s: float = 1.0
    inline_bytes: int = 1 << 20
    iov_min_bytes: int = 8192
    iov_recv: bool = True
    iov_recv_min_bytes: int = 0
    ucx_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 4096:
            raise InvalidArgumentError(f"chunk_bytes must be an int >= 4096, got {self.chunk_bytes!r}")
        if not isinstance(self.device_chunk_bytes, int) or self.device_chunk_bytes < 4096:
            raise InvalidArgumentError(f"device_chunk_bytes must be an int >= 4096, got {self.device_chunk_bytes!r}")
        if not isinstance(self.device_slots, int) or self.device_slots < 2:
            raise InvalidArgumentError(f"device_slots must be an int >= 2 (sends and receives each need one), "
                                       f"got {self.device_slots!r}")
        if not isinstance(self.depth, int) or not 1 <= self.depth <= 255:
            raise InvalidArgumentError(f"depth must be in 1..255, got {self.depth!r}")
        if not isinstance(self.slots, int) or self.slots < 2:
            raise InvalidArgumentError(f"slots must be an int >= 2 (sends and receives each need one), "
                                       f"got {self.slots!r}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise InvalidArgumentError(f"port must be in 0..65535, got {self.port!r}")
        if not isinstance(self.inline_bytes, int) or self.inline_bytes < 0:
            raise InvalidArgumentError(f"inline_bytes must be an int >= 0, got {self.inline_bytes!r}")
        if not isinstance(self.iov_min_bytes, int) or self.iov_min_bytes < 0:
            raise InvalidArgumentError(f"iov_min_bytes must be an int >= 0, got {self.iov_min_bytes!r}")
        if not isinstance(self.iov_recv_min_bytes, int) or self.iov_recv_min_bytes < 0:
            raise InvalidArgumentError(f"iov_recv_min_bytes must be an int >= 0, got {self.iov_recv_min_bytes!r}")
        if not self.keepalive_s > 0:
            raise InvalidArgumentError(f"keepalive_s must be > 0, got {self.keepalive_s!r}")

    @classmethod
    def from_env(cls) -> "UcxSettings":
        d = cls()
        return cls(chunk_bytes=_env_int("XFER_UCX_CHUNK_BYTES", d.chunk_bytes),
                   depth=_env_int("XFER_UCX_DEPTH", d.depth), slots=_env_int("XFER_UCX_SLOTS", d.slots),
                   device_chunk_bytes=_env_int("XFER_UCX_DEVICE_CHUNK_BYTES", d.device_chunk_bytes),
                   device_slots=_env_int("XFER_UCX_DEVICE_SLOTS", d.device_slots),
                   port=_env_int("XFER_UCX_PORT", d.port), address=os.environ.get("XFER_UCX_ADDRESS") or None,
                   keepalive_s=float(os.environ.get("XFER_UCX_KEEPALIVE_S", d.keepalive_s)),
                   inline_bytes=_env_int("XFER_UCX_INLINE_BYTES", d.inline_bytes),
                   iov_min_bytes=_env_int("XFER_UCX_IOV_MIN_BYTES", d.iov_min_bytes),
                   iov_recv=env_on("XFER_UCX_IOV_RECV", d.iov_recv),
                   iov_recv_min_bytes=_env_int("XFER_UCX_IOV_RECV_MIN_BYTES", d.iov_recv_min_bytes))

    def slot_bytes(self, kind: str) -> int:
        """Bytes per staging slot of a pool kind ("host", "pinned", "cuda:N")."""
        return self.device_chunk_bytes if kind.startswith("cuda") else self.chunk_bytes

    def slot_count(self, kind: str) -> int:
        return self.device_slots if kind.startswith("cuda") else self.slots

    def context_options(self) -> dict:
        """UCX options for the context: tuned defaults, unless the user's environment sets them."""
        opts = {k: v for k, v in TUNED_UCX.items() if f"UCX_{k}" not in os.environ}
        if "UCX_KEEPALIVE_INTERVAL" not in os.environ:
            opts["KEEPALIVE_INTERVAL"] = f"{self.keepalive_s}s"
        opts.update(self.ucx_options)
        return opts


class Kind(enum.IntEnum):
    REQ = 1  # initiator -> target: a transfer (its xid), to validate; a WRITE's chunks follow at once
    # 2 was ACCEPT (wire version 1): the initiator no longer waits for one
    REFUSE = 3  # target -> initiator: invalid (typed error name + message)
    ACK = 4  # WRITE: target -> initiator, every byte landed and the notification was delivered
    FIN = 5  # READ: initiator -> target, every byte landed; deliver the notification
    CANCEL = 6  # either way: drop the transfer (deadline, cancel, local failure)


# How fast two hosts' monotonic clocks may drift apart (a REQ's delay is judged against the least
# delay its connection has seen; that floor rises this fast, so drift never reads as delay): 100 ppm
CLOCK_DRIFT = 1e-4


def ctrl_tag(conn: int) -> int:
    return (conn & 0xFFFFFFFF) << 32


def data_tag(conn: int, xid: int, seq: int) -> int:
    return ((conn & 0xFFFFFFFF) << 32) | ((xid & 0xFFFFFF) << 8) | (seq & 0xFF)


XID_MOD = 1 << 24


def next_xid(xid: int) -> int:
    """The xid after ``xid`` (1 .. 2**24-1; 0 is never used: its chunk 0 would look like control)."""
    return xid % (XID_MOD - 1) + 1


def xid_after(a: int, b: int) -> bool:
    """Whether xid ``a`` was issued after ``b`` (serial-number order over the 24-bit wrap)."""
    return 0 < (a - b) % XID_MOD < XID_MOD // 2


# Per kind: (its numeric fields as one struct, their names, its string fields). Every message of
# the kind carries them; any other header field goes as JSON after them.
_FIELDS = {
    Kind.REQ: (struct.Struct("!QIIIIIdd"), ("k", "xid", "n", "bpc", "lpc", "lid", "ttl", "sent"),
               ("op", "region", "tid", "from", "order")),
    Kind.REFUSE: (struct.Struct("!Q"), ("k",), ("error", "message")),
    Kind.ACK: (struct.Struct("!Q"), ("k",), ()),
    Kind.FIN: (struct.Struct("!Q"), ("k",), ()),
    Kind.CANCEL: (struct.Struct("!Q?"), ("k", "init"), ("why",)),
}
_LEN = struct.Struct("!H")


def encode(kind: Kind, header: dict, ids: np.ndarray | None = None, payload: bytes = b"") -> np.ndarray:
    """A control message as a uint8 array (what UCX sends). ``header`` must hold every field of
    ``kind`` (``_FIELDS``); other fields (JSON-able) travel as JSON."""
    fixed, nums, strs = _FIELDS[kind]
    parts = [fixed.pack(*[header[f] for f in nums])]
    for f in strs:
        text = str(header[f]).encode()[:0xFFFF]
        parts += (_LEN.pack(len(text)), text)
    rest = {f: v for f, v in header.items() if f not in nums and f not in strs}
    if rest:
        parts.append(json.dumps(rest, separators=(",", ":")).encode())
    h = b"".join(parts)
    b = (b"" if ids is None else np.ascontiguousarray(ids, dtype="<i8").tobytes()) + payload
    return np.frombuffer(bytearray(_MSG.pack(int(kind), len(h), len(b)) + h + b), dtype=np.uint8)


def decode(buf: np.ndarray) -> tuple[Kind, dict, bytes]:
    """(kind, header, binary part) of a control message; PeerDisconnectedError if malformed."""
    raw = memoryview(buf).cast("B")
    try:
        kind, hlen, blen = _MSG.unpack_from(raw)
        if _MSG.size + hlen + blen != len(raw):
            raise PeerDisconnectedError(f"malformed control message: {hlen}+{blen} bytes announced, "
                                        f"{len(raw)} received")
        kind = Kind(kind)
        fixed, nums, strs = _FIELDS[kind]
        at, end = _MSG.size, _MSG.size + hlen
        header = dict(zip(nums, fixed.unpack_from(raw, at)))
        at += fixed.size
        for f in strs:
            (n,) = _LEN.unpack_from(raw, at)
            header[f] = str(raw[at + 2:at + 2 + n], "utf-8")
            at += 2 + n
        if at > end:
            raise PeerDisconnectedError(f"malformed {kind.name} header: {at - _MSG.size} bytes of fields in a "
                                        f"header of {hlen}")
        if at < end:
            rest = json.loads(bytes(raw[at:end]))
            if not isinstance(rest, dict):
                raise PeerDisconnectedError(f"malformed {kind.name} header: extra fields are {type(rest).__name__}")
            header.update(rest)
        return kind, header, bytes(raw[end:])
    except PeerDisconnectedError:
        raise
    except (struct.error, ValueError, KeyError) as exc:  # short, unknown kind, bad UTF-8 or JSON
        raise PeerDisconnectedError(f"malformed control message of {len(raw)} bytes: {exc}") from None


def split_ids(binary: bytes, count: int) -> tuple[np.ndarray, bytes]:
    """Block ids (``count`` int64) and the notification payload from a REQ's binary part."""
    n = 8 * count
    if count < 0 or len(binary) < n:
        raise InvalidArgumentError(f"request announces {count} block ids but carries {len(binary)} bytes")
    return np.frombuffer(binary[:n], dtype="<i8").astype(np.int64), binary[n:]


def hello(conn: int, agent_id: str, name: str) -> np.ndarray:
    head = _HELLO.pack(MAGIC, VERSION, conn, agent_id.encode()[:32].ljust(32, b"0"))
    body = name.encode()[:HELLO_BYTES - _HELLO.size]
    return np.frombuffer((head + body).ljust(HELLO_BYTES, b"\0"), dtype=np.uint8).copy()


def parse_hello(buf: np.ndarray) -> tuple[int, str, str]:
    """(conn id to use, agent id, agent name) from a peer's hello."""
    raw = buf.tobytes()
    magic, version, conn, agent_id = _HELLO.unpack_from(raw)
    if magic != MAGIC:
        raise PeerDisconnectedError(f"peer is not an xfer UCX transport: hello starts with {magic!r}, "
                                    f"expected {MAGIC!r}")
    if version != VERSION:
        raise PeerDisconnectedError(f"peer speaks xfer UCX wire version {version}, this side {VERSION}")
    return conn, agent_id.decode(), raw[_HELLO.size:].rstrip(b"\0").decode(errors="replace")
