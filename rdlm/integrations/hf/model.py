"""`RavenForCausalLM`: a `RecurrentDepthLM` behind transformers' causal-LM interface (files through
`rdlm.model.huginn`, forward with a `RecurrentCache`, generate on rdlm's decode engine)."""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils.hub import convert_file_size_to_int

from rdlm.inference.execution.noise import noise_table
from rdlm.integrations.hf.cache import RecurrentCache, padding_attention_mask
from rdlm.integrations.hf.config import (
    GENERATION_CONFIG_NAME,
    OuroConfig,
    RavenConfig,
    config_class_of,
    quiet_rope_notes,
)
from rdlm.integrations.hf.generation import generate_with_engine, with_rdlm_generation_defaults
from rdlm.integrations.hf.loading import HUB_KEYWORDS, INERT_LOAD_KEYWORDS, download_model, resolve_device
from rdlm.model import huginn
from rdlm.model.dtypes import resolve_dtype
from rdlm.model.layers import ATTENTION_IMPLEMENTATIONS
from rdlm.model.lm import RecurrentDepthLM

# forward() keywords transformers' machinery may pass that change nothing at these values.
# (PEFT's PeftModelForCausalLM passes inputs_embeds=None with every call.)
_INERT_FORWARD_KWARGS = {
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "inputs_embeds": (None,),
}


