"""Which implementation moves a block copy's bytes (:class:`CopyPath`), and why: the request
(``path=``, else ``xfer.settings.current().copy.path``, i.e. ``XFER_COPY_PATH``; default ``auto``),
the sides' memory (CUDA, pinned or pageable host) and, for ``auto``, the copy table by direction
and slice size (see :mod:`xfer.kernels._dispatch` for the whole rule)."""

from __future__ import annotations

import enum
import functools
import json
import threading
from collections.abc import Mapping, Sequence

import torch

from xfer import settings
from xfer.errors import InvalidArgumentError, TransportUnavailableError
from xfer.layout import KVLayout

__all__ = ["CopyPath", "COPY_REQUESTS", "DEFAULT_COPY_TABLE", "DIRECTIONS", "copy_table", "set_copy_table",
           "select_path", "slice_bytes"]


class CopyPath(enum.Enum):
    """Which implementation moves the bytes."""

    TRITON = "triton"  # a CUDA side: one compiled Triton launch
    COPY_ENGINE_BATCH = "copy_engine_batch"  # a CUDA side: cudaMemcpyBatchAsync over the byte runs
    COPY_ENGINE_2D = "copy_engine_2d"  # a CUDA side: cudaMemcpy2DAsync per uniform-stride run set
    TRITON_INTERPRETER = "triton_interpreter"  # CPU tensors and TRITON_INTERPRET=1 (how CI tests the kernel)
    TORCH_REFERENCE = "torch_reference"  # CPU tensors otherwise


# request -> path; "auto" resolves through the table
COPY_REQUESTS = {"kernel": CopyPath.TRITON, "triton": CopyPath.TRITON, "batch": CopyPath.COPY_ENGINE_BATCH,
                 "copy_engine_batch": CopyPath.COPY_ENGINE_BATCH, "2d": CopyPath.COPY_ENGINE_2D,
                 "copy_engine_2d": CopyPath.COPY_ENGINE_2D, "auto": None}
_ENGINE_MODE = {CopyPath.COPY_ENGINE_BATCH: "batch", CopyPath.COPY_ENGINE_2D: "2d"}
_REQUEST_OF = {CopyPath.TRITON: "kernel", **_ENGINE_MODE}
DIRECTIONS = ("d2d", "d2h", "h2d")
# direction -> ((minimum slice bytes, path), ...) ascending: the last row a copy's slices reach wins.
# Measured on the H200 (bench/results/2026-12-02-h200-ipc-copy-paths.json, -copy-calibration.txt): the kernel beat
# cudaMemcpyBatchAsync, 2D and per-run copies at every slice size and direction of the seed case
# (16,384 slices): 32 KiB d2h 0.89 vs 0.79 of a contiguous pinned copy, h2d 0.93 vs 0.84; d2d and
# IPC the copy engines reach < 1 % (each run costs the engines ~4 us). So: the kernel everywhere.
DEFAULT_COPY_TABLE: dict[str, tuple[tuple[int, str], ...]] = {
    "d2d": ((0, "kernel"),),
    "d2h": ((0, "kernel"),),
    "h2d": ((0, "kernel"),),
}
_TABLE: list = []  # [(table, source, settings generation or None for set_copy_table's)] once resolved
_TABLE_LOCK = threading.Lock()


def _check_table(table: Mapping, source: str) -> dict[str, tuple[tuple[int, str], ...]]:
    if not isinstance(table, Mapping):
        raise InvalidArgumentError(f"copy table ({source}) must map directions to rows, got {type(table).__name__}")
    out = dict(DEFAULT_COPY_TABLE)
    for direction, rows in table.items():
        if direction not in DIRECTIONS:
            raise InvalidArgumentError(f"copy table ({source}) names direction {direction!r}; expected {DIRECTIONS}")
        try:
            rows = tuple((int(m), str(p)) for m, p in rows)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"copy table ({source}) rows of {direction} must be [min_bytes, path] pairs, "
                                       f"got {rows!r}") from None
        if not rows or rows[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(rows, rows[1:])):
            raise InvalidArgumentError(f"copy table ({source}) rows of {direction} must start at 0 bytes and grow "
                                       f"strictly, got {list(rows)}")
        for _, p in rows:
            if p not in COPY_REQUESTS or p == "auto":
                raise InvalidArgumentError(f"copy table ({source}) names path {p!r}; expected kernel, batch or 2d")
        out[direction] = rows
    return out


