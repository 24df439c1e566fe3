"""The layers of the recurrent-depth model (rdlm.model.lm): RMSNorm, attention with RoPE, QK-norm and a
KV-cache hook, the gated MLP, and the block that prelude, core and coda are made of (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from rdlm.model.config import RDLMConfig
from rdlm.model.rope import apply_rope

# Identifies one attention layer at one point of the recurrence, for a KV cache:
# ("prelude", layer, -1), ("core", layer, iteration), ("coda", layer, -1).
LayerKey = tuple[str, int, int]
Rope = tuple[Tensor, Tensor]


class KVCacheHook(Protocol):
    """What attention needs from a KV cache: store this call's keys/values, return all of them.

    `k` and `v` are [batch, heads, new_tokens, head_dim] (RoPE already applied). The returned tensors
    hold every key/value the new tokens may attend to, [batch, heads, total_tokens, head_dim].
    Which slot an iteration uses (full, shared `i mod k`, latest-existing for early exits) is the
    cache's decision, made from the key.
    """

    def update(self, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps), computed in float32, cast back, then scaled by the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x) * self.weight


class Attention(nn.Module):
    """Causal self-attention with RoPE; grouped-query when the config has fewer key/value heads."""

    def __init__(self, config: RDLMConfig) -> None:
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = config.num_heads, config.kv_heads, config.head_dim
        self.rope_pairs = config.rope_pairs
        h, q_width, kv_width = config.hidden_size, config.num_heads * config.head_dim, config.kv_heads * config.head_dim
        self.qkv = nn.Linear(h, q_width + 2 * kv_width, bias=False)  # output rows: q, then k, then v
        # Learnable biases on queries (index 0) and keys (index 1) only, added before RoPE.
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.num_heads, self.head_dim)) if config.qk_bias else None
        # OLMo-2's QK-norm: one RMSNorm over all query heads together, one over all key heads.
        self.q_norm = RMSNorm(q_width, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(kv_width, config.norm_eps) if config.qk_norm else None
        self.out = nn.Linear(q_width, h, bias=False)
        # "sdpa": torch's fused kernels; "eager": the same arithmetic as plain matmuls and a softmax.
        self.implementation = "sdpa"

    def forward(self, x: Tensor, rope: Rope, mask: Tensor | None, cache: KVCacheHook | None, key: LayerKey) -> Tensor:
        batch, seq, _ = x.shape
        cos, sin = rope
        if self.kv_heads == self.num_heads and self.q_norm is None:
            qkv = self.qkv(x).view(batch, seq, 3, self.num_heads, self.head_dim)
            qk, v = qkv[:, :, :2], qkv[:, :, 2]  # queries and keys get bias and RoPE together
            if self.qk_bias is not None:
                qk = qk + self.qk_bias.view(2, self.num_heads, self.head_dim)
            q, k = apply_rope(qk, cos.unsqueeze(2), sin.unsqueeze(2), self.rope_pairs).unbind(dim=2)
        else:
            q, k, v = self.qkv(x).split(
                (self.num_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim), dim=-1
            )
            if self.q_norm is not None and self.k_norm is not None:  # (QK-norm: both)
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.view(batch, seq, self.num_heads, self.head_dim), k.view(batch, seq, self.kv_heads, self.head_dim)
            if self.qk_bias is not None:  # (equal head counts: the config refuses it with grouped queries)
                q, k = q + self.qk_bias[0], k + self.qk_bias[1]
            q, k = apply_rope(q, cos, sin, self.rope_pairs), apply_rope(k, cos, sin, self.rope_pairs)
            v = v.view(batch, seq, self.kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        attend = getattr(cache, "attend", None)  # several calls packed in one sequence (inference.cache.PackedCall)
        if attend is not None:
            y = attend(key, q, k, v, self.attention)
        else:
            if cache is not None:
                k, v = cache.update(key, k, v)
            if mask is None and k.shape[2] != seq:  # a cache without an explicit mask: queries are the last tokens
                mask = causal_mask(seq, k.shape[2], x.device)
            y = self.attention(q, k, v, mask)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """softmax(q k^T / sqrt(d) + mask) v over [batch, heads, n, d]; no mask: causal (as many keys as queries)."""
        gqa: dict[str, Any] = {"enable_gqa": True} if self.kv_heads != self.num_heads else {}
        if mask is None and self.implementation == "sdpa":
            return sdpa(q, k, v, None, **gqa)
        if mask is None:
            mask = causal_mask(q.shape[2], k.shape[2], q.device)
        if self.implementation == "sdpa":
            return sdpa(q, k, v, mask, **gqa)
        return eager_attention(q, k, v, attn_mask=mask)


# cuDNN's attention builds an execution plan for every new shape (~5 ms a call on an H200 with torch 2.11,
# measured by the GPU suite), and decoding meets a new key length at every token: inference on CUDA takes
# the flash and memory-efficient kernels instead. Training (fixed shapes, plans reused) keeps torch's choice.
INFERENCE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, **gqa: Any) -> Tensor:
    """F.scaled_dot_product_attention, causal when `mask` is None; without cuDNN's kernel when it runs on
    CUDA without autograd (see INFERENCE_BACKENDS)."""
    if q.is_cuda and not torch.is_grad_enabled():
        with sdpa_kernel(INFERENCE_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, **gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, **gqa)


ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def eager_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(d) + mask) v written out (what F.scaled_dot_product_attention computes), for
    debugging and for tools that hook the attention weights. Boolean masks: True = may attend."""
    if k.shape[1] != q.shape[1]:  # grouped-query: each key/value head serves a group of query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores.softmax(dim=-1) @ v


