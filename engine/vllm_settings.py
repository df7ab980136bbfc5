"""The vLLM connector's settings: ``VllmConfig`` + ``kv_connector_extra_config``, read strictly.

Every key of ``kv_connector_extra_config`` is in ``EXTRA_KEYS`` (name -> (parser, default, what));
an unknown key (a typo such as ``timeout``) raises at start-up with the list of known keys, and
booleans accept ``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``) as JSON values or
strings. Imports nothing from vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from xfer.errors import InvalidArgumentError

__all__ = ["XferSettings", "EXTRA_KEYS", "LAYOUTS", "parse_extra"]

LAYOUTS = ("auto", "flash_attn", "flashinfer", "packed", "mla")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _bad(key: str, value: Any, want: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"kv_connector_extra_config.{key} must be {want}, got {value!r}")


def _bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:
        return v.strip().lower() in _TRUE
    raise _bad(key, v, "true or false")


def _seconds(key: str, v: Any) -> float:
    try:
        f = float(v) if not isinstance(v, bool) and isinstance(v, (int, float, str)) else math.nan
    except ValueError:
        f = math.nan
    if not 0 < f < math.inf:
        raise _bad(key, v, "a finite number of seconds > 0")
    return f


def _count(key: str, v: Any, low: int) -> int:
    try:
        n = int(v) if not isinstance(v, bool) and isinstance(v, (int, str)) else None
    except ValueError:
        n = None
    if n is None or n < low:
        raise _bad(key, v, f"an integer >= {low}")
    return n


def _text(key: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise _bad(key, v, "a non-empty string")
    return v


def _names(key: str, v: Any) -> tuple[str, ...]:
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(x, str) and x for x in items):
        raise _bad(key, v, "a list of transport names (or one comma-separated string)")
    return tuple(x.strip() for x in items)


def _layout(key: str, v: Any) -> str:
    if v not in LAYOUTS:
        raise _bad(key, v, f"one of {LAYOUTS}")
    return v


# name -> (parser, default, what it is); None as a default: not set (vLLM's own value, or none)
EXTRA_KEYS: dict[str, tuple[Callable[[str, Any], Any], Any, str]] = {
    "store": (_text, None, "metadata store URL (tcp://HOST:PORT or etcd://HOST:PORT); required across processes"),
    "host_store": (_bool, False, "this instance may host the tcp:// store when nobody does yet"),
    "lease_s": (_seconds, 120.0, "prefill side: seconds unread blocks are held for a decode instance"),
    "timeout_s": (_seconds, 30.0, "deadline of finding a peer, of each layer transfer and of each message"),
    "load_async": (_bool, True, "decode side: load between steps (False: layer by layer inside the forward)"),
    "peer_tp_size": (lambda k, v: _count(k, v, 1), None, "TP size of the other side (default: this side's)"),
    "listen_host": (_text, "127.0.0.1", "address peers reach this instance's xfer agent on"),
    "transport": (_text, None, "pin one xfer transport (local, ipc, ucx, nvshmem)"),
    "transports": (_names, None, "start only these xfer transports"),
    "layout": (_layout, "auto", f"KV layout of vLLM's cache tensors, one of {LAYOUTS}"),
    "tp_rank": (lambda k, v: _count(k, v, 0), None, "tests: this worker's TP rank"),
    "tp_size": (lambda k, v: _count(k, v, 1), None, "tests: this side's TP size"),
    "total_kv_heads": (lambda k, v: _count(k, v, 1), None, "tests: the model's kv heads"),
    "use_mla": (_bool, None, "tests: the cache is an MLA latent"),
}


def parse_extra(extra: dict | None) -> dict[str, Any]:
    """``kv_connector_extra_config`` checked and typed: every key of ``EXTRA_KEYS``, defaults filled."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise InvalidArgumentError(f"kv_connector_extra_config has unknown keys {unknown}; known keys: "
                                   f"{sorted(EXTRA_KEYS)}")
    return {k: (default if extra.get(k) is None else parse(k, extra[k]))
            for k, (parse, default, _) in EXTRA_KEYS.items()}


@dataclass(frozen=True)
class XferSettings:
    """What the connector reads from ``VllmConfig`` and ``kv_connector_extra_config``."""

    engine_id: str
    is_producer: bool
    is_consumer: bool
    block_size: int
    tp_size: int = 1
    tp_rank: int | None = None  # None: ask vLLM's parallel state in the worker
    peer_tp_size: int | None = None
    total_kv_heads: int = 1
    use_mla: bool = False
    store_url: str | None = None
    host_store: bool = False
    lease_s: float = 120.0
    timeout_s: float = 30.0
    load_async: bool = True
    listen_host: str = "127.0.0.1"
    transport: str | None = None
    transports: tuple[str, ...] | None = None
    layout: str = "auto"

    def __post_init__(self) -> None:
        _layout("layout", self.layout)
        for name in ("lease_s", "timeout_s"):
            _seconds(name, getattr(self, name))
        if self.lease_s <= self.timeout_s:
            raise InvalidArgumentError(f"lease_s ({self.lease_s}) must exceed timeout_s ({self.timeout_s}): a lease "
                                       f"shorter than one transfer frees blocks a reader is still copying")
        if self.store_url is not None and not self.store_url.startswith(("tcp://", "etcd://")):
            raise _bad("store", self.store_url, "tcp://HOST:PORT or etcd://HOST:PORT")

    @property
    def peer_tp(self) -> int:
        return self.peer_tp_size or self.tp_size

    @classmethod
    def from_vllm(cls, vllm_config) -> "XferSettings":
        kv = vllm_config.kv_transfer_config
        x = parse_extra(kv.kv_connector_extra_config)
        mc = vllm_config.model_config
        return cls(
            engine_id=str(kv.engine_id), is_producer=bool(kv.is_kv_producer), is_consumer=bool(kv.is_kv_consumer),
            block_size=int(vllm_config.cache_config.block_size),
            tp_size=x["tp_size"] or int(vllm_config.parallel_config.tensor_parallel_size),
            tp_rank=x["tp_rank"], peer_tp_size=x["peer_tp_size"],
            total_kv_heads=x["total_kv_heads"] or int(mc.get_total_num_kv_heads()),
            use_mla=bool(mc.use_mla) if x["use_mla"] is None else x["use_mla"], store_url=x["store"],
            host_store=x["host_store"], lease_s=x["lease_s"], timeout_s=x["timeout_s"], load_async=x["load_async"],
            listen_host=x["listen_host"], transport=x["transport"], transports=x["transports"], layout=x["layout"])
