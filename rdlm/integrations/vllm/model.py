"""A recurrent-depth model as a vLLM model, built from vLLM's own layers (parallel linears, its Attention and
KV cache, its rotary embedding, its weight loaders), so tensor parallelism, quantization and the engine's
scheduling are vLLM's (docs/vllm.md).

One class serves every family rdlm reads (Huginn, the retrofitted Llama/OLMo models, Ouro): a family is a
configuration (`RDLMConfig`, read by the family's adapter), as in rdlm's own model. The forward is the
paper's four stages over vLLM's flattened tokens:

    e   = P(x)                   prelude
    s_0 = rdlm's s_0 table at each token's position (zeros for init_scale 0; e itself for Ouro)
    s_i = R(e, s_{i-1})          r core iterations, each core layer's attention with its own KV cache per
                                 iteration ("per-iteration"), or one cache per core layer ("shared")
    p   = C(s_r)                 coda, then vLLM's logits processor

With an exit criterion (rdlm_exit_criterion), a decoded token stops changing once it has converged; its
later iterations' cache entries hold its last computed keys and values (what rdlm's `fill_missing` gives,
so later tokens read its latest entry), and the loop stops once every token of the batch has exited.
Prompt tokens run every iteration, as in `rdlm generate` with such a criterion.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
)
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from rdlm.inference.execution.noise import noise_table
from rdlm.inference.exits.track import ExitTrack
from rdlm.integrations.vllm import options
from rdlm.model.config import RDLMConfig
from rdlm.model.families import CheckpointError, adapter_of
from rdlm.model.lm import RecurrentDepthLM


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
        if self.pre:
            x = self.norm_1(x)
        q, k, v = self.attn.qkv(x)[0].split((self.q_size, self.kv_size, self.kv_size), dim=-1)
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

    def attend(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, cache: Attention) -> Tensor:
        """The rest of the layer after its queries, keys and values: attention with `cache`, the MLP, the
        norms of the config's scheme (rdlm.model.layers.Block)."""
        branch = self.attn.out(cache(q, k, v))[0]
        x = x + (self.norm_2(branch) if self.post else branch)
        if self.sandwich:
            x = self.norm_2(x)
        inner = self.norm_3(x) if self.pre else x
        branch = self.mlp.out(self.act(self.mlp.fc(inner)[0]))[0]
        x = x + (self.norm_4(branch) if self.post else branch)
        return self.norm_4(x) if self.sandwich else x

    def forward(self, positions: Tensor, x: Tensor, cache: Attention) -> Tensor:
        return self.attend(x, *self.qkv(positions, x), cache)


