"""Signal-word waits and own-word writes for NVSHMEM's *limited MPG* mode.

When several PEs share one GPU without MPS, NVSHMEM runs in limited MPG mode: puts and
``putmem_signal`` work, but ``signal_wait_until_on_stream`` prints "Called NVSHMEM API not
supported with limited MPG runs" and **exits the process**, and the own-PE branch of
``signal_op_on_stream`` (``cuStreamWriteValue64``) failed on the H200 (CUDA_ERROR_INVALID_VALUE).
In that mode the lanes use these instead, on the same streams and the same symmetric words:

- own-word writes: a one-element ``fill_`` of the word's tensor view, queued on the stream;
- a peer's word (credits): a one-thread Triton kernel stores it through the ``nvshmem_ptr``
  mapping (release order at system scope);
- waits (``word >= value``): the CUDA driver's stream memory operation ``cuStreamWaitValue64``
  (GEQ; no SM is held), which is what NVSHMEM itself issues where it may. A self-test on a
  symmetric scratch word decides at start-up; where the driver refuses it, a one-warp Triton
  kernel spins on the word with acquire loads at system scope.

The puts that set the words come over peer mappings of one GPU, so no remote-write flush is
needed. Signal values stay below 2**63 (int64 words).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from ...errors import TransportError, TransportUnavailableError

__all__ = ["MpgOps", "is_limited_mpg", "unmapped"]

log = logging.getLogger("xfer.nvshmem")

LIMITED_MPG = 3  # NVSHMEM_STATUS_LIMITED_MPG


def is_limited_mpg(status_name: str, status_value: int) -> bool:
    return "LIMITED_MPG" in status_name or status_value == LIMITED_MPG


def unmapped(addr: int, nbytes: int = 1) -> str | None:
    """Why the first or last byte of ``nbytes`` at ``addr`` (e.g. an ``nvshmem_ptr`` of a peer's
    memory) is not device memory this process may touch, or None (also when the CUDA driver
    bindings are missing: nothing to ask). The question Triton's launcher asks of pointers;
    NVSHMEM 3.4's host ``nvshmem_ptr`` returns addresses in the peer's reserved range without it."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None
    attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
    for a in {addr, addr + max(1, nbytes) - 1}:
        err, _ = cu.cuPointerGetAttribute(attr, a)
        if err != cu.CUresult.CUDA_SUCCESS:
            return f"0x{a:x} is not mapped in this process ({err.name})"
    return None


@functools.cache
def _spin_kernel():
    import triton
    import triton.language as tl

    # one compiled variant whatever the word's alignment: preloaded once (MpgOps), never loaded behind a wait
    @triton.jit(do_not_specialize=["value"], do_not_specialize_on_alignment=["word_ptr"])
    def wait_geq(word_ptr, value):
        seen = tl.atomic_add(word_ptr, 0, sem="acquire", scope="sys")
        while seen < value:
            seen = tl.atomic_add(word_ptr, 0, sem="acquire", scope="sys")

    return wait_geq


@functools.cache
def _set_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["value"], do_not_specialize_on_alignment=["word_ptr"])
    def set_word(word_ptr, value):
        tl.atomic_xchg(word_ptr, value, sem="release", scope="sys")

    return set_word


class _Word:
    """A raw device address as a Triton pointer argument (an int64 word; a peer's, mapped here)."""

    dtype = torch.int64

    def __init__(self, addr: int) -> None:
        self.addr = addr

    def data_ptr(self) -> int:
        return self.addr


