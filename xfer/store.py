"""Metadata store: agents publish opaque bytes under their name; peers wait until they appear.

``TCPStoreBackend`` (torch's TCPStore, the embedded default: one agent hosts it) and ``EtcdStore``
(an external etcd v3 server, through ``etcd3gw``), picked by ``open_store(url)``. Backend failures
reach the caller as ``StoreError`` naming key and endpoint; a wait that runs out, ``StoreTimeoutError``.

Every call returns by its bound whatever the server does: ``timeout`` (the store's, in seconds)
for connecting and for each request, plus the wait of ``get``. torch's TCPStore client stays
blocked past its own timeout against a frozen server (SIGSTOP, a wedged host), so each request
runs on a short-lived thread that the caller abandons at the bound (``StoreTimeoutError``); the
connection it was using is replaced for later calls, and while ``MAX_UNANSWERED`` abandoned
requests are still stuck, further calls fail at once instead of piling up threads.
"""

from __future__ import annotations

import base64
import enum
import errno
import logging
import math
import socket
import threading
import time
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any, Callable
from urllib.parse import urlsplit

from .errors import InvalidArgumentError, StoreError, StoreTimeoutError, XferError

__all__ = ["MetadataStore", "TCPStoreBackend", "EtcdStore", "StoreKind", "open_store"]

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "xfer/"
_URL_FORMS = "tcp://HOST:PORT (connect), tcp://HOST:0 (host on a free port), etcd://HOST:PORT"


class StoreKind(enum.Enum):
    """Backends, by URL scheme."""
    TCP = "tcp"
    ETCD = "etcd"


def _describe(e: BaseException) -> str:
    """One line naming a backend exception (etcd3gw keeps the server's words in ``detail_text``)."""
    text = (str(e).strip().splitlines() or [""])[0]
    detail = getattr(e, "detail_text", None)
    return f"{type(e).__name__}: {text} {detail or ''}".strip()


