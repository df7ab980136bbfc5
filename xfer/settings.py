"""Every knob of xfer in one table, and the typed settings objects it is read into.

Each :class:`Knob` names its environment variable, the settings object and field that hold it,
its type, default and unit, and one line of why it exists. :meth:`Settings.from_env` parses the
environment once (here and nowhere else) into frozen dataclasses; ``AgentConfig.settings`` holds
one (read when the config is made), and the kernels' process defaults are :func:`current` (read
on first use; :func:`reload` reads again). Nothing reads an ``XFER_*`` variable on a hot path.
``docs/settings.md`` is generated from :data:`KNOBS` (:func:`render_markdown`); a test fails
when it is stale or when code reads an ``XFER_*`` variable the table does not declare.

Groups without a settings object here (``bench``) are read by the bench scripts themselves.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field, fields
from typing import Mapping

from .errors import InvalidArgumentError

__all__ = ["Knob", "KNOBS", "Settings", "UcxSettings", "ControlSettings", "CopySettings", "OneSidedSettings",
           "FenceSettings", "SglangSettings", "EngineSettings", "TUNED_UCX", "FOREIGN", "current", "reload", "render_markdown", "parse_bytes"]


@dataclass(frozen=True)
class Knob:
    """One setting: ``env`` overrides ``default``; ``group.field`` is where it is held."""

    env: str
    group: str  # the Settings attribute (ucx, control, copy, onesided, fence, agent, sglang, engine) or "bench"
    field: str
    kind: str  # int (K/M suffixes allowed), bytes (same), bool, float, str, list (comma-separated)
    default: object
    unit: str
    why: str


KNOBS: tuple[Knob, ...] = (
    Knob("XFER_SECRET", "agent", "secret", "str", None, "",
         "the deployment's shared secret (>= 16 bytes), AgentConfig.secret's default: metadata and every control "
         "message are signed and checked; unset: off"),
    Knob("XFER_CONTROL_MAX_CONNS", "control", "max_conns", "int", 512, "connections",
         "connections the control port holds at once (also capped at a quarter of the process's file limit); past "
         "it the oldest one still in its handshake is closed, else the new one is refused"),
    Knob("XFER_CONTROL_MAX_CONNS_PER_HOST", "control", "max_conns_per_host", "int", 128, "connections",
         "connections from one peer address at once (loopback peers share one)"),
    Knob("XFER_CONTROL_MAX_PENDING", "control", "max_pending", "int", 64, "connections",
         "connections still in their handshake at once; a new one past it closes the oldest (a flood of idle "
         "sockets cannot lock peers out)"),
    Knob("XFER_CONTROL_HANDSHAKE_S", "control", "handshake_s", "float", 5.0, "s",
         "a connection must prove the key (or, without a secret, finish the handshake) this soon after it opens"),
    Knob("XFER_CONTROL_FRAME_S", "control", "frame_s", "float", 10.0, "s",
         "a frame must arrive whole this soon after its first byte, and a reply be read this soon (slow senders "
         "and readers cannot hold buffers)"),
    Knob("XFER_CONTROL_IDLE_S", "control", "idle_s", "float", 300.0, "s",
         "an authenticated connection with no request for this long is closed (clients reconnect by themselves: "
         "the server announces it in its handshake)"),
    Knob("XFER_CONTROL_MAX_HEADER", "control", "max_header", "bytes", 1 << 20, "bytes",
         "largest JSON header of an authenticated request (a batch of notices with their block lists)"),
    Knob("XFER_CONTROL_BUFFER_BYTES", "control", "buffer_bytes", "bytes", 64 << 20, "bytes",
         "bytes of unfinished frames the control port holds over all connections; past it the connection holding "
         "most is closed"),
    Knob("XFER_CONTROL_SPIN_US", "control", "spin_us", "int", 0, "us",
         "the control channel polls instead of sleeping for this long: a client waiting for a reply, the server "
         "after each request it answered (one core busy meanwhile; a sleeping thread's wake-up costs tens of us on "
         "an idle VM core, on every round trip of a lone transfer); 0: off"),
    Knob("XFER_CONTROL_UNIX", "control", "unix", "bool", True, "",
         "peers on this host (the same host id) reach the control server over an abstract Unix socket whose random "
         "name the metadata publishes, instead of loopback TCP (one control round trip 102-113 us against 118-120 us "
         "on the 2-core CPU VM, bench/control_rtt.py); a peer that cannot reach it (another network namespace) uses "
         "TCP; off: TCP only"),
    Knob("XFER_FENCE_GRACE_S", "fence", "grace_s", "float", 1.0, "s",
         "a stopping transfer waits this long for its peer's confirmation (ucx: that it dropped the flow; local, "
         "ipc: the reply to its last notice) before ucx closes the connection to end the flow's receives"),
    Knob("XFER_FENCE_BOUND_S", "fence", "bound_s", "float", 5.0, "s",
         "how long past its deadline Transfer.wait() waits for a stopping transfer's fence before raising "
         "FenceTimeoutError (keep its blocks quarantined), and Agent.revoke's default timeout"),
    Knob("XFER_COPY_PATH", "copy", "path", "str", None, "kernel|batch|2d|auto",
         "how copies touching CUDA memory move (Triton kernel, cudaMemcpyBatchAsync, cudaMemcpy2DAsync, or auto "
         "by the copy table); AgentConfig.copy_path's default; unset: auto"),
    Knob("XFER_COPY_TABLE", "copy", "table", "str", None, "path",
         "a JSON copy table for auto (bench/copy_calibrate.py's output) instead of the built-in one"),
    Knob("XFER_NATIVE_LAUNCH", "copy", "native_launch", "bool", True, "",
         "kernel copies between long-lived CUDA sides (the transports', and the functional copies' cached "
         "caches) upload their ids and launch through xfer's C helpers (cuMemcpyHtoDAsync, cuLaunchKernel of "
         "Triton's compiled kernel) where they are built (xfer.native); 0: Triton's launcher and a ctypes "
         "upload (H100, 2026-12-07: 20-50 % more host time a call). The helpers' block-id and side checks "
         "need no knob"),
    Knob("TRITON_INTERPRET", "copy", "interpret", "bool", False, "",
         "Triton's own variable: copies between CPU tensors run the Triton kernel in its interpreter (how CI "
         "tests the kernel) rather than the torch reference"),
    Knob("XFER_LAUNCH_INLINE", "onesided", "launch_inline", "bool", True, "",
         "ipc/local/NVSHMEM-direct: a READ's stream copy is launched by the posting thread when nothing posted "
         "earlier waits (saves a thread hand-off; a WRITE waits for its grant on the worker); off: the worker "
         "thread launches every copy"),
    Knob("XFER_NOTICE_EARLY", "onesided", "notice_early", "bool", None, "",
         "local/ipc: a lone WRITE's notice is sent at its copy's launch, naming a shared-memory landing slot the "
         "initiator writes once the copy ended; the target answers (delivers) once it reads it, so the notice's "
         "round trip overlaps the copy (xfer.transports.onesided.mailbox); unset: on for ipc (its copies launch "
         "on a stream; on an H100 a lone granted seed-case write took 0.74 against 1.14-1.17 ms), off for host "
         "copies (local: the notice would leave before the copy)"),
    Knob("XFER_STAGE_IDS", "onesided", "stage_ids", "bool", True, "",
         "ipc/NVSHMEM-direct: a WRITE's stream copy is prepared while its grant request travels (peer tensors "
         "mapped, path chosen, the kernel's block ids uploaded), so the launch after the grant is the kernel's "
         "alone; off: prepared at its launch (H100, lone seed-case write: launch after the grant 0.07 ms on, "
         "0.2 ms off)"),
    Knob("XFER_ASK_INLINE", "onesided", "ask_inline", "bool", None, "",
         "ipc/local/NVSHMEM-direct: a lone WRITE's grant request is sent by the posting thread (one send, no "
         "wait) rather than the worker; unset: where its copy launches on a CUDA stream (ipc, NVSHMEM direct: on "
         "an H100 a lone seed-case write took 0.94 against 1.19-1.20 ms, and 1.09 against 1.58-1.65 ms), not "
         "for host copies (local: on the 2-core CPU VM it added ~100 us to write() and took nothing off the "
         "call-to-granted time)"),
    Knob("XFER_UCX_CHUNK_BYTES", "ucx", "chunk_bytes", "bytes", 16 << 20, "bytes",
         "host staging slot and wire message size; published to peers, who plan with the smaller side's"),
    Knob("XFER_UCX_DEPTH", "ucx", "depth", "int", 4, "chunks",
         "chunks of one transfer in flight at once (gathered, on the wire or being scattered); <= 255"),
    Knob("XFER_UCX_SLOTS", "ucx", "slots", "int", 8, "slots",
         "host staging slots per memory kind shared by all transfers (>= 2; sends hold at most half): the "
         "footprint is slots x chunk_bytes whatever the transfers"),
    Knob("XFER_UCX_DEVICE_CHUNK_BYTES", "ucx", "device_chunk_bytes", "bytes", 64 << 20, "bytes",
         "device staging slot size (GPU-direct); each chunk costs ~0.1-0.2 ms of host work, so device "
         "transfers move in as few chunks as fit"),
    Knob("XFER_UCX_DEVICE_SLOTS", "ucx", "device_slots", "int", 4, "slots",
         "device staging slots (device_slots x device_chunk_bytes of GPU memory per device, on first use)"),
    Knob("XFER_UCX_PORT", "ucx", "port", "int", 0, "port", "UCX listener port (0: any free one)"),
    Knob("XFER_UCX_ADDRESS", "ucx", "address", "str", None, "host",
         "the address published to peers (default: the control listen_host, or this host's name resolved when "
         "that is a wildcard)"),
    Knob("XFER_UCX_KEEPALIVE_S", "ucx", "keepalive_s", "float", 1.0, "s",
         "UCX endpoint keepalive: how soon a silent dead peer is noticed"),
    Knob("XFER_UCX_INLINE_BYTES", "ucx", "inline_bytes", "bytes", 1 << 20, "bytes",
         "chunks up to this size are gathered/scattered on the engine thread (two thread hand-offs fewer); larger "
         "ones on the copy thread, overlapping the wire"),
    Knob("XFER_UCX_IOV", "ucx", "iov", "bool", True, "",
         "raw libucp tag calls (scatter-gather sends from host blocks, receives into them); off: ucxx's API "
         "only, every chunk staged both ways"),
    Knob("XFER_UCX_IOV_MIN_BYTES", "ucx", "iov_min_bytes", "bytes", 8192, "bytes",
         "host blocks at least this big are sent straight from the blocks (below it each address costs UCX more "
         "than the gather saves: 4 KiB blocks 0.49-0.64 of ucxx in place vs 0.65-0.76 gathered)"),
    Knob("XFER_UCX_IOV_RECV", "ucx", "iov_recv", "bool", True, "",
         "chunks are received straight into host blocks where both sides use the same block order; off: into a "
         "slot, then scattered"),
    Knob("XFER_UCX_IOV_RECV_MIN_BYTES", "ucx", "iov_recv_min_bytes", "bytes", 0, "bytes",
         "the block size from which a host region receives in place (UCX unpacks into the address list in C: "
         "512 B blocks 1.3-1.46 ms a lone write in place vs 1.8-2.0 scattered)"),
    Knob("XFER_UCX_MIN_CHUNKS", "ucx", "min_chunks", "int", 16, "chunks",
         "a transfer staged on both sides is cut into about this many chunks so gather, wire and scatter overlap"),
    Knob("XFER_UCX_MIN_CHUNKS_IN_PLACE", "ucx", "min_chunks_in_place", "int", 4, "chunks",
         "the same where either side moves its chunks in place (one copy stage or none left to overlap; 64 MiB "
         "of 4 KiB blocks: 0.65-0.76 of ucxx in 4 chunks vs 0.55 in 16)"),
    Knob("XFER_UCX_MIN_CHUNK_BYTES", "ucx", "min_chunk_bytes", "bytes", 1 << 20, "bytes",
         "no chunk is cut below this (each chunk has fixed costs: a message, completions, copy calls)"),
    Knob("XFER_UCX_MIN_CHUNKS_DEVICE", "ucx", "min_chunks_device", "int", 1, "chunks",
         "between two device regions a chunk's stages are HBM copies of tens of us against ~0.1-0.2 ms of host "
         "work a chunk: no cutting below the slot size"),
    Knob("XFER_UCX_MAX_CTRL_BYTES", "ucx", "max_ctrl_bytes", "bytes", 4 << 20, "bytes",
         "largest UCX control message taken (a REQ's block ids and notification: ~500,000 ids); a bigger one is "
         "drained unreceived (its size is known from the probe) and logged, and an initiator refuses to send one"),
    Knob("XFER_UCX_EARLY_CHUNKS", "ucx", "early_chunks", "int", 1024, "chunks",
         "chunks (their tags verified) a UCX connection may hold ahead of their REQ; past it the peer's "
         "connection is failed"),
    Knob("XFER_SGLANG_TIMEOUT_S", "sglang", "timeout_s", "float", 30.0, "s",
         "the SGLang connector's one deadline: per transfer, and per look-up, connect and handshake step"),
    Knob("XFER_SGLANG_TRANSPORTS", "sglang", "transports", "list", None, "names",
         "start only these xfer transports in SGLang's connector (e.g. local,ucx); unset: every one that can run"),
    Knob("XFER_SGLANG_HOST", "sglang", "host", "str", "127.0.0.1", "host",
         "the control address the SGLang connector's agents listen on"),
    Knob("XFER_SGLANG_REPLACE", "sglang", "replace", "str", None, "backend",
         "set by xfer.engine.sglang_plugin.install: processes SGLang spawns swap this transfer backend (e.g. "
         "mooncake) for xfer's (read by the sitecustomize hook at interpreter start)"),
    Knob("XFER_TP_BACKEND", "engine", "tp_backend", "str", "gloo", "backend",
         "torch.distributed backend of the demo engine's tensor-parallel group"),
    Knob("XFER_BENCH_DEBUG", "bench", "debug", "bool", False, "",
         "xfer-bench prints the traceback of an unexpected error (bench/cli.py)"),
    Knob("XFER_UCX_BENCH_NS", "bench", "netns", "str", None, "JSON",
         "internal: the namespace pair bench/ucx_bench.py --netns hands the copy of itself it runs in namespace A"),
)

# Other programs' variables xfer reads or sets (theirs to define; listed in docs/settings.md)
FOREIGN: tuple[tuple[str, str], ...] = (
    ("UCX_*", "UCX's own settings (UCX_TLS, UCX_NET_DEVICES, ...) apply; the ucx transport sets TUNED_UCX's "
              "TCP_TX_SEG_SIZE=512K, TCP_RX_SEG_SIZE=512K, TCP_MAX_IOV=64 and the keepalive only where the user "
              "set none, and UCX_WARN_UNUSED_ENV_VARS=n if unset"),
    ("NVSHMEM_DISABLE_CUDA_VMM", "set to 1 before NVSHMEM init where PEs share a GPU (its growing heap left peer "
                                 "chunks unmapped there), unless the user set it"),
    ("NVSHMEM_SYMMETRIC_SIZE", "NVSHMEM's heap size: named in the error when a symmetric allocation fails"),
    ("PYTORCH_CUDA_ALLOC_CONF", "ipc reports its CUDA IPC handle kind (expandable segments or legacy) from it"),
    ("CUDA_VISIBLE_DEVICES", "named when ipc cannot see a peer's GPU"),
)

# UCX's own defaults that cost two thirds of the wire over TCP (see ucx/transport.py): 8 KiB TCP
# segments turn a rendezvous into thousands of small bcopy fragments, and a scatter-gather
# rendezvous moves at most TCP_MAX_IOV entries (6 by default) per zero-copy fragment (32 x 256 x
# 4 KiB: 0.62-0.70 of a contiguous ucxx send with 6, 0.72-0.89 with 64; 256 no better than 64).
# A user's own UCX_* variable always wins over these.
TUNED_UCX = {"TCP_TX_SEG_SIZE": "512K", "TCP_RX_SEG_SIZE": "512K", "TCP_MAX_IOV": "64"}


def parse_bytes(name: str, raw: str) -> int:
    """An integer setting; a K or M suffix multiplies by 1024 or 1024**2."""
    text, scale = raw.strip().upper(), 1
    if text[-1:] in ("K", "M"):
        text, scale = text[:-1], 1024 if text[-1] == "K" else 1 << 20
    try:
        return int(text) * scale
    except ValueError:
        raise InvalidArgumentError(f"{name} must be an integer (optionally with K or M), got {raw!r}") from None


def _parse(knob: Knob, raw: str | None):
    if raw is None or not raw.strip():
        return knob.default
    if knob.kind in ("int", "bytes"):
        return parse_bytes(knob.env, raw)
    if knob.kind == "bool":  # 0, no, off or false turn it off
        return raw.strip().lower() not in ("0", "no", "off", "false")
    if knob.kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise InvalidArgumentError(f"{knob.env} must be a number ({knob.unit}), got {raw!r}") from None
    if knob.kind == "list":
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    return raw if knob.kind == "str" else knob.default


def _values(group: str, environ: Mapping[str, str]) -> dict:
    return {k.field: _parse(k, environ.get(k.env)) for k in KNOBS if k.group == group}


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise InvalidArgumentError(what)


@dataclass(frozen=True)
class UcxSettings:
    """The UCX transport's knobs (``XFER_UCX_*``; each explained in :data:`KNOBS`).

    ``ucx_options``: UCX context options applied last (over :data:`TUNED_UCX` and the keepalive).
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
    iov: bool = True
    iov_min_bytes: int = 8192
    iov_recv: bool = True
    iov_recv_min_bytes: int = 0
    min_chunks: int = 16
    min_chunks_in_place: int = 4
    min_chunk_bytes: int = 1 << 20
    min_chunks_device: int = 1
    max_ctrl_bytes: int = 4 << 20
    early_chunks: int = 1024
    ucx_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("chunk_bytes", "device_chunk_bytes"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 4096, f"{name} must be an int >= 4096, got {value!r}")
        for name in ("slots", "device_slots"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 2,
                   f"{name} must be an int >= 2 (sends and receives each need one), got {value!r}")
        _check(isinstance(self.depth, int) and 1 <= self.depth <= 255, f"depth must be in 1..255, got {self.depth!r}")
        _check(isinstance(self.port, int) and 0 <= self.port < 65536, f"port must be in 0..65535, got {self.port!r}")
        for name in ("inline_bytes", "iov_min_bytes", "iov_recv_min_bytes", "min_chunk_bytes"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 0, f"{name} must be an int >= 0, got {value!r}")
        for name in ("min_chunks", "min_chunks_in_place", "min_chunks_device"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1, f"{name} must be an int >= 1, got {value!r}")
        _check(isinstance(self.max_ctrl_bytes, int) and self.max_ctrl_bytes >= 65536,
               f"max_ctrl_bytes must be an int >= 65536, got {self.max_ctrl_bytes!r}")
        _check(isinstance(self.early_chunks, int) and self.early_chunks >= 16,
               f"early_chunks must be an int >= 16, got {self.early_chunks!r}")
        _check(isinstance(self.keepalive_s, (int, float)) and self.keepalive_s > 0,
               f"keepalive_s must be > 0, got {self.keepalive_s!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "UcxSettings":
        return cls(**_values("ucx", os.environ if environ is None else environ))

    def slot_bytes(self, kind: str) -> int:
        """Bytes per staging slot of a pool kind ("host", "pinned", "cuda:N")."""
        return self.device_chunk_bytes if kind.startswith("cuda") else self.chunk_bytes

    def slot_count(self, kind: str) -> int:
        return self.device_slots if kind.startswith("cuda") else self.slots

    def context_options(self, environ: Mapping[str, str] | None = None) -> dict:
        """UCX context options: the tuned defaults where the user's environment sets no ``UCX_*`` of
        that name (read when the transport starts), the keepalive, then ``ucx_options``."""
        environ = os.environ if environ is None else environ
        opts = {k: v for k, v in TUNED_UCX.items() if f"UCX_{k}" not in environ}
        if "UCX_KEEPALIVE_INTERVAL" not in environ:
            opts["KEEPALIVE_INTERVAL"] = f"{self.keepalive_s}s"
        opts.update(self.ucx_options)
        return opts


@dataclass(frozen=True)
class ControlSettings:
    """Limits of the control port (``XFER_CONTROL_*``; each explained in :data:`KNOBS`, and in
    docs/security.md with the threat model)."""

    max_conns: int = 512
    max_conns_per_host: int = 128
    max_pending: int = 64
    handshake_s: float = 5.0
    frame_s: float = 10.0
    idle_s: float = 300.0
    max_header: int = 1 << 20
    buffer_bytes: int = 64 << 20
    spin_us: int = 0
    unix: bool = True

    def __post_init__(self) -> None:
        _check(isinstance(self.unix, bool), f"control.unix must be a bool, got {self.unix!r}")
        for name in ("max_conns", "max_conns_per_host", "max_pending"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1, f"control.{name} must be an int >= 1, got {value!r}")
        for name in ("handshake_s", "frame_s", "idle_s"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and 0 < value < float("inf"),
                   f"control.{name} must be a finite number > 0 seconds, got {value!r}")
        _check(isinstance(self.spin_us, int) and 0 <= self.spin_us <= 1_000_000,
               f"control.spin_us must be an int in 0 .. 1000000, got {self.spin_us!r}")
        _check(isinstance(self.max_header, int) and 4096 <= self.max_header < 1 << 32,
               f"control.max_header must be an int in 4096 .. 2**32-1, got {self.max_header!r}")
        _check(isinstance(self.buffer_bytes, int) and self.buffer_bytes >= 2 * self.max_header,
               f"control.buffer_bytes must be an int >= 2 x max_header, got {self.buffer_bytes!r}")


@dataclass(frozen=True)
class CopySettings:
    """How block copies touching CUDA memory pick their path (see ``xfer.kernels``)."""

    path: str | None = None
    table: str | None = None
    native_launch: bool = True
    interpret: bool = False


@dataclass(frozen=True)
class OneSidedSettings:
    launch_inline: bool = True
    stage_ids: bool = True
    ask_inline: bool | None = None  # None: on for copies launched on a CUDA stream
    notice_early: bool | None = None  # None: on where copies launch on a CUDA stream (ipc)


@dataclass(frozen=True)
class FenceSettings:
    """How long a stop may take to be fenced (see ``xfer.transfer.Transfer``)."""

    grace_s: float = 1.0
    bound_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("grace_s", "bound_s"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf"),
                   f"fence.{name} must be a finite number of seconds > 0, got {value!r}")
        _check(self.bound_s > self.grace_s, f"fence.bound_s ({self.bound_s}) must exceed fence.grace_s "
                                            f"({self.grace_s}): a stop ended by closing the connection needs both")


@dataclass(frozen=True)
class SglangSettings:
    """The SGLang connector's knobs (``xfer.engine.sglang_conn``)."""

    timeout_s: float = 30.0
    transports: tuple[str, ...] | None = None
    host: str = "127.0.0.1"
    replace: str | None = None


@dataclass(frozen=True)
class EngineSettings:
    tp_backend: str = "gloo"


_GROUPS = {"ucx": UcxSettings, "control": ControlSettings, "copy": CopySettings, "onesided": OneSidedSettings,
           "fence": FenceSettings, "sglang": SglangSettings, "engine": EngineSettings}


@dataclass(frozen=True)
class Settings:
    """Every settings group; ``secret`` is the ``XFER_SECRET`` default of ``AgentConfig.secret``."""

    ucx: UcxSettings = field(default_factory=UcxSettings)
    control: ControlSettings = field(default_factory=ControlSettings)
    copy: CopySettings = field(default_factory=CopySettings)
    onesided: OneSidedSettings = field(default_factory=OneSidedSettings)
    fence: FenceSettings = field(default_factory=FenceSettings)
    sglang: SglangSettings = field(default_factory=SglangSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    secret: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Defaults with the environment's ``XFER_*`` overrides (typed errors name a bad value)."""
        environ = os.environ if environ is None else environ
        groups = {name: kind(**_values(name, environ)) for name, kind in _GROUPS.items()}
        return cls(**groups, **_values("agent", environ))


_current: list[Settings] = []
_lock = threading.Lock()


def current() -> Settings:
    """The process's settings from the environment, read on first use (the kernels' defaults)."""
    if _current:
        return _current[0]
    with _lock:
        if not _current:
            _current.append(Settings.from_env())
        return _current[0]


def reload() -> Settings:
    """Read the environment again for :func:`current` (tests, or a process that changed it)."""
    with _lock:
        _current[:] = [Settings.from_env()]
    _generation[0] += 1
    return _current[0]


_generation = [0]  # bumped by reload: memos of what the settings decide compare it


def generation() -> int:
    return _generation[0]


def _fmt_default(knob: Knob) -> str:
    value = knob.default
    if value is None:
        return "unset"
    if knob.kind == "bytes" and isinstance(value, int) and value >= 1024 and value % 1024 == 0:
        return f"{value >> 20}M" if value % (1 << 20) == 0 else f"{value >> 10}K"
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def render_markdown() -> str:
    """``docs/settings.md``: the table of every knob (generated; do not edit the file by hand)."""
    lines = ["# Settings", "",
             "Generated from `xfer/settings.py` (`python -m xfer.settings > docs/settings.md`); a test fails when "
             "this file is stale. Environment variables override the defaults; an agent reads them once, when its "
             "`AgentConfig` is made (`AgentConfig.settings`, a `xfer.settings.Settings`; pass one to set them in "
             "code). The kernels' defaults are read on first use (`xfer.settings.current()`).", "",
             "| variable | setting | type | default | unit | why |", "|---|---|---|---|---|---|"]
    for k in KNOBS:
        where = f"`{k.group}.{k.field}`" if k.group != "bench" else "bench scripts"
        why = k.why.replace("|", "\\|")
        unit = k.unit.replace("|", "\\|")
        lines.append(f"| `{k.env}` | {where} | {k.kind} | {_fmt_default(k)} | {unit} | {why} |")
    lines += ["", "`int` and `bytes` values take a K or M suffix (x1024, x1024²); `bool` values 0, no, off or false "
              "turn a setting off; `list` values are comma-separated.", "",
              "## Other programs' variables", "", "| variable | what xfer does with it |", "|---|---|"]
    lines += [f"| `{name}` | {what} |" for name, what in FOREIGN] + [""]
    return "\n".join(lines)


def _check_table() -> None:
    """Every knob of a settings group is a field of its dataclass with the same default."""
    for k in KNOBS:
        if k.group == "bench":
            continue
        cls = Settings if k.group == "agent" else _GROUPS[k.group]
        defaults = {f.name: f.default for f in fields(cls)}
        assert defaults.get(k.field, object()) == k.default, f"{k.env}: {cls.__name__}.{k.field} default differs"


if __name__ == "__main__":
    print(render_markdown(), end="")
