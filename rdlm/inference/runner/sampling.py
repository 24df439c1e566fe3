"""Choosing the next token from logits: repetition penalty, greedy or temperature with top-k / top-p /
min-p, each row drawing from its own generator."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rdlm.inference.params import GenerationConfig

if TYPE_CHECKING:
    from rdlm.model.lm import RecurrentDepthLM


GREEDY_BELOW = 1e-5  # a temperature under this chooses greedily, as at 0


def token_logprobs(logits: Tensor, chosen: Tensor, k: int) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Per row of logits [B, V]: (log p of the chosen token [B], the k most likely (token, log p), best
    first), from the model's distribution (float32 log-softmax of the raw logits), in one host copy."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, chosen.view(-1, 1).to(logp.device))
    top = logp.topk(k, dim=-1) if k else None
    values = torch.cat(
        [picked] + ([top.values, top.indices.to(logp.dtype)] if top is not None else []), dim=-1
    ).tolist()
    return [(row[0], tuple((int(i), v) for v, i in zip(row[1 : 1 + k], row[1 + k :], strict=True))) for row in values]


def sample(
    logits: Tensor,
    config: GenerationConfig,
    generators: Sequence[torch.Generator] | None = None,
    seen: Tensor | None = None,
) -> Tensor:
    """Next tokens [B] from logits [B, V]: repetition penalty, then greedy or temperature with
    top-k / top-p / min-p filtering. Each row draws from its own generator (reproducible per row)."""
    logits = logits.float()
    if seen is not None and config.repetition_penalty != 1:
        p = config.repetition_penalty  # CTRL-style: shrink the logits of tokens already seen
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if config.temperature < GREEDY_BELOW:  # the limit of sampling as the temperature falls (and no overflow)
        return logits.argmax(dim=-1)
    logits = logits / config.temperature
    # A tiny temperature or penalty can take a logit to +inf, where softmax gives NaN: such a row draws among
    # its infinite logits alone (the limit of the distribution). Finite rows are left as they are.
    infinite = torch.isposinf(logits)
    logits = torch.where(infinite.any(dim=-1, keepdim=True), torch.where(infinite, 0.0, float("-inf")), logits)
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


class NonFiniteLogitsError(FloatingPointError):
    """The model's logits hold NaN or infinity: no token can be chosen from them."""

    def __init__(self, model: RecurrentDepthLM, token: int) -> None:
        super().__init__(
            f"model produced non-finite logits at new token {token}; weights may be NaN: "
            f"{getattr(model, 'source', None) or 'the model'}"
        )


def read_tokens(chosen: Tensor, logits: Tensor) -> tuple[list[int], bool]:
    """(chosen ids, whether every logit was finite), read in the one device-to-host copy the ids need
    anyway: the check costs no synchronization of its own (the CUDA-graph step included)."""
    values = torch.cat([chosen.reshape(-1), torch.isfinite(logits).all().reshape(1).to(chosen.dtype)]).tolist()
    return values[:-1], bool(values[-1])


def _choose_group(
    logits: Tensor, config: GenerationConfig, generators: list[torch.Generator], seen: Tensor
) -> tuple[list[int], list | None, list[bool]]:
    """Tokens, scores and whether each row's logits were finite, for rows that share a config: sampled from
    finite numbers (a NaN would fail inside the sampler), read in the one host copy the tokens need."""
    chosen = sample(torch.nan_to_num(logits), config, generators, seen)
    scored = None if config.logprobs is None else token_logprobs(logits, chosen, config.logprobs)
    finite = torch.isfinite(logits).all(dim=-1)
    values = torch.cat([chosen.reshape(-1), finite.to(chosen.dtype)]).tolist()
    return values[: len(finite)], scored, [bool(v) for v in values[len(finite) :]]


def choose(
    model: RecurrentDepthLM,
    logits: Tensor,
    config: GenerationConfig,
    generators: list[torch.Generator],
    seen: Tensor,
    produced: int,
) -> tuple[list[int], list | None]:
    """The next token of each row of `logits` [rows, V] (`sample`) and, with `config.logprobs`, its log p
    and the top k (`token_logprobs`), after `produced` new tokens; NonFiniteLogitsError when a row's logits
    are not finite."""
    tokens, scored, finite = _choose_group(logits, config, generators, seen)
    if not all(finite):
        raise NonFiniteLogitsError(model, produced + 1)
    return tokens, scored


def choose_rows(
    logits: Tensor,
    configs: list[GenerationConfig],
    generators: list[torch.Generator],
    seen: Tensor,
    rows: Tensor,
    upload: Callable[[list], Tensor],
) -> list[tuple[int, tuple | None] | None]:
    """The next token (and its scores, or None) of each row j of `logits` [n, V], sampled by `configs[j]`
    with `generators[j]` from the tokens seen at `seen[rows[j]]`: one host read per distinct config. A row
    whose logits are not finite gets None; the others get the tokens they would get alone (each row draws
    from its own generator), so one broken row fails no other."""
    groups: dict[GenerationConfig, list[int]] = {}
    for j, config in enumerate(configs):
        groups.setdefault(config, []).append(j)
    chosen: list[tuple[int, tuple | None] | None] = [None] * len(configs)
    for config, members in groups.items():
        pick = upload(members)
        tokens, scored, finite = _choose_group(logits[pick], config, [generators[j] for j in members], seen[rows[pick]])
        for k, j in enumerate(members):
            if finite[k]:
                chosen[j] = tokens[k], None if scored is None else scored[k]
    return chosen