def set_copy_table(table: Mapping | None, source: str = "set_copy_table") -> None:
    """Use ``table`` (``{direction: [[min_slice_bytes, "kernel"|"batch"|"2d"], ...]}``, the
    calibration's ``table``) for ``auto``; directions it omits keep the default. ``None``: back
    to the default (or ``XFER_COPY_TABLE``)."""
    checked = None if table is None else (_check_table(table, source), source, None)
    with _TABLE_LOCK:
        _TABLE[:] = [] if checked is None else [checked]
        _TABLE_GEN[0] += 1


def copy_table() -> tuple[dict[str, tuple[tuple[int, str], ...]], str]:
    """The table ``auto`` uses, and where it came from."""
    gen = settings.generation()
    with _TABLE_LOCK:
        if _TABLE and _TABLE[0][2] in (None, gen):
            return _TABLE[0][:2]
    path = (settings.current().copy.table or "").strip()
    if path:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(f"XFER_COPY_TABLE={path!r} cannot be read as JSON: {exc}") from None
        entry = (_check_table(doc.get("table", doc) if isinstance(doc, dict) else doc, f"XFER_COPY_TABLE={path}"),
                 f"XFER_COPY_TABLE={path}", gen)
    else:
        entry = (dict(DEFAULT_COPY_TABLE), "default table", gen)
    with _TABLE_LOCK:
        if not _TABLE or _TABLE[0][2] not in (None, gen):
            _TABLE[:] = [entry]
        return _TABLE[0][:2]


def _request(path) -> tuple[str, str]:
    """(normalized request, where it came from)."""
    source = "path argument"
    if path is None:
        path = (settings.current().copy.path or "").strip()
        path, source = (path, "XFER_COPY_PATH") if path else ("auto", "default")
    if isinstance(path, CopyPath):
        if path not in _REQUEST_OF:
            raise InvalidArgumentError(f"copy path {path} is chosen from the tensors, not requested; request "
                                       f"kernel, batch, 2d or auto")
        return _REQUEST_OF[path], source
    key = str(path).strip().lower()
    if key not in COPY_REQUESTS:
        raise InvalidArgumentError(f"copy path ({source}) must be one of kernel, batch, 2d, auto; got {path!r}")
    return {"triton": "kernel", "copy_engine_batch": "batch", "copy_engine_2d": "2d"}.get(key, key), source


def _interpret_requested() -> bool:
    return settings.current().copy.interpret


def _pick(src: tuple[str, bool], dst: tuple[str, bool]) -> tuple[CopyPath, str]:
    """Path for sides given as (device type, all pinned)."""
    for side, (dev, _) in (("source", src), ("destination", dst)):
        if dev not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"block copies take CUDA or host tensors, the {side} is on {dev}")
    if "cuda" in (src[0], dst[0]):
        for side, (dev, pinned) in (("source", src), ("destination", dst)):
            if dev == "cpu" and not pinned:
                raise InvalidArgumentError(f"{side} tensors are pageable host memory; a kernel reaches host "
                                           f"memory only when pinned: allocate them with pin_memory=True")
        return CopyPath.TRITON, "a side is on CUDA"
    if _interpret_requested():
        return CopyPath.TRITON_INTERPRETER, "CPU tensors and TRITON_INTERPRET=1"
    return CopyPath.TORCH_REFERENCE, "CPU tensors (set TRITON_INTERPRET=1 to run the Triton kernel)"


def _where(tensors: Sequence[torch.Tensor]) -> tuple[str, bool]:
    dev = tensors[0].device.type if tensors else "cpu"
    return dev, dev == "cpu" and torch.cuda.is_available() and all(t.is_pinned() for t in tensors)


