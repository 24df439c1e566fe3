"""The parallel (diffusion-style) sampler for recurrent depth.

Sequential decoding finishes a token's r core iterations before it starts the next token. The sampler
of Geiping et al. 2025, "Efficient Parallel Samplers for Recurrent-Depth Models and Their Connection to
Diffusion Language Models" (arXiv 2510.14961; `generate_diffusion_style` in the authors' repository
seal-rg/recurrent-pretraining, recpre/raven_modeling_minimal.py) instead advances a *wavefront* of
positions whose states are still being refined, like a diffusion model denoising along the sequence:

    wave = positions start .. start + W - 1; the tokens of the first are final, the others are drafts
    every step:
        prelude over the wave's tokens; e = EMA of each position's embeddings over its steps
        s <- (1 - m_p) s + m_p * noise,  m_p = state_noise_mixing / (1 + iterations run at p)
        `inner_recurrence` core iterations on every position of the wave (one batched call each)
        coda over the wave: the logits at p draft the token at p + 1 (the newest position drafts a new one)
        freeze: a position whose state stopped moving (the freeze criterion between this step and the
            previous one, latent-diff < 0.03 by default) makes the tokens up to it final and the wave
            restart there (as in the reference); a position that has had its full r = num_steps
            iterations makes its own draft final and leaves the wave. Everything before the latest
            such position leaves the wave with it (its cache entries stay).
        append `headway` new positions (the newest draft, then copies of it as placeholders) starting
            from s_0 (or, with continuous_cot, from the newest states), at most `max_wavefront` in all

Each step costs `inner_recurrence` core calls over W positions instead of one position's, so when a
position needs about r / inner_recurrence steps to settle, one token is final per step for
inner_recurrence core calls rather than r. With `max_wavefront=1` and `inner_recurrence = r` the wave
is one position that runs its r iterations and is done: plain sequential decoding, token for token.

Cache: the wave runs over the session's cache like a prompt block: at step t the wave's entries are
(re)written at its buffer indices, and entries before the wave start are final. Iteration i of a step
uses cache slot i (full) or i mod k (shared), so later positions read the entries of the same inner
iteration of earlier ones. The reference's Huginn default, `latest-m4-compress-s4`, keeps one entry
per core layer (the latest iteration's): `cache_strategy="shared", cache_slots=1` here.

Where this differs from the reference (each checked against it on the huginn-tiny fixture,
tests/fixtures/parallel_reference.json):
- The freeze criterion compares a position with its own state of the previous step. The reference,
  after a step that froze c positions, compares position q with the previous state of position q + c
  (it keeps the previous states from the new wave start, then slices them by the start's move again).
  With that bookkeeping reproduced, this sampler gives the reference's tokens, per-position iteration
  counts and step counts exactly (tests/test_parallel.py).
- A position that has had r = num_steps iterations is final (the reference iterates a position until
  it settles, however long); this bounds the work per token and makes the degenerate case sequential.
- With headway > 1, the placeholder tokens are copies of the newest draft (the reference draws
  random ids); state-mixing noise comes from a generator seeded with `seed`; its damping counts the
  iterations run at the position (the reference also counts the prefill's r at the first new one).
- Without a full prefill, prompt tokens are never redrafted (the reference rewrites the prompt after a
  step in which an early prompt position is the last to settle).

Batches: one prompt at a time. A batch would need a wavefront per row (rows commit different numbers of
positions per step, so their starts and widths diverge): the wave as a [B, W_max] block with a
per-row start index for the cache writes, a per-row validity mask over the block (the attention mask
then hides both padding and each row's positions beyond its wave), and per-row commit bookkeeping;
the core calls themselves batch unchanged.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

from rdlm.inference.engine import Session
from rdlm.inference.params import GenerationConfig
from rdlm.inference.sampling import NonFiniteLogitsError, choose, sample
from rdlm.model.lm import RecurrentDepthLM


class ParallelSampler:
    """Decode one prompt with a wavefront of partly converged positions (see the module doc).

    Positions are indices of the session's buffer (batch 1: buffer index == position). Per-position
    bookkeeping (tokens, iterations run) lives in tensors over the whole buffer; the wave's own
    tensors (states, smoothed embeddings, criterion streaks, previous logits) are [1, W, ...] and
    shift when the wave start moves."""

    def __init__(self, model: RecurrentDepthLM, prompts: list[list[int]], config: GenerationConfig) -> None:
        if len(prompts) != 1:
            raise ValueError(
                f"the parallel sampler takes one prompt at a time, got {len(prompts)}; a batch would need "
                "one wavefront per row (per-row start, width and commit bookkeeping; see rdlm.inference.parallel)")
        if not model.config.takes_initial_state:
            raise ValueError("the parallel sampler refines drafts from a noise state; a model whose s_0 is its "
                             "embedding (Ouro) has none: use the sequential sampler")
        self.config = c = config
        prompt_length = len(prompts[0])
        room = model.config.context_length - prompt_length - c.max_new_tokens
        # The wave may run ahead of the last token asked for (positions beyond it still decide freezes).
        ahead = (c.max_wavefront or model.config.context_length) + c.headway
        self.session = Session(model, prompts, config, extra_tokens=max(0, min(ahead, room)))
        self.model, s = model, self.session
        self.criterion = c.freezer()
        length = s.cache.max_length
        self.tokens = torch.zeros(length + 1, dtype=torch.long, device=s.device)  # final, then drafts
        self.tokens[:prompt_length] = s.ids[0]
        self.iterations = torch.zeros(length + 1, dtype=torch.long, device=s.device)  # run at each position
        self.noise = torch.Generator(device=s.device).manual_seed(c.seed)
        self.core_passes = 0     # core block calls, each over the whole wave
        self.wave_steps = 0
        self.start = 0           # first position of the wave; positions before it are final in the cache
        self.final = prompt_length  # positions before this hold final tokens

    # ---- the wave's tensors

    def _open(self, start: int, n: int, exact: bool) -> None:
        """The first wave: positions start .. start + n - 1, all with final tokens."""
        s = self.session
        self.start = start
        self.state = self.previous = self._initial_state(start, n)
        self.exact = torch.full((n,), exact, dtype=torch.bool, device=s.device)
        self.smoothed = torch.zeros_like(self.state) if self.config.embedding_ema > 0 else None
        self.streak = torch.zeros(n, dtype=torch.long, device=s.device)
        self.prev_logits: Tensor | None = None
        self.has_logits = torch.zeros(n, dtype=torch.bool, device=s.device)

    def _initial_state(self, start: int, n: int) -> Tensor:
        """s_0 of new positions: the session's (seed, position) noise, the same as sequential decoding."""
        s = self.session
        shape = (1, n, self.model.config.hidden_size)
        return s.runner.initial_state(torch.zeros(shape, dtype=s.dtype, device=s.device), s.runner.positions(start, n))

    # ---- decoding

    def run(self, prefill_logits: Tensor | None) -> Iterator[tuple[int, int]]:
        """Yield (token, iterations at the position that chose it) as tokens become final.
        `prefill_logits`: the prompt's last logits after a full prefill (`Session.prefill`), or None
        to start the wave over the whole prompt."""
        c, s = self.config, self.session
        prompt_length = s.prompt_length
        if prefill_logits is not None:
            (first,), _ = choose(self.model, prefill_logits, c, s.samplers, s.seen, 0)
            self.tokens[prompt_length] = first
            self.final = prompt_length + 1
            self._open(prompt_length, 1, exact=True)
            yield int(first), c.prefill_steps or c.num_steps
        else:
            if c.max_wavefront is not None and prompt_length > c.max_wavefront:
                raise ValueError(f"without a full prefill the prompt ({prompt_length} tokens) is the first "
                                 f"wave and must fit in max_wavefront ({c.max_wavefront}); prefill it or "
                                 "raise max_wavefront")
            self._open(0, prompt_length, exact=True)
        while self.state.shape[1] > 0:
            yield from self.step()

    def step(self) -> list[tuple[int, int]]:
        """One wavefront step; returns the tokens that became final."""
        c, s, runner = self.config, self.session, self.session.runner
        a, width = self.start, self.state.shape[1]
        s.rewind(a)  # the wave's entries are (re)written from its start
        e, call = s.begin(self.tokens[a:a + width].view(1, width))
        if self.smoothed is not None:  # EMA of the input embeddings as drafts change
            old = torch.where(self.exact.view(1, -1, 1), e, self.smoothed)
            e = self.smoothed = (1 - c.embedding_ema) * e + c.embedding_ema * old
        prev, state = self.previous, self.state
        if c.state_noise_mixing > 0:  # dampened: positions that iterated more get less noise
            mix = c.state_noise_mixing / (1 + self.iterations[a:a + width].to(state.dtype))
            noise = runner.state_noise(state, c.init_scale, self.noise)
            state = state * (1 - mix.view(1, -1, 1)) + mix.view(1, -1, 1) * noise
        state = runner.iterate(state, e, call, range(c.inner_recurrence))
        self.core_passes += c.inner_recurrence
        self.wave_steps += 1
        self.iterations[a:a + width] += c.inner_recurrence
        logits = runner.readout(state, call)[0]  # [W, V]: logits at p draft p + 1
        first_draft = max(self.final, a + 1)  # final tokens are never redrafted
        self.tokens[first_draft:a + width + 1] = self._draft(logits)[first_draft - a - 1:]

        # Freeze. Criterion between this step's and the previous step's state (or logits) per position.
        crit = self.criterion
        prev_logits = logits if self.prev_logits is None else self.prev_logits
        passed = crit(prev_logits, logits, prev[0], state[0])
        if crit.uses_logits:  # a position's first step has nothing to compare its logits with
            passed = passed & self.has_logits
        self.streak = torch.where(passed, self.streak + 1, 0)
        index = torch.arange(width, device=s.device)
        settled = torch.where(self.streak >= crit.patience, index, -1).max()
        done = torch.where(self.iterations[a:a + width] >= c.num_steps, index + 1, -1).max()
        finite = torch.isfinite(logits).all().long()
        settled, done, finite = torch.stack((settled, done, finite)).tolist()  # the one host sync of a step
        if not finite:
            raise NonFiniteLogitsError(self.model, a + 1 - self.session.prompt_length)
        new_start = a + max(settled, done, 0)
        new_final = max(self.final, new_start + 1)
        out = [(int(t), int(n)) for t, n in zip(self.tokens[self.final:new_final].tolist(),
                                                self.iterations[self.final - 1:new_final - 1].tolist())]
        self.final = new_final

        # The next wave: drop what froze, append `headway` new positions. Like the reference, the
        # width limit counts from this step's start; the wave keeps at least one position.
        end = a + width + c.headway
        if c.max_wavefront is not None:
            end = min(end, a + c.max_wavefront)
        end = min(max(end, new_start + 1), s.cache.max_length)
        keep, new = new_start - a, max(0, end - (a + width))
        fresh = (torch.arange(a + width, a + width + new, device=s.device) < new_final)
        self.tokens[a + width + 1:a + width + new] = self.tokens[a + width]  # placeholders: newest draft
        if c.continuous_cot and width >= c.headway:
            init = state[:, width - c.headway:][:, :new]
        else:
            init = self._initial_state(a + width, new)
        self._next_wave(state, keep, init)
        self.exact = torch.cat((self.exact[keep:], fresh))
        if self.smoothed is not None:
            self.smoothed = torch.cat((self.smoothed[:, keep:], torch.zeros_like(init)), dim=1)
        self.streak = torch.cat((self.streak[keep:], self.streak.new_zeros(new)))
        if crit.uses_logits:
            self.prev_logits = torch.cat((logits[keep:], logits.new_zeros(new, logits.shape[-1])))
            self.has_logits = torch.cat((torch.ones_like(self.has_logits[keep:width]),
                                         self.has_logits.new_zeros(new)))
        self.start = new_start
        s.rewind(new_start)
        return out

    def _next_wave(self, state: Tensor, keep: int, init: Tensor) -> None:
        """The next wave's states: this step's from `keep` on, then the new positions' s_0. The freeze
        criterion compares each position with its own state here (`previous`)."""
        self.state = self.previous = torch.cat((state[:, keep:], init), dim=1)

    def _draft(self, logits: Tensor) -> Tensor:
        """Tokens [n] from logits [n, V] (greedy at temperature 0), all drawn from the row's generator."""
        return sample(logits, self.config, [self.session.samplers[0]] * logits.shape[0])
