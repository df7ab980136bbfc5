"""What instances tell each other, and the store-backed inbox that carries the control messages.

Data and its completion travel through xfer: a prefill instance's per-layer write carries a
``LayerNote`` payload (request id, layer, TP rank) and its final zero-block write a ``TokenNote``
(the first token and the prefill timings). Control (router -> decode -> prefill, and decode's
release back to prefill) travels as JSON through the metadata store: ``Inbox`` is a queue of
numbered keys ``inbox/<name>/<n>``; a sender takes ``n`` from an atomic counter, the owner reads
keys in order, waiting on the next one.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field

from xfer.errors import StoreTimeoutError

__all__ = ["Request", "LayerNote", "TokenNote", "encode", "decode", "Inbox", "send"]


@dataclass
class Request:
    """A generation request: ``prompt`` token ids, greedy ``max_new_tokens``; ``arrival`` in time.time() s."""

    id: str
    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0
    prefill: str = ""  # the prefill instance (or TP group leader) chosen by the router
    extra: dict = field(default_factory=dict)


@dataclass
class LayerNote:
    """Payload of one per-layer write: layer ``layer`` of request ``req`` from TP rank ``rank`` landed."""

    req: str
    layer: int
    rank: int = 0
    kind: str = "layer"


@dataclass
class TokenNote:
    """Payload of the write of the last layer: prefill of ``req`` produced ``token``.

    ``layer``: the layer whose blocks this write carries (-1: none, a pure message). Times are the
    prefill process's ``time.time()`` at forward start and end (the token known).
    """

    req: str
    token: int
    t_start: float
    t_forward: float
    layer: int = -1
    rank: int = 0
    kind: str = "token"


def encode(note) -> bytes:
    return json.dumps(asdict(note), separators=(",", ":")).encode()


def decode(payload: bytes) -> LayerNote | TokenNote:
    d = json.loads(payload)
    return LayerNote(**d) if d.get("kind") == "layer" else TokenNote(**d)


def send(store, name: str, msg: dict) -> None:
    """Append ``msg`` (JSON-able) to ``name``'s inbox."""
    n = store.add(f"inbox/{name}/tail", 1)
    store.set(f"inbox/{name}/{n}", json.dumps(msg).encode())


class Inbox:
    """The messages sent to ``name``, read in order by a background thread (own store connection).

    ``get(timeout)`` returns the next message or None; ``close()`` stops the reader.
    """

    def __init__(self, store_url: str, name: str, *, open_store=None):
        from xfer.store import open_store as _open

        self._store = (open_store or _open)(store_url)
        self.name = name
        self._next = 1
        self._items: list[dict] = []
        self._error: Exception | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"inbox-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            key = f"inbox/{self.name}/{self._next}"
            try:
                raw = self._store.get(key, 5.0)  # close() wakes it with a message
            except StoreTimeoutError:
                continue
            except Exception as exc:  # the store went away (router gone): nothing more will come
                with self._cond:
                    self._error = None if self._stop.is_set() else exc
                    self._cond.notify_all()
                return
            self._store.delete(key)
            self._next += 1
            msg = json.loads(raw)
            if msg.get("type") == "_wake":
                continue
            with self._cond:
                self._items.append(msg)
                self._cond.notify_all()

    def get(self, timeout: float = 0.0) -> dict | None:
        """The next message, waiting up to ``timeout`` s; raises the store's error once it failed."""
        with self._cond:
            if not self._items and timeout > 0 and self._error is None:
                self._cond.wait(timeout)
            if self._items:
                return self._items.pop(0)
            if self._error is not None:
                raise self._error
            return None

    def close(self) -> None:
        """Stop the reader (waking it with a message of its own) and drop the connection. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            send(self._store, self.name, {"type": "_wake"})
        except Exception:  # the store is gone already: the reader ends on its own
            pass
        self._thread.join(timeout=6)
        self._store.close()
