"""Agent configuration: one frozen dataclass, validated on construction, and the transport kinds."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from .errors import InvalidArgumentError
from .settings import Settings

__all__ = ["AgentConfig", "NvshmemGroup", "TransportKind"]


class TransportKind(str, enum.Enum):
    LOCAL = "local"  # same process (any device), or host shared memory between local processes
    IPC = "ipc"  # CUDA IPC / UVA peer mappings between processes on one node
    NVSHMEM = "nvshmem"  # NVSHMEM symmetric memory, put-with-signal
    UCX = "ucx"  # UCX through ucxx, across nodes


@dataclass(frozen=True)
class NvshmemGroup:
    """The agents that form one NVSHMEM job: ``size`` processes, this one is ``rank``.

    store: metadata-store URL (``tcp://HOST:PORT`` or ``etcd://HOST:PORT``) where rank 0
        publishes the NVSHMEM unique id under ``name``.
    device: CUDA device index of this process's PE (None: the current device).
    staging_bytes: symmetric staging ring per peer (allocated collectively at init).
    """

    store: str
    name: str
    rank: int
    size: int
    device: int | None = None
    staging_bytes: int = 256 << 20
    init_timeout_s: float = 120.0
    close_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in "/ \t\n"):
            raise InvalidArgumentError(f"NvshmemGroup.name must be a non-empty str without '/' or spaces, "
                                       f"got {self.name!r}")
        if not isinstance(self.store, str) or not self.store.startswith(("tcp://", "etcd://")):
            raise InvalidArgumentError(f"NvshmemGroup.store must be a tcp://HOST:PORT or etcd://HOST:PORT URL, "
                                       f"got {self.store!r}")
        if self.device is not None and (not isinstance(self.device, int) or self.device < 0):
            raise InvalidArgumentError(f"NvshmemGroup.device must be None or a CUDA index >= 0, got {self.device!r}")
        for field in ("init_timeout_s", "close_timeout_s"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InvalidArgumentError(f"NvshmemGroup.{field} must be a finite number > 0, got {value!r}")
        if not isinstance(self.size, int) or self.size < 1:
            raise InvalidArgumentError(f"NvshmemGroup.size must be an int >= 1, got {self.size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise InvalidArgumentError(f"NvshmemGroup.rank must be in 0..{self.size - 1}, got {self.rank!r}")
        if not isinstance(self.staging_bytes, int) or self.staging_bytes < (1 << 20):
            raise InvalidArgumentError(f"NvshmemGroup.staging_bytes must be >= 1 MiB, got {self.staging_bytes!r}")


@dataclass(frozen=True)
class AgentConfig:
    """Settings of one :class:`xfer.Agent`.

    default_timeout_s: deadline of a transfer that names none (seconds).
    connect_timeout_s: how long ``connect`` may take to reach a peer's control port.
    listen_host / listen_port: the control endpoint peers reach (port 0 picks a free one).
    transport: pin one transport; ``None`` lets the selection policy choose per route.
        A pinned transport that cannot serve a pair raises, it never falls back.
    chunk_bytes: the local transport copies in chunks of about this size and checks the
        deadline and cancellation between them.
    max_notify_bytes: largest notification payload accepted.
    nvshmem: join this NVSHMEM group at construction (collective: blocks until all ranks join);
        None leaves the NVSHMEM transport off.
    secret: the deployment's shared secret (>= 16 bytes; default: ``settings.secret``, the
        XFER_SECRET environment variable). With one, metadata and every control message are signed
        and checked (HMAC-SHA256, replay-protected); peers without it are rejected. None and no
        variable: off.
    enable: start only these transports (None: every one that can run here). Each started
        transport costs threads and, for ucx, a listener; a disabled one is reported as such.
    copy_path: how the one-sided transports (ipc, local) move blocks that touch CUDA memory:
        ``kernel`` (one Triton launch), ``batch`` (``cudaMemcpyBatchAsync``), ``2d``
        (``cudaMemcpy2DAsync``) or ``auto`` (by direction and slice size, see
        ``xfer.kernels.copy_table``); None: ``settings.copy.path`` (the ``XFER_COPY_PATH``
        environment variable), else auto. The path a transfer took is on ``Transfer.copy_path``
        (and in ipc's ``Transfer.path``).
    settings: every other knob (:class:`xfer.settings.Settings`: UCX staging and chunking, copy
        paths, launches); None: read from the environment (``XFER_*``) when the config is made.
    """

    default_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    transport: TransportKind | None = None
    chunk_bytes: int = 64 << 20
    max_notify_bytes: int = 1 << 16
    nvshmem: NvshmemGroup | None = None
    enable: tuple[TransportKind, ...] | None = None
    secret: bytes | str | None = field(default=None, repr=False)
    copy_path: str | None = None
    settings: Settings | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.settings is None:
            object.__setattr__(self, "settings", Settings.from_env())
        elif not isinstance(self.settings, Settings):
            raise InvalidArgumentError(f"settings must be an xfer.settings.Settings or None, "
                                       f"got {type(self.settings).__name__}")
        for name in ("default_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a finite number > 0 seconds, got {value!r}")
        if not isinstance(self.listen_port, int) or not 0 <= self.listen_port < 65536:
            raise InvalidArgumentError(f"listen_port must be in 0..65535, got {self.listen_port!r}")
        if self.transport is not None and not isinstance(self.transport, TransportKind):
            try:
                object.__setattr__(self, "transport", TransportKind(self.transport))
            except ValueError:
                raise InvalidArgumentError(
                    f"transport must be one of {[k.value for k in TransportKind]} or None, got {self.transport!r}"
                ) from None
        if self.nvshmem is not None and not isinstance(self.nvshmem, NvshmemGroup):
            raise InvalidArgumentError(f"nvshmem must be an NvshmemGroup or None, got {type(self.nvshmem).__name__}")
        if self.enable is not None:
            try:
                kinds = tuple(TransportKind(k) for k in self.enable)
            except (ValueError, TypeError):
                raise InvalidArgumentError(
                    f"enable must list transports from {[k.value for k in TransportKind]}, got {self.enable!r}"
                ) from None
            object.__setattr__(self, "enable", kinds)
            if self.transport is not None and self.transport not in kinds:
                raise InvalidArgumentError(f"pinned transport {self.transport.value!r} is not in enable={list(kinds)}")
        if self.copy_path is not None:
            value = str(self.copy_path).strip().lower() if isinstance(self.copy_path, str) else None
            names = {"kernel": "kernel", "triton": "kernel", "batch": "batch", "copy_engine_batch": "batch",
                     "2d": "2d", "copy_engine_2d": "2d", "auto": "auto"}
            if value not in names:
                raise InvalidArgumentError(f"copy_path must be one of kernel, batch, 2d, auto or None, "
                                           f"got {self.copy_path!r}")
            object.__setattr__(self, "copy_path", names[value])
        for name in ("chunk_bytes", "max_notify_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int (bytes), got {value!r}")
