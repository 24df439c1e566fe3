"""A recurrent-depth model as a vLLM model, built from vLLM's own layers (parallel linears, its Attention and
KV cache, its rotary embedding, its weight loaders), so tensor parallelism, quantization and the engine's
scheduling are vLLM's (docs/vllm.md).

One class serves every family rdlm reads (Huginn, the retrofitted Llama/OLMo models, Ouro): a family is a
configuration (`RDLMConfig`, read by the family's adapter), as in rdlm's own model. The forward is the
paper's four stages over vLLM's flattened tokens:

    e   = P(x)                   prelude
    s_0 = rdlm's s_0 table at each token's position (zeros for init_scale 0; e itself for Ouro)
    s_i = R(e, s_{i-1})          r core iterations, each core layer's attention with its own KV cache per
                                 iteration ("per-iteration"), or k per core layer, iteration i using
                                 slot i mod k ("shared")
    p   = C(s_r)                 coda, then vLLM's logits processor

With an exit criterion (rdlm_exit_criterion), a decoded token stops changing once it has converged, and the
loop stops once every token of the step has exited (rdlm.integrations.vllm.adaptive). The layers are
rdlm.integrations.vllm.layers; the engine settings the recurrence needs are set by
rdlm.integrations.vllm.engine_config.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.forward_context import is_forward_context_available
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.platforms import current_platform

from rdlm.inference.execution.noise import noise_table
from rdlm.integrations.vllm import options
from rdlm.integrations.vllm.adaptive import ExitLoop, ExitStats, decoding_tokens
from rdlm.integrations.vllm.engine_config import refuse_speculation
from rdlm.integrations.vllm.layers import LayerWeights
from rdlm.model.config import RDLMConfig
from rdlm.model.families import CheckpointError, adapter_of
from rdlm.model.lm import RecurrentDepthLM


# The forward's token-count dimension varies per step (annotations are strings here: vLLM cannot infer it).
# vLLM compiles the forward unless enforce_eager: at fixed r, and with an exit criterion (every iteration run,
# exited tokens held: the adaptive loop's stops are the host's, which a graph cannot hold).
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0})
class CompiledRecurrentDepth(nn.Module):
    """The served model's layers and forward, which vLLM compiles (RecurrentDepthForCausalLM chooses per step
    between this compiled forward and the eager one)."""

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
        if self.recurrence.criterion is not None:
            check_exit_settings(vllm_config)
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
        for attention in self.kv:  # what rdlm::vllm_write_cache counts in (rdlm.integrations.vllm.adaptive)
            vars(attention)["rdlm_stats"] = self.stats  # a plain attribute, not a submodule

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
        return self.kv[self._core_start + self.recurrence.slot(iteration) * self.config.core_layers + layer]

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
        """The r core iterations; with an exit criterion, per token (rdlm.integrations.vllm.adaptive): eagerly
        with the host's looks, which stop the loop once every token has exited, or, in a forward vLLM
        compiles, in stretches between looks that are skipped (their cache slots filled) once every token has
        exited, and else run with exited tokens held. Returns the state the coda reads."""
        criterion, layer_name = self.recurrence.criterion, self.core_cache(0, 0).layer_name
        if criterion is not None and torch.compiler.is_compiling():
            decoding = torch.ops.rdlm.vllm_decoding_tokens(positions, layer_name)
            return ExitLoop(self, positions, decoding, looks=False).run(state, embedded)
        decoding = None if criterion is None else decoding_tokens(positions, layer_name)
        if decoding is None or not (criterion is not None and criterion.uses_gate or bool(decoding.any())):
            for i in range(self.recurrence.num_steps):
                state = self.core_iteration(state, embedded, positions, i)
            if not torch.compiler.is_compiling():  # a compiled forward runs no Python: nothing counts
                self.stats.count(self.recurrence.num_steps)
            return state
        return ExitLoop(self, positions, decoding, looks=True).run(state, embedded)

    def coda_output(self, state: Tensor, positions: Tensor) -> Tensor:
        placement = self.config.final_norm
        x = self.final_norm(state) if placement == "sandwich" else state
        for i, layer in enumerate(self.coda):
            x = layer(positions, x, self.kv[self._coda_start + i])
        return x if placement == "loop" else self.final_norm(x)

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


class RecurrentDepthForCausalLM(CompiledRecurrentDepth):
    """Any checkpoint rdlm reads, served by vLLM (registered as RdlmForCausalLM, and as RavenForCausalLM and
    OuroForCausalLM where vLLM has no model of that name: rdlm.integrations.vllm.register).

    With an exit criterion in a compiled engine, a decode step of at most `rdlm_exit_eager_tokens` tokens runs
    the eager loop (host looks) instead of the compiled forward (a torch.cond per look); both stop once every
    token of the step has exited, with the same tokens (docs/vllm.md, "Compiled")."""

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        positions = kwargs["positions"] if "positions" in kwargs else args[1]  # vLLM's forward arguments
        if positions.shape[0] <= self.recurrence.eager_tokens and self.decode_step(positions):
            return self.forward(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def decode_step(self, positions: Tensor) -> bool:
        """Whether every token of the step is decoded (a step with a prompt token runs every iteration for it
        either way); False for vLLM's warm-up and profiling runs, which have no attention metadata."""
        if not is_forward_context_available():
            return False
        decoding = decoding_tokens(positions, self.core_cache(0, 0).layer_name)
        return decoding is not None and bool(decoding.all())


def check_exit_settings(vllm_config: VllmConfig) -> None:
    """With an exit criterion, the engine settings rdlm's config hook sets (rdlm.integrations.vllm.engine_config)
    must hold, or the model is refused by name: a model served under a name without the hook cannot change
    vLLM's answers silently."""
    refuse_speculation(vllm_config)
    wrong = [
        name
        for name, on in (
            ("prefix caching (--no-enable-prefix-caching)", vllm_config.cache_config.enable_prefix_caching),
            ("chunked prefill (--no-enable-chunked-prefill)", vllm_config.scheduler_config.enable_chunked_prefill),
            (
                "CUDA graphs (--enforce-eager)",
                not vllm_config.model_config.enforce_eager and not current_platform.is_cpu(),
            ),
        )
        if on
    ]
    if wrong:
        raise options.RecurrenceOptionError(
            f"rdlm_exit_criterion needs {', '.join(wrong)} off (rdlm's config hook turns them off for the "
            "architectures rdlm registers; this model was served under another name): turn them off"
        )


def _shape_only(config: RDLMConfig) -> RecurrentDepthLM:
    """rdlm's model of `config` on the meta device: its parameter names and its s_0 draw, no memory."""
    with torch.device("meta"):
        return RecurrentDepthLM(config)


def _name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
