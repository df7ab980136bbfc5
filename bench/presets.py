"""xfer-bench workloads: one KV transfer shape, the presets named after real models, and the
fitting of a preset to this machine's memory and time.

A workload moves ``blocks_moved`` blocks (every layer, K and V) out of a cache of twice that many,
every other block, so no two slices are adjacent and nothing merges into bigger copies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["Workload", "PRESETS", "MLA_LAYOUTS", "fit", "with_slice_bytes", "parse_bytes", "fmt_bytes"]

MLA_LAYOUTS = ("mla", "mla_fp8")
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}


@dataclass(frozen=True)
class Workload:
    """One transfer: ``blocks_moved`` blocks × ``num_layers`` layers × K/V (1 for MLA latents).

    slice = one block of one (layer, K/V): ``block_size * num_heads * head_dim * itemsize`` bytes.
    """

    preset: str
    layout: str  # an xfer.LayoutKind value
    num_layers: int
    blocks_moved: int
    block_size: int
    num_heads: int
    head_dim: int  # MLA: the latent row (576 bf16 elements, or 656 bytes for mla_fp8)
    dtype: str = "bfloat16"
    fit_to: str = "slice"  # what fit() may shrink: "slice" (heads) or "blocks"
    fitted: str = ""  # what fit() changed and why; empty when nothing

    def __post_init__(self) -> None:
        for f in ("num_layers", "blocks_moved", "block_size", "num_heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"workload {f} must be a positive int, got {v!r}")
        mla = self.layout in MLA_LAYOUTS
        if mla and self.num_heads != 1:
            raise ValueError(f"layout {self.layout} holds one latent row per token, got num_heads={self.num_heads}")
        if self.layout == "mla_fp8" and (self.head_dim != 656 or self.dtype != "uint8"):
            raise ValueError(f"layout mla_fp8 has 656-byte uint8 rows, got head_dim={self.head_dim} of {self.dtype}")
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"workload dtype must be one of {sorted(_ITEMSIZE)}, got {self.dtype!r}")

    @property
    def num_kv(self) -> int:
        return 1 if self.layout in MLA_LAYOUTS else 2

    @property
    def num_blocks(self) -> int:
        return 2 * self.blocks_moved

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def slice_bytes(self) -> int:
        return self.block_size * self.num_heads * self.head_dim * self.itemsize

    @property
    def slices(self) -> int:
        return self.num_layers * self.num_kv * self.blocks_moved

    @property
    def payload_bytes(self) -> int:
        return self.slices * self.slice_bytes

    def dims(self) -> dict:
        """Keyword arguments of ``xfer.make_kv_cache`` (dtype excluded)."""
        return dict(num_layers=self.num_layers, num_blocks=self.num_blocks, block_size=self.block_size,
                    num_heads=self.num_heads, head_dim=self.head_dim)

    def ids(self) -> tuple[list[int], list[int]]:
        """(source ids, destination ids): every other block, written in reverse order at the peer."""
        n = self.blocks_moved
        return list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))[::-1]

    def label(self) -> str:
        kv = "K/V" if self.num_kv == 2 else "latent"
        return (f"{self.preset} {self.layout}: {self.num_layers} layers x {kv} x {self.blocks_moved} blocks, "
                f"{fmt_bytes(self.slice_bytes)} slices ({self.slices:,} slices, {fmt_bytes(self.payload_bytes)})")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(num_kv=self.num_kv, num_blocks=self.num_blocks, slice_bytes=self.slice_bytes,
                 slices=self.slices, payload_bytes=self.payload_bytes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Workload":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


# bf16 KV, vLLM's block of 16 tokens (64 for MLA, FlashMLA's block), a 4,096-token prompt.
PRESETS: dict[str, Workload] = {
    # the seed case: 64 layers x K/V x 128 blocks x 32 KiB = 16,384 slices, 512 MiB
    "seed": Workload("seed", "vllm_flash_attn_nhd", 64, 128, 16, 8, 128, fit_to="slice"),
    # Llama 3 8B: 32 layers, 8 KV heads of 128, one rank: 32 KiB slices
    "llama3-8b": Workload("llama3-8b", "vllm_flash_attn_nhd", 32, 256, 16, 8, 128, fit_to="blocks"),
    # Llama 3 70B at tensor parallelism 8: 80 layers, 8 KV heads / 8 ranks = 1 per rank: 4 KiB slices
    "llama3-70b-tp8": Workload("llama3-70b-tp8", "vllm_flash_attn_nhd", 80, 256, 16, 1, 128, fit_to="blocks"),
    # DeepSeek-V3: 61 layers of MLA latents (512 + 64 rope, bf16), 64-token blocks: 72 KiB slices
    "deepseek-v3": Workload("deepseek-v3", "mla", 61, 64, 64, 1, 576, fit_to="blocks"),
    # for CI: 4 layers x K/V x 8 blocks x 512 B
    "small": Workload("small", "vllm_flash_attn_nhd", 4, 8, 4, 2, 32, fit_to="slice"),
}


def with_slice_bytes(w: Workload, nbytes: int) -> Workload:
    """``w`` with slices of ``nbytes``: changes heads (head_dim kept), else head_dim with one head;
    MLA changes the block size (the latent row is fixed by the format)."""
    unit = w.block_size * w.itemsize
    if w.layout in MLA_LAYOUTS:
        row = w.head_dim * w.itemsize
        if nbytes % row:
            raise ValueError(f"slice size {nbytes} B is not a multiple of the {w.layout} row "
                                       f"({row} B per token): try {row * 16} or {row * 64}")
        return dataclasses.replace(w, block_size=nbytes // row)
    if nbytes % (unit * w.head_dim) == 0:
        return dataclasses.replace(w, num_heads=nbytes // (unit * w.head_dim))
    if nbytes % unit == 0:
        return dataclasses.replace(w, num_heads=1, head_dim=nbytes // unit)
    raise ValueError(f"slice size {nbytes} B is not a multiple of block_size x itemsize = {unit} B "
                               f"({w.block_size} tokens of {w.dtype})")


def fit(w: Workload, cap_bytes: int, why: str, *, slice_ok: bool = True, blocks_ok: bool = True) -> Workload:
    """Shrink ``w`` until its payload is at most ``cap_bytes``: halve heads (then head_dim) when
    ``fit_to == "slice"``, then halve the blocks moved; ``slice_ok`` / ``blocks_ok`` False keep
    what the user set. Records what changed in ``fitted``."""
    out = w
    shrink_slice = slice_ok and w.fit_to == "slice" and w.layout not in MLA_LAYOUTS
    while out.payload_bytes > cap_bytes:
        if shrink_slice and out.num_heads > 1:
            out = dataclasses.replace(out, num_heads=out.num_heads // 2)
        elif shrink_slice and out.head_dim > 16:
            out = dataclasses.replace(out, head_dim=out.head_dim // 2)
        elif blocks_ok and out.blocks_moved > 1:
            out = dataclasses.replace(out, blocks_moved=out.blocks_moved // 2)
        else:
            break
    if out is w:
        return w
    changed = (f"{fmt_bytes(out.slice_bytes)} slices instead of {fmt_bytes(w.slice_bytes)}"
               if out.slice_bytes != w.slice_bytes else "")
    if out.blocks_moved != w.blocks_moved:
        changed += (", " if changed else "") + f"{out.blocks_moved} blocks instead of {w.blocks_moved}"
    return dataclasses.replace(out, fitted=f"{changed}: payload capped at {fmt_bytes(cap_bytes)} ({why})")


def parse_bytes(text: str) -> int:
    """'512', '4K', '16KiB', '1M' -> bytes (K = 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    if scale > 1:
        t = t[:-1]
    try:
        value = int(t) * scale
    except ValueError:
        raise ValueError(f"expected a byte count such as 512, 4K or 16M, got {text!r}") from None
    if value < 1:
        raise ValueError(f"byte count must be positive, got {text!r}")
    return value


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"
