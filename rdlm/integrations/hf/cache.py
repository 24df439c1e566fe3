"""`RecurrentCache`, transformers' `Cache` over rdlm's decode engine, and the padding mask of a plain
forward."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from rdlm.checks import is_int
from rdlm.integrations.hf.sequences import Sequences
from rdlm.model.layers import padded_causal_mask
from rdlm.model.lm import RecurrentDepthLM


class RecurrentCache(Cache):
    """transformers' `Cache` for recurrence: the engine's `Sequences` (rdlm/integrations/hf/sequences.py) over one
    preallocated `RecurrentKVCache` (rdlm/inference/execution/cache.py: a slot per core iteration, "full", or k slots
    that iteration i reads and writes as i mod k, "shared"; paper section 6, "Zero-Shot KV-cache Sharing").

        cache = RecurrentCache(max_length=64)                    # or forward(..., use_cache=True)
        out = model(prompt_ids, attention_mask=mask, past_key_values=cache, num_steps=8)
        out = model(next_ids, past_key_values=out.past_key_values, num_steps=8)   # one new token per row

    The first call is the prompt: a batch left-padded as transformers pads for generation (the mask
    says where). Later calls append tokens to every row. s_0 of the token at position p is row p of the
    engine's (seed, position) noise table, so a forward over this cache gives the logits `rdlm.inference.generate`
    decodes from, and two runs give the same numbers. The engine fixes r per call; with the "full"
    strategy the number of slots (default: the first call's r) bounds the r of later calls.
    """

    def __init__(
        self,
        max_length: int | None = None,
        num_slots: int | None = None,
        strategy: str = "full",
        seed: int | None = None,
        init_scale: float | None = None,
    ) -> None:
        super().__init__(layers=[])
        if strategy not in ("full", "shared"):
            raise ValueError(f"strategy must be 'full' or 'shared', got {strategy!r}")
        if strategy == "shared" and num_slots is None:
            raise ValueError("the shared strategy needs num_slots (the cache budget k)")
        if num_slots is not None and not is_int(num_slots, 1):
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        self.max_length, self.num_slots, self.strategy = max_length, num_slots, strategy
        self.seed, self.init_scale = _check_seed(seed), _check_scale(init_scale)
        self.session: Sequences | None = None

    def forward(
        self,
        model: RecurrentDepthLM,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        num_steps: int,
        seed: int | None = None,
        init_scale: float | None = None,
    ) -> Tensor:
        """Run `input_ids` [B, n] at r = num_steps over the cache; logits [B, n, V]."""
        for name, value in (("seed", _check_seed(seed)), ("init_scale", _check_scale(init_scale))):
            mine = getattr(self, name)
            if value is not None and mine is not None and value != mine:
                raise ValueError(f"this cache was filled with {name}={mine}; got {name}={value}")
            if mine is None:
                setattr(self, name, value)
        if self.session is None:
            return self._prefill(model, input_ids, attention_mask, num_steps)
        batch, n = input_ids.shape
        if batch != self.session.batch:
            raise ValueError(f"this cache holds {self.session.batch} rows, got a batch of {batch}")
        if attention_mask is not None:
            if tuple(attention_mask.shape) != (batch, self.session.length + n):
                raise ValueError(
                    f"attention_mask must cover the cached and the new tokens, "
                    f"[{batch}, {self.session.length + n}], got {list(attention_mask.shape)}"
                )
            if not bool(attention_mask[:, -n:].bool().all()):
                raise ValueError(
                    "tokens after the prompt must all be real (attention_mask 1): the recurrent "
                    "cache pads only on the left, in the first call"
                )
        if self.session.length + n > self.session.cache.max_length:
            raise ValueError(
                f"this cache holds {self.session.cache.max_length} tokens; "
                f"{self.session.length + n} do not fit (RecurrentCache(max_length=...))"
            )
        return self.session.forward(input_ids, num_steps, last_only=False)[0]

    def _prefill(
        self, model: RecurrentDepthLM, input_ids: Tensor, attention_mask: Tensor | None, num_steps: int
    ) -> Tensor:
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {list(mask.shape)} does not match input_ids {list(input_ids.shape)}")
        if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
            raise ValueError("the recurrent cache takes left-padded prompts (padding first, then the tokens)")
        length = input_ids.shape[1]
        max_length = self.max_length if self.max_length is not None else model.config.context_length
        if length > max_length:
            raise ValueError(f"a prompt of {length} tokens does not fit a cache of max_length {max_length}")
        self.seed = 0 if self.seed is None else self.seed
        self.init_scale = 1.0 if self.init_scale is None else self.init_scale
        self.session = Sequences(
            model,
            [row[keep].tolist() for row, keep in zip(input_ids, mask, strict=True)],
            max_length - length,
            self.num_slots if self.num_slots is not None else num_steps,
            self.strategy,
            self.seed,
            self.init_scale,
        )
        return self.session.forward(self.session.ids, num_steps, last_only=False)[0]

    # ---- what transformers asks of a Cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.session is None else self.session.length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.session.cache.max_length if self.session is not None else (self.max_length or -1)

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.session is not None

    @property
    def batch_size(self) -> int:
        return -1 if self.session is None else self.session.batch

    def reset(self) -> None:
        self.session = None

    def _refuse(self, what: str) -> None:
        raise NotImplementedError(
            f"RecurrentCache does not {what} (rdlm decodes greedily or by sampling, "
            "one token per row; no beam search, assisted decoding or rollback)"
        )

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self._refuse("reorder rows")

    def crop(self, tokens_to_remove: int) -> None:
        self._refuse("crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse("repeat rows")

    def batch_select_indices(self, indices: Tensor) -> None:
        self._refuse("select rows")


def _check_seed(seed: int | None) -> int | None:
    if seed is not None and not (isinstance(seed, int) and seed >= 0):
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return seed


def _check_scale(init_scale: float | None) -> float | None:
    if init_scale is not None and not (isinstance(init_scale, (int, float)) and 0 <= init_scale < math.inf):
        raise ValueError(f"init_scale must be a finite number >= 0, got {init_scale!r}")
    return init_scale


def padding_attention_mask(attention_mask: Tensor) -> Tensor:
    """[batch, seq] padding mask -> boolean [batch, 1, seq, seq] causal mask over real tokens.

    Each query may always see itself, so a padding query has one valid key instead of none (an
    all-masked row would give NaN); padding outputs are never read.
    """
    return padded_causal_mask(attention_mask.bool(), attention_mask.shape[-1])
