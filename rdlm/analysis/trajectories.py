"""Recording latent trajectories s_0, s_1, ..., s_r of every token (paper Figures 5 and 6).

The recurrence is driven step by step (`RecurrentDepthLM.embed / init_state / step`), so states can be
written out as they are produced instead of being held as a Python list: with Huginn-0125 (h = 5280) a
512-token prompt at r = 1024 is 11 GB of float32 states. Three ways to keep that bounded, and the
`Trajectory.storage` note says which one was used:

- stream to disk: states go into a `.npy` file opened as a numpy memmap (`stream_to=`);
- subsample iterations: keep every k-th state (k chosen so the record fits `max_bytes`);
- subsample tokens: record only some token positions (the whole prompt still runs, since tokens
  attend to each other; only the stored rows are fewer).

The same loop also continues past `r` to a large `limit_steps` without storing, to get the approximate
limit state s* of Figure 5 from the same s_0.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import Tensor

from rdlm.model.lm import RecurrentDepthLM

# A recurrence over a batch of latent states: (state [B, T, h], iteration index) -> next state.
StepFn = Callable[[Tensor, int], Tensor]

DEFAULT_MAX_BYTES = 512 * 2**20


@dataclass
class Trajectory:
    """Latent states of one prompt: `states[j, c]` is token `positions[j]` at iteration `iterations[c]`."""

    states: np.ndarray  # [tokens, recorded iterations, hidden] float32 (np.memmap if streamed)
    iterations: np.ndarray  # iteration index i of each recorded column (0 is s_0)
    positions: np.ndarray  # prompt positions of the recorded tokens
    token_ids: np.ndarray  # the whole prompt's token ids
    num_steps: int  # r: the last iteration recorded
    limit: np.ndarray | None = None  # s* [tokens, hidden] after `limit_steps` iterations, same s_0
    limit_steps: int | None = None
    storage: list[str] = field(default_factory=list)  # how the record was kept (memory/disk/subsampled)

    @property
    def num_tokens(self) -> int:
        return self.states.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.states.shape[2]

    def token_state(self, j: int) -> np.ndarray:
        """The trajectory of recorded token j as an in-memory [iterations, hidden] array."""
        return np.asarray(self.states[j], dtype=np.float32)


def select_positions(seq_len: int, max_tokens: int | None) -> np.ndarray:
    """All positions, or `max_tokens` of them evenly spread over the prompt (first and last included)."""
    if max_tokens is None or seq_len <= max_tokens:
        return np.arange(seq_len)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return np.unique(np.linspace(0, seq_len - 1, max_tokens).round().astype(int))


def select_iterations(num_steps: int, stride: int) -> np.ndarray:
    """0, stride, 2*stride, ... and always the last iteration r."""
    if stride < 1:
        raise ValueError(f"iteration stride must be >= 1, got {stride}")
    kept = np.arange(0, num_steps + 1, stride)
    return kept if kept[-1] == num_steps else np.append(kept, num_steps)


def record(
    step: StepFn,
    initial_state: Tensor,
    num_steps: int,
    *,
    positions: Sequence[int] | np.ndarray | None = None,
    iteration_stride: int | None = None,
    limit_steps: int | None = None,
    stream_to: str | os.PathLike | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    token_ids: Sequence[int] | None = None,
) -> Trajectory:
    """Iterate `step` from `initial_state` ([1, T, h]) and record the states of `positions`.

    iteration_stride: keep every k-th state. None: 1 if the record fits `max_bytes` (or is streamed),
        else the smallest stride that fits.
    limit_steps: keep iterating (without storing) up to this many steps and return s* as `limit`.
    stream_to: write the states into this `.npy` file (numpy memmap) instead of memory.
    """
    if initial_state.ndim != 3 or initial_state.shape[0] != 1:
        raise ValueError(f"initial_state must be [1, tokens, hidden], got {tuple(initial_state.shape)}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if limit_steps is not None and limit_steps < num_steps:
        raise ValueError(f"limit_steps ({limit_steps}) must be >= num_steps ({num_steps})")
    _, seq_len, hidden = initial_state.shape
    recorded = np.arange(seq_len) if positions is None else np.asarray(positions, dtype=int)
    if recorded.size == 0 or recorded.min() < 0 or recorded.max() >= seq_len:
        raise ValueError(f"token positions must lie in [0, {seq_len}), got {recorded.tolist()}")
    storage = []
    if recorded.size < seq_len:
        storage.append(f"tokens subsampled: {recorded.size} of {seq_len} positions recorded")

    bytes_per_iteration = recorded.size * hidden * 4
    if iteration_stride is None:
        iteration_stride = 1
        if stream_to is None and bytes_per_iteration * (num_steps + 1) > max_bytes:
            fits = max(2, max_bytes // bytes_per_iteration)  # at least s_0 and s_r
            iteration_stride = math.ceil(num_steps / (fits - 1))
    iterations = select_iterations(num_steps, iteration_stride)
    if iterations.size < min(3, num_steps + 1):  # the dynamics need three states at least
        mib = bytes_per_iteration / 2**20
        raise ValueError(
            f"the memory budget max_bytes = {max_bytes / 2**20:.3g} MiB (--max-memory-mb) holds "
            f"fewer than 3 states of {recorded.size} tokens x {hidden} ({mib:.3g} MiB each): give at "
            f"least {3 * mib:.3g} MiB, fewer tokens (--max-tokens) or stream the states (--stream)"
        )
    if iteration_stride > 1:
        storage.append(
            f"iterations subsampled: every {iteration_stride}th state kept ({iterations.size} of {num_steps + 1})"
        )
    shape = (recorded.size, iterations.size, hidden)
    size_mb = np.prod(shape) * 4 / 2**20
    if stream_to is not None:
        stream_to = Path(stream_to)
        stream_to.parent.mkdir(parents=True, exist_ok=True)
        partial = stream_to.with_name(stream_to.name + ".partial")
        states: np.ndarray = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=shape)
        storage.append(f"streamed to disk: {stream_to} ({size_mb:.1f} MiB, numpy memmap)")
    else:
        states = np.empty(shape, dtype=np.float32)
        storage.append(f"in memory ({size_mb:.1f} MiB)")

    column = {int(i): c for c, i in enumerate(iterations)}
    index = torch.as_tensor(recorded, device=initial_state.device)

    def keep(state: Tensor, i: int) -> None:
        if i in column:
            states[:, column[i]] = state[0, index].float().cpu().numpy()

    state = initial_state
    keep(state, 0)
    for i in range(1, max(num_steps, limit_steps or 0) + 1):
        state = step(state, i - 1)
        keep(state, i)
    limit = state[0, index].float().cpu().numpy() if limit_steps is not None else None

    if stream_to is not None:
        cast(np.memmap, states).flush()
        os.replace(partial, stream_to)  # the open memmap keeps pointing at the same file
    ids = np.asarray(token_ids if token_ids is not None else [], dtype=np.int64)
    return Trajectory(
        states=states,
        iterations=iterations,
        positions=recorded,
        token_ids=ids,
        num_steps=num_steps,
        limit=limit,
        limit_steps=limit_steps,
        storage=storage,
    )


@dataclass
class Recurrence:
    """A model's core recurrence for one prompt: e = P(x) computed once, then s -> R(e, s)."""

    model: RecurrentDepthLM
    input_ids: Tensor  # [batch, seq]
    embedded: Tensor
    rope: tuple[Tensor, Tensor]

    @classmethod
    @torch.no_grad()
    def for_prompt(cls, model: RecurrentDepthLM, token_ids: Sequence[int] | Tensor, batch: int = 1) -> Recurrence:
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1)
        if ids.numel() == 0:
            raise ValueError("the prompt has no tokens")
        outside = (ids < 0) | (ids >= model.config.vocab_size)
        if bool(outside.any()):
            raise ValueError(
                f"token id {int(ids[outside][0])} is outside the model's vocabulary (size {model.config.vocab_size})"
            )
        device = model.embedding.weight.device
        ids = ids.to(device).expand(batch, -1)
        rope = model.rope(torch.arange(ids.shape[1], device=device))
        return cls(model=model, input_ids=ids, embedded=model.embed(ids, rope), rope=rope)

    @torch.no_grad()
    def step(self, state: Tensor, iteration: int) -> Tensor:
        return self.model.step(state, self.embedded, iteration, self.rope)

    @torch.no_grad()
    def readout(self, state: Tensor) -> Tensor:
        """Next-token logits [batch, seq, vocab] if the recurrence stopped at `state`."""
        return self.model.readout(state, self.rope)

    def initial_state(self, seed: int = 0, init_scale: float = 1.0) -> Tensor:
        generator = torch.Generator(device=self.embedded.device).manual_seed(seed)
        return self.model.init_state(self.embedded, init_scale, generator)


