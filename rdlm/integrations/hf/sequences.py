"""Blocks of tokens over one preallocated `RecurrentKVCache`: a left-padded batch of sequences, for a
transformers forward over `RecurrentCache` (rdlm.integrations.hf), which decodes in transformers' own loop.

`Sequences` runs blocks of several tokens per row at a fixed r through its `ModelCalls`
(rdlm.inference.execution.model_calls: the model, the cache, the valid entries the masks read, the s_0 noise table),
each block a `PromptChunk` (rdlm.inference.runner.prefill). Every generation of rdlm itself, whatever its
features (fixed r, adaptive exits, continuous chain of thought, KV-cache sharing, self-speculative
decoding, the parallel sampler, a prefill alone), decodes on the continuous batch
(rdlm.inference.batching), for `generate` and the server alike.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from rdlm.inference.execution.cache import Strategy
from rdlm.inference.execution.model_calls import Call, ModelCalls
from rdlm.inference.exits.criteria import ExitCriterion
from rdlm.inference.params import check_length, check_prompts
from rdlm.inference.runner.prefill import PromptChunk
from rdlm.model.lm import RecurrentDepthLM


class Sequences:
    """A batch of sequences over one `ModelCalls` and its cache, run in blocks of tokens at a fixed r (a
    transformers forward over `RecurrentCache`: the prompt, then a token at a time).
    Prompts are left-padded to a common length: buffer index t of row b holds that row's token at
    position t - pad[b]. `length` buffer entries are written; a block appends at `length`.

    new_tokens: the room after the longest prompt (the buffer holds prompt and new tokens); num_slots /
    strategy: the core cache (rdlm.inference.execution.cache); seed / init_scale: the s_0 noise table; criterion /
    min_steps: a learned exit gate that picks each token's read-out iteration (an Ouro checkpoint), else
    None."""

    def __init__(
        self,
        model: RecurrentDepthLM,
        prompts: list[list[int]],
        new_tokens: int,
        num_slots: int,
        strategy: str,
        seed: int,
        init_scale: float,
        criterion: ExitCriterion | None = None,
        min_steps: int = 0,
    ) -> None:
        check_prompts(model, prompts)
        self.model, self.criterion, self.min_steps = model, criterion, min_steps
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.batch = len(prompts)
        self.prompt_length = max(len(p) for p in prompts)
        check_length(model, self.prompt_length, new_tokens)
        max_length = self.prompt_length + new_tokens
        pad = torch.tensor([self.prompt_length - len(p) for p in prompts], device=self.device)
        # (a str from the caller: RecurrentKVCache refuses one other than "full" or "shared")
        self.calls = ModelCalls(
            model, self.batch, max_length, num_slots, cast(Strategy, strategy), pad, seed, init_scale
        )
        self.cache = self.calls.cache
        self.ids = torch.zeros(self.batch, self.prompt_length, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            self.ids[b, self.prompt_length - len(p) :] = torch.tensor(p, device=self.device)
        self.length = 0  # buffer entries written so far

    # ---- block calls (prompt, drafts, verification): eager, over slices of the cache

    def begin(self, ids: Tensor) -> tuple[Tensor, Call]:
        """Mark the new tokens (buffer indices from `self.length` on) valid and run the prelude: (e, the
        call for these tokens)."""
        self.calls.admit(self.length, ids.shape[1])
        call = self.calls.block(self.length, ids.shape[1])
        return self.calls.embed(ids, call), call

    def forward(self, ids: Tensor, num_steps: int, last_only: bool = True) -> tuple[Tensor, Tensor]:
        """Run tokens through the model at a fixed r (the prefill: `PromptChunk`, a chunk of every row);
        append them to the cache. (logits, state): the logits of the last token [B, V], or of every token
        [B, n, V] with `last_only=False`. With a learned gate, each token is read out at the iteration its
        gate chose, as the reference selects, so the first new token is the reference's."""
        e, call = self.begin(ids)
        chunk = PromptChunk.block(self.calls, call, e, num_steps, self.criterion, self.min_steps)
        state, logits = chunk.run(self.calls)
        self.length += ids.shape[1]
        return (logits[:, -1] if last_only else logits), state
