"""KV-cache layouts as strides over logical dims.

Logical dims: layer ``L``, K/V ``K`` (2, or 1 for MLA latents), block ``B``, token-in-block ``N``,
kv-head ``H``, head-dim ``C``. A :class:`KVLayout` maps every (layer, kv) pair ("slot") onto one
of several base tensors at an element offset, with one set of element strides for ``B, N, H, C``.
Engines change physical order often; a layout reads it from the tensors' strides, so a new order
needs no new code.

Every address below is relative to a base tensor's ``data_ptr()`` and counted in elements of
``dtype`` unless the name says bytes.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import numpy as np
import torch

from .errors import BlockIdError, LayoutError, LayoutMismatchError, LengthMismatchError
from .native import C as _native  # the optional C helpers (None where not built)

__all__ = ["KVLayout", "LayoutKind", "Runs", "PairRuns", "make_kv_cache", "pair_runs"]

_LETTERS = set("LKBNHCT")
_FINGERPRINT_FIELDS = ("num_layers", "num_kv", "block_size", "num_heads", "head_dim", "dtype")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise LayoutError(f"unknown dtype {name!r}; expected a torch dtype name such as 'bfloat16'")
    return dt


class LayoutKind(enum.Enum):
    """The named layouts of the engines xfer serves (see ``make_kv_cache``)."""

    DISTSERVE = "distserve"  # K and V tensors, each [B, L, H, N, C]
    VLLM_FLASH_ATTN_NHD = "vllm_flash_attn_nhd"  # per layer (2, B, N, H, C)
    VLLM_FLASH_ATTN_HND = "vllm_flash_attn_hnd"  # per layer (2, B, N, H, C) logical, (2, B, H, N, C) physical
    VLLM_FLASHINFER = "vllm_flashinfer"  # per layer (B, 2, N, H, C)
    VLLM_CROSS_LAYER = "vllm_cross_layer"  # one tensor (B, L, 2, N, H, C)
    PACKED_KV = "packed_kv"  # per layer [B, H, N, 2*C]: K | V packed in the last dim
    MLA = "mla"  # per layer (B, N, 576) bf16: 512 latent + 64 rope
    MLA_FP8 = "mla_fp8"  # per layer (B, N, 656) bytes: 512 fp8 + 16 B scales + 128 B bf16 rope
    SGLANG = "sglang"  # k_buffer[l], v_buffer[l] of (slots, H, C), pages of block_size tokens


@dataclass(frozen=True)
class Runs:
    """Byte runs of one side: ``tensor[i]`` base tensor index, ``offset[i]`` and ``nbytes[i]`` in bytes."""

    tensor: np.ndarray  # [R] int64
    offset: np.ndarray  # [R] int64, bytes from the base tensor's data_ptr
    nbytes: np.ndarray  # [R] int64

    def __len__(self) -> int:
        return int(self.tensor.shape[0])


@dataclass(frozen=True)
class PairRuns:
    """Matched byte runs: copy ``nbytes[i]`` from (src_tensor, src_offset) to (dst_tensor, dst_offset)."""

    src_tensor: np.ndarray
    src_offset: np.ndarray
    dst_tensor: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])


# block id lists up to this long are checked as Python lists (see KVLayout.check_block_ids)
_SMALL_IDS = 512
_INT64 = np.dtype(np.int64)  # numpy's native int64 dtype is one object


@dataclass(frozen=True)
class KVLayout:
    """How a paged KV cache sits in memory.

    ``slot_tensor[s]`` / ``slot_offset[s]`` give, for slot ``s = layer * num_kv + kv``, the base
    tensor index and the element offset of block 0; element (b, n, h, c) of that slot is at
    ``slot_offset[s] + b*block_stride + n*token_stride + h*head_stride + c*dim_stride``.
    ``tensor_numel[t]`` is how many elements base tensor ``t`` must hold from its data_ptr.
    """

    name: str
    num_layers: int
    num_kv: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    block_stride: int
    token_stride: int
    head_stride: int
    dim_stride: int
    slot_tensor: tuple[int, ...]
    slot_offset: tuple[int, ...]
    tensor_numel: tuple[int, ...]

    def __hash__(self) -> int:
        # computed once: a layout keys several per-call caches (kernel geometry, checked sides),
        # and hashing its 3 slot tables on every copy costs more than the lookups it serves
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __reduce__(self):  # the cached hash must not travel: str hashes differ between processes
        return self.__class__, tuple(getattr(self, f.name) for f in fields(self))

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv", "num_blocks", "block_size", "num_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{field} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        for field in ("block_stride", "token_stride", "head_stride", "dim_stride"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{field} must be a positive int (elements), got {value!r}")
        if len(self.slot_tensor) != self.num_slots or len(self.slot_offset) != self.num_slots:
            raise LayoutError(
                f"slot tables need num_layers*num_kv = {self.num_slots} entries, got "
                f"{len(self.slot_tensor)} tensors and {len(self.slot_offset)} offsets"
            )
        for s, (t, off) in enumerate(zip(self.slot_tensor, self.slot_offset)):
            if not 0 <= t < len(self.tensor_numel):
                raise LayoutError(f"slot {s} names base tensor {t}; there are {len(self.tensor_numel)}")
            if off < 0 or off + self.slot_extent > self.tensor_numel[t]:
                raise LayoutError(
                    f"slot {s} spans elements [{off}, {off + self.slot_extent}) of base tensor {t}, "
                    f"which holds {self.tensor_numel[t]}"
                )

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.num_layers * self.num_kv

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_numel)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def block_numel(self) -> int:
        """Elements of one block in one slot (N*H*C)."""
        return self.block_size * self.num_heads * self.head_dim

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block in one slot."""
        return self.block_numel * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id stands for across all layers and K/V."""
        return self.block_nbytes * self.num_slots

    @property
    def slot_extent(self) -> int:
        """Elements from a slot's block 0 to one past its last element."""
        s = self
        return 1 + (s.num_blocks - 1) * s.block_stride + (s.block_size - 1) * s.token_stride + (
            s.num_heads - 1
        ) * s.head_stride + (s.head_dim - 1) * s.dim_stride

    def slot(self, layer: int, kv: int) -> int:
        return layer * self.num_kv + kv

    def _inner(self) -> list[tuple[int, int, str]]:
        """(size, stride, letter) of N, H, C, size-1 dims dropped, outermost first."""
        dims = [(self.block_size, self.token_stride, "N"), (self.num_heads, self.head_stride, "H"),
                (self.head_dim, self.dim_stride, "C")]
        return sorted((d for d in dims if d[0] > 1), key=lambda d: -d[1])

    @property
    def inner_order(self) -> str:
        """Physical order of N, H, C within a block, outermost first (e.g. 'NHC' or 'HNC')."""
        present = "".join(d[2] for d in self._inner())
        return present + "".join(x for x in "NHC" if x not in present)

    @property
    def block_contiguous(self) -> bool:
        """True when one block of one slot is a single dense run of ``block_nbytes``."""
        expect = 1
        for size, stride, _ in reversed(self._inner()):
            if stride != expect:
                return False
            expect *= size
        return True

    # ---- identity and compatibility ----------------------------------------------------------
    def fingerprint(self) -> dict:
        """What two agents must agree on to exchange blocks (physical order may differ)."""
        return {
            "num_layers": self.num_layers, "num_kv": self.num_kv, "block_size": self.block_size,
            "num_heads": self.num_heads, "head_dim": self.head_dim, "dtype": dtype_name(self.dtype),
        }

    def fingerprint_hash(self) -> str:
        """A short hash of :meth:`fingerprint`, made once per layout object (a JSON dump and a
        SHA-256 cost ~25 us; requests and notices name their layout by it on every transfer)."""
        made = self.__dict__.get("_fingerprint_hash")
        if made is None:
            blob = json.dumps(self.fingerprint(), sort_keys=True).encode()
            made = self.__dict__["_fingerprint_hash"] = hashlib.sha256(blob).hexdigest()[:16]
        return made

    def check_compatible(self, other: "KVLayout", *, what: str = "peer",
                         fields: Sequence[str] = _FINGERPRINT_FIELDS) -> None:
        """Raise :class:`LayoutMismatchError` naming the first field where the two differ (of
        ``fields``, fingerprint fields: all of them unless told)."""
        if other is self:  # every post checks its pair: the same object needs no comparison
            return
        mine, theirs = self.fingerprint(), other.fingerprint()
        if mine == theirs:
            return
        for field in fields:
            if mine[field] != theirs[field]:
                raise LayoutMismatchError(
                    f"layouts differ in {field}: local {self.name} has {mine[field]!r}, "
                    f"{what} {other.name} has {theirs[field]!r}"
                )

    def to_dict(self) -> dict:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["dtype"] = dtype_name(self.dtype)
        for f in ("slot_tensor", "slot_offset", "tensor_numel"):
            d[f] = list(d[f])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        if not isinstance(d, dict):
            raise LayoutError(f"a layout record must be a dict, got {type(d).__name__}")
        missing = [f for f in cls.__dataclass_fields__ if f not in d]
        if missing:
            raise LayoutError(f"layout record lacks fields {missing}")
        kw = {f: d[f] for f in cls.__dataclass_fields__}
        kw["dtype"] = dtype_from_name(kw["dtype"])
        for f in ("slot_tensor", "slot_offset", "tensor_numel"):
            if not isinstance(kw[f], list) or not all(type(x) is int for x in kw[f]):
                raise LayoutError(f"layout field {f} must be a list of ints, got {kw[f]!r}"[:200])
            kw[f] = tuple(kw[f])
        if not isinstance(kw["name"], str):
            raise LayoutError(f"layout name must be a str, got {kw['name']!r}")
        return cls(**kw)

    # ---- tensors -----------------------------------------------------------------------------
    def check_tensors(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Check that ``tensors`` can back this layout; returns them as a list."""
        tensors = list(tensors)
        if len(tensors) != self.num_tensors:
            raise LayoutError(f"layout {self.name} has {self.num_tensors} base tensors, got {len(tensors)}")
        device = tensors[0].device if tensors else None
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"base tensor {i} is a {type(t).__name__}, expected a torch.Tensor")
            if t.dtype != self.dtype:
                raise LayoutError(f"base tensor {i} has dtype {t.dtype}, layout {self.name} expects {self.dtype}")
            if t.device != device:
                raise LayoutError(f"base tensor {i} is on {t.device}, base tensor 0 on {device}")
            storage = t.untyped_storage()
            have = storage.data_ptr() + storage.nbytes() - t.data_ptr()
            need = self.tensor_numel[i] * self.itemsize
            if have < need:
                raise LayoutError(f"base tensor {i} holds {have} bytes from its data_ptr, layout needs {need}")
        return tensors

    def views(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-slot logical views ``[num_blocks, block_size, num_heads, head_dim]`` (no copy)."""
        tensors = self.check_tensors(tensors)
        out = []
        size = (self.num_blocks, self.block_size, self.num_heads, self.head_dim)
        stride = (self.block_stride, self.token_stride, self.head_stride, self.dim_stride)
        for t, off in zip(self.slot_tensor, self.slot_offset):
            base = tensors[t]
            out.append(torch.as_strided(base, size, stride, base.storage_offset() + off))
        return out

    def check_block_ids(self, ids, *, what: str = "block ids", unique: bool = False) -> np.ndarray:
        """Validate a block id list; returns it as a 1-D int64 numpy array."""
        stats = None
        if ids.__class__ is np.ndarray and ids.dtype is _INT64 and ids.ndim == 1:
            arr = ids  # what engines pass: three cheap tests (a post meets cold caches)
            if _native is not None and 0 < arr.size <= _SMALL_IDS:
                stats = _native.id_stats(arr, None, self.num_blocks, unique)  # (None: not contiguous)
        elif ids.__class__ is list and _native is not None and 0 < len(ids) <= _SMALL_IDS:
            # a list of Python ints (what engines hold): converted and checked in one C pass; anything
            # else in it (bools, floats, numpy scalars) leaves stats None and takes the path below
            arr = np.empty(len(ids), dtype=np.int64)
            stats = _native.id_stats(ids, arr, self.num_blocks, unique)
            if stats is None:
                return self.check_block_ids(tuple(ids), what=what, unique=unique)
        else:
            if isinstance(ids, torch.Tensor):
                ids = ids.detach().cpu().numpy()
            arr = np.asarray(ids)
            if arr.ndim != 1:
                raise BlockIdError(f"{what} must be 1-D, got shape {arr.shape}")
            if arr.size and arr.dtype.kind not in "iu":  # (np.issubdtype says the same, ~1 us slower a call)
                raise BlockIdError(f"{what} must be integers, got dtype {arr.dtype}")
            if arr.dtype != np.int64:
                arr = arr.astype(np.int64)
            if _native is not None and 0 < arr.size <= _SMALL_IDS:  # (tensors, int32 arrays, tuples: once
                stats = _native.id_stats(arr, None, self.num_blocks, unique)  # converted, the same C pass)
        if not arr.size:
            return arr
        if stats is not None:  # the C pass (xfer/_native.c): range, and repeats of in-range unique ids
            lo, hi, repeats = stats
        elif arr.size <= _SMALL_IDS:
            # a request's few hundred ids: Python's min/max/set on a list. Same speed warm, but it
            # touches far less code than numpy's ufunc machinery: on a core whose caches a transfer
            # just flushed (the state a post usually meets) 40-55 us for both checks against 85-105
            lst = arr.tolist()
            lo, hi = min(lst), max(lst)
            repeats = unique and len(set(lst)) != len(lst)
        else:
            # unique: one sort gives the range and the repeats (a bincount would allocate and scan
            # num_blocks counters: ~50 µs a call on a 200k-block cache, against ~3 µs)
            srt = np.sort(arr) if unique else None
            lo, hi = (int(srt[0]), int(srt[-1])) if srt is not None else (int(arr.min()), int(arr.max()))
            repeats = srt is not None and bool((srt[1:] == srt[:-1]).any())
        if lo < 0:
            raise BlockIdError(f"{what} contain negative id {lo}; valid ids are 0..{self.num_blocks - 1}")
        if hi >= self.num_blocks:
            raise BlockIdError(f"{what} contain id {hi}; layout {self.name} has {self.num_blocks} blocks")
        if repeats:  # the error path only: name the first id seen twice
            seen: set[int] = set()
            for i in arr.tolist():
                if i in seen:
                    raise BlockIdError(f"{what} repeat id {i}; each must appear once")
                seen.add(i)
        return arr

    def staging(self, num_blocks: int) -> "KVLayout":
        """A dense single-tensor layout ``[L, K, num_blocks, <inner in this layout's order>]``.

        Gathering into it is a pure byte copy when this layout's blocks are contiguous.
        """
        sizes = {"N": self.block_size, "H": self.num_heads, "C": self.head_dim}
        strides, acc = {}, 1
        for letter in reversed(self.inner_order):
            strides[letter] = acc
            acc *= sizes[letter]
        blk = self.block_numel
        return KVLayout(
            name="staging", num_layers=self.num_layers, num_kv=self.num_kv, num_blocks=num_blocks,
            block_size=self.block_size, num_heads=self.num_heads, head_dim=self.head_dim,
            dtype=self.dtype, block_stride=blk, token_stride=strides["N"], head_stride=strides["H"],
            dim_stride=strides["C"], slot_tensor=(0,) * self.num_slots,
            slot_offset=tuple(s * num_blocks * blk for s in range(self.num_slots)),
            tensor_numel=(self.num_slots * num_blocks * blk,),
        )

    def joint_runs(self, other: "KVLayout") -> tuple[int, list[tuple[int, int, int]]]:
        """Elements per run contiguous in both this layout and ``other`` (same fingerprint), and
        the remaining inner dims as (size, stride here, stride there), outermost first."""
        return _joint_inner(self, other)

    def runs(self, block_ids) -> Runs:
        """Merged byte runs covering ``block_ids`` in every slot, in address order."""
        ids = self.check_block_ids(block_ids)
        p = pair_runs(self, ids, self, ids)
        return Runs(p.src_tensor, p.src_offset, p.nbytes)

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], dims: str, *, block_size: int | None = None,
                     num_kv: int | None = None, name: str = "custom") -> "KVLayout":
        """Describe tensors whose axes are named by ``dims`` (letters from ``LKBNHCT``).

        ``T`` is a token slot axis (token-granular caches); it needs ``block_size`` (page size).
        When ``L`` and/or ``K`` are not axes, the tensors enumerate them, layer-major:
        ``tensors[l * num_kv + kv]`` (neither), ``tensors[kv]`` (only L is an axis) or
        ``tensors[l]`` (only K is an axis). All tensors share shape, strides, dtype and device.
        """
        tensors = list(tensors)
        if not tensors:
            raise LayoutError("from_tensors needs at least one tensor")
        if not isinstance(dims, str) or len(set(dims)) != len(dims) or not set(dims) <= _LETTERS:
            raise LayoutError(f"dims must be distinct letters from 'LKBNHCT', got {dims!r}")
        t0 = tensors[0]
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"tensor {i} is a {type(t).__name__}, expected a torch.Tensor")
            if t.dim() != len(dims):
                raise LayoutError(f"tensor {i} has {t.dim()} dims, dims {dims!r} names {len(dims)}")
            if (t.shape, t.stride(), t.dtype, t.device) != (t0.shape, t0.stride(), t0.dtype, t0.device):
                raise LayoutError(
                    f"tensor {i} has shape {tuple(t.shape)} stride {t.stride()} {t.dtype} on {t.device}; "
                    f"tensor 0 has shape {tuple(t0.shape)} stride {t0.stride()} {t0.dtype} on {t0.device}"
                )
        size = dict(zip(dims, t0.shape))
        stride = dict(zip(dims, t0.stride()))
        if "C" not in dims:
            raise LayoutError(f"dims {dims!r} lack the head-dim axis 'C'")
        if "T" in dims:
            if "B" in dims or "N" in dims:
                raise LayoutError(f"dims {dims!r} mix the token-slot axis 'T' with 'B'/'N'")
            if not block_size or size["T"] % block_size:
                raise LayoutError(f"token axis of {size['T']} slots needs a block_size dividing it, got {block_size!r}")
            size["B"], stride["B"] = size["T"] // block_size, stride["T"] * block_size
            size["N"], stride["N"] = block_size, stride["T"]
        elif "B" not in dims or "N" not in dims:
            raise LayoutError(f"dims {dims!r} need block 'B' and token 'N' axes, or a token-slot axis 'T'")
        elif block_size is not None and block_size != size["N"]:
            raise LayoutError(f"block_size={block_size} disagrees with the N axis of size {size['N']}")
        if "H" not in dims:
            size["H"], stride["H"] = 1, size["C"] * stride["C"]
        if "K" in dims:
            if num_kv is not None and num_kv != size["K"]:
                raise LayoutError(f"num_kv={num_kv} disagrees with the K axis of size {size['K']}")
            num_kv = size["K"]
        num_kv = 2 if num_kv is None else num_kv
        n = len(tensors)
        if "L" in dims and "K" in dims:
            layers, per = size["L"], None
            if n != 1:
                raise LayoutError(f"dims {dims!r} hold every layer and K/V: expected 1 tensor, got {n}")
        elif "L" in dims:
            layers = size["L"]
            if n != num_kv:
                raise LayoutError(f"dims {dims!r} hold every layer: expected {num_kv} tensors (one per K/V), got {n}")
        elif "K" in dims:
            layers = n
        else:
            if n % num_kv:
                raise LayoutError(f"{n} tensors do not split into layers of num_kv={num_kv}")
            layers = n // num_kv
        slot_tensor, slot_offset = [], []
        for layer in range(layers):
            for kv in range(num_kv):
                off = layer * stride.get("L", 0) * ("L" in dims) + kv * stride.get("K", 0) * ("K" in dims)
                if "L" in dims and "K" in dims:
                    t = 0
                elif "L" in dims:
                    t = kv
                elif "K" in dims:
                    t = layer
                else:
                    t = layer * num_kv + kv
                slot_tensor.append(t)
                slot_offset.append(off)
        for letter in "BNHC":
            if size[letter] > 1 and stride[letter] < 1:
                raise LayoutError(f"axis {letter} has stride {stride[letter]}; strides must be positive")
        extent = 1 + sum((size[d] - 1) * stride[d] for d in dims)
        return cls(
            name=name, num_layers=layers, num_kv=num_kv, num_blocks=size["B"], block_size=size["N"],
            num_heads=size["H"], head_dim=size["C"], dtype=t0.dtype,
            block_stride=max(stride["B"], 1), token_stride=max(stride["N"], 1),
            head_stride=max(stride["H"], 1), dim_stride=max(stride["C"], 1),
            slot_tensor=tuple(slot_tensor), slot_offset=tuple(slot_offset), tensor_numel=(extent,) * n,
        )

    @classmethod
    def distserve(cls, k_cache: torch.Tensor, v_cache: torch.Tensor) -> "KVLayout":
        """DistServe / SwiftTransformer: K and V tensors, each ``[B, L, H, N, C]``."""
        return cls.from_tensors([k_cache, v_cache], "BLHNC", name=LayoutKind.DISTSERVE.value)

    @classmethod
    def vllm_flash_attn(cls, kv_caches: Sequence[torch.Tensor]) -> "KVLayout":
        """vLLM FlashAttention: per layer, logical shape ``(2, B, N, H, C)``; NHD or HND by strides."""
        layout = cls.from_tensors(kv_caches, "KBNHC")
        order = "hnd" if layout.inner_order.startswith("HN") else "nhd"
        return _renamed(layout, f"vllm_flash_attn_{order}")

    @classmethod
    def vllm_flashinfer(cls, kv_caches: Sequence[torch.Tensor]) -> "KVLayout":
        """vLLM FlashInfer: per layer ``(B, 2, N, H, C)`` (HND when strides say so)."""
        return cls.from_tensors(kv_caches, "BKNHC", name=LayoutKind.VLLM_FLASHINFER.value)

    @classmethod
    def vllm_cross_layer(cls, kv_cache: torch.Tensor) -> "KVLayout":
        """vLLM cross-layer blocks: one tensor ``(B, L, 2, N, H, C)``; a block spans all layers."""
        return cls.from_tensors([kv_cache], "BLKNHC", name=LayoutKind.VLLM_CROSS_LAYER.value)

    @classmethod
    def packed_kv(cls, kv_caches: Sequence[torch.Tensor]) -> "KVLayout":
        """K and V packed in the last dim: per layer ``[B, H, N, 2*C]``."""
        views = []
        for i, t in enumerate(kv_caches):
            if t.dim() != 4 or t.shape[-1] % 2:
                raise LayoutError(f"packed K|V tensor {i} must be [B, H, N, 2*C], got shape {tuple(t.shape)}")
            views.append(t.unflatten(-1, (2, t.shape[-1] // 2)))
        return cls.from_tensors(views, "BHNKC", name=LayoutKind.PACKED_KV.value)

    @classmethod
    def mla(cls, kv_caches: Sequence[torch.Tensor]) -> "KVLayout":
        """MLA latents: per layer ``(B, N, head_size)``: 576 bf16, or 656 bytes (uint8) for fp8."""
        name = LayoutKind.MLA_FP8.value if kv_caches and kv_caches[0].dtype == torch.uint8 else LayoutKind.MLA.value
        return cls.from_tensors(kv_caches, "BNC", num_kv=1, name=name)

    @classmethod
    def sglang(cls, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
               page_size: int) -> "KVLayout":
        """SGLang token-granular pools: ``k_buffer[l]``, ``v_buffer[l]`` of ``(slots, H, C)``."""
        if len(k_buffers) != len(v_buffers):
            raise LayoutError(f"{len(k_buffers)} K buffers but {len(v_buffers)} V buffers")
        interleaved = [t for pair in zip(k_buffers, v_buffers) for t in pair]
        return cls.from_tensors(interleaved, "THC", block_size=page_size, name=LayoutKind.SGLANG.value)


def _renamed(layout: KVLayout, name: str) -> KVLayout:
    d = layout.to_dict()
    d["name"] = name
    return KVLayout.from_dict(d)


def make_kv_cache(kind: LayoutKind | str, *, num_layers: int, num_blocks: int, block_size: int,
                  num_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
                  device: str | torch.device = "cpu",
                  empty: Callable[..., torch.Tensor] = torch.empty) -> tuple[list[torch.Tensor], KVLayout]:
    """Allocate a KV cache the way the named engine does; returns (base tensors, layout).

    ``empty(shape, dtype=, device=)`` allocates each physical tensor (e.g. shared host memory).
    MLA kinds ignore ``num_heads`` (1) and take ``head_dim`` as the head size (576 or 656 bytes).
    """
    kind = LayoutKind(kind)
    L, B, N, H, C = num_layers, num_blocks, block_size, num_heads, head_dim

    def alloc(*shape, dt=dtype):
        return empty(shape, dtype=dt, device=device)

    if kind is LayoutKind.DISTSERVE:
        k, v = alloc(B, L, H, N, C), alloc(B, L, H, N, C)
        return [k, v], KVLayout.distserve(k, v)
    if kind is LayoutKind.VLLM_FLASH_ATTN_NHD:
        ts = [alloc(2, B, N, H, C) for _ in range(L)]
        return ts, KVLayout.vllm_flash_attn(ts)
    if kind is LayoutKind.VLLM_FLASH_ATTN_HND:
        ts = [alloc(2, B, H, N, C) for _ in range(L)]
        return ts, KVLayout.vllm_flash_attn([t.permute(0, 1, 3, 2, 4) for t in ts])
    if kind is LayoutKind.VLLM_FLASHINFER:
        ts = [alloc(B, 2, N, H, C) for _ in range(L)]
        return ts, KVLayout.vllm_flashinfer(ts)
    if kind is LayoutKind.VLLM_CROSS_LAYER:
        t = alloc(B, L, 2, N, H, C)
        return [t], KVLayout.vllm_cross_layer(t)
    if kind is LayoutKind.PACKED_KV:
        ts = [alloc(B, H, N, 2 * C) for _ in range(L)]
        return ts, KVLayout.packed_kv(ts)
    if kind is LayoutKind.MLA:
        ts = [alloc(B, N, C) for _ in range(L)]
        return ts, KVLayout.mla(ts)
    if kind is LayoutKind.MLA_FP8:
        ts = [alloc(B, N, C, dt=torch.uint8) for _ in range(L)]
        return ts, KVLayout.mla(ts)
    assert kind is LayoutKind.SGLANG
    ks = [alloc(B * N, H, C) for _ in range(L)]
    vs = [alloc(B * N, H, C) for _ in range(L)]
    return [t for pair in zip(ks, vs) for t in pair], KVLayout.sglang(ks, vs, page_size=N)


def _joint_inner(src: KVLayout, dst: KVLayout) -> tuple[int, list[tuple[int, int, int]]]:
    """Elements per run contiguous on both sides, and the outer (size, src_stride, dst_stride) dims."""
    dims = [(src.block_size, src.token_stride, dst.token_stride),
            (src.num_heads, src.head_stride, dst.head_stride),
            (src.head_dim, src.dim_stride, dst.dim_stride)]
    dims = sorted((d for d in dims if d[0] > 1), key=lambda d: -d[1])
    run = 1
    while dims and dims[-1][1] == run and dims[-1][2] == run:
        run *= dims.pop()[0]
    return run, dims


def pair_runs(src: KVLayout, src_ids, dst: KVLayout, dst_ids) -> PairRuns:
    """Byte runs moving blocks ``src_ids`` of ``src`` onto ``dst_ids`` of ``dst``, merged where
    consecutive runs are contiguous on both sides. Raises before anything is computed on bad input."""
    src.check_compatible(dst, what="destination")
    s_ids = src.check_block_ids(src_ids, what="source block ids")
    d_ids = dst.check_block_ids(dst_ids, what="destination block ids", unique=True)
    if s_ids.size != d_ids.size:
        raise LengthMismatchError(f"{s_ids.size} source block ids but {d_ids.size} destination block ids")
    run, outer = _joint_inner(src, dst)
    isz = src.itemsize

    def positions(layout: KVLayout, ids: np.ndarray, which: int) -> tuple[np.ndarray, np.ndarray]:
        tensor = np.asarray(layout.slot_tensor, dtype=np.int64)[:, None]
        pos = np.asarray(layout.slot_offset, dtype=np.int64)[:, None] + ids[None, :] * layout.block_stride
        tensor = np.broadcast_to(tensor, pos.shape)
        for d in outer:
            pos = pos[..., None] + np.arange(d[0], dtype=np.int64) * d[which]
            tensor = np.broadcast_to(tensor[..., None], pos.shape)
        return tensor.reshape(-1), pos.reshape(-1) * isz

    st, so = positions(src, s_ids, 1)
    dt, do = positions(dst, d_ids, 2)
    nbytes = run * isz
    if so.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return PairRuns(empty, empty, empty, empty, empty)
    # runs are independent copies: visit them in source address order so that interleaved
    # slots (K|V packed, cross-layer blocks) merge too; a new run starts wherever the previous
    # one does not continue on both sides
    order = np.lexsort((so, st))
    st, so, dt, do = st[order], so[order], dt[order], do[order]
    cont = (st[1:] == st[:-1]) & (dt[1:] == dt[:-1]) & (so[1:] == so[:-1] + nbytes) & (do[1:] == do[:-1] + nbytes)
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lengths = np.diff(np.append(starts, so.size)) * nbytes
    return PairRuns(st[starts].copy(), so[starts].copy(), dt[starts].copy(), do[starts].copy(), lengths)