class RecurrentDepthForCausalLM(nn.Module):
    """Any checkpoint rdlm reads, served by vLLM (registered as RavenForCausalLM and OuroForCausalLM)."""

    s0_table: Tensor | None  # a buffer (register_buffer): s_0's rows by position, None where s_0 is zero

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        if get_pp_group().world_size > 1:
            raise ValueError("rdlm's vLLM model does not support pipeline parallelism; use tensor parallelism")
        if getattr(vllm_config, "lora_config", None) is not None:  # vLLM's --enable-lora (docs/vllm.md, "LoRA")
            raise ValueError(
                "rdlm's vLLM model does not take vLLM's LoRA adapters (--enable-lora): rdlm's adapters sit in "
                "rdlm's layers, not vLLM's LoRA-aware ones; merge the adapter into the model (rdlm lora merge) or "
                "serve it with rdlm serve --lora NAME=DIR"
            )
        hf_config = vllm_config.model_config.hf_config
        config, self.recurrence = options.read(hf_config.to_dict(), f"{type(hf_config).__name__}")
        model_config = vllm_config.model_config
        if (
            self.recurrence.criterion is not None
            and not model_config.enforce_eager
            and vllm_config.device_config.device.type == "cuda"
        ):
            raise options.RecurrenceOptionError(
                "rdlm_exit_criterion stops the loop when every token has exited, which a CUDA graph cannot "
                "hold: serve with enforce_eager=True (--enforce-eager)"
            )
        if self.recurrence.criterion is not None and vllm_config.cache_config.enable_prefix_caching:
            logging.getLogger(__name__).warning(
                "rdlm: with rdlm_exit_criterion and prefix caching, a prompt whose every token is cached has its "
                "last token recomputed alone, which then reads as decoded and may exit early (rdlm generate runs "
                "every prompt token to r): for rdlm's tokens, turn prefix caching off (--no-enable-prefix-caching)"
            )
        self.config = config
        quant, cache_config = vllm_config.quant_config, vllm_config.cache_config
        h, d = config.hidden_size, config.head_dim
        self.embedding = VocabParallelEmbedding(
            config.vocab_size, h, quant_config=quant, prefix=_name(prefix, "embedding")
        )
        rope_parameters = {**(config.rope_scaling or {}), "rope_theta": config.rope_base}
        rope = get_rope(
            d, config.context_length, is_neox_style=config.rope_pairs == "halves", rope_parameters=rope_parameters
        )

        def layers(part: str, n: int) -> nn.ModuleList:
            return nn.ModuleList(LayerWeights(config, rope, quant, _name(prefix, f"{part}.{i}")) for i in range(n))

        self.prelude, self.core, self.coda = (
            layers("prelude", config.prelude_layers),
            layers("core", config.core_layers),
            layers("coda", config.coda_layers),
        )
        self.adapter = (
            ReplicatedLinear(2 * h, h, bias=config.adapter_bias, quant_config=quant, prefix=_name(prefix, "adapter"))
            if config.injection == "concat"
            else None
        )
        self.final_norm = RMSNorm(h, config.norm_eps)
        self.exit_gate = (
            ReplicatedLinear(h, 1, bias=True, prefix=_name(prefix, "exit_gate")) if config.exit_gate else None
        )
        self.lm_head = ParallelLMHead(config.vocab_size, h, quant_config=quant, prefix=_name(prefix, "lm_head"))
        if config.tie_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.embedding)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        # The KV caches: one Attention each (vLLM allocates a cache per Attention), named with one layer index
        # (vLLM reads one integer from a cache's name): prelude layers, then the core's (one per core layer and
        # iteration, or one per core layer when shared), then the coda's.
        tp = get_tensor_model_parallel_world_size()
        heads, kv_heads = config.num_heads // tp, max(1, config.kv_heads // tp)
        core_caches = config.core_layers * self.recurrence.core_caches
        total = config.prelude_layers + core_caches + config.coda_layers
        self.kv = nn.ModuleList(
            Attention(
                heads,
                d,
                d**-0.5,
                num_kv_heads=kv_heads,
                cache_config=cache_config,
                quant_config=quant,
                prefix=_name(prefix, f"kv.{i}"),
            )
            for i in range(total)
        )
        self._core_start, self._coda_start = config.prelude_layers, config.prelude_layers + core_caches
        # s_0 of each position: rdlm's table (rdlm.inference.execution.noise), so a token's s_0 does not depend on the
        # batch; drawn once on the CPU (the same numbers on every device), then kept on the model's device.
        table = None
        if config.takes_initial_state:
            table = noise_table(
                _shape_only(config),
                self.recurrence.seed,
                self.recurrence.init_scale,
                config.context_length,
                model_config.dtype,
                vllm_config.device_config.device,
            )
        self.register_buffer("s0_table", table, persistent=False)
        self.embed_scale = config.embedding_scale
        self.stats = ExitStats()

    # ---------------------------------------------------------------------------------------------
    # vLLM's model interface

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.embedding(input_ids)

    def forward(
        self,
        input_ids: Tensor | None,
        positions: Tensor,
        intermediate_tensors=None,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        if inputs_embeds is None:
            assert input_ids is not None  # vLLM gives one of the two
            x = self.embed_input_ids(input_ids)
        else:
            x = inputs_embeds
        if self.embed_scale != 1:
            x = x * self.embed_scale
        for i, layer in enumerate(self.prelude):
            x = layer(positions, x, self.kv[i])
        embedded = x
        state = self.initial_state(embedded, positions)
        state = self.iterate(state, embedded, positions)
        return self.coda_output(state, positions)

    def compute_logits(self, hidden_states: Tensor) -> Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    # ---------------------------------------------------------------------------------------------
    # The recurrence

    def initial_state(self, embedded: Tensor, positions: Tensor) -> Tensor:
        if not self.config.takes_initial_state:
            return embedded
        if self.s0_table is None:
            return torch.zeros_like(embedded)
        return self.s0_table.index_select(0, positions)

    def core_cache(self, layer: int, iteration: int) -> Attention:
        slot = iteration if self.recurrence.cache == "per-iteration" else 0
        return self.kv[self._core_start + slot * self.config.core_layers + layer]

    def core_input(self, state: Tensor, embedded: Tensor) -> Tensor:
        if self.adapter is not None:
            return self.adapter(torch.cat((state, embedded), dim=-1))[0]
        return state + embedded if self.config.injection == "add" else state

    def core_iteration(self, state: Tensor, embedded: Tensor, positions: Tensor, iteration: int) -> Tensor:
        """s_i = R(e, s_{i-1}) for every token."""
        x = self.core_input(state, embedded)
        for layer, weights in enumerate(self.core):
            x = weights(positions, x, self.core_cache(layer, iteration))
        return self.final_norm(x) if self.config.final_norm == "loop" else x

    def iterate(self, state: Tensor, embedded: Tensor, positions: Tensor) -> Tensor:
        """The r core iterations; with an exit criterion, per token (`_iterate_with_exits`). Returns the state
        the coda reads."""
        criterion = self.recurrence.criterion
        decoding = self._decoding_tokens(positions) if criterion is not None else None
        if criterion is None or decoding is None or not (criterion.uses_gate or bool(decoding.any())):
            for i in range(self.recurrence.num_steps):
                state = self.core_iteration(state, embedded, positions, i)
            self.stats.steps += 1
            self.stats.step_iterations += self.recurrence.num_steps
            return state
        return self._iterate_with_exits(state, embedded, positions, decoding)

    def _iterate_with_exits(self, state: Tensor, embedded: Tensor, positions: Tensor, decoding: Tensor) -> Tensor:
        """The r iterations with the exit criterion read after each (rdlm's one exit update,
        ExitTrack.after_iteration), as `rdlm generate` reads it:
        - a decoded token that exits keeps its state and, at later iterations, writes the keys and values of
          its last computed iteration into each core cache (rdlm's fill_missing); once every token of the
          step has exited, the rest of the caches are filled that way and nothing else is computed;
        - prompt tokens run every iteration; with a learned gate the coda reads each one's state at the
          iteration where its gate fired (rdlm's gated prefill), otherwise its last."""
        r, criterion, min_steps = self.recurrence.num_steps, self.recurrence.criterion, self.recurrence.min_steps
        assert criterion is not None  # (iterate comes here only with one)
        gate: Callable[[Tensor], Tensor] | None
        track = ExitTrack.start(state.shape[0], state.device, gate=criterion.uses_gate)
        if criterion.uses_gate:
            track = dataclasses.replace(track, exit_state=state)
            exit_gate = self.exit_gate
            assert exit_gate is not None  # a criterion that reads a gate needs the model's (options.read)
            gate = lambda s: torch.sigmoid(exit_gate(s)[0].squeeze(-1).float())  # noqa: E731
        else:
            gate = None
        last_kv: list[tuple[Tensor, Tensor]] = []
        run = r
        for i in range(r):
            frozen = track.exited & decoding
            if i > 0 and bool(frozen.all()):
                self._fill_caches(last_kv, i)
                run = i
                break
            held = frozen.unsqueeze(-1)
            x = self.core_input(state, embedded)
            for layer, weights in enumerate(cast("Iterable[LayerWeights]", self.core)):
                q, k, v = weights.qkv(positions, x)
                if i > 0:
                    k, v = torch.where(held, last_kv[layer][0], k), torch.where(held, last_kv[layer][1], v)
                    last_kv[layer] = (k, v)
                else:
                    last_kv.append((k, v))
                x = weights.attend(x, q, k, v, self.core_cache(layer, i))
            new = self.final_norm(x) if self.config.final_norm == "loop" else x
            prev, state = state, torch.where(held, state, new)
            track = track.after_iteration(criterion, i, r, prev, state, min_steps=min_steps, gate=gate)
        assert track.iterations is not None  # ExitTrack.start counts the iterations
        self.stats.count(run, track.iterations[decoding])
        if criterion.uses_gate:
            assert track.exit_state is not None  # set above, kept by every update
            return track.exit_state
        return state

    def _fill_caches(self, last_kv: list[tuple[Tensor, Tensor]], first: int) -> None:
        """Every token exited before iteration `first`: the caches of iterations first .. r-1 get each token's
        last keys and values (rdlm's fill_missing). A shared cache holds them already."""
        if self.recurrence.cache != "per-iteration":
            return
        for i in range(first, self.recurrence.num_steps):
            for layer, (k, v) in enumerate(last_kv):
                write_cache(self.core_cache(layer, i), k, v)

    def coda_output(self, state: Tensor, positions: Tensor) -> Tensor:
        placement = self.config.final_norm
        x = self.final_norm(state) if placement == "sandwich" else state
        for i, layer in enumerate(self.coda):
            x = layer(positions, x, self.kv[self._coda_start + i])
        return x if placement == "loop" else self.final_norm(x)

    def _decoding_tokens(self, positions: Tensor) -> Tensor | None:
        """[T] bool: the tokens vLLM decodes (a request's only new token after its prompt), which an exit
        criterion reads; prompt tokens run every iteration. None where the step has no attention metadata
        (vLLM's warm-up runs)."""
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):
            metadata = metadata[0]
        if isinstance(metadata, dict):
            metadata = metadata.get(self.core_cache(0, 0).layer_name)
        starts = getattr(metadata, "query_start_loc", None)
        lengths = getattr(metadata, "seq_lens", None)
        if starts is None or lengths is None:
            return None
        starts = starts.to(positions.device)
        queries = starts[1:] - starts[:-1]
        one = (queries == 1) & (lengths.to(positions.device)[: queries.shape[0]] > 1)
        decoding = torch.zeros(positions.shape[0], dtype=torch.bool, device=positions.device)
        decoding[starts[:-1][one]] = True
        return decoding

    # ---------------------------------------------------------------------------------------------
    # Weights

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """The checkpoint's tensors, renamed to rdlm's parameters by the family's adapter (as rdlm's own loader
        reads them), into vLLM's layers through their weight loaders (fused q/k/v and gate/up shards)."""
        adapter = adapter_of(self.config)
        tensors = dict(weights)
        if any(name.endswith((".qweight", ".scales")) for name in tensors):
            raise CheckpointError(
                "an rdlm-quantized checkpoint cannot be served by vLLM; serve the unquantized "
                "model with vLLM's own quantization (e.g. quantization='fp8')"
            )
        adapter.rope_from_file(tensors)  # a stored RoPE table is never used: vLLM's rotary embedding computes it
        state, unexpected = adapter.from_file(tensors)
        if unexpected:
            raise CheckpointError(f"unexpected tensor(s) {', '.join(sorted(unexpected)[:8])}")
        if self.config.tie_embeddings:
            state.pop("lm_head.weight", None)
        params = dict(self.named_parameters())
        # rdlm's parameters, not this module's: a vLLM quantization method may add parameters of its own
        expected = {name for name, _ in _shape_only(self.config).named_parameters()}
        missing = sorted(expected - set(state))
        if missing:
            raise CheckpointError(f"missing tensor(s) {', '.join(adapter.file_name(n) for n in missing[:8])}")
        loaded = set()
        for name, tensor in state.items():
            if name not in params:
                raise CheckpointError(f"unexpected tensor {adapter.file_name(name)}")
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if name.endswith("attn.qkv.weight"):
                q_rows = self.config.num_heads * self.config.head_dim
                kv_rows = self.config.kv_heads * self.config.head_dim
                for shard, part in zip(("q", "k", "v"), tensor.split((q_rows, kv_rows, kv_rows)), strict=True):
                    loader(param, part, shard)
            elif name.endswith("mlp.fc.weight"):
                for half, part in enumerate(tensor.chunk(2)):
                    loader(param, part, half)
            else:
                loader(param, tensor)
            loaded.add(name)
        return loaded


@dataclasses.dataclass
class ExitStats:
    """What the forward ran since the model was loaded (read with `vllm.LLM.apply_model`): `steps` forwards
    and the core iterations they ran (`step_iterations`, each over all of the step's tokens); with an exit
    criterion, the decoded tokens and the iterations each ran before it exited (`token_iterations`)."""

    steps: int = 0
    step_iterations: int = 0
    decoded_tokens: int = 0
    token_iterations: int = 0

    def count(self, iterations: int, token_steps: Tensor) -> None:
        self.steps += 1
        self.step_iterations += iterations
        self.decoded_tokens += token_steps.numel()
        self.token_iterations += int(token_steps.sum())


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


def _shape_only(config: RDLMConfig) -> RecurrentDepthLM:
    """rdlm's model of `config` on the meta device: its parameter names and its s_0 draw, no memory."""
    with torch.device("meta"):
        return RecurrentDepthLM(config)


def _name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
