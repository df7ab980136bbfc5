"""Layer-wise streaming: post layer ``l``'s blocks to the decode instance as soon as they are in the
prefill pool, while the forward goes on with layer ``l+1``.

On CPU the forward is synchronous, so the write is posted from the cache hook itself. On a GPU
the hook runs when layer ``l``'s kernels are *queued*: it records an event on the current stream
and hands it to a :class:`Poster` thread, which waits for that event before posting
(``Agent.write`` takes no event to wait on; the transport's copy runs on its own stream, and
posting only once the layer's kernels completed is what keeps the copy from reading KV before it
is written). The forward thread never blocks on a transfer and never synchronises the device:
the hook costs one event record and a queue put. The poster thread lives as long as its prefill
instance (no thread start per request).
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from xfer.errors import TransferTimeoutError

from .kv_pool import region_name
from .protocol import LayerNote, TokenNote, encode

__all__ = ["LayerStreamer", "Poster"]


class Poster:
    """One thread that waits for each queued CUDA event, then runs the work queued with it, in order."""

    def __init__(self, name: str = "xfer-stream-poster"):
        self.error: BaseException | None = None  # the first failure of an event wait (a CUDA error is sticky)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, event, fn, *args) -> None:
        """Run ``fn(*args)`` on the poster thread once ``event`` (a ``torch.cuda.Event`` or None) completed."""
        self._queue.put((event, fn, args))

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far ran; False if that took longer than ``timeout``."""
        done = threading.Event()
        self._queue.put((None, done.set, ()))
        return done.wait(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, fn, args = item
            try:
                if event is not None:
                    event.synchronize()
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - surfaced by the streamer's finish()
                self.error = self.error or exc

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)


class LayerStreamer:
    """Streams one request's layers from ``src_blocks`` to the peer's ``dst_blocks``.

    peer_heads: the decode-side head range this rank writes (``None``: all heads, region ``kv.<l>``).
    timeout: deadline of each layer's transfer, in seconds.
    """

    def __init__(self, agent, peer: str, req: str, src_blocks: list[int], dst_blocks: list[int], *,
                 num_layers: int, rank: int = 0, peer_heads: tuple[int, int] | None = None,
                 timeout: float = 30.0, device: torch.device | None = None, hold_last: bool = True,
                 poster: Poster | None = None):
        self.agent, self.peer, self.req, self.rank = agent, peer, req, rank
        # the last layer waits for the first token (lm_head is ~1 layer's matmul on 1 position), so
        # one write carries both and the decode side needs no extra round trip
        self.last = num_layers - 1 if hold_last else None
        self._held = False
        self.src, self.dst, self.peer_heads, self.timeout = src_blocks, dst_blocks, peer_heads, timeout
        self.transfers = []
        self._error: BaseException | None = None
        self._poster = poster if device is not None and device.type == "cuda" else None
        self._device = device
        if self._poster is None and device is not None and device.type == "cuda":
            raise ValueError("a CUDA prefill streams through a Poster thread: pass poster=")

    def layer_done(self, layer: int) -> None:
        """Cache hook: layer ``layer``'s new tokens are in the pool (or queued to be, on a GPU)."""
        if self._poster is None:
            self._post(layer)
            return
        event = torch.cuda.Event()
        # on the forward's stream (the pool's GPU, which need not be the current device), after
        # layer ``layer``'s KV writes
        event.record(torch.cuda.current_stream(self._device))
        self._poster.put(event, self._post_guarded, layer)

    def _post_guarded(self, layer: int) -> None:
        try:
            self._post(layer)
        except BaseException as exc:  # noqa: BLE001 - raised again by finish()
            self._error = self._error or exc

    def _post(self, layer: int, note: bytes | None = None, blocks: bool = True) -> None:
        if layer == self.last and note is None:
            self._held = True
            return
        note = note or encode(LayerNote(req=self.req, layer=layer, rank=self.rank))
        self.transfers.append(self.agent.write(
            self.peer, self.src if blocks else [], self.dst if blocks else [], region=region_name(layer),
            peer_region=region_name(layer, self.peer_heads), notify=note, timeout=self.timeout,
            after=None))  # the poster waited for this layer's event: no ordering behind later layers

    def finish(self, token: int | None, t_start: float, t_forward: float) -> float:
        """Send the first token and wait until every layer landed; returns that time.

        With ``hold_last`` the token rides on the held last layer's write (one write, after the
        lm_head); without, the last layer is not held back (its copy overlaps the last MLP and the
        lm_head) and the token goes at once as an ``Agent.send`` message (the decode side counts
        layers and token separately, in any order, and reads no KV before every layer landed). Raises the first
        transfer's typed error (TransferTimeoutError, PeerDisconnectedError, ...).
        """
        note = None
        if token is not None:
            note = TokenNote(req=self.req, token=int(token), t_start=t_start, t_forward=t_forward, rank=self.rank)
            if self.last is None:
                # a control message straight to the peer: it does not queue behind the layers' copies
                self.agent.send(self.peer, encode(note), timeout=self.timeout)
        if self._poster is not None and not self._poster.flush(self.timeout):
            raise TransferTimeoutError(f"request {self.req}: layers not posted within {self.timeout} s")
        if self._error is None and self._poster is not None and self._poster.error is not None:
            self._error = self._poster.error
        if self._error is not None:
            raise self._error
        if self._held:
            if note is not None:
                note.layer = self.last
            self._post(self.last, encode(note or LayerNote(req=self.req, layer=self.last, rank=self.rank)))
        for t in self.transfers:
            t.wait()
        return time.time()
