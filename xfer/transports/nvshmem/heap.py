"""This PE's symmetric heap: the one table of what NVSHMEM allocated (``nvshmem.core.tensor``) or
registered (``register_external_tensor``) here, in order, with the address ranges the direct path
looks tensors up in. Allocation and registration are collectives: every PE makes the same calls
in the same order, under the runtime's lock; so is freeing at teardown."""

from __future__ import annotations

import math
import os

import torch

from ...errors import InvalidArgumentError, TransportError, TransportUnavailableError

__all__ = ["SymmetricHeap", "STAGING_ALLOCATIONS"]

STAGING_ALLOCATIONS = 3  # the runtime's first allocations: receive area, send area, signal words


class SymmetricHeap:
    def __init__(self, nvc, lock, pe: int, device: torch.device):
        self._nvc, self._lock, self.pe, self.device = nvc, lock, pe, device
        self._tensors: list[torch.Tensor] = []  # from nvshmem.core.tensor, in allocation order
        self._externals: list[torch.Tensor] = []  # register_external aliases, in registration order
        self._ranges: list[tuple[int, int, int]] = []  # (local start, bytes, symmetric start)

    def alloc(self, nbytes: int) -> torch.Tensor:
        """Collective: ``nbytes`` of symmetric memory as a uint8 tensor (freed by ``free``)."""
        with self._lock:
            try:
                t = self._nvc.tensor((nbytes,), dtype=torch.uint8, except_on_del=False)
            except Exception as exc:  # noqa: BLE001 - NvshmemError carries no detail
                raise TransportUnavailableError(
                    f"nvshmem_malloc of {nbytes} bytes failed on PE {self.pe} ({exc!r}); the symmetric heap is "
                    f"NVSHMEM_SYMMETRIC_SIZE={os.environ.get('NVSHMEM_SYMMETRIC_SIZE', '<default 1 GiB>')}, and "
                    f"{len(self._tensors)} allocations were made before") from None
        self._tensors.append(t)
        self._ranges.append((t.data_ptr(), nbytes, t.data_ptr()))
        return t

    def empty(self, shape, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """Collective: an uninitialised tensor on the symmetric heap (same call order on every PE)."""
        if device is not None and torch.device(device) != self.device:
            raise InvalidArgumentError(f"symmetric memory of this PE is on {self.device}, asked for {device}")
        shape = tuple(int(x) for x in shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with torch.cuda.device(self.device.index):
            raw = self.alloc(max(nbytes, 1))
        return raw[:nbytes].view(dtype).view(shape)

    def register(self, tensors) -> list[torch.Tensor]:
        """Collective: put existing device tensors on the symmetric heap; returns their aliases."""
        out = []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.device != self.device or not t.is_contiguous():
                raise InvalidArgumentError(f"tensor {i} must be a contiguous tensor on {self.device}, got "
                                           f"{getattr(t, 'device', type(t).__name__)}")
            nbytes = t.numel() * t.element_size()
            with torch.cuda.device(self.device.index), self._lock:
                try:
                    alias = self._nvc.register_external_tensor(t)
                except Exception as exc:  # noqa: BLE001 - reported with what NVSHMEM needs
                    raise TransportError(f"nvshmem register_external_tensor failed for tensor {i} ({nbytes} bytes at "
                                         f"{t.data_ptr():#x}): {exc!r}; NVSHMEM registers CUDA VMM allocations "
                                         f"(e.g. torch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)") from None
            self._externals.append(alias)
            self._ranges.append((t.data_ptr(), nbytes, alias.data_ptr()))
            out.append(alias)
        return out

    def offsets(self, tensors, layout, base: int) -> list[int] | None:
        """Where each base tensor sits on the symmetric heap, relative to ``base`` (the receive
        area's address), or None if one does not (only KV pools count, not the staging areas)."""
        out = []
        for i, t in enumerate(tensors):
            p, need = t.data_ptr(), layout.tensor_numel[i] * layout.itemsize
            for start, nbytes, sym in self._ranges[STAGING_ALLOCATIONS:]:
                if start <= p and p + need <= start + nbytes:
                    out.append(sym + (p - start) - base)
                    break
            else:
                return None
        return out

    def own_bytes(self, ptr: int, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` at ``ptr`` as a view of this PE's own symmetric memory, or None."""
        for t in self._tensors + self._externals:
            start = t.data_ptr()
            if start <= ptr and ptr + nbytes <= start + t.numel() * t.element_size():
                flat = t.view(-1).view(torch.uint8)
                return flat[ptr - start:ptr - start + nbytes]
        return None

    def free(self) -> None:
        """Collective, at teardown (the caller holds the device and the lock, and has synchronized):
        unregister the aliases, free the allocations in allocation order (the same on every PE)."""
        for alias in self._externals:
            self._nvc.unregister_external_tensor(alias)
        for t in self._tensors:
            self._nvc.free_tensor(t)

    def forget(self) -> list[torch.Tensor]:
        """Empty the table; returns what it held (a skipped teardown keeps them for the process's life)."""
        held = self._tensors + self._externals
        self._tensors, self._externals, self._ranges = [], [], []
        return held
