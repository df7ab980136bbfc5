"""The UCX transport's wire format: tags, the connection hello and control messages.

Tags (64 bits; UCX matches tags per worker and does not say which endpoint a message came on, so
a tag names the receiving connection and proves itself):

    bits 63..48   the receiving side's id for the connection (1 .. 65535, from its hello)
    bits 47..32   control message: 0;  data chunk: the transfer's xid, low 16 bits (never 0)
    bits 31..0    control message: 0;  data chunk: BLAKE2s(the connection's tag key,
                  direction || xid || chunk number)[:4] (``Conn.chunk_tag``)

``xid`` is the 32-bit id the initiator gave the transfer in its REQ (increasing per connection,
skipping values whose low 16 bits are 0); a receiver recovers it from its low 16 bits and the
connection's newest xid (``full_xid``: live transfers are within 2**15 of it). Chunks of one
transfer are sent in order over one endpoint, so the receiver expects chunk k's tag from the
k-th arrival: without the connection's key a forged chunk matches it with probability 2**-32.

Hello (UCX stream API, both directions, fixed 256 bytes): ``!4sHI32s16s`` magic, version, the
conn id the peer must put in its tags, agent id (32 ASCII hex), a fresh nonce, then the agent
name (UTF-8, NUL padded). Both sides derive the connection's session key from the two nonces
(``Conn.establish``; xfer.auth) and prove it with a PROOF message before anything else.

Control message: ``!BIIQ16s`` kind, header length, binary length, sequence number, MAC · header
· binary part (block ids as little-endian int64, then the notification payload). The MAC
(xfer.auth.Session) covers the direction, sequence number, kind and both parts, and is checked
(``open_message``) before anything beyond this 33-byte prefix is decoded. The header holds the
fields its kind always carries in binary (``_FIELDS``: fixed-size numbers, then length-prefixed
UTF-8 strings), then anything else as JSON (a REQ's layout on first use), parsed bounded
(xfer.guard.loads). JSON was the whole header up to version 3: encoding and decoding it cost
15-25 us each on a cold cache (the 2-core VM), against 1-3 us for ``struct``.
"""

from __future__ import annotations

import enum
import json
import struct

import numpy as np

from ...auth import NONCE_BYTES
from ...errors import InvalidArgumentError, PeerDisconnectedError
from ...guard import loads

__all__ = ["Kind", "encode", "open_message", "hello", "parse_hello", "ctrl_tag", "full_xid", "next_xid",
           "xid_after", "request_error", "HELLO_BYTES", "VERSION", "PREFIX_BYTES"]

# 2: the initiator names the transfer (xid) and sends at once, no ACCEPT
# 3: a REQ names its layout by a per-connection id ("lid"); only the first REQ with it carries it
# 4: binary control headers (JSON only for the rare fields); a REQ carries its send time ("sent")
# 5: STOPPED (a stop is fenced on both sides); a REQ with a non-finite ttl or send time is refused
# 6: per-connection session keys (hello nonces), MAC'd control messages with sequence numbers, a
#    PROOF each way first; 16-bit connection ids, 32-bit xids, keyed chunk tags
VERSION = 6
LAYOUTS_MAX = 1024  # layouts one connection may describe (a peer that sends more is failed)
MAGIC = b"XFUC"
HELLO_BYTES = 256
_HELLO = struct.Struct("!4sHI32s16s")
_MSG = struct.Struct("!BIIQ16s")
PREFIX_BYTES = _MSG.size  # 33: a PROOF is exactly this (no header, no binary part)
CONN_MAX = 0xFFFF  # connection ids are 1 .. CONN_MAX (16 bits of a tag)


class Kind(enum.IntEnum):
    REQ = 1  # initiator -> target: a transfer (its xid), to validate; a WRITE's chunks follow at once
    # 2 was ACCEPT (wire version 1): the initiator no longer waits for one
    REFUSE = 3  # target -> initiator: invalid (typed error name + message)
    ACK = 4  # WRITE: target -> initiator, every byte landed and the notification was delivered
    FIN = 5  # READ: initiator -> target, every byte landed; deliver the notification
    CANCEL = 6  # either way: drop the transfer (deadline, cancel, local failure); the target's once it settled
    STOPPED = 7  # target -> initiator: the stopped transfer is dropped and settled here (the stop's fence)
    PROOF = 8  # either way, first: no body; its MAC proves the sender derived the session key


# How fast two hosts' monotonic clocks may drift apart (a REQ's delay is judged against the least
# delay its connection has seen; that floor rises this fast, so drift never reads as delay): 100 ppm
CLOCK_DRIFT = 1e-4


def ctrl_tag(conn: int) -> int:
    return (conn & CONN_MAX) << 48


XID_MOD = 1 << 32


def next_xid(xid: int) -> int:
    """The xid after ``xid`` (1 .. 2**32-1, never one whose low 16 bits are 0: its tags would read
    as a control message's)."""
    xid = xid % (XID_MOD - 1) + 1
    return xid + 1 if xid & 0xFFFF == 0 else xid


def xid_after(a: int, b: int) -> bool:
    """Whether xid ``a`` was issued after ``b`` (serial-number order over the 32-bit wrap)."""
    return 0 < (a - b) % XID_MOD < XID_MOD // 2