class MpgOps:
    """``words``: the int64 tensor of this PE's signal words (a scratch word last)."""

    def __init__(self, words: torch.Tensor, timeout_s: float = 10.0) -> None:
        self.words, self.base = words, words.data_ptr()
        self.mode = "memop"
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            cu = None
        self._cu = cu
        if cu is None:
            self.mode = "kernel"
        else:
            self._geq = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
            err = self._self_test(timeout_s)
            if err:
                log.info("NVSHMEM limited MPG: cuStreamWaitValue64 unusable on the symmetric heap (%s); "
                         "waits spin in a one-warp kernel", err)
                self.mode = "kernel"
        self._preload(timeout_s)
        log.info("NVSHMEM in limited MPG mode: signal waits by %s",
                 "cuStreamWaitValue64" if self.mode == "memop" else "a spinning one-warp kernel")

    def _preload(self, timeout_s: float) -> None:
        """Run the store kernel (and the spin kernel) once now, on the scratch word (already 1):
        their first launch may synchronize the context (CUDA lazy loading), which must not happen
        behind a signal wait that only this process's later work releases."""
        scratch = self.words[-1:]
        stream = torch.cuda.Stream(self.words.device)
        try:
            with torch.cuda.stream(stream):
                _set_kernel()[(1,)](scratch, 1, num_warps=1)
                if self.mode == "kernel":
                    _spin_kernel()[(1,)](scratch, 1, num_warps=1)
        except Exception:  # noqa: BLE001 - a safeguard only: the first real store loads them instead
            log.warning("NVSHMEM limited MPG: running the signal kernels once at start-up failed", exc_info=True)
            return
        event = torch.cuda.Event()
        event.record(stream)
        end = time.monotonic() + timeout_s
        while not event.query():
            if time.monotonic() > end:
                raise TransportUnavailableError("NVSHMEM limited MPG: the signal kernels' first run did not complete")
            time.sleep(1e-4)

    def _view(self, addr: int) -> torch.Tensor:
        i, rem = divmod(addr - self.base, 8)
        if rem or not 0 <= i < self.words.numel():
            raise TransportError(f"0x{addr:x} is not one of this PE's signal words")
        return self.words[i:i + 1]

    def _self_test(self, timeout_s: float) -> str | None:
        scratch = self.words[-1:]
        stream = torch.cuda.Stream(self.words.device)
        with torch.cuda.stream(stream):
            scratch.fill_(1)
        try:
            self._memop_wait(stream, scratch.data_ptr(), 1)
        except TransportError as exc:
            stream.synchronize()
            return str(exc)
        event = torch.cuda.Event()
        event.record(stream)
        end = time.monotonic() + timeout_s
        while not event.query():
            if time.monotonic() > end:  # cannot happen with a working wait: the word is already 1
                raise TransportUnavailableError("cuStreamWaitValue64 self-test did not complete; the stream is stuck")
            time.sleep(1e-4)
        return None

    def _memop_wait(self, stream, addr: int, value: int) -> None:
        cu = self._cu
        (err,) = cu.cuStreamWaitValue64(cu.CUstream(stream.cuda_stream), cu.CUdeviceptr(addr), value, self._geq)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise TransportError(f"cuStreamWaitValue64 on 0x{addr:x} >= {value} failed: {err!r}")

    def wait(self, stream, addr: int, value: int) -> None:
        """Queue on ``stream``: go on once the word at ``addr`` is >= ``value``."""
        if self.mode == "memop":
            self._memop_wait(stream, addr, value)
            return
        view = self._view(addr)
        with torch.cuda.stream(stream):
            _spin_kernel()[(1,)](view, int(value), num_warps=1)

    def set_remote(self, stream, mapped_addr: int, value: int) -> None:
        """Queue on ``stream``: a peer PE's word, mapped here at ``mapped_addr`` (``nvshmem_ptr``),
        := ``value``, with release order after this stream's earlier work. NVSHMEM 3.4.5's own
        ``signal_op_on_stream`` issues ``cuStreamWriteValue64`` on the mapping, which fails in
        limited MPG and exits the process."""
        with torch.cuda.stream(stream):
            try:
                _set_kernel()[(1,)](_Word(mapped_addr), int(value), num_warps=1)
            except ValueError as exc:  # Triton's launcher asks CUDA whether the address is mapped here
                # seen on the H200 with two PEs on one GPU and a 2.5 GiB heap (the tests' small heaps
                # work): storing through the address anyway faults and kills this process's context
                raise TransportError(f"the peer's signal word, mapped here at 0x{mapped_addr:x} by nvshmem_ptr, is "
                                     f"not accessible from this process (limited MPG): {exc}") from None

    def set_own(self, stream, addr: int, value: int) -> None:
        """Queue on ``stream``: this PE's word at ``addr`` := ``value``."""
        view = self._view(addr)
        with torch.cuda.stream(stream):
            view.fill_(int(value))
