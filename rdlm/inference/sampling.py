"""Choosing the next token from logits: repetition penalty, greedy or temperature with top-k / top-p /
min-p, each row drawing from its own generator."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from rdlm.inference.params import GenerationConfig


def token_logprobs(logits: Tensor, chosen: Tensor, k: int) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Per row of logits [B, V]: (log p of the chosen token [B], the k most likely (token, log p), best
    first), from the model's distribution (float32 log-softmax of the raw logits), in one host copy."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, chosen.view(-1, 1).to(logp.device))
    top = logp.topk(k, dim=-1) if k else None
    values = torch.cat([picked] + ([top.values, top.indices.to(logp.dtype)] if k else []), dim=-1).tolist()
    return [(row[0], tuple((int(i), v) for v, i in zip(row[1:1 + k], row[1 + k:]))) for row in values]


def sample(logits: Tensor, config: GenerationConfig, generators: Sequence[torch.Generator] | None = None,
           seen: Tensor | None = None) -> Tensor:
    """Next tokens [B] from logits [B, V]: repetition penalty, then greedy or temperature with
    top-k / top-p / min-p filtering. Each row draws from its own generator (reproducible per row)."""
    logits = logits.float()
    if seen is not None and config.repetition_penalty != 1:
        p = config.repetition_penalty  # CTRL-style: shrink the logits of tokens already seen
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / config.temperature
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        kth = logits.topk(config.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= config.top_p  # keeps the first
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    if config.min_p is not None:
        probs = probs.masked_fill(probs < config.min_p * probs.amax(dim=-1, keepdim=True), 0)
    # Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p; one q vector per row.
    if generators is None:
        q = torch.empty_like(probs).exponential_()
    else:
        q = torch.stack([torch.empty_like(probs[0]).exponential_(generator=g) for g in generators])
    return (probs / q).argmax(dim=-1)