def full_xid(low: int, ref: int) -> int:
    """The xid whose low 16 bits are ``low`` nearest to ``ref`` (within 2**15 either way)."""
    d = (low - ref) & 0xFFFF
    return (ref + d if d < 0x8000 else ref + d - 0x10000) % XID_MOD


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


def encode(kind: Kind, header: dict, ids: np.ndarray | None = None, payload: bytes = b"", session=None) -> np.ndarray:
    """A control message as a uint8 array (what UCX sends), sealed by ``session`` (its sequence
    number and MAC). ``header`` must hold every field of ``kind`` (``_FIELDS``); other fields
    (JSON-able) travel as JSON."""
    fixed, nums, strs = _FIELDS.get(kind, _NONE)
    parts = [fixed.pack(*[header[f] for f in nums])]
    for f in strs:
        text = str(header[f]).encode()[:0xFFFF]
        parts += (_LEN.pack(len(text)), text)
    rest = {f: v for f, v in header.items() if f not in nums and f not in strs}
    if rest:
        parts.append(json.dumps(rest, separators=(",", ":")).encode())
    h = b"".join(parts)
    b = (b"" if ids is None else np.ascontiguousarray(ids, dtype="<i8").tobytes()) + payload
    seq, mac = session.seal(int(kind), h, b)
    return np.frombuffer(bytearray(_MSG.pack(int(kind), len(h), len(b), seq, mac) + h + b), dtype=np.uint8)


_NONE = (struct.Struct(""), (), ())


def open_message(buf: np.ndarray, session) -> tuple[Kind, dict, bytes]:
    """(kind, header, binary part) of a control message: its lengths, then its MAC and sequence
    number (``session.open``: AuthenticationError), then its fields (InvalidArgumentError naming
    what is malformed). Nothing past the fixed prefix is decoded before the MAC verified."""
    raw = memoryview(buf).cast("B")
    if len(raw) < _MSG.size:
        raise InvalidArgumentError(f"control message of {len(raw)} bytes, shorter than its {_MSG.size}-byte prefix")
    kind, hlen, blen, seq, mac = _MSG.unpack_from(raw)
    if _MSG.size + hlen + blen != len(raw):
        raise InvalidArgumentError(f"malformed control message: {hlen}+{blen} bytes announced, {len(raw)} received")
    end = _MSG.size + hlen
    h, binary = bytes(raw[_MSG.size:end]), bytes(raw[end:])
    session.open(seq, kind, h, binary, mac)
    try:
        kind = Kind(kind)
        fixed, nums, strs = _FIELDS.get(kind, _NONE)
        header = dict(zip(nums, fixed.unpack_from(h, 0)))
        at = fixed.size
        for f in strs:
            (n,) = _LEN.unpack_from(h, at)
            if at + 2 + n > hlen:
                raise ValueError(f"string field {f} of {n} bytes overruns the header")
            header[f] = h[at + 2:at + 2 + n].decode()
            at += 2 + n
    except (struct.error, ValueError) as exc:  # short, unknown kind, bad UTF-8
        raise InvalidArgumentError(f"malformed control message of {len(raw)} bytes: {exc}") from None
    if at < hlen:
        header.update(loads(h[at:], max_bytes=hlen, what=f"{kind.name} header's extra fields"))
    return kind, header, binary


def split_ids(binary: bytes, count: int) -> tuple[np.ndarray, bytes]:
    """Block ids (``count`` int64) and the notification payload from a REQ's binary part."""
    n = 8 * count
    if count < 0 or len(binary) < n:
        raise InvalidArgumentError(f"request announces {count} block ids but carries {len(binary)} bytes")
    return np.frombuffer(binary[:n], dtype="<i8").astype(np.int64), binary[n:]


def hello(conn: int, agent_id: str, name: str, nonce: bytes) -> np.ndarray:
    head = _HELLO.pack(MAGIC, VERSION, conn, agent_id.encode()[:32].ljust(32, b"0"), nonce)
    body = name.encode()[:HELLO_BYTES - _HELLO.size]
    return np.frombuffer((head + body).ljust(HELLO_BYTES, b"\0"), dtype=np.uint8).copy()


def parse_hello(buf: np.ndarray) -> tuple[int, str, str, bytes]:
    """(conn id to use, agent id, agent name, nonce) from a peer's hello."""
    raw = buf.tobytes()
    magic, version, conn, agent_id, nonce = _HELLO.unpack_from(raw)
    if magic != MAGIC:
        raise PeerDisconnectedError(f"peer is not an xfer UCX transport: hello starts with {magic[:4]!r}, "
                                    f"expected {MAGIC!r}")
    if version != VERSION:
        raise PeerDisconnectedError(f"peer speaks xfer UCX wire version {version}, this side {VERSION}")
    if not 0 < conn <= CONN_MAX:
        raise PeerDisconnectedError(f"peer sent connection id {conn} in its hello (1..{CONN_MAX})")
    assert len(nonce) == NONCE_BYTES
    return conn, agent_id.decode(errors="replace"), raw[_HELLO.size:].rstrip(b"\0").decode(errors="replace"), nonce


def request_error(req) -> Exception | None:
    """The error a finished UCX request ended with (ucxx's or the raw binding's ``check_error``),
    None when it succeeded."""
    try:
        req.check_error()
    except Exception as exc:  # noqa: BLE001 - UCX's error of this request, handed to its callback
        return exc
    return None
