"""The recurrent-depth language model (docs/architecture.md, paper section 3).

    e   = P(x)                       prelude: embed tokens (times sqrt(h)), then l_P layers
    s_0 ~ TruncNormal(0, 2/5)        random latent state, one vector per token
    s_i = R(e, s_{i-1})              core block: adapter(concat[s_{i-1}, e]) -> l_R layers, r times
    p   = C(s_r)                     coda: final norm, l_C layers, final norm, tied un-embedding

`RecurrentDepthLM.forward` is those four lines. The pieces are public methods (`embed`, `init_state`,
`step`, `readout`) so that inference code can drive the recurrence itself (per-token exits, warm starts,
speculative decoding) without reimplementing the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rdlm.model.config import RDLMConfig
from rdlm.model.layers import ATTENTION_IMPLEMENTATIONS, Attention, Block, KVCacheHook, RMSNorm, Rope
from rdlm.model.loss import expected_exit_loss, linear_cross_entropy
from rdlm.model.recurrence import sample_num_steps
from rdlm.model.rope import rope_tables

NumSteps = int | tuple[int, int] | Sequence[int]


@dataclass
class RecurrentOutput:
    logits: Tensor | None  # [batch, seq, vocab], float32 (None: return_logits=False)
    loss: Tensor | None = None  # mean cross-entropy over labels != -100
    state: Tensor | None = None  # final latent state s_r, before the final norm
    trajectory: list[Tensor] | None = None  # [s_0, s_1, ..., s_r] when asked for
    num_steps: tuple[int, int] = (0, 0)  # (iterations without gradient, iterations with gradient)


class RecurrentDepthLM(nn.Module):
    # Set outside __init__ and declared for the type checker: the RoPE tables (register_buffer), the directory a
    # loaded model came from (rdlm.model.huginn), and the quantization (rdlm.model.quantize) of a quantized model,
    # which a model never loaded or quantized lacks.
    rope_cos: Tensor
    rope_sin: Tensor
    source: str
    quantization: Any  # a rdlm.model.quantize.QuantSpec (not imported: that module imports this one)
    quantized_layers: dict[str, str]
    lora_specs: dict[str, Any]  # name -> rdlm.model.lora.LoraSpec of each LoRA adapter added (none: absent)

    def __init__(self, config: RDLMConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        # Built on the meta device to be loaded (rdlm.model.huginn), the model skips what only fills values: the
        # embedding's own random init and the RoPE tables, which the loader puts in. On meta, normal_ and arange
        # import torch._dynamo, seconds of every command's start. Elsewhere the embedding draws as before, so a
        # seeded model keeps its weights.
        on_meta = torch.get_default_device().type == "meta"
        self.embedding = nn.Embedding(
            config.vocab_size, h, _weight=torch.empty(config.vocab_size, h) if on_meta else None
        )
        self.embed_scale = config.embedding_scale
        self.prelude = nn.ModuleList(Block(config) for _ in range(config.prelude_layers))
        # Concatenating injection: adapter R^{2h} -> R^h over [state, embedding]; the others need none.
        self.adapter = nn.Linear(2 * h, h, bias=config.adapter_bias) if config.injection == "concat" else None
        self.core = nn.ModuleList(Block(config) for _ in range(config.core_layers))
        self.coda = nn.ModuleList(Block(config) for _ in range(config.coda_layers))
        self.final_norm = RMSNorm(h, config.norm_eps)  # n_c: placed by config.final_norm
        self.lm_head = None if config.tie_embeddings else nn.Linear(h, config.vocab_size, bias=False)
        # Ouro's learned exit gate: lambda_i = sigmoid(exit_gate(s_i)) after core iteration i.
        self.exit_gate = nn.Linear(h, 1) if config.exit_gate else None
        if on_meta:
            cos = sin = torch.empty(config.context_length, config.head_dim // 2)
        else:
            cos, sin = rope_tables(config.head_dim, config.context_length, config.rope_base, config.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    # ----------------------------------------------------------------------------------------------
    # Initialization (Takase et al.; docs/architecture.md#initialization)

    @property
    def init_std(self) -> float:
        return math.sqrt(2 / (5 * self.config.hidden_size))

    @property
    def out_proj_std(self) -> float:
        return math.sqrt(1 / (5 * self.config.hidden_size * self.config.effective_depth))

    def reset_parameters(self) -> None:
        std, out_std = self.init_std, self.out_proj_std
        for name, param in self.named_parameters():
            if name.endswith(("qk_bias", ".bias")):
                nn.init.zeros_(param)
            elif param.ndim == 1:  # RMSNorm weights
                nn.init.ones_(param)
            else:
                s = out_std if name.endswith(("attn.out.weight", "mlp.out.weight")) else std
                nn.init.trunc_normal_(param, mean=0.0, std=s, a=-3 * s, b=3 * s)

    # ----------------------------------------------------------------------------------------------
    # The four stages

    def check_positions(self, positions: Tensor) -> None:
        """Raise if a position is beyond the context length. Reads the positions on the host (a sync), so
        callers do it once, outside a compiled region or a decode loop."""
        if positions.numel() and int(positions.max()) >= self.config.context_length:
            raise ValueError(
                f"position {int(positions.max())} is beyond the context length "
                f"{self.config.context_length} of this model"
            )

    def rope(self, positions: Tensor, check: bool = True) -> Rope:
        """cos/sin for token positions ([seq] or [batch, seq]), shaped [B|1, seq, 1, head_dim/2].
        `check=False` skips the context-length check (a host sync) for callers that checked already."""
        if check:
            self.check_positions(positions)
        if positions.ndim == 1:
            positions = positions.unsqueeze(0)
        return self.rope_cos[positions].unsqueeze(2), self.rope_sin[positions].unsqueeze(2)

    def embed(
        self, input_ids: Tensor, rope: Rope, mask: Tensor | None = None, cache: KVCacheHook | None = None
    ) -> Tensor:
        """Prelude P: token embedding times the embedding scale (sqrt(h) for Huginn), then the prelude
        layers. Returns e."""
        x = self.embedding(input_ids)
        if self.embed_scale != 1:
            x = x * self.embed_scale
        for i, layer in enumerate(self.prelude):
            x = layer(x, rope, mask, cache, ("prelude", i, -1))
        return x

    def init_state(self, embedded: Tensor, scale: float = 1.0, generator: torch.Generator | None = None) -> Tensor:
        """s_0: truncated normal (3 sigma), std sqrt(2/(5h)) * sqrt(h) * scale; scale 0 gives zeros.
        A checkpoint's `init_values.std` replaces sqrt(2/(5h)) (config.state_init_std), its embedding scale
        sqrt(h). With `state_init="embedding"` (Ouro) s_0 is e itself, whatever the scale."""
        if self.config.state_init == "embedding":
            return embedded
        state = torch.zeros_like(embedded)
        std = self.config.state_std
        if scale == 0 or std == 0 or self.config.state_init == "zero":
            return state
        if torch.compiler.is_compiling():
            # torch's trunc_normal_ rejects and redraws until every value is in range, a loop on the
            # data that a graph cannot hold; the inverse-CDF draw is the same distribution, loop-free.
            bound = math.erf(3 / math.sqrt(2))  # P(|z| < 3)
            state = state.uniform_(-bound, bound, generator=generator).erfinv_() * (std * math.sqrt(2))
            state = state.clamp(-3 * std, 3 * std)
        else:
            nn.init.trunc_normal_(state, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
        return state * (self.embed_scale * scale)

    def start_state(self, embedded: Tensor, noise: Tensor | None) -> Tensor:
        """s_0 from a caller's own draws: e itself for `state_init="embedding"` (Ouro), else `noise`
        (None: zeros)."""
        if self.config.state_init == "embedding":
            return embedded
        return torch.zeros_like(embedded) if noise is None else noise

    def step(
        self,
        state: Tensor,
        embedded: Tensor,
        iteration: int,
        rope: Rope,
        mask: Tensor | None = None,
        cache: KVCacheHook | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """One core iteration R: s_i = core(adapter([s_{i-1}, e])) (Huginn); s_{i-1} + e goes in with
        additive injection, s_{i-1} alone with none; final_norm "loop" normalizes s_i (Ouro)."""
        if self.config.test_time_noise > 0:
            state = self.add_state_noise(state, iteration, generator)
        if self.adapter is not None:
            x = self.adapter(torch.cat((state, embedded), dim=-1))
        elif self.config.injection == "add":
            x = state + embedded
        else:
            x = state
        for i, layer in enumerate(self.core):
            x = layer(x, rope, mask, cache, ("core", i, iteration))
        return self.final_norm(x) if self.config.final_norm == "loop" else x

    def exit_probability(self, state: Tensor) -> Tensor:
        """lambda_i = sigmoid(gate(s_i)) [batch, seq] in float32: the learned gate's probability of exiting
        at the iteration that produced `state`, given it was reached (Ouro; config.exit_gate)."""
        if self.exit_gate is None:
            raise ValueError("this model has no learned exit gate (config.exit_gate is false)")
        return torch.sigmoid(self.exit_gate(state).squeeze(-1).float())

    def compile_step(self, **options) -> RecurrentDepthLM:
        """Compile one core iteration (`step`) with `torch.compile(**options)` and keep the loop over
        iterations in Python, so every r reuses the same compiled step. (`torch.compile(model)` works
        too, `fullgraph=True` included, but it unrolls the loop: one graph per r.) Returns the model."""
        self.step = torch.compile(RecurrentDepthLM.step.__get__(self), **options)  # type: ignore[method-assign]  # the compiled step replaces the method on purpose
        return self

    def add_state_noise(self, state: Tensor, iteration: int, generator: torch.Generator | None = None) -> Tensor:
        """The reference code's test-time noise, before core iteration `iteration` (0-based):
        s <- n4(s * (1 - a) + N(0, 1) * a), a = test_time_noise * state_std * sqrt(h), scheduled by
        test_time_noise_type (fixed: a; geom: a/(i+1); sqrt: a/sqrt(i+1); line: max(a, (r_mean - i)/r_mean);
        chi: 2 * U(0, 1) * a), then the core's last norm n4. Draws from `generator` (default: torch's)."""
        c = self.config
        a = c.test_time_noise * c.state_std * self.embed_scale

        def normal() -> Tensor:
            return torch.randn(state.shape, generator=generator, dtype=state.dtype, device=state.device)

        # The arithmetic follows the reference step by step, so a seeded run gives its very numbers.
        if c.test_time_noise_type == "fixed":
            state = state * (1 - a) + normal() * a
        elif c.test_time_noise_type in ("geom", "sqrt"):
            step1 = torch.as_tensor(iteration + 1, device=state.device)
            step1 = step1.sqrt() if c.test_time_noise_type == "sqrt" else step1
            state = state * (1 - a / step1) + normal() * a / step1
        elif c.test_time_noise_type == "line":
            noise: float | Tensor = max(a, (c.mean_recurrence - iteration) / c.mean_recurrence)
            state = state * (1 - noise) + normal() * noise
        else:  # chi
            noise = 2 * torch.rand(1, generator=generator, device=state.device, dtype=state.dtype) * a
            state = state * (1 - noise) + normal() * noise
        return cast(Block, self.core[-1]).norm_4(state)

    def readout(
        self, state: Tensor, rope: Rope, mask: Tensor | None = None, cache: KVCacheHook | None = None
    ) -> Tensor:
        """Coda C (final norm, coda layers, final norm: see `coda_output`), then the un-embedding.
        Returns float32 logits."""
        return self.head(self.coda_output(state, rope, mask, cache))

    def head(self, x: Tensor) -> Tensor:
        """The un-embedding of coda outputs (`coda_output`): float32 logits."""
        # lm_head is a module when untied, or a quantized copy of a tied head (rdlm.model.quantize)
        return (F.linear(x, self.embedding.weight) if self.lm_head is None else self.lm_head(x)).float()

    def coda_output(
        self, state: Tensor, rope: Rope, mask: Tensor | None = None, cache: KVCacheHook | None = None
    ) -> Tensor:
        """Coda C up to the un-embedding: final norm, coda layers, final norm (Huginn). final_norm "output"
        skips the first norm (the retrofitted models), "loop" both (the state is normalized already)."""
        placement = self.config.final_norm
        x = self.final_norm(state) if placement == "sandwich" else state
        for i, layer in enumerate(self.coda):
            x = layer(x, rope, mask, cache, ("coda", i, -1))
        return x if placement == "loop" else self.final_norm(x)

    @property
    def head_is_a_matrix(self) -> bool:
        """Whether the un-embedding is a plain weight matrix (the tied embedding, or an untied nn.Linear), which
        the chunked loss multiplies by itself. A quantized head (rdlm.model.quantize) or one with a LoRA adapter
        (rdlm.model.lora) reads out through its own module instead: the whole logits, then the loss."""
        return self.lm_head is None or type(self.lm_head) is nn.Linear

    @property
    def unembedding_weight(self) -> Tensor:
        return self.embedding.weight if self.lm_head is None else self.lm_head.weight

    # ----------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: Tensor,
        num_steps: NumSteps | None = None,
        *,
        initial_state: Tensor | None = None,
        init_scale: float = 1.0,
        positions: Tensor | None = None,
        position_offset: int = 0,
        attention_mask: Tensor | None = None,
        cache: KVCacheHook | None = None,
        labels: Tensor | None = None,
        return_state: bool = False,
        return_trajectory: bool = False,
        return_logits: bool = True,
        loss_reduction: str = "mean",
        generator: torch.Generator | None = None,
        exit_loss_beta: float | None = None,
    ) -> RecurrentOutput:
        """Run prelude, `num_steps` core iterations and coda.

        num_steps: r (every iteration in the caller's grad mode), or (n, k): n iterations without
            gradient followed by k with gradient (truncated backprop). None: in training, drawn from
            the recurrence sampler; in eval, the config's mean recurrence.
        initial_state: an explicit s_0 [batch, seq, hidden]; otherwise s_0 is drawn with `init_scale`
            (0 gives the all-zero state) from `generator`.
        positions / position_offset: token positions for RoPE (default offset .. offset + seq).
        attention_mask: boolean or additive mask broadcastable to [batch, heads, seq, keys]; default causal.
        cache: a KV cache (see KVCacheHook) for incremental decoding.
        labels: next-token targets aligned with the logits (-100 is ignored) for `loss`.
        return_logits: False (with labels) computes the loss chunk by chunk without ever holding the
            [batch, seq, vocab] logits (rdlm.model.loss; what training uses); `logits` is then None. (A head
            that is not a plain matrix, quantized or with an adapter, computes the logits whole: see
            `head_is_a_matrix`.)
        loss_reduction: "mean" over the counted targets, or "sum".
        exit_loss_beta: with labels, on a model with a learned exit gate (Ouro): the loss is the expected
            loss over the exit distribution minus beta times its entropy (rdlm.model.loss.expected_exit_loss),
            every iteration read out; needs every iteration with gradient. `logits` are the last iteration's.
        """
        no_grad_steps, grad_steps = self.resolve_num_steps(num_steps, generator)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        # Positions are checked here, on the host, never inside a compiled graph: default positions from
        # their Python ints, given ones by reading them, which `torch.compile` leaves to the caller.
        if positions is None:
            end = position_offset + input_ids.shape[1]
            if end > self.config.context_length:
                raise ValueError(
                    f"position {end - 1} is beyond the context length {self.config.context_length} of this model"
                )
            positions = torch.arange(position_offset, end, device=input_ids.device)
        elif not torch.compiler.is_compiling():
            self.check_positions(positions)
        rope = self.rope(positions, check=False)

        embedded = self.embed(input_ids, rope, attention_mask, cache)
        if initial_state is None:
            state = self.init_state(embedded, init_scale, generator)
        else:
            if initial_state.shape != embedded.shape:
                raise ValueError(
                    f"initial_state has shape {tuple(initial_state.shape)}, expected {tuple(embedded.shape)}"
                )
            state = initial_state.to(embedded.dtype)
        trajectory = [state] if return_trajectory else None

        if exit_loss_beta is not None:
            self._check_exit_loss(labels, no_grad_steps)
            trajectory = [state] if trajectory is None else trajectory
        with torch.no_grad():
            for i in range(no_grad_steps):
                state = self.step(state, embedded, i, rope, attention_mask, cache, generator)
                if trajectory is not None:
                    trajectory.append(state)
        for i in range(no_grad_steps, no_grad_steps + grad_steps):
            if self.config.activation_checkpointing and self.training and torch.is_grad_enabled():
                state = checkpoint(
                    self.step, state, embedded, i, rope, attention_mask, cache, generator, use_reentrant=False
                )
            else:
                state = self.step(state, embedded, i, rope, attention_mask, cache, generator)
            if trajectory is not None:
                trajectory.append(state)

        loss = None
        if exit_loss_beta is not None:
            assert trajectory is not None and labels is not None  # both set or checked above (_check_exit_loss)
            logits, loss = self._expected_exit_loss(
                trajectory[1:], rope, attention_mask, cache, labels, exit_loss_beta, loss_reduction
            )
            trajectory = trajectory if return_trajectory else None
        elif labels is not None and not return_logits and self.head_is_a_matrix:
            logits = None
            loss = linear_cross_entropy(
                self.coda_output(state, rope, attention_mask, cache), self.unembedding_weight, labels, loss_reduction
            )
        else:
            logits = self.readout(state, rope, attention_mask, cache)
            if labels is not None:
                loss = F.cross_entropy(
                    logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction=loss_reduction
                )
        return RecurrentOutput(
            logits=logits,
            loss=loss,
            state=state if return_state else None,
            trajectory=trajectory,
            num_steps=(no_grad_steps, grad_steps),
        )

    def _check_exit_loss(self, labels: Tensor | None, no_grad_steps: int) -> None:
        if self.exit_gate is None:
            raise ValueError("exit_loss_beta needs a model with a learned exit gate (config.exit_gate)")
        if labels is None:
            raise ValueError("exit_loss_beta needs labels")
        if no_grad_steps:
            raise ValueError(
                "the expected exit loss reads every iteration: run them all with gradient "
                f"(got {no_grad_steps} without)"
            )

    def _expected_exit_loss(
        self,
        states: list[Tensor],
        rope: Rope,
        mask: Tensor | None,
        cache: KVCacheHook | None,
        labels: Tensor,
        beta: float,
        reduction: str,
    ) -> tuple[Tensor, Tensor]:
        """(last iteration's logits, the expected loss over the gate's exit distribution)."""
        losses, lambdas = [], []
        for state in states:
            logits = self.readout(state, rope, mask, cache)
            losses.append(
                F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none").view(
                    labels.shape
                )
            )
            lambdas.append(self.exit_probability(state))
        loss = expected_exit_loss(
            torch.stack(losses, dim=-1), torch.stack(lambdas, dim=-1), labels != -100, beta, reduction
        )
        return logits, loss

    def resolve_num_steps(
        self, num_steps: NumSteps | None, generator: torch.Generator | None = None
    ) -> tuple[int, int]:
        if num_steps is None:
            if self.training:
                c = self.config
                return sample_num_steps(
                    c.mean_recurrence, c.backprop_depth, c.recurrence_sampler, c.recurrence_sigma, generator
                )
            return 0, self.config.mean_recurrence
        if isinstance(num_steps, Tensor):
            num_steps = num_steps.tolist()
        if isinstance(num_steps, (int,)) and not isinstance(num_steps, bool):
            split = (0, num_steps)
        elif isinstance(num_steps, Sequence) and len(num_steps) == 2:
            split = (int(num_steps[0]), int(num_steps[1]))
        else:
            raise ValueError(f"num_steps must be an int r or a pair (no_grad, with_grad), got {num_steps!r}")
        if split[0] < 0 or split[1] < 0 or sum(split) < 1:
            raise ValueError(f"num_steps must give at least 1 iteration and no negative counts, got {num_steps!r}")
        return split

    def set_attention(self, implementation: str) -> None:
        """Every attention layer computes with `implementation`, one of ATTENTION_IMPLEMENTATIONS."""
        if implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attention implementation must be one of {ATTENTION_IMPLEMENTATIONS}, got {implementation!r}"
            )
        for module in self.modules():
            if isinstance(module, Attention):
                module.implementation = implementation

    def num_parameters(self, exclude_embedding: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        return total - self.embedding.weight.numel() if exclude_embedding else total

    def parameter_groups(self) -> dict[str, int]:
        """Parameter counts of prelude(+adapter excluded), core(+adapter), coda(+final norm), embedding."""
        count = lambda m: sum(p.numel() for p in m.parameters()) if m is not None else 0  # noqa: E731
        return {
            "embedding": self.embedding.weight.numel() + count(self.lm_head),
            "prelude": count(self.prelude),
            "core": count(self.core) + count(self.adapter),
            "coda": count(self.coda) + self.final_norm.weight.numel(),
        }
