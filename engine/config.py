"""Engine settings: the model to build and the KV pool to hold it, as frozen dataclasses.

Both travel between processes as JSON (``to_dict`` / ``from_dict``): every instance builds the
same randomly initialised model from the same spec and seed (no weights are downloaded).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, replace

import torch

from xfer.errors import InvalidArgumentError
from xfer.layout import LayoutKind

__all__ = ["ModelFamily", "ModelSpec", "PoolSpec", "WaitMode", "PRESETS"]

# layouts with one base tensor per layer: a layer's blocks are one region of their own
PER_LAYER_KINDS = (LayoutKind.VLLM_FLASH_ATTN_NHD, LayoutKind.VLLM_FLASH_ATTN_HND, LayoutKind.VLLM_FLASHINFER,
                   LayoutKind.PACKED_KV, LayoutKind.DISTSERVE, LayoutKind.VLLM_CROSS_LAYER)


class ModelFamily(str, enum.Enum):
    LLAMA = "llama"  # LlamaForCausalLM
    QWEN2 = "qwen2"  # Qwen2ForCausalLM (q/k/v biases)


class WaitMode(str, enum.Enum):
    """When a decode instance lets a request's forward touch its KV."""

    REQUEST = "request"  # once every layer of the request landed
    LAYER = "layer"  # layer by layer: the forward waits at layer l until layer l landed


@dataclass(frozen=True)
class ModelSpec:
    """A causal LM built from a config with random weights (``seed``), in ``dtype``."""

    family: ModelFamily = ModelFamily.LLAMA
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_positions: int = 4096
    dtype: str = "float32"
    seed: int = 0
    init_std: float = 0.02  # HF's initializer_range; larger gives peakier logits on random weights

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", ModelFamily(self.family))
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"ModelSpec.{name} must be an int >= 1, got {value!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(f"hidden_size {self.hidden_size} / num_heads {self.num_heads} / num_kv_heads "
                                       f"{self.num_kv_heads} must divide evenly")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise InvalidArgumentError(f"ModelSpec.dtype must name a torch dtype, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    def to_dict(self) -> dict:
        return {**asdict(self), "family": self.family.value}

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        return cls(**d)


@dataclass(frozen=True)
class PoolSpec:
    """The paged KV memory of one instance.

    num_blocks: blocks in the pool; block_size: tokens per block; layout: physical order (a
    per-layer kind streams one region per layer); device: where the pool lives.
    """

    num_blocks: int = 64
    block_size: int = 16
    layout: LayoutKind = LayoutKind.VLLM_FLASH_ATTN_NHD
    device: str = "cpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", LayoutKind(self.layout))
        if self.layout not in PER_LAYER_KINDS:
            raise InvalidArgumentError(f"PoolSpec.layout must be one of {[k.value for k in PER_LAYER_KINDS]}, "
                                       f"got {self.layout.value!r} (MLA and token-granular pools are not engine pools)")
        for name in ("num_blocks", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"PoolSpec.{name} must be an int >= 1, got {value!r}")
        torch.device(self.device)  # raises on a malformed device string

    def with_blocks(self, num_blocks: int) -> PoolSpec:
        return replace(self, num_blocks=num_blocks)

    def to_dict(self) -> dict:
        return {**asdict(self), "layout": self.layout.value}

    @classmethod
    def from_dict(cls, d: dict) -> PoolSpec:
        return cls(**d)


PRESETS = {
    # CI: a few hundred thousand parameters, float32 so greedy ties are rare and exact
    "tiny": ModelSpec(init_std=0.2),
    "tiny-qwen2": ModelSpec(family=ModelFamily.QWEN2, init_std=0.2),
    # a Llama-3-8B-shaped model (random weights) for the H200 runs
    "8b": ModelSpec(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    intermediate_size=14336, max_positions=8192, dtype="bfloat16"),
    "1b": ModelSpec(vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                    intermediate_size=8192, max_positions=8192, dtype="bfloat16"),
}
