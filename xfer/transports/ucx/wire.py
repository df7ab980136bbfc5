"""The UCX transport's wire format: tags, the connection hello and control messages.

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
import struct

import numpy as np

from ...errors import InvalidArgumentError, PeerDisconnectedError

__all__ = ["Kind", "encode", "decode", "hello", "parse_hello", "ctrl_tag", "data_tag",
           "CTRL_MASK", "HELLO_BYTES", "VERSION"]

# 2: the initiator names the transfer (xid) and sends at once, no ACCEPT
# 3: a REQ names its layout by a per-connection id ("lid"); only the first REQ with it carries it
# 4: binary control headers (JSON only for the rare fields); a REQ carries its send time ("sent")
# 5: STOPPED (a stop is fenced on both sides); a REQ with a non-finite ttl or send time is refused
VERSION = 5
LAYOUTS_MAX = 1024  # layouts one connection may describe (a peer that sends more is failed)
MAGIC = b"XFUC"
HELLO_BYTES = 256
_HELLO = struct.Struct("!4sHI32s")
_MSG = struct.Struct("!BII")
CTRL_MASK = 0xFFFFFFFF  # probe mask: the low 32 bits (0 = control) of any connection


class Kind(enum.IntEnum):
    REQ = 1  # initiator -> target: a transfer (its xid), to validate; a WRITE's chunks follow at once
    # 2 was ACCEPT (wire version 1): the initiator no longer waits for one
    REFUSE = 3  # target -> initiator: invalid (typed error name + message)
    ACK = 4  # WRITE: target -> initiator, every byte landed and the notification was delivered
    FIN = 5  # READ: initiator -> target, every byte landed; deliver the notification
    CANCEL = 6  # either way: drop the transfer (deadline, cancel, local failure); the target's once it settled
    STOPPED = 7  # target -> initiator: the stopped transfer is dropped and settled here (the stop's fence)


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
    Kind.STOPPED: (struct.Struct("!Q"), ("k",), ()),
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
