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


def _logprob_columns(logits: Tensor, chosen: Tensor, k: int) -> Tensor:
    """Per row of logits [B, V]: log p of the chosen token, then the k most likely tokens' log p and ids
    ([B, 1 + 2k], float32 log-softmax of the raw logits), on the device."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, chosen.view(-1, 1).to(logp.device))
    top = logp.topk(k, dim=-1) if k else None
    return torch.cat([picked] + ([top.values, top.indices.to(logp.dtype)] if top is not None else []), dim=-1)


def _scores(row: list[float], k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(log p of the chosen token, the k most likely (token, log p), best first) from a row of
    `_logprob_columns` read to the host."""
    return row[0], tuple((int(i), v) for v, i in zip(row[1 : 1 + k], row[1 + k :], strict=True))


def greedy(config: GenerationConfig) -> bool:
    """Whether `config` chooses greedily: temperature 0, or any below GREEDY_BELOW (its limit)."""
    return config.temperature < GREEDY_BELOW


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
    if greedy(config):  # the limit of sampling as the temperature falls (and no overflow)
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


def all_finite(logits: Tensor) -> Tensor:
    """Per row of logits [n, V]: whether every entry is finite. The row's largest and smallest entries are finite
    exactly when all are (NaN propagates through both): two reductions, where `isfinite(logits).all(-1)` makes
    and reduces a mask of the whole row (on one CPU thread at 32 x 8192: ~36 against ~370 µs)."""
    return torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))


def read_tokens(chosen: Tensor, logits: Tensor) -> tuple[list[int], bool]:
    """(chosen ids, whether every logit was finite), read in the one device-to-host copy the ids need
    anyway: the check costs no synchronization of its own (the CUDA-graph step included)."""
    values = torch.cat([chosen.reshape(-1), all_finite(logits).all().reshape(1).to(chosen.dtype)]).tolist()
    return values[:-1], bool(values[-1])


def sampling_key(config: GenerationConfig) -> tuple:
    """What changes the sampling call of a row (`sample` and its scores): rows with the same key are chosen in
    one call whatever else their requests differ in (seed, lengths, stop strings, depth); each row still draws
    from its own generator."""
    chooses_greedily = greedy(config)
    drawn = () if chooses_greedily else (config.temperature, config.top_k, config.top_p, config.min_p)
    return chooses_greedily, drawn, config.repetition_penalty, config.logprobs


def choose_rows(
    logits: Tensor,
    configs: list[GenerationConfig],
    generators: list[torch.Generator],
    seen: Tensor,
    rows: Tensor,
    upload: Callable[[list], Tensor],
) -> list[tuple[int, tuple | None] | None]:
    """The next token (and its scores, or None) of each row j of `logits` [n, V], sampled by `configs[j]`
    with `generators[j]` from the tokens seen at `seen[rows[j]]`: one sampling call per distinct
    `sampling_key`, and one host read in all (the tokens, whether each row's logits were finite, the scores).
    A row whose logits are not finite gets None; the others get the tokens they would get alone (each row
    draws from its own generator, from finite numbers: a NaN would fail inside the sampler), so one broken row
    fails no other."""
    groups: dict[tuple, list[int]] = {}
    for j, config in enumerate(configs):
        groups.setdefault(sampling_key(config), []).append(j)
    # Token ids are exact in float32 below 2**24; the scores are float32 already.
    exact = torch.float32 if logits.shape[-1] < 2**24 else torch.float64
    tokens, finite, scores = [], [], []
    for members in groups.values():
        config = configs[members[0]]
        if len(groups) == 1:  # every row: no gather
            part, part_rows = logits, rows
        else:
            pick = upload(members)
            part, part_rows = logits[pick], rows[pick]
        # Greedy, a row's NaN or infinity only marks it failed (`finite`), and the rows' seen tokens matter only
        # with a repetition penalty: neither the copy nor the gather is made where it changes nothing.
        drawn = not greedy(config)
        penalized = config.repetition_penalty != 1
        source = torch.nan_to_num(part) if drawn or penalized else part
        chosen = sample(source, config, [generators[j] for j in members], seen[part_rows] if penalized else None)
        tokens.append(chosen.reshape(-1).to(exact))
        finite.append(all_finite(part).to(exact))
        if config.logprobs is not None:
            scores.append(_logprob_columns(part, chosen, config.logprobs).to(exact).flatten())
    values = torch.cat(tokens + finite + scores).tolist()  # the one host read
    n = len(configs)
    chosen_rows: list[tuple[int, tuple | None] | None] = [None] * n
    at, scored_at = 0, 2 * n  # the rows in the groups' order; their scores after the tokens and flags
    for members in groups.values():
        k = configs[members[0]].logprobs
        for j in members:
            score = None
            if k is not None:
                score = _scores(values[scored_at : scored_at + 1 + 2 * k], k)
                scored_at += 1 + 2 * k
            if values[n + at]:
                chosen_rows[j] = int(values[at]), score
            at += 1
    return chosen_rows
