"""Build a Hugging Face causal LM from a :class:`ModelSpec` (random weights, fixed seed) and run it
on any ``Cache``. transformers renamed the forward's cache argument (``past_key_values`` ->
``cache``, 5.2x); ``cache_kwarg`` reads the installed name from the signature."""

from __future__ import annotations

import functools
import inspect

import torch

from .config import ModelFamily, ModelSpec

__all__ = ["build_model", "hf_config", "cache_kwarg", "next_token_logits", "mask_dtype", "hf_generate",
           "hf_generate_margins"]


def hf_config(spec: ModelSpec):
    """The transformers config of ``spec`` (``LlamaConfig`` or ``Qwen2Config``)."""
    from transformers import LlamaConfig, Qwen2Config

    cls = LlamaConfig if spec.family is ModelFamily.LLAMA else Qwen2Config
    config = cls(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                 num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                 intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_positions,
                 initializer_range=spec.init_std, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def build_model(spec: ModelSpec, device: str | torch.device = "cpu"):
    """``LlamaForCausalLM(config)`` / ``Qwen2ForCausalLM(config)`` seeded with ``spec.seed``, in eval mode.

    Weights are drawn on ``device`` with its own generator: two processes on the same kind of
    device get identical weights from the same spec.
    """
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    cls = LlamaForCausalLM if spec.family is ModelFamily.LLAMA else Qwen2ForCausalLM
    device = torch.device(device)
    torch.manual_seed(spec.seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(spec.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(spec.torch_dtype)  # parameters born in their dtype: no fp32 copy of a large model
    try:
        with torch.device(device):
            model = cls(hf_config(spec))
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype=spec.torch_dtype).eval().requires_grad_(False)


@functools.lru_cache(maxsize=8)
def _cache_kwarg(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model) -> str:
    """The name under which this transformers version's forward takes a ``Cache``."""
    return _cache_kwarg(type(model))


@torch.inference_mode()
def next_token_logits(model, input_ids: torch.Tensor, cache, **inputs) -> torch.Tensor:
    """Run ``input_ids`` ([B, S] int64) through ``model`` on ``cache``; logits of the last position, [B, V] float.

    ``inputs``: more forward arguments, e.g. a :class:`PagedCache`'s ``model_inputs`` (per-row
    positions and mask) for rows of different lengths.
    """
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache}, **inputs)
    return out.logits[:, -1, :].float()


def mask_dtype(model) -> torch.dtype:
    """The attention-mask dtype the model's attention takes: bool for ``sdpa``, else an additive float mask."""
    return torch.bool if model.config._attn_implementation == "sdpa" else model.dtype


@torch.inference_mode()
def hf_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Single-process greedy generation by ``model.generate`` (its own DynamicCache): the reference."""
    ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         min_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_generate_margins(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Like :func:`hf_generate`, plus each step's gap between the top two logits (a small gap is a
    near-tie that float rounding of another, equally valid, kernel order may flip)."""
    ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         min_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None, output_logits=True,
                         return_dict_in_generate=True)
    margins = []
    for logits in out.logits:
        top = logits[0].float().topk(2).values
        margins.append(float(top[0] - top[1]))
    return out.sequences[0, len(prompt):].tolist(), margins