class RavenForCausalLM(PreTrainedModel, GenerationMixin):
    """`RecurrentDepthLM` behind the transformers causal-LM interface.

    Extra forward/generate arguments: `num_steps` (core iterations r, default the config's mean
    recurrence), `init_scale` (scale of the random initial state s_0; 0 gives the deterministic
    all-zero state) and `seed` (s_0 from the engine's (seed, position) noise table). forward also takes
    a given s_0 as `input_states` (the reference's name) or `initial_state` (rdlm's), [batch, seq, hidden],
    and a `RecurrentCache` as `past_key_values`.

    `generate` (and so `pipeline("text-generation")`) runs rdlm's decode engine (rdlm.inference.generate) over
    its recurrent KV cache, with transformers' generation config, sampling options and streamer.
    """

    config_class: type[RavenConfig | OuroConfig] = RavenConfig  # a family's own (OuroForCausalLM: OuroConfig)
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]  # noqa: RUF012 (an instance attribute in transformers, set from this default)
    _supports_sdpa = True
    supports_gradient_checkpointing = True

    def __init__(self, config: RavenConfig | OuroConfig, model: RecurrentDepthLM | None = None) -> None:
        super().__init__(config)
        self.model = model if model is not None else RecurrentDepthLM(config.to_rdlm())
        self.post_init()
        self.generation_config = with_rdlm_generation_defaults(self.generation_config, self.model.config)

    def _init_weights(self, module: torch.nn.Module) -> None:
        # RecurrentDepthLM initializes itself (Takase et al., docs/architecture.md#initialization); loaded
        # weights replace it.
        pass

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embedding

    def get_output_embeddings(self) -> torch.nn.Module | None:
        return self.model.lm_head  # None when tied: the un-embedding is the embedding's weight

    # ----------------------------------------------------------------------------------------------
    # Files: always through rdlm.model.huginn

    @classmethod
    def from_pretrained(  # type: ignore[override]  # rdlm's loader: transformers' options it serves, named
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *args: Any,
        config: RavenConfig | OuroConfig | None = None,
        dtype: Any = None,
        torch_dtype: Any = None,
        device_map: Any = None,
        attn_implementation: str | None = None,
        generation_config: GenerationConfig | None = None,
        subfolder: str = "",
        output_loading_info: bool = False,
        **kwargs: Any,
    ) -> RavenForCausalLM | tuple[RavenForCausalLM, dict[str, list[str]]]:
        """Load a Huginn-layout directory (or a Hub repository id) with `rdlm.model.huginn.load_pretrained`.

        dtype (or torch_dtype): None / "auto" keeps the file's dtype; a torch dtype or its name casts.
        device_map: None (cpu), one device ("cpu", "cuda:0", 0, {"": "cuda:0"}), or "auto" where the
            machine has one device (the GPU, else the CPU); rdlm never splits a model across devices.
        attn_implementation: "sdpa" (default) or "eager". generation_config: replaces the directory's
            generation_config.json. Hub downloads take revision, cache_dir, token, force_download and
            local_files_only. Any other keyword is refused by name, never ignored.
        """
        if args:
            raise TypeError(
                f"{cls.__name__}.from_pretrained takes the path and keywords only; got "
                f"{len(args)} more positional argument(s)"
            )
        hub = {k: kwargs.pop(k) for k in HUB_KEYWORDS if k in kwargs}
        # With PEFT installed, the Auto classes pass their hub options for an adapter as adapter_kwargs; they
        # load one only through _adapter_model_path (the directory held adapter_config.json).
        if "_adapter_model_path" not in kwargs and isinstance(kwargs.get("adapter_kwargs"), dict):
            kwargs.pop("adapter_kwargs")
        if "_adapter_model_path" in kwargs:
            raise TypeError(
                f"{cls.__name__}.from_pretrained: {pretrained_model_name_or_path} is a LoRA adapter; load its base "
                "and then the adapter with peft.PeftModel.from_pretrained(model, adapter_dir) (docs/fine-tuning.md)"
            )
        for name, allowed in INERT_LOAD_KEYWORDS.items():
            if name in kwargs and allowed is not None and kwargs[name] not in allowed:
                raise ValueError(
                    f"from_pretrained: {name}={kwargs[name]!r} is not supported for rdlm models "
                    f"(only {' or '.join(map(repr, allowed))})"
                )
            kwargs.pop(name, None)
        if kwargs:
            raise TypeError(
                f"{cls.__name__}.from_pretrained does not support {', '.join(sorted(kwargs))} "
                f"(rdlm loads safetensors whole onto one device; supported: dtype, device_map, "
                f"attn_implementation, generation_config, subfolder, output_loading_info, "
                f"{', '.join(HUB_KEYWORDS)})"
            )
        device = resolve_device(device_map)  # refuse a bad device_map before reading anything
        path = Path(pretrained_model_name_or_path)
        if not path.is_dir():
            path = Path(download_model(str(pretrained_model_name_or_path), hub, subfolder))
        if subfolder:
            path = path / subfolder if (path / subfolder).is_dir() else path
        model = huginn.load_pretrained(
            path, dtype=resolve_dtype(dtype if dtype is not None else torch_dtype), device=device
        )
        config_class = config_class_of(model.config)
        if config is None or not isinstance(config, config_class):
            with quiet_rope_notes():
                config = cast(RavenConfig | OuroConfig, config_class.from_pretrained(path))
        config.name_or_path = str(pretrained_model_name_or_path)
        wrapper = model_class_of(model.config).from_model(model, config)
        if generation_config is None and (path / GENERATION_CONFIG_NAME).is_file():
            generation_config = GenerationConfig.from_pretrained(path)
        if generation_config is not None:
            wrapper.generation_config = with_rdlm_generation_defaults(copy.deepcopy(generation_config), model.config)
        if attn_implementation is not None:
            wrapper.set_attn_implementation(attn_implementation)
        if output_loading_info:  # loading is strict: any missing or unexpected tensor is an error
            return wrapper, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
        return wrapper

    @classmethod
    def from_model(
        cls, model: RecurrentDepthLM, config: RavenConfig | OuroConfig | None = None, **config_overrides: Any
    ) -> RavenForCausalLM:
        """Wrap an rdlm model (weights shared, not copied)."""
        if cls.config_class is not config_class_of(model.config):
            return model_class_of(model.config).from_model(model, config, **config_overrides)
        if config is None:
            with quiet_rope_notes():
                config = cls.config_class(**{**huginn.config_to_huginn(model.config), **config_overrides})
        with torch.device("meta"):  # a placeholder model, replaced at once: no random init of real weights
            wrapper = cls(config, model=RecurrentDepthLM(model.config))
        wrapper.model = model
        wrapper.generation_config = with_rdlm_generation_defaults(
            GenerationConfig.from_model_config(config), model.config
        )
        return wrapper.eval()

    def save_pretrained(  # type: ignore[override]  # rdlm's writer: the options of transformers' it serves
        self,
        save_directory: str | os.PathLike,
        is_main_process: bool = True,
        *,
        dtype: torch.dtype | None = None,
        max_shard_size: int | str | None = None,
        max_shard_bytes: int | None = None,
        push_to_hub: bool = False,
        safe_serialization: bool = True,
        **kwargs: Any,
    ) -> None:
        """Write the Huginn layout with `rdlm.model.huginn.save_pretrained` (atomic, sharded above
        max_shard_size: bytes, or transformers' "5GB" / "500MiB" strings), plus generation_config.json.
        is_main_process=False writes nothing (transformers' convention for multi-process saving)."""
        if push_to_hub:
            raise ValueError(
                "save_pretrained(push_to_hub=True) is not supported: rdlm saves the directory "
                "locally; upload it with huggingface_hub.upload_folder(repo_id=..., folder_path=...)"
            )
        if not safe_serialization:
            raise ValueError("rdlm writes safetensors only (safe_serialization=False is not supported)")
        if kwargs:
            raise TypeError(
                f"{type(self).__name__}.save_pretrained does not support "
                f"{', '.join(sorted(kwargs))} (supported: is_main_process, dtype, max_shard_size)"
            )
        if max_shard_size is not None and max_shard_bytes is not None:
            raise ValueError("give max_shard_size or max_shard_bytes, not both")
        if max_shard_size is not None:
            max_shard_bytes = convert_file_size_to_int(max_shard_size)
        if not is_main_process:
            return
        extra = {GENERATION_CONFIG_NAME: self.generation_config.to_diff_dict()}
        huginn.save_pretrained(
            self.model,
            save_directory,
            dtype=dtype,
            extra_json=extra,
            max_shard_bytes=max_shard_bytes or huginn.DEFAULT_SHARD_BYTES,
        )

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]  # refused, any arguments
        raise NotImplementedError(
            "push_to_hub is not supported: save_pretrained(dir), then "
            "huggingface_hub.upload_folder(repo_id=..., folder_path=dir)"
        )

    # ----------------------------------------------------------------------------------------------
    # Model switches transformers users expect

    def set_attn_implementation(self, attn_implementation: str | dict, **kwargs: Any) -> None:  # type: ignore[override]  # rdlm's two implementations
        """ "sdpa" (torch's fused attention, the default) or "eager" (the same arithmetic written out)."""
        if kwargs:
            raise TypeError(f"set_attn_implementation does not take {', '.join(sorted(kwargs))}")
        if isinstance(attn_implementation, dict):
            values = set(attn_implementation.values())
            if len(values) != 1:
                raise ValueError(f"one attention implementation for the whole model, got {attn_implementation}")
            (attn_implementation,) = values
        if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation must be one of {ATTENTION_IMPLEMENTATIONS} for rdlm models, "
                f"got {attn_implementation!r}"
            )
        self.model.set_attention(attn_implementation)
        self.config._attn_implementation = attn_implementation

    def activation_checkpointing_enable(
        self, activation_checkpointing_kwargs: dict | None = None, every_n_layers: int = 1, offload: bool = False
    ) -> None:
        """Recompute each core iteration in backward instead of storing its activations (the config's
        activation_checkpointing; paper section 4: checkpointing per iteration)."""
        options = dict(activation_checkpointing_kwargs or {})
        if options.pop("use_reentrant", False):
            raise ValueError("rdlm checkpoints with use_reentrant=False only")
        if options or every_n_layers != 1 or offload:
            extra = (
                sorted(options) + (["every_n_layers"] if every_n_layers != 1 else []) + (["offload"] if offload else [])
            )
            raise ValueError(
                f"activation checkpointing in rdlm is per core iteration; not supported: {', '.join(extra)}"
            )
        self.model.config = self.model.config.replace(activation_checkpointing=True)

    def activation_checkpointing_disable(self) -> None:
        self.model.config = self.model.config.replace(activation_checkpointing=False)

    @property
    def is_activation_checkpointing(self) -> bool:
        return self.model.config.activation_checkpointing

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs: Any) -> None:
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.is_activation_checkpointing

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> torch.nn.Embedding:
        """Resize the (tied) embedding and an untied head to new_num_tokens (rounded up to a multiple of
        pad_to_multiple_of); both configs' vocab_size follow. New rows: the mean of the old embeddings
        (mean_resizing=True) or the model's own init (truncated normal, std sqrt(2/(5h)))."""
        old = self.model.embedding
        if new_num_tokens is None and pad_to_multiple_of is None:
            return old
        new_num_tokens = old.num_embeddings if new_num_tokens is None else int(new_num_tokens)
        if pad_to_multiple_of is not None:
            new_num_tokens = math.ceil(new_num_tokens / pad_to_multiple_of) * pad_to_multiple_of
        if new_num_tokens < 1:
            raise ValueError(f"new_num_tokens must be >= 1, got {new_num_tokens}")
        if new_num_tokens == old.num_embeddings:
            return old

        def resized(weight: Tensor) -> Tensor:
            out = weight.new_empty(new_num_tokens, weight.shape[1])
            keep = min(new_num_tokens, weight.shape[0])
            with torch.no_grad():
                out[:keep] = weight[:keep]
                if new_num_tokens > keep:
                    if mean_resizing:
                        out[keep:] = weight.float().mean(0).to(weight.dtype)
                    else:
                        std = self.model.init_std
                        torch.nn.init.trunc_normal_(out[keep:], std=std, a=-3 * std, b=3 * std)
            return out

        embedding = torch.nn.Embedding(
            new_num_tokens, old.embedding_dim, device=old.weight.device, dtype=old.weight.dtype
        )
        embedding.weight = torch.nn.Parameter(resized(old.weight.detach()), requires_grad=old.weight.requires_grad)
        self.model.embedding = embedding
        if self.model.lm_head is not None:
            head = self.model.lm_head
            self.model.lm_head = torch.nn.Linear(
                head.in_features, new_num_tokens, bias=False, device=head.weight.device, dtype=head.weight.dtype
            )
            self.model.lm_head.weight = torch.nn.Parameter(resized(head.weight.detach()))
        self.model.config = self.model.config.replace(vocab_size=new_num_tokens)
        self.config.vocab_size = new_num_tokens
        return embedding

    # ----------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        num_steps: int | None = None,
        init_scale: float | None = None,
        seed: int | None = None,
        input_states: Tensor | None = None,
        initial_state: Tensor | None = None,
        past_key_values: RecurrentCache | None = None,
        use_cache: bool | None = None,
        cache_position: Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        """attention_mask: transformers' [batch, seq] padding mask (1 = real token), left or right padded
            (with a cache: [batch, cached + new], left padded).
        labels: transformers' convention, the input ids themselves (shifted here), -100 ignored.
        s_0: input_states / initial_state (give one of them); else row p of the (seed, position) noise
            table when a seed or a cache is given; else a fresh draw from torch's generator (training).
        past_key_values: a RecurrentCache to decode incrementally; use_cache=True starts one and returns it.
        Keywords this wrapper does not implement are an error, never silently dropped."""
        unknown = sorted(k for k, v in kwargs.items() if k not in _INERT_FORWARD_KWARGS)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.forward() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}"
            )
        active = sorted(k for k, v in kwargs.items() if v not in _INERT_FORWARD_KWARGS[k])
        if active:
            raise ValueError(
                f"{type(self).__name__}.forward() does not support {', '.join(active)} (no attentions or hidden states)"
            )
        if input_states is not None and initial_state is not None:
            raise ValueError("give the initial state as input_states or initial_state, not both")
        state = input_states if input_states is not None else initial_state
        r = num_steps if num_steps is not None else self.model.config.mean_recurrence
        if past_key_values is None and use_cache:
            past_key_values = RecurrentCache()
        if past_key_values is not None:
            if not isinstance(past_key_values, RecurrentCache):
                raise TypeError(
                    f"past_key_values must be an rdlm.integrations.hf.RecurrentCache (a cache with a slot "
                    f"per core iteration), got {type(past_key_values).__name__}"
                )
            if state is not None or position_ids is not None or cache_position is not None:
                raise ValueError(
                    "with a RecurrentCache, s_0 comes from its seed and positions from its "
                    "attention mask: drop input_states/initial_state/position_ids/cache_position"
                )
            logits = past_key_values.forward(self.model, input_ids, attention_mask, r, seed, init_scale)
        else:
            if position_ids is None and cache_position is not None:
                position_ids = cache_position
            mask = None
            if attention_mask is not None and not bool(attention_mask.all()):
                mask = padding_attention_mask(attention_mask)
                if position_ids is None:
                    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
            scale = 1.0 if init_scale is None else init_scale
            if state is None and seed is not None:
                positions = (
                    position_ids
                    if position_ids is not None
                    else torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
                )
                self.model.check_positions(positions)
                table = noise_table(
                    self.model,
                    seed,
                    scale,
                    int(positions.max()) + 1,
                    self.model.embedding.weight.dtype,
                    input_ids.device,
                )
                # No table: s_0 is zeros or the embedding, which the model makes itself from `scale`.
                state = None if table is None else table[positions]
            logits = self.model(
                input_ids,
                num_steps=num_steps,
                initial_state=state,
                init_scale=scale,
                positions=position_ids,
                attention_mask=mask,
            ).logits
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        # transformers 5.24 names the field `cache` and still accepts past_key_values (with a deprecation notice)
        result = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=past_key_values)  # type: ignore[call-arg]
        return result.to_tuple() if return_dict is False else result

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    # ----------------------------------------------------------------------------------------------
    # generate: transformers' interface, rdlm's decode engine

    @torch.inference_mode()
    def generate(
        self,
        inputs: Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        streamer: Any = None,
        **kwargs: Any,
    ) -> Tensor | GenerateDecoderOnlyOutput:
        """transformers' generate, decoded by rdlm.inference.generate over the recurrent KV cache.

        Options come, in rising priority, from the model's generation_config (rdlm's defaults from the
        model config), a `generation_config` argument and keywords, merged as transformers merges them.
        transformers' options: max_new_tokens / max_length, do_sample, temperature, top_k, top_p, min_p,
        repetition_penalty, eos_token_id, pad_token_id, stop_strings (with tokenizer=), streamer (one
        prompt), return_dict_in_generate. rdlm's (RDLM_GENERATION_DEFAULTS): num_steps, exit_criterion,
        exit_threshold, min_steps, kv_cache_budget, continuous_cot, init_scale, seed (s_0 and sampling
        draws; never torch's global generator), draft_steps, draft_length, max_latent_iterations and
        target_mean_iterations (a depth budget per row). The authors' spelling works too:
        `criterion=` ("none" = no adaptive exits), `exit_threshold="auto"`, `continuous_compute=`.
        Anything else that would change the result (beam search, logits processors, scores, ...) is
        refused by name."""
        return generate_with_engine(self, inputs, generation_config, streamer, **kwargs)


class OuroForCausalLM(RavenForCausalLM):
    """The same wrapper for an Ouro checkpoint (model_type "ouro")."""

    config_class = OuroConfig


# transformers config class -> the wrapper of a model with that config.
MODEL_CLASSES: dict[type, type[RavenForCausalLM]] = {RavenConfig: RavenForCausalLM, OuroConfig: OuroForCausalLM}


def model_class_of(config) -> type[RavenForCausalLM]:
    """The wrapper class of a model's family (the one of its transformers config class)."""
    return MODEL_CLASSES[config_class_of(config)]
