"""What one agent tells its peers: identity, control endpoint, transports, registered regions.

Wire form: ``b"XFMD"`` · version (u16) · payload length (u32) · CRC-32 of payload (u32) · JSON.
Decoding checks every field's type and raises :class:`MetadataError` naming what is wrong
(JSON of any depth, size or shape included: :func:`xfer.guard.loads`); no pickle, nothing is executed.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from dataclasses import dataclass, field

from . import guard
from .errors import InvalidArgumentError, LayoutError, MetadataError
from .layout import KVLayout

__all__ = ["AgentMetadata", "RegionRecord", "encode", "decode", "VERSION"]

MAGIC = b"XFMD"
VERSION = 1
_HEADER = struct.Struct("!4sHII")
MAX_METADATA_BYTES = 64 << 20
UNIX_NAME = re.compile(r"xfer-ctl-[0-9a-f]{24}")  # a control server's abstract Unix socket (control_unix)
MAX_DEPTH = 16  # agent -> regions -> region -> exports -> transport -> descriptor: 5 today


@dataclass(frozen=True)
class RegionRecord:
    """A registered KV region as a peer sees it: its layout, device and per-transport exports."""

    name: str
    layout: KVLayout
    device: str
    exports: dict = field(default_factory=dict)  # transport kind value -> descriptor dict

    def to_dict(self) -> dict:
        return {"name": self.name, "layout": self.layout.to_dict(), "device": self.device, "exports": self.exports}


@dataclass(frozen=True)
class AgentMetadata:
    name: str
    agent_id: str
    pid: int
    hostname: str
    host_id: str
    control: tuple[str, int]
    transports: dict = field(default_factory=dict)  # kind value -> info dict
    regions: dict = field(default_factory=dict)  # region name -> RegionRecord
    control_unix: str | None = None  # the control server's abstract Unix socket, for peers on this host

    def to_dict(self) -> dict:
        d = {
            "name": self.name, "agent_id": self.agent_id, "pid": self.pid, "hostname": self.hostname,
            "host_id": self.host_id, "control": list(self.control), "transports": self.transports,
            "regions": {k: r.to_dict() for k, r in self.regions.items()},
        }
        if self.control_unix is not None:
            d["control_unix"] = self.control_unix
        return d


def encode(md: AgentMetadata, auth=None) -> bytes:
    """Wire form; with ``auth`` (an :class:`xfer.auth.Authenticator`) the payload is signed."""
    d = md.to_dict() if auth is None else auth.sign_metadata(md.to_dict())
    payload = json.dumps(d, separators=(",", ":"), sort_keys=True).encode()
    return _HEADER.pack(MAGIC, VERSION, len(payload), zlib.crc32(payload)) + payload


def _need(d: dict, key: str, kind, where: str):
    if key not in d:
        raise MetadataError(f"metadata {where} lacks field {key!r}")
    value = d[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MetadataError(f"metadata {where}.{key} must be {getattr(kind, '__name__', kind)}, "
                            f"got {type(value).__name__}")
    return value


def decode(blob: bytes, auth=None) -> AgentMetadata:
    """Parse peer metadata; raises :class:`MetadataError` on anything truncated or malformed,
    and, with ``auth``, :class:`AuthenticationError` when it is unsigned or its MAC fails."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise MetadataError(f"metadata must be bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) < _HEADER.size:
        raise MetadataError(f"metadata truncated: {len(blob)} bytes, the header alone is {_HEADER.size}")
    magic, version, length, crc = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise MetadataError(f"not xfer metadata: starts with {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise MetadataError(f"metadata version {version}, this xfer reads version {VERSION}")
    body = blob[_HEADER.size:]
    if length > MAX_METADATA_BYTES or len(body) != length:
        raise MetadataError(f"metadata truncated or padded: header says {length} payload bytes, got {len(body)}")
    if zlib.crc32(body) != crc:
        raise MetadataError(f"metadata checksum mismatch: expected {crc:#010x}, got {zlib.crc32(body):#010x}")
    try:
        d = guard.loads(body, max_bytes=MAX_METADATA_BYTES, max_depth=MAX_DEPTH, what="metadata payload")
    except InvalidArgumentError as exc:
        raise MetadataError(str(exc)) from None
    if auth is not None:
        auth.check_metadata(d)
    control = _need(d, "control", list, "agent")
    if len(control) != 2 or not isinstance(control[0], str) or not isinstance(control[1], int) \
            or not 0 < control[1] < 65536:
        raise MetadataError(f"metadata agent.control must be [host, port], got {control!r}"[:200])
    regions = {}
    for name, r in _need(d, "regions", dict, "agent").items():
        where = f"region {name!r}"
        if not isinstance(r, dict):
            raise MetadataError(f"metadata {where} must be an object")
        try:
            layout = KVLayout.from_dict(_need(r, "layout", dict, where))
        except LayoutError as exc:
            raise MetadataError(f"metadata {where} has a bad layout: {exc}") from None
        regions[name] = RegionRecord(name=name, layout=layout, device=_need(r, "device", str, where),
                                     exports=_need(r, "exports", dict, where))
    transports = _need(d, "transports", dict, "agent")
    for kind, info in transports.items():
        if not isinstance(info, dict):
            raise MetadataError(f"metadata transport {kind!r} info must be an object")
    unix = d.get("control_unix")
    if unix is not None and not (isinstance(unix, str) and UNIX_NAME.fullmatch(unix)):
        raise MetadataError(f"metadata agent.control_unix must be an xfer control socket name, got {unix!r}"[:200])
    agent_id = _need(d, "agent_id", str, "agent")
    if not 0 < len(agent_id.encode()) <= 32:
        raise MetadataError(f"metadata agent.agent_id must be 1..32 bytes, got {agent_id[:40]!r}")
    return AgentMetadata(
        name=_need(d, "name", str, "agent"), agent_id=agent_id,
        pid=_need(d, "pid", int, "agent"), hostname=_need(d, "hostname", str, "agent"),
        host_id=_need(d, "host_id", str, "agent"), control=(control[0], control[1]),
        transports=transports, regions=regions, control_unix=unix,
    )