def causal_mask(queries: int, keys: int, device: torch.device | str | None = None) -> Tensor:
    """Boolean [queries, keys] mask where the queries are the last `queries` of `keys` tokens."""
    offset = keys - queries
    q_pos = torch.arange(queries, device=device).unsqueeze(1) + offset
    return q_pos >= torch.arange(keys, device=device).unsqueeze(0)


def padded_causal_mask(valid: Tensor, queries: int) -> Tensor:
    """Boolean [B, 1, queries, K] mask of the last `queries` of K buffer entries, `valid` [B, K] marking the
    entries that hold a token (padding does not): causal over the valid keys, and each query always sees
    itself, so a padding query has one key instead of none (its softmax is defined; nothing reads it)."""
    keys = valid.shape[-1]
    q = torch.arange(keys - queries, keys, device=valid.device).view(-1, 1)
    k = torch.arange(keys, device=valid.device).view(1, -1)
    return (valid[:, None, None, :] & (k <= q)) | (k == q)


class GatedMLP(nn.Module):
    """SwiGLU: the first half of the fused projection goes through SiLU and gates the second half."""

    def __init__(self, config: RDLMConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.out = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.out(F.silu(gate) * up)


class Block(nn.Module):
    """One transformer layer; where it normalizes is the config's `norm_scheme`:

    sandwich  x = n2(x + Attn(n1(x)));  x = n4(x + MLP(n3(x)))     Huginn
    prenorm   x = x + Attn(n1(x));      x = x + MLP(n3(x))         Llama, the retrofitted Llama models
    postnorm  x = x + n2(Attn(x));      x = x + n4(MLP(x))         OLMo-2
    peri      x = x + n2(Attn(n1(x)));  x = x + n4(MLP(n3(x)))     Ouro
    """

    def __init__(self, config: RDLMConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.norm_eps
        scheme = config.norm_scheme
        self.sandwich = scheme == "sandwich"  # n2/n4 after the residual sum, not on the branch
        if scheme != "postnorm":
            self.norm_1, self.norm_3 = RMSNorm(h, eps), RMSNorm(h, eps)
        if scheme != "prenorm":
            self.norm_2, self.norm_4 = RMSNorm(h, eps), RMSNorm(h, eps)
        self.pre, self.post = scheme != "postnorm", scheme in ("postnorm", "peri")
        self.attn = Attention(config)
        self.mlp = GatedMLP(config)

    def forward(
        self,
        x: Tensor,
        rope: Rope,
        mask: Tensor | None = None,
        cache: KVCacheHook | None = None,
        key: LayerKey = ("", 0, -1),
    ) -> Tensor:
        branch = self.attn(self.norm_1(x) if self.pre else x, rope, mask, cache, key)
        x = x + (self.norm_2(branch) if self.post else branch)
        if self.sandwich:
            x = self.norm_2(x)
        branch = self.mlp(self.norm_3(x) if self.pre else x)
        x = x + (self.norm_4(branch) if self.post else branch)
        return self.norm_4(x) if self.sandwich else x
