"""A READ checked by its initiator: the peer's busy counts, read straight from its memory.

A one-sided READ copies a peer's blocks with no hold on them; it may report DONE only if nothing
changed or gave those blocks back while it copied (``xfer.transports.grants``: no write hold on
them live at its end or ended since its copy began, no revocation since). The target checks that
when the READ's notice comes, and the initiator used to wait for its answer: a control round trip
after the copy (on the H100, 0.11 of a lone seed-case READ's 0.56 ms). A target on this host
publishes the counts' shared segment with the region (``busy``), so the initiator reads them itself
once its copy ended (:func:`xfer.transports.grants.read_changed`, the target's own check) and ends
the READ then. Its notice still tells the target and says that the reader checked: a lone READ's
notice left at the launch (``reader_checks`` in its landing fields; delivered once the slot says
the copy ended), the others' go once their copies ended, several to one peer in one message
(``reader_checked``); the answers are taken later
(:meth:`xfer.transports.onesided.transport.OneSidedTransport._sweep`), and a refused READ sends
none (nothing of it is delivered).

The segment is the peer's: :class:`BusyTables` maps it once per (peer, region), only if it is an
xfer segment of the peer's process holding exactly the region's 3 x ``num_blocks`` words, and
never writes it. A peer that publishes none, or a bad one, gets the notice checked on its side,
as before. What a peer could fake by it is only its own READ's check, which protects the reader.
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch

from ...errors import TransportError
from ...shm import SHM_DIR, open_segment

__all__ = ["BusyTables"]

_NAME = re.compile(r"^xfer-(\d+)-\d+$")


class BusyTables:
    """Peer regions' busy counts this initiator reads (at most ``cap`` mapped; past it the oldest
    mapping is dropped). ``view`` is called by whichever thread launches a READ."""

    def __init__(self, cap: int = 64) -> None:
        self.cap, self._views = cap, {}

    def view(self, name, pid, num_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(writes, written, revoked) of the peer segment ``name``, which process ``pid`` (the
        peer's) must own with exactly ``num_blocks`` blocks' counts; None where it is not such a
        segment or cannot be mapped (then the peer checks the READ's notice itself)."""
        m = _NAME.match(name) if isinstance(name, str) and len(name) <= 64 else None
        if m is None or not isinstance(pid, int) or isinstance(pid, bool) or int(m.group(1)) != pid:
            return None
        hit = self._views.get((name, num_blocks))
        if hit is None:
            try:  # its size first: nothing of another size is mapped
                if os.stat(os.path.join(SHM_DIR, name)).st_size != 3 * 8 * num_blocks:
                    return None
                flat = open_segment(name)
            except (OSError, TransportError):
                return None
            if flat.numel() != 3 * 8 * num_blocks:
                return None
            words = flat.view(torch.float64).view(3, num_blocks).numpy()
            if len(self._views) >= self.cap:
                self._views.pop(next(iter(self._views)))
            hit = self._views[(name, num_blocks)] = (words[0], words[1], words[2])
        return hit