@functools.lru_cache(maxsize=256)
def slice_bytes(src_layout: KVLayout, dst_layout: KVLayout) -> int:
    """Bytes contiguous on both sides of one (block, slot): what ``auto`` sizes a copy by."""
    src_layout.check_compatible(dst_layout, what="destination")
    return src_layout.joint_runs(dst_layout)[0] * src_layout.itemsize


def _direction(src: tuple[str, bool], dst: tuple[str, bool]) -> str:
    return "d2d" if src[0] == dst[0] == "cuda" else "d2h" if src[0] == "cuda" else "h2d"


_CHOSEN: dict = {}  # memo of _choose where no copy-engine check was involved: it runs on every copy
_TABLE_GEN = [0]  # bumped by set_copy_table


def _choose(src: tuple[str, bool], dst: tuple[str, bool], size: int | None, path) -> tuple[CopyPath, str]:
    """Path for sides (device type, all pinned), slices of ``size`` bytes (None: unknown), a request."""
    key = (src, dst, size, path, settings.generation(), _TABLE_GEN[0])
    try:
        hit = _CHOSEN.get(key)
    except TypeError:  # an unhashable request: _request names it
        key, hit = None, None
    if hit is None:
        chosen, why, engines_checked = _choose_uncached(src, dst, size, path)
        hit = chosen, why
        if key is not None and not engines_checked:  # the copy engines' availability is not memoized
            if len(_CHOSEN) > 1024:
                _CHOSEN.clear()
            _CHOSEN[key] = hit
    return hit


def _choose_uncached(src: tuple[str, bool], dst: tuple[str, bool], size: int | None,
                     path) -> tuple[CopyPath, str, bool]:
    """(path, why, whether the copy engines' availability was consulted)."""
    base, why = _pick(src, dst)
    if base is not CopyPath.TRITON:
        return base, why, False  # no CUDA side: the request does not apply
    req, source = _request(path)
    direction = _direction(src, dst)
    from . import copy_engine
    if req != "auto":
        chosen = COPY_REQUESTS[req]
        if chosen in _ENGINE_MODE:
            reason = copy_engine.available(_ENGINE_MODE[chosen])
            if reason:
                raise TransportUnavailableError(f"copy path {req!r} ({source}) cannot run here: {reason}")
        return chosen, f"{req} requested ({source}), {direction}", chosen in _ENGINE_MODE
    table, table_source = copy_table()
    rows = table[direction]
    row = rows[0] if size is None else [r for r in rows if r[0] <= size][-1]
    chosen = COPY_REQUESTS[row[1]]
    what = "slice size unknown" if size is None else f"{size}-byte slices"
    why = f"auto ({table_source}): {what} {direction} -> {row[1]} (row from {row[0]} B)"
    if chosen in _ENGINE_MODE:
        reason = copy_engine.available(_ENGINE_MODE[chosen])
        if reason and chosen is CopyPath.COPY_ENGINE_BATCH and copy_engine.available("2d") is None:
            return CopyPath.COPY_ENGINE_2D, f"{why}; batch unavailable ({reason}): 2d", True
        if reason:
            return CopyPath.TRITON, f"{why}; copy engine unavailable ({reason}): kernel", True
        return chosen, why, True
    return chosen, why, False


def select_path(src_tensors: Sequence[torch.Tensor], dst_tensors: Sequence[torch.Tensor], *,
                src_layout: KVLayout | None = None, dst_layout: KVLayout | None = None,
                path=None) -> tuple[CopyPath, str]:
    """The path a copy between these tensors takes, and why; raises if no path can serve them.

    ``path``: the request (see the module doc); with both layouts, ``auto`` decides by their
    slice size, without them by the table's smallest row.
    """
    size = slice_bytes(src_layout, dst_layout) if src_layout is not None and dst_layout is not None else None
    return _choose(_where(src_tensors), _where(dst_tensors), size, path)
