"""The one-sided transports' split stream launch (issue 32): a kernel copy's block ids are staged
on the device before the grant comes (``BoundCopy.stage``), the launch after it is the kernel's
alone (``BoundCopy.launch_staged``), and a copy that will not launch gives its ids buffer back
(``BoundCopy.unstage``, through the transport's ``_release``). The CUDA calls are stood in for here
(the GPU tests run the real ones: tests/test_ipc.py); this checks that the two halves do what
``BoundCopy``'s lean stream path does, in its order."""

from __future__ import annotations

import contextlib
import types

import numpy as np

from xfer.kernels import BoundCopy
from xfer.transports.onesided import transport as onesided


class _Event:
    def __init__(self):
        self.recorded = None

    def record(self, stream):
        self.recorded = stream


def _fakes(monkeypatch, calls):
    from xfer.kernels import _dispatch
    from xfer.kernels import copy as kcopy

    class Pair:
        table, device = "table", types.SimpleNamespace(index=3)

        def stage(self, s, d, stream):
            calls.append(("upload", s.tolist(), d.tolist(), stream))
            return "ids", ["entry"], (7, 4, 2 * len(s), ("c1", "c2"), ("key", len(s)))

        def launch_staged(self, ids, n, shape, stream):
            programs, warps, n_rows, consts, key = shape
            kcopy._launch(programs, (self.table, ids, n, n_rows, *consts), warps, self.device.index, stream, key)

        def release(self, entry, event):
            calls.append(("release", entry, event))

    pair = Pair()
    monkeypatch.setattr(_dispatch, "_on_device", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(_dispatch, "_pair", lambda *a: calls.append(("pair",)) or pair)
    monkeypatch.setattr(_dispatch, "_KeepAliveEvent", _Event)
    monkeypatch.setattr(onesided.torch.cuda, "Event", _Event)
    monkeypatch.setattr(kcopy, "_launch", lambda *a: calls.append(("launch", *a)))
    side = types.SimpleNamespace(spans=None, tensors=["t"])
    bound = types.SimpleNamespace(_touch=False, _tables={}, src=side, dst=side, src_layout=None, dst_layout=None)
    # BoundCopy's own methods over the stand-in state
    for name in ("stage", "launch_staged", "unstage", "_check_overlap"):
        setattr(bound, name, getattr(BoundCopy, name).__get__(bound) if name != "unstage" else BoundCopy.unstage)
    stream = types.SimpleNamespace(device_index=3, device="cuda:3", wait_event=lambda e: calls.append(("wait", e)))
    return pair, bound, stream


def test_staged_ids_then_the_launch_alone(monkeypatch):
    calls = []
    pair, bound, stream = _fakes(monkeypatch, calls)
    staged = bound.stage(np.array([5, 6]), np.array([9, 8]), stream)
    assert calls == [("pair",), ("upload", [5, 6], [9, 8], stream)] and bound._tables == {3: pair}
    calls.clear()
    event = bound.launch_staged(staged, "ready")
    assert calls[0] == ("wait", "ready")  # the caller's stream first, then the kernel: nothing else
    assert calls[1] == ("launch", 7, ("table", "ids", 2, 4, "c1", "c2"), 4, 3, stream, ("key", 2))
    assert calls[2] == ("release", ["entry"], event) and event.recorded is stream
    assert event.keep[2] == (pair, "ids") and event.path.value == "triton"
    # a second copy of the pair reuses its tables
    calls.clear()
    bound.stage(np.array([1]), np.array([2]), stream)
    assert calls == [("upload", [1], [2], stream)]


def test_a_staged_copy_that_will_not_launch_gives_its_ids_buffer_back(monkeypatch):
    calls = []
    pair, bound, stream = _fakes(monkeypatch, calls)
    prep = onesided._Prep(bound, np.array([5]), np.array([9]), None, stream, 1)
    prep.staged = bound.stage(prep.src_ids, prep.dst_ids, stream)
    calls.clear()
    onesided._release(prep)
    ((what, entry, event),) = calls
    assert (what, entry) == ("release", ["entry"]) and event.recorded is stream  # reusable once the upload ended
    assert prep.staged is None
    onesided._release(prep)  # once only
    onesided._release(None)
    onesided._release(ValueError("a preparation that failed"))
    assert len(calls) == 1
