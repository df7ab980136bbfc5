"""Tensor-parallel prefill: a Hugging Face Llama / Qwen2 model sharded over ``world`` rank processes.

Megatron-style, done on the built model in place (``shard_model``): every decoder layer keeps only
its rank's share of the attention heads (rows of ``q_proj``, ``k_proj``, ``v_proj`` and their
biases; columns of ``o_proj``) and of the MLP (rows of ``gate_proj`` / ``up_proj``, columns of
``down_proj``); ``o_proj`` and ``down_proj`` become :class:`RowParallelLinear`, which sums the
ranks' partial outputs with one all-reduce each. Embeddings, norms and ``lm_head`` stay whole on
every rank (each rank computes the same logits). So a rank computes, and its paged cache holds, only
kv-heads ``shard_heads(...)``: it streams exactly that head slice into the decode instance's
blocks (region ``kv.<l>.h<a>-<b>``), and the decode instance, which runs the whole model, joins
the slices. HF's attention reshapes with ``-1`` heads and keeps ``num_key_value_groups``, so the
sharded layers run unchanged.

What is real and what is not: the weights are built whole and then cut (a rank briefly holds the
full model; fine for the random models here, a loader would read only its shard); the all-reduce
runs through ``torch.distributed`` (gloo between CPU processes or ranks sharing one GPU, nccl for
one GPU per rank). Partial sums make the logits differ from the unsharded model by float rounding,
as in any TP engine. Tests compare greedy tokens in float32, where that rounding is far below the
top-2 logit gaps; in bfloat16 the random test models have steps whose top-2 gap is one bf16 ulp,
and there any other summation order (sharded or not) may pick the other, tied, token.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn

from xfer.errors import InvalidArgumentError

__all__ = ["shard_heads", "shard_model", "RowParallelLinear", "init_group", "close_group"]


def _split(n: int, rank: int, world: int, what: str) -> tuple[int, int]:
    if n % world:
        raise InvalidArgumentError(f"{what} ({n}) must divide evenly over {world} tensor-parallel ranks")
    return rank * n // world, (rank + 1) * n // world


def shard_heads(num_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    """The kv-head range ``[h0, h1)`` rank ``rank`` of ``world`` computes."""
    return _split(num_kv_heads, rank, world, "num_kv_heads")


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_shard @ W[:, shard].T) + b``: the input-dim slice of a Linear, summed over ranks.

    For a half-precision model the partial products are summed in float32 (weights kept in
    float32, the all-reduce in float32, one rounding to the model dtype at the end): the unsharded
    GEMM also accumulates in float32 and rounds once, so the sharded layer differs from it only by
    summation order, not by two extra bf16 roundings of the partial sums (which flip greedy
    tokens of the test models). ``accumulate=None`` keeps the model dtype (what a fast engine does).
    """

    def __init__(self, linear: nn.Linear, lo: int, hi: int, group=None, keep_bias: bool = True,
                 accumulate: torch.dtype | None = torch.float32):
        super().__init__()
        dtype = linear.weight.dtype
        self.acc = accumulate if accumulate is not None and dtype.itemsize < accumulate.itemsize else None
        weight = linear.weight[:, lo:hi].contiguous()
        self.weight = nn.Parameter(weight if self.acc is None else weight.to(self.acc), requires_grad=False)
        self.bias = (nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
                     if linear.bias is not None and keep_bias else None)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x if self.acc is None else x.to(self.acc), self.weight)
        torch.distributed.all_reduce(y, group=self.group)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


def _rows(linear: nn.Linear, lo: int, hi: int) -> nn.Linear:
    """The output-dim slice ``[lo, hi)`` of ``linear`` as a new Linear (column parallel)."""
    out = nn.Linear(linear.in_features, hi - lo, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[lo:hi])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[lo:hi])
    return out.requires_grad_(False)


def shard_model(model, rank: int, world: int, group=None) -> tuple[int, int]:
    """Cut ``model`` (a Llama / Qwen2 causal LM) in place to rank ``rank``'s share; returns its kv-head range."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q0, q1 = _split(cfg.num_attention_heads, rank, world, "num_attention_heads")
    k0, k1 = shard_heads(cfg.num_key_value_heads, rank, world)
    i0, i1 = _split(cfg.intermediate_size, rank, world, "intermediate_size")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = _rows(attn.q_proj, q0 * head_dim, q1 * head_dim)
        attn.k_proj = _rows(attn.k_proj, k0 * head_dim, k1 * head_dim)
        attn.v_proj = _rows(attn.v_proj, k0 * head_dim, k1 * head_dim)
        attn.o_proj = RowParallelLinear(attn.o_proj, q0 * head_dim, q1 * head_dim, group, keep_bias=rank == 0)
        mlp.gate_proj = _rows(mlp.gate_proj, i0, i1)
        mlp.up_proj = _rows(mlp.up_proj, i0, i1)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, i0, i1, group, keep_bias=rank == 0)
    model.tp_heads = (k0, k1)
    return k0, k1


def init_group(store, name: str, rank: int, world: int, *, device: torch.device, timeout_s: float = 60.0,
               host: str = "127.0.0.1") -> str:
    """Join tensor-parallel group ``name`` (this process's default ``torch.distributed`` group).

    Rank 0 hosts a c10d TCPStore on a free port of ``host`` and publishes it in the metadata
    ``store`` under ``tp/<name>/addr``; the others wait for it there. Backend: nccl when every rank
    can have a GPU of its own, else gloo. Collectives time out after ``timeout_s``. Returns the backend.
    """
    import torch.distributed as dist

    key = f"tp/{name}/addr"
    if rank == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        c10d = dist.TCPStore(host, port, world, is_master=True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
        store.set(key, f"{host}:{port}".encode())
    else:
        h, p = store.get(key, timeout_s).decode().rsplit(":", 1)
        c10d = dist.TCPStore(h, int(p), world, is_master=False, timeout=timedelta(seconds=timeout_s))
    from xfer.settings import Settings

    backend = Settings.from_env().engine.tp_backend  # XFER_TP_BACKEND
    dist.init_process_group(backend, store=dist.PrefixStore(name, c10d), rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return backend


def close_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