def record_trajectory(
    model: RecurrentDepthLM,
    token_ids: Sequence[int] | Tensor,
    num_steps: int,
    *,
    limit_steps: int | None = None,
    seed: int = 0,
    init_scale: float = 1.0,
    initial_state: Tensor | None = None,
    max_tokens: int | None = None,
    positions: Sequence[int] | np.ndarray | None = None,
    iteration_stride: int | None = None,
    stream_to: str | os.PathLike | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Trajectory:
    """Run `model` on one prompt for `num_steps` iterations and record [s_0 .. s_r] per token.

    s_0 is drawn as in training (seed, init_scale; 0 gives the all-zero state) unless `initial_state`
    ([1, seq, hidden]) is given. See `record` for the memory options.
    """
    recurrence = Recurrence.for_prompt(model, token_ids)
    seq_len = recurrence.input_ids.shape[1]
    if positions is None:
        positions = select_positions(seq_len, max_tokens)
    if initial_state is None:
        initial_state = recurrence.initial_state(seed, init_scale)
    else:
        initial_state = initial_state.to(recurrence.embedded)
        if initial_state.shape != recurrence.embedded.shape:
            raise ValueError(
                f"initial_state has shape {tuple(initial_state.shape)}, expected {tuple(recurrence.embedded.shape)}"
            )
    return record(
        recurrence.step,
        initial_state,
        num_steps,
        positions=positions,
        iteration_stride=iteration_stride,
        limit_steps=limit_steps,
        stream_to=stream_to,
        max_bytes=max_bytes,
        token_ids=recurrence.input_ids[0].tolist(),
    )
