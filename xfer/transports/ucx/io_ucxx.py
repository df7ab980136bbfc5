"""The UCX engine's I/O back end through ucxx's own API: contiguous tag sends and receives of one
buffer, and ucxx's probe objects. Used when the raw ``libucp`` binding (io_raw) is off
(``XFER_UCX_IOV=0``) or cannot be bound; every chunk is then staged on both sides.

An I/O back end offers ``probe()`` (the next message of any tag: (tag, probe) or None),
``send(conn, buf, tag)`` and ``recv(buf, probe)`` (each returns a request the engine polls:
``completed``, ``check_error()``), and says whether it moves host chunks in place
(``sends_in_place`` / ``receives_in_place``: then ``send_iov`` / ``recv_iov`` too). The engine
picks one when it starts; ``UcxTransport.info()`` names it (``io``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["UcxxIO"]


class UcxxIO:
    name = "ucxx"
    sends_in_place = receives_in_place = False

    def __init__(self, ucx, worker):
        u = ucx.libucxx
        self._array, self._tag, self._worker = ucx.Array, u.UCXXTag, worker
        self._any_tag, self._any_mask = u.UCXXTag(0), u.UCXXTagMask(0)
        self._scratch = np.zeros(1, dtype=np.uint8)

    def probe(self):
        """(sender tag, probe) of the worker's next message of any tag, removed from UCX's queue."""
        probe = self._worker.tag_probe(self._any_tag, self._any_mask, remove=True)
        if not probe.matched:
            return None
        return probe.sender_tag.value, probe

    def send(self, conn, buf, tag: int):
        """Tag-send ``buf`` (a numpy array or CUDA tensor) on ``conn``'s endpoint."""
        return conn.ep.tag_send(self._array(buf), self._tag(tag))

    def recv(self, buf, probe):
        """Receive the probed message into ``buf``."""
        return self._worker.tag_recv_with_handle(self._array(buf), probe)

    def drain(self, probe):
        """Consume the probed message unreceived: a one-byte receive, which UCX truncates."""
        return self._worker.tag_recv_with_handle(self._array(self._scratch), probe)
