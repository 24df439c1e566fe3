"""One transformer layer of a recurrent-depth model with vLLM's layers (parallel linears, its RMSNorm, rotary
embedding and activation): the arithmetic of rdlm.model.layers.Block. The KV cache a layer attends with is a
vLLM `Attention` passed per call, so one core layer serves every iteration with the cache of that iteration."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
)
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

from rdlm.model.config import RDLMConfig


class LayerWeights(nn.Module):
    """One transformer layer's weights and arithmetic (rdlm.model.layers.Block) with vLLM's layers; the KV
    cache it attends with is an `Attention` passed per call, so a core layer serves every iteration.
    Parameter names are rdlm's own, so a checkpoint loads through rdlm's family adapters."""

    def __init__(self, config: RDLMConfig, rope, quant_config, prefix: str) -> None:
        super().__init__()
        h, eps, d = config.hidden_size, config.norm_eps, config.head_dim
        self.tp = get_tensor_model_parallel_world_size()
        if config.num_heads % self.tp or (config.kv_heads % self.tp and self.tp % config.kv_heads):
            raise ValueError(
                f"{config.num_heads} attention heads ({config.kv_heads} key/value heads) cannot be "
                f"split over {self.tp} tensor-parallel ranks"
            )
        self.heads, self.kv_heads = config.num_heads // self.tp, max(1, config.kv_heads // self.tp)
        self.kv_whole = config.kv_heads < self.tp  # fewer key/value heads than ranks: each rank holds them all
        self.q_size, self.kv_size, self.head_dim = self.heads * d, self.kv_heads * d, d
        scheme = config.norm_scheme
        self.sandwich, self.pre, self.post = scheme == "sandwich", scheme != "postnorm", scheme in ("postnorm", "peri")
        if scheme != "postnorm":
            self.norm_1, self.norm_3 = RMSNorm(h, eps), RMSNorm(h, eps)
        if scheme != "prenorm":
            self.norm_2, self.norm_4 = RMSNorm(h, eps), RMSNorm(h, eps)
        self.attn: Any = nn.Module()  # a namespace of vLLM's layers (typed Any: vLLM ships no types here)
        self.attn.qkv = QKVParallelLinear(
            h, d, config.num_heads, config.kv_heads, bias=False, quant_config=quant_config, prefix=f"{prefix}.attn.qkv"
        )
        self.attn.out = RowParallelLinear(
            config.num_heads * d, h, bias=False, quant_config=quant_config, prefix=f"{prefix}.attn.out"
        )
        if config.qk_bias:  # [2, heads, d]: index 0 added to q, 1 to k, before RoPE; split by heads
            self.attn.qk_bias = nn.Parameter(torch.zeros(2, 1, self.heads, d), requires_grad=False)
            self.attn.qk_bias.weight_loader = self._load_head_split  # type: ignore[attr-defined]  # vLLM's loaders read it
        self.qk_norm = config.qk_norm
        if config.qk_norm:  # OLMo-2: one RMSNorm over all query heads together (all ranks), one over all keys
            self.attn.q_norm = RMSNorm(config.num_heads * d, eps)
            self.attn.k_norm = RMSNorm(config.kv_heads * d, eps)
        self.rope = rope
        self.mlp: Any = nn.Module()  # (as attn)
        self.mlp.fc = MergedColumnParallelLinear(
            h, [config.intermediate_size] * 2, bias=False, quant_config=quant_config, prefix=f"{prefix}.mlp.fc"
        )
        self.mlp.out = RowParallelLinear(
            config.intermediate_size, h, bias=False, quant_config=quant_config, prefix=f"{prefix}.mlp.out"
        )
        self.act = SiluAndMul()

    def _load_head_split(self, param: Tensor, loaded: Tensor) -> None:
        rank = get_tensor_model_parallel_rank()
        param.data.copy_(loaded.narrow(2, rank * self.heads, self.heads))

    def qkv(self, positions: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of the layer's input x [T, h] (its first norm, biases, QK-norm and RoPE
        applied), each [T, heads * d]."""
        return self.heads_of(positions, self.project(x))

    def project(self, x: Tensor) -> Tensor:
        """The fused q/k/v projection [T, (heads + 2 kv_heads) d] of the layer's input: what the rest of
        `qkv` turns into queries, keys and values, the same for the same token and position (the exit loop
        holds an exited token's keys and values by holding this)."""
        return self.attn.qkv(self.norm_1(x) if self.pre else x)[0]

    def heads_of(self, positions: Tensor, fused: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values from the fused projection: QK-norm, biases and RoPE applied."""
        q, k, v = fused.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        if self.qk_norm:
            q, k = self._all_heads_norm(q, self.attn.q_norm), self._all_heads_norm(k, self.attn.k_norm, self.kv_whole)
        if hasattr(self.attn, "qk_bias"):
            q, k = q + self.attn.qk_bias[0].flatten(), k + self.attn.qk_bias[1].flatten()
        q, k = self.rope(positions, q, k)
        return q, k, v

    def _all_heads_norm(self, x: Tensor, norm: RMSNorm, whole: bool = False) -> Tensor:
        """The norm over every rank's heads together (`whole`: each rank holds all of them, replicated)."""
        if self.tp == 1 or whole:
            return norm(x)
        gathered = norm(tensor_model_parallel_all_gather(x.contiguous()))
        return gathered.chunk(self.tp, dim=-1)[get_tensor_model_parallel_rank()]

    def attend(
        self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, cache: Attention | Callable[[Tensor, Tensor, Tensor], Tensor]
    ) -> Tensor:
        """The rest of the layer after its queries, keys and values: attention with `cache` (an Attention, or
        a function that attends with one), the MLP, the norms of the config's scheme (rdlm.model.layers.Block)."""
        return self.after_attention(x, cache(q, k, v))

    def after_attention(self, x: Tensor, attended: Tensor) -> Tensor:
        """The layer's output from its input x and the attention's output."""
        branch = self.attn.out(attended)[0]
        x = x + (self.norm_2(branch) if self.post else branch)
        if self.sandwich:
            x = self.norm_2(x)
        inner = self.norm_3(x) if self.pre else x
        branch = self.mlp.out(self.act(self.mlp.fc(inner)[0]))[0]
        x = x + (self.norm_4(branch) if self.post else branch)
        return self.norm_4(x) if self.sandwich else x

    def forward(self, positions: Tensor, x: Tensor, cache: Attention) -> Tensor:
        return self.attend(x, *self.qkv(positions, x), cache)


def write_cache(cache: Attention, k: Tensor, v: Tensor) -> None:
    """Write keys and values into one Attention's KV cache for this step's tokens without attending."""
    from vllm.model_executor.layers.attention.attention import unified_kv_cache_update

    if cache.attn_backend.forward_includes_kv_cache_update:
        cache(k.new_zeros(k.shape[0], cache.num_heads * cache.head_size), k, v)
    else:
        unified_kv_cache_update(
            k.view(-1, cache.num_kv_heads, cache.head_size),
            v.view(-1, cache.num_kv_heads, cache.head_size),
            cache.layer_name,
        )