def _check_seconds(name: str, value: float, *, positive: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise InvalidArgumentError(f"{name} must be a finite number of seconds {'>' if positive else '>='} 0, "
                                   f"got {value!r}")
    return float(value)


def _parse_counter(key: str, value: bytes, endpoint: str) -> int:
    try:
        return int(value.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise StoreError(f"add({key!r}) on store {endpoint}: value {value[:32]!r} is not an integer counter") from None


class MetadataStore(ABC):
    """Bytes under string keys, shared by the agents of one deployment.

    Public methods validate, put the key under ``prefix``, bound the call (see the module doc)
    and turn any backend failure into ``StoreError``; a backend implements the underscored
    primitives on full (prefixed) keys, and ``_reset`` to drop a connection a stuck call holds.
    """

    __slots__ = ("endpoint", "prefix", "timeout", "_closed", "_guard", "_unanswered")
    MAX_UNANSWERED = 4  # abandoned requests still blocked on the server; more fail fast

    def __init__(self, endpoint: str, prefix: str = DEFAULT_PREFIX, timeout: float = 30.0) -> None:
        if not isinstance(prefix, str):
            raise InvalidArgumentError(f"store prefix must be a str, got {prefix!r}")
        self.endpoint = endpoint  # a URL a peer can pass to open_store, e.g. "tcp://10.0.0.1:29500"
        self.prefix = prefix
        self.timeout = _check_seconds("timeout", timeout, positive=True)  # connect and each request, s
        self._closed = False
        self._guard = threading.Lock()
        self._unanswered = 0

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` (bytes-like, up to a few hundred KB) under ``key``, replacing any old value."""
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"value for key {key!r} must be bytes, got {type(value).__name__}")
        self._call("set", key, self._set, bytes(value))

    def get(self, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to be set.

        Returns or raises within ``timeout`` plus the store's request timeout, whatever the server does."""
        timeout = _check_seconds("timeout", timeout)
        value = self._call("get", key, self._wait_get, timeout, wait_s=timeout)
        if value is None:
            raise StoreTimeoutError(f"key {self.prefix + key!r} did not appear in store {self.endpoint} "
                                    f"within {timeout:g} s")
        return value

    def try_get(self, key: str) -> bytes | None:
        """The value of ``key``, or ``None`` if it is not set; never waits on the key."""
        return self._call("try_get", key, self._try_get)

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it existed."""
        return bool(self._call("delete", key, self._delete))

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer counter ``key`` (absent counts as 0); the new value."""
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise InvalidArgumentError(f"add amount must be an int, got {amount!r}")
        return int(self._call("add", key, self._add, amount))

    def close(self) -> None:
        """Release the connection (a host also stops its server). Idempotent."""
        if not self._closed:
            self._closed = True
            self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> MetadataStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"{type(self).__name__}(endpoint={self.endpoint!r}, prefix={self.prefix!r}, {state})"

    def _call(self, op: str, key: str, fn: Callable[..., Any], *args: Any, wait_s: float = 0.0) -> Any:
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"store key must be a non-empty str, got {key!r}")
        full = self.prefix + key
        if self._closed:
            raise StoreError(f"{op}({full!r}) on closed store {self.endpoint}")
        try:
            return self._bounded(f"{op}({full!r})", lambda: fn(full, *args), self.timeout + wait_s)
        except XferError:
            raise
        except Exception as e:  # any backend failure; the raw exception stays as __cause__
            raise StoreError(f"{op}({full!r}) on store {self.endpoint} failed: {_describe(e)}") from e

    def _bounded(self, what: str, fn: Callable[[], Any], limit_s: float) -> Any:
        """``fn()`` on its own thread; its result, or StoreTimeoutError once ``limit_s`` passed.

        A call still running at the bound is abandoned (it ends when the server answers or the
        connection dies) and ``_reset`` gives later calls a connection of their own."""
        with self._guard:
            if self._unanswered >= self.MAX_UNANSWERED:
                raise StoreTimeoutError(f"{what} on store {self.endpoint}: {self._unanswered} earlier requests are "
                                        f"still unanswered (server frozen or unreachable); not sending more")
        done, box = threading.Event(), {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller below
                box["error"] = e
            done.set()
            with self._guard:
                if box.get("abandoned"):
                    self._unanswered -= 1

        threading.Thread(target=run, name=f"xfer-store {what[:40]}", daemon=True).start()
        if not done.wait(limit_s):
            with self._guard:
                if not done.is_set():
                    box["abandoned"] = True
                    self._unanswered += 1
            if box.get("abandoned"):
                self._reset()
                raise StoreTimeoutError(f"{what} on store {self.endpoint}: no answer within {limit_s:g} s "
                                        f"(server frozen or unreachable)")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _reset(self) -> None:
        """Drop the connection an abandoned call may still hold (later calls make a new one)."""

    # The backend's primitives, on full (prefixed) keys. _wait_get returns None when time runs out.
    @abstractmethod
    def _set(self, key: str, value: bytes) -> None: ...
    @abstractmethod
    def _try_get(self, key: str) -> bytes | None: ...
    @abstractmethod
    def _wait_get(self, key: str, timeout: float) -> bytes | None: ...
    @abstractmethod
    def _delete(self, key: str) -> bool: ...
    @abstractmethod
    def _add(self, key: str, amount: int) -> int: ...
    @abstractmethod
    def _close(self) -> None: ...


class TCPStoreBackend(MetadataStore):
    """``torch.distributed.TCPStore``: one agent hosts the server (``is_host=True``), peers connect.

    The server lives as long as the host's store: closing the host cuts every peer off.
    ``timeout`` bounds the connect (retried until then) and any single request (see the module doc).
    """

    __slots__ = ("host", "port", "is_host", "_server", "_store")
    # try_get reads with compare_set(key, _MISSING, _MISSING): one round trip that returns the value,
    # or _MISSING (writing nothing) when the key is absent. check()+get() would race with delete and
    # then block for the whole store timeout. So this exact value cannot be stored.
    _MISSING = b"\x00xfer-store:absent-key-sentinel\x00"

    def __init__(self, host: str, port: int, *, is_host: bool, timeout: float = 30.0,
                 prefix: str = DEFAULT_PREFIX) -> None:
        timeout = _check_seconds("timeout", timeout, positive=True)
        self.host, self.is_host, self._server = host, is_host, None
        listen_fd = None
        try:
            if is_host:
                # Bind the listening socket ourselves: TCPStore alone listens on every interface,
                # whatever host it is given. It takes ownership of the fd.
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                sock = socket.create_server((host, port), family=family, backlog=512)
                port = sock.getsockname()[1]
                listen_fd = sock.detach()
        except OSError as e:  # bind failed (EADDRINUSE: someone hosts it already)
            raise StoreError(f"cannot host a TCPStore on {host}:{port}: {_describe(e)}") from e
        self.port = port
        super().__init__(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}", prefix, timeout)
        try:
            # connecting waits for the server's answer: bounded like any request
            self._store = self._bounded("connect", lambda: self._open(listen_fd), timeout + 1.0)
        except Exception as e:  # DistNetworkError: nobody answered within the timeout
            role = "host" if is_host else "connect to"
            raise StoreError(f"cannot {role} TCPStore at {host}:{port} within {timeout:g} s: {_describe(e)}") from e
        if is_host:
            self._server = self._store  # keeps the server alive while a replacement client is in use

    def _open(self, listen_fd: int | None = None):
        from torch.distributed import TCPStore  # torch is heavy: imported when a store is made

        kw: dict[str, Any] = dict(wait_for_workers=False, use_libuv=True)
        if listen_fd is not None:
            kw["master_listen_fd"] = listen_fd
        return TCPStore(self.host, self.port, None, listen_fd is not None, timedelta(seconds=self.timeout), **kw)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", {'host' if self.is_host else 'peer'})"

    def _client(self):
        """The connection for this call: a fresh one after ``_reset`` (made on the bounded thread)."""
        store = self._store
        if store is None:
            store = self._store = self._open()
        return store

    def _reset(self) -> None:
        self._store = None  # the stuck call keeps its own reference; the host's server stays in _server

    def _set(self, key: str, value: bytes) -> None:
        if value == self._MISSING:
            raise InvalidArgumentError(f"value for key {key!r} is the store's reserved absent-key sentinel")
        self._client().set(key, value)

    def _try_get(self, key: str) -> bytes | None:
        value = self._client().compare_set(key, self._MISSING, self._MISSING)
        return None if value == self._MISSING else value

    _POLL_S = (0.002, 0.05)  # first and longest pause between reads while waiting for a key

    def _wait_get(self, key: str, timeout: float) -> bytes | None:
        # Polls with compare_set (one short round trip each; other threads' calls interleave) rather
        # than TCPStore.wait, which holds a connection (a clone per waiting call) for the whole wait.
        deadline = time.monotonic() + timeout
        pause = self._POLL_S[0]
        while (value := self._try_get(key)) is None:  # loops again if deleted between reads
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(pause, remaining))
            pause = min(2 * pause, self._POLL_S[1])
        return value

    def _delete(self, key: str) -> bool:
        return self._client().delete_key(key)

    def _add(self, key: str, amount: int) -> int:
        # The server drops the connection of a client that adds to a non-integer value: check first.
        current = self._try_get(key)
        if current is not None:
            _parse_counter(key, current, self.endpoint)
        return self._client().add(key, amount)

    def _close(self) -> None:
        self._store = self._server = None  # TCPStore has no close(); dropping it closes the socket (and the server)


class EtcdStore(MetadataStore):
    """An etcd v3 server (>= 3.4) through its HTTP gateway, with ``etcd3gw``.

    ``get`` waits with an etcd watch that starts right after the revision it last read, so a put
    in between is never missed. ``timeout`` bounds the connect (retried until then) and each request.
    """

    __slots__ = ("_client", "_exc")
    _WATCH_SLICE_S = 5.0  # re-read at least this often, in case a watch stream dies silently

    def __init__(self, host: str, port: int, *, timeout: float = 30.0, prefix: str = DEFAULT_PREFIX) -> None:
        timeout = _check_seconds("timeout", timeout, positive=True)
        super().__init__(f"etcd://[{host}]:{port}" if ":" in host else f"etcd://{host}:{port}", prefix, timeout)
        try:
            import etcd3gw
            import requests  # etcd3gw's HTTP client
        except ImportError as e:
            raise StoreError(f"store {self.endpoint} needs the etcd3gw package: pip install xfer[etcd]") from e
        self._exc = etcd3gw.exceptions
        session = requests.Session()
        session.trust_env = False  # etcd is a cluster-internal service: never route it through an env proxy
        self._client = etcd3gw.Etcd3Client(host=host, port=port, timeout=timeout, session=session)
        deadline, delay = time.monotonic() + timeout, 0.05
        while True:  # the server may still be starting: retry with a bounded back-off
            try:
                self._client.status()
                return
            except Exception as e:
                if time.monotonic() + delay > deadline or not isinstance(e, self._exc.ConnectionFailedError):
                    session.close()
                    raise StoreError(f"cannot reach etcd at {self.endpoint} within {timeout:g} s: "
                                     f"{_describe(e)}") from e
            time.sleep(delay)
            delay = min(2 * delay, 0.5)

    def _range(self, key: bytes) -> tuple[bytes | None, int, int]:
        """(value or None, store revision of this read, the key's mod_revision or 0).

        etcd3gw's get() hides the header revision, which the watch needs: this calls the range API."""
        r = self._client.post(self._client.get_url("/kv/range"), json={"key": _b64(key)})
        revision = int(r["header"]["revision"])
        if not r.get("kvs"):
            return None, revision, 0
        kv = r["kvs"][0]
        return base64.b64decode(kv.get("value", "")), revision, int(kv["mod_revision"])

    def _set(self, key: str, value: bytes) -> None:
        self._client.put(key.encode(), value)

    def _try_get(self, key: str) -> bytes | None:
        return self._range(key.encode())[0]

    def _wait_get(self, key: str, timeout: float) -> bytes | None:
        k, deadline = key.encode(), time.monotonic() + timeout
        while True:
            value, revision, _ = self._range(k)
            if value is not None:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                event = self._client.watch_once(k, timeout=min(remaining, self._WATCH_SLICE_S),
                                                start_revision=revision + 1, filters=["NODELETE"])
            except self._exc.WatchTimedOut:
                continue
            return event["kv"].get("value", b"")  # the gateway omits an empty value

    def _delete(self, key: str) -> bool:
        return self._client.delete(key.encode())

    def _add(self, key: str, amount: int) -> int:
        k = key.encode()
        while True:  # compare-and-swap: retry when another writer got in between read and write
            value, _, mod = self._range(k)
            new = amount if value is None else _parse_counter(key, value, self.endpoint) + amount
            unchanged = ({"target": "CREATE", "create_revision": 0} if value is None  # still absent
                         else {"target": "MOD", "mod_revision": mod})
            txn = {"compare": [{"key": _b64(k), "result": "EQUAL", **unchanged}],
                   "success": [{"request_put": {"key": _b64(k), "value": _b64(str(new).encode())}}]}
            if self._client.transaction(txn).get("succeeded"):
                return new

    def _close(self) -> None:
        self._client.session.close()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _parse_url(url: str) -> tuple[StoreKind, str, int]:
    bad = InvalidArgumentError(f"bad store URL {url!r}; expected one of: {_URL_FORMS}")
    if not isinstance(url, str):
        raise bad
    parts = urlsplit(url)
    try:
        kind, port = StoreKind(parts.scheme), parts.port
    except ValueError:  # unknown scheme, or a port that is not a number in 0..65535
        raise bad from None
    extra = parts.path not in ("", "/") or parts.query or parts.fragment or parts.username
    if not parts.hostname or port is None or extra or (kind is StoreKind.ETCD and port == 0):
        raise bad
    return kind, parts.hostname, port


def open_store(url: str, *, host_if_missing: bool = False, timeout: float = 30.0,
               prefix: str = DEFAULT_PREFIX) -> MetadataStore:
    """Open the store at ``url``: ``tcp://HOST:PORT`` connects, ``tcp://HOST:0`` hosts on a free port
    (read it from ``.port`` / ``.endpoint``), ``etcd://HOST:PORT`` uses an etcd server.

    ``host_if_missing=True`` makes a ``tcp://`` URL host the store unless the port is already bound
    (then it connects); it is ignored for etcd, whose server runs outside xfer. ``timeout`` (s)
    bounds connecting and each request.
    """
    kind, host, port = _parse_url(url)
    if kind is StoreKind.ETCD:
        store: MetadataStore = EtcdStore(host, port, timeout=timeout, prefix=prefix)
    elif port == 0 or host_if_missing:
        try:
            store = TCPStoreBackend(host, port, is_host=True, timeout=timeout, prefix=prefix)
        except StoreError as e:
            in_use = isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.EADDRINUSE
            if port == 0 or not in_use:
                raise
            store = TCPStoreBackend(host, port, is_host=False, timeout=timeout, prefix=prefix)
    else:
        store = TCPStoreBackend(host, port, is_host=False, timeout=timeout, prefix=prefix)
    log.info("metadata store %r opened from %s", store, url)
    return store
