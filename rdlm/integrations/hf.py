"""Hugging Face `transformers` integration: a config + model pair for model_type "huginn_raven".

    import rdlm.integrations.hf  # registers the classes with AutoConfig / AutoModelForCausalLM / AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("path/to/huginn-dir")          # no trust_remote_code
    out = model.generate(ids, max_new_tokens=32, num_steps=16, do_sample=False)

The released Huginn-0125 `config.json` names the authors' remote code in `auto_map`. Once the type
"huginn_raven" is registered locally, transformers resolves to the local classes and never asks for
`trust_remote_code`. The weights are read and written by `rdlm.model.huginn`, the one home of the Huginn
layout: `RavenForCausalLM` wraps a `RecurrentDepthLM` and only adapts calling conventions.

Supported transformers versions: SUPPORTED_TRANSFORMERS below (configs are dataclasses from 5.0 on).
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

SUPPORTED_TRANSFORMERS = (">=5.0", "<6")


def _check_transformers_version() -> None:
    try:
        import transformers
    except ImportError as err:
        raise ImportError("rdlm.integrations.hf needs transformers: pip install 'rdlm[hf]'") from err
    from packaging.version import Version

    version = Version(transformers.__version__)
    if not Version("5.0") <= version < Version("6"):
        raise ImportError(f"rdlm.integrations.hf supports transformers {','.join(SUPPORTED_TRANSFORMERS)}, found "
                          f"{transformers.__version__}; pip install 'transformers{','.join(SUPPORTED_TRANSFORMERS)}'")


_check_transformers_version()

from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig,  # noqa: E402
                          GenerationMixin, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerFast)
from transformers.cache_utils import Cache  # noqa: E402
from transformers.generation.utils import GenerateDecoderOnlyOutput  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402
from transformers.utils.hub import convert_file_size_to_int  # noqa: E402

from rdlm.model import huginn  # noqa: E402
from rdlm.model.config import RDLMConfig  # noqa: E402
from rdlm.model.dtypes import resolve_dtype  # noqa: E402
from rdlm.data.tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS  # noqa: E402
from rdlm.inference.engine import Session, noise_table  # noqa: E402
from rdlm.model.lm import ATTENTION_IMPLEMENTATIONS, RecurrentDepthLM, causal_mask  # noqa: E402

MODEL_TYPE = huginn.MODEL_TYPE
GENERATION_CONFIG_NAME = "generation_config.json"
# The authors' RavenForCausalLM.generate spells some of rdlm's options differently: criterion ("none" =
# off), exit_threshold "auto" (= the criterion's default), continuous_compute.
REFERENCE_GENERATION_NAMES = {"criterion": "exit_criterion", "continuous_compute": "continuous_cot"}
# forward() keywords transformers' machinery may pass that change nothing at these values.
_INERT_FORWARD_KWARGS = {"output_attentions": (None, False), "output_hidden_states": (None, False)}
# from_pretrained keywords for a Hub download.
HUB_KEYWORDS = ("revision", "cache_dir", "token", "force_download", "local_files_only")
# from_pretrained keywords that change nothing for rdlm at these values (None: at any value):
# safetensors are read whole onto one device, with no remote code and no pickle, so nothing is ever
# offloaded; transformers' Auto classes and pipelines pass the private ones.
INERT_LOAD_KEYWORDS: dict[str, tuple | None] = {
    "trust_remote_code": None, "low_cpu_mem_usage": None, "weights_only": None, "offload_folder": None,
    "use_safetensors": (None, True), "_from_auto": None, "_from_pipeline": None, "_commit_hash": None,
    "quantization_config": (None,), "max_memory": (None,), "variant": (None,), "gguf_file": (None,),
    "tp_plan": (None,), "key_mapping": (None,), "adapter_kwargs": (None, {}),
}


class RavenConfig(PreTrainedConfig):
    """The Huginn config.json keys (docs/checkpoint-format.md#config-keys); defaults are Huginn-0125's.

    Keys rdlm does not model (init_values, sampling_scheme, ...) are kept as plain attributes so that
    a loaded config saves back unchanged. `to_rdlm()` gives the model's `RDLMConfig`.
    """

    model_type = MODEL_TYPE
    attribute_map = {"hidden_size": "n_embd", "num_attention_heads": "n_heads",
                     "max_position_embeddings": "block_size"}

    n_embd: int = 5280
    n_heads: int = 55
    n_layers_in_prelude: int = 2
    n_layers_in_recurrent_block: int = 4
    n_layers_in_coda: int = 2
    intermediate_size: int = 17920
    vocab_size: int = 65536
    block_size: int = 4096
    norm_eps: float = 1e-6
    rope_base: float = 50000.0
    qk_bias: bool = True
    tie_embeddings: bool = True
    mean_recurrence: int = 32
    mean_backprop_depth: int = 8
    bos_token_id: int | None = 65504
    eos_token_id: int | list[int] | None = 65505
    pad_token_id: int | None = 65509
    tie_word_embeddings: bool = False  # tying lives inside RecurrentDepthLM, not in transformers' loader

    def to_rdlm(self) -> RDLMConfig:
        return huginn.config_from_huginn(self.to_dict(), source=f"{MODEL_TYPE} config")

    @classmethod
    def from_rdlm(cls, config: RDLMConfig, dtype: torch.dtype = torch.float32) -> "RavenConfig":
        return cls(**huginn.config_to_huginn(config, dtype))


class RecurrentCache(Cache):
    """transformers' `Cache` for recurrence: the decode engine's `Session` (rdlm/inference/engine.py) over one
    preallocated `RecurrentKVCache` (rdlm/inference/cache.py: a slot per core iteration, "full", or k slots that
    iteration i reads and writes as i mod k, "shared"; paper section 6, "Zero-Shot KV-cache Sharing").

        cache = RecurrentCache(max_length=64)                    # or forward(..., use_cache=True)
        out = model(prompt_ids, attention_mask=mask, past_key_values=cache, num_steps=8)
        out = model(next_ids, past_key_values=out.past_key_values, num_steps=8)   # one new token per row

    The first call is the prompt: a batch left-padded as transformers pads for generation (the mask
    says where). Later calls append tokens to every row. s_0 of the token at position p is row p of the
    engine's (seed, position) noise table, so a forward over this cache gives the logits `rdlm.inference.generate`
    decodes from, and two runs give the same numbers. The engine fixes r per call; with the "full"
    strategy the number of slots (default: the first call's r) bounds the r of later calls.
    """

    def __init__(self, max_length: int | None = None, num_slots: int | None = None, strategy: str = "full",
                 seed: int | None = None, init_scale: float | None = None) -> None:
        super().__init__(layers=[])
        if strategy not in ("full", "shared"):
            raise ValueError(f"strategy must be 'full' or 'shared', got {strategy!r}")
        if strategy == "shared" and num_slots is None:
            raise ValueError("the shared strategy needs num_slots (the cache budget k)")
        self.max_length, self.num_slots, self.strategy = max_length, num_slots, strategy
        self.seed, self.init_scale = seed, init_scale
        self.session: Session | None = None

    def forward(self, model: RecurrentDepthLM, input_ids: Tensor, attention_mask: Tensor | None,
                num_steps: int, seed: int | None = None, init_scale: float | None = None) -> Tensor:
        """Run `input_ids` [B, n] at r = num_steps over the cache; logits [B, n, V]."""
        for name, value in (("seed", seed), ("init_scale", init_scale)):
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
                raise ValueError(f"attention_mask must cover the cached and the new tokens, "
                                 f"[{batch}, {self.session.length + n}], got {list(attention_mask.shape)}")
            if not bool(attention_mask[:, -n:].bool().all()):
                raise ValueError("tokens after the prompt must all be real (attention_mask 1): the recurrent "
                                 "cache pads only on the left, in the first call")
        if self.session.length + n > self.session.cache.max_length:
            raise ValueError(f"this cache holds {self.session.cache.max_length} tokens; "
                             f"{self.session.length + n} do not fit (RecurrentCache(max_length=...))")
        return self.session.forward(input_ids, num_steps, last_only=False)[0]

    def _prefill(self, model: RecurrentDepthLM, input_ids: Tensor, attention_mask: Tensor | None,
                 num_steps: int) -> Tensor:
        from rdlm.inference.generate import GenerationConfig

        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {list(mask.shape)} does not match input_ids {list(input_ids.shape)}")
        if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
            raise ValueError("the recurrent cache takes left-padded prompts (padding first, then the tokens)")
        length = input_ids.shape[1]
        max_length = self.max_length if self.max_length is not None else model.config.context_length
        if length > max_length:
            raise ValueError(f"a prompt of {length} tokens does not fit a cache of max_length {max_length}")
        slots = self.num_slots if self.num_slots is not None else num_steps
        config = GenerationConfig(
            max_new_tokens=max_length - length, num_steps=num_steps if self.strategy == "shared" else slots,
            cache_strategy=self.strategy, cache_slots=slots if self.strategy == "shared" else None,
            seed=0 if self.seed is None else self.seed,
            init_scale=1.0 if self.init_scale is None else self.init_scale, compile=False)
        self.seed, self.init_scale = config.seed, config.init_scale
        self.session = Session(model, [row[keep].tolist() for row, keep in zip(input_ids, mask)], config)
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
        raise NotImplementedError(f"RecurrentCache does not {what} (rdlm decodes greedily or by sampling, "
                                  "one token per row; no beam search, assisted decoding or rollback)")

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self._refuse("reorder rows")

    def crop(self, tokens_to_remove: int) -> None:
        self._refuse("crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse("repeat rows")

    def batch_select_indices(self, indices: Tensor) -> None:
        self._refuse("select rows")


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

    config_class = RavenConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    supports_gradient_checkpointing = True

    def __init__(self, config: RavenConfig, model: RecurrentDepthLM | None = None) -> None:
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
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any,
                        config: RavenConfig | None = None, dtype: Any = None, torch_dtype: Any = None,
                        device_map: Any = None, attn_implementation: str | None = None,
                        generation_config: GenerationConfig | None = None, subfolder: str = "",
                        output_loading_info: bool = False, **kwargs: Any) -> "RavenForCausalLM":
        """Load a Huginn-layout directory (or a Hub repository id) with `rdlm.model.huginn.load_pretrained`.

        dtype (or torch_dtype): None / "auto" keeps the file's dtype; a torch dtype or its name casts.
        device_map: None (cpu), one device ("cpu", "cuda:0", 0, {"": "cuda:0"}), or "auto" where the
            machine has one device (the GPU, else the CPU); rdlm never splits a model across devices.
        attn_implementation: "sdpa" (default) or "eager". generation_config: replaces the directory's
            generation_config.json. Hub downloads take revision, cache_dir, token, force_download and
            local_files_only. Any other keyword is refused by name, never ignored.
        """
        if args:
            raise TypeError(f"{cls.__name__}.from_pretrained takes the path and keywords only; got "
                            f"{len(args)} more positional argument(s)")
        hub = {k: kwargs.pop(k) for k in HUB_KEYWORDS if k in kwargs}
        for name, allowed in INERT_LOAD_KEYWORDS.items():
            if name in kwargs and allowed is not None and kwargs[name] not in allowed:
                raise ValueError(f"from_pretrained: {name}={kwargs[name]!r} is not supported for rdlm models "
                                 f"(only {' or '.join(map(repr, allowed))})")
            kwargs.pop(name, None)
        if kwargs:
            raise TypeError(f"{cls.__name__}.from_pretrained does not support {', '.join(sorted(kwargs))} "
                            f"(rdlm loads safetensors whole onto one device; supported: dtype, device_map, "
                            f"attn_implementation, generation_config, subfolder, output_loading_info, "
                            f"{', '.join(HUB_KEYWORDS)})")
        device = _resolve_device(device_map)  # refuse a bad device_map before reading anything
        path = Path(pretrained_model_name_or_path)
        if not path.is_dir():
            path = Path(_download(str(pretrained_model_name_or_path), hub, subfolder))
        if subfolder:
            path = path / subfolder if (path / subfolder).is_dir() else path
        model = huginn.load_pretrained(path, dtype=resolve_dtype(dtype if dtype is not None else torch_dtype),
                                       device=device)
        if config is None or not isinstance(config, RavenConfig):
            config = RavenConfig.from_pretrained(path)
        config.name_or_path = str(pretrained_model_name_or_path)
        wrapper = cls.from_model(model, config)
        if generation_config is None and (path / GENERATION_CONFIG_NAME).is_file():
            generation_config = GenerationConfig.from_pretrained(path)
        if generation_config is not None:
            wrapper.generation_config = with_rdlm_generation_defaults(copy.deepcopy(generation_config),
                                                                      model.config)
        if attn_implementation is not None:
            wrapper.set_attn_implementation(attn_implementation)
        if output_loading_info:  # loading is strict: any missing or unexpected tensor is an error
            return wrapper, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
        return wrapper

    @classmethod
    def from_model(cls, model: RecurrentDepthLM, config: RavenConfig | None = None,
                   **config_overrides: Any) -> "RavenForCausalLM":
        """Wrap an rdlm model (weights shared, not copied)."""
        if config is None:
            config = RavenConfig(**{**huginn.config_to_huginn(model.config), **config_overrides})
        with torch.device("meta"):  # a placeholder model, replaced at once: no random init of real weights
            wrapper = cls(config, model=RecurrentDepthLM(model.config))
        wrapper.model = model
        wrapper.generation_config = with_rdlm_generation_defaults(
            GenerationConfig.from_model_config(config), model.config)
        return wrapper.eval()

    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True, *,
                        dtype: torch.dtype | None = None, max_shard_size: int | str | None = None,
                        max_shard_bytes: int | None = None, push_to_hub: bool = False,
                        safe_serialization: bool = True, **kwargs: Any) -> None:
        """Write the Huginn layout with `rdlm.model.huginn.save_pretrained` (atomic, sharded above
        max_shard_size: bytes, or transformers' "5GB" / "500MiB" strings), plus generation_config.json.
        is_main_process=False writes nothing (transformers' convention for multi-process saving)."""
        if push_to_hub:
            raise ValueError("save_pretrained(push_to_hub=True) is not supported: rdlm saves the directory "
                             "locally; upload it with huggingface_hub.upload_folder(repo_id=..., folder_path=...)")
        if not safe_serialization:
            raise ValueError("rdlm writes safetensors only (safe_serialization=False is not supported)")
        if kwargs:
            raise TypeError(f"{type(self).__name__}.save_pretrained does not support "
                            f"{', '.join(sorted(kwargs))} (supported: is_main_process, dtype, max_shard_size)")
        if max_shard_size is not None and max_shard_bytes is not None:
            raise ValueError("give max_shard_size or max_shard_bytes, not both")
        if max_shard_size is not None:
            max_shard_bytes = convert_file_size_to_int(max_shard_size)
        if not is_main_process:
            return
        extra = {GENERATION_CONFIG_NAME: self.generation_config.to_diff_dict()}
        huginn.save_pretrained(self.model, save_directory, dtype=dtype, extra_json=extra,
                               max_shard_bytes=max_shard_bytes or huginn.DEFAULT_SHARD_BYTES)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("push_to_hub is not supported: save_pretrained(dir), then "
                                  "huggingface_hub.upload_folder(repo_id=..., folder_path=dir)")

    # ----------------------------------------------------------------------------------------------
    # Model switches transformers users expect

    def set_attn_implementation(self, attn_implementation: str | dict, **kwargs: Any) -> None:
        """"sdpa" (torch's fused attention, the default) or "eager" (the same arithmetic written out)."""
        if kwargs:
            raise TypeError(f"set_attn_implementation does not take {', '.join(sorted(kwargs))}")
        if isinstance(attn_implementation, dict):
            values = set(attn_implementation.values())
            if len(values) != 1:
                raise ValueError(f"one attention implementation for the whole model, got {attn_implementation}")
            (attn_implementation,) = values
        if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation must be one of {ATTENTION_IMPLEMENTATIONS} for rdlm models, "
                             f"got {attn_implementation!r}")
        self.model.set_attention(attn_implementation)
        self.config._attn_implementation = attn_implementation

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Recompute each core iteration in backward instead of storing its activations (the config's
        activation_checkpointing; paper section 4: checkpointing per iteration)."""
        options = dict(activation_checkpointing_kwargs or {})
        if options.pop("use_reentrant", False):
            raise ValueError("rdlm checkpoints with use_reentrant=False only")
        if options or every_n_layers != 1 or offload:
            extra = sorted(options) + (["every_n_layers"] if every_n_layers != 1 else []) + \
                (["offload"] if offload else [])
            raise ValueError(f"activation checkpointing in rdlm is per core iteration; not supported: "
                             f"{', '.join(extra)}")
        self.model.config = self.model.config.replace(activation_checkpointing=True)

    def activation_checkpointing_disable(self) -> None:
        self.model.config = self.model.config.replace(activation_checkpointing=False)

    @property
    def is_activation_checkpointing(self) -> bool:
        return self.model.config.activation_checkpointing

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None,
                                      **kwargs: Any) -> None:
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.is_activation_checkpointing

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> torch.nn.Embedding:
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

        embedding = torch.nn.Embedding(new_num_tokens, old.embedding_dim, device=old.weight.device,
                                       dtype=old.weight.dtype)
        embedding.weight = torch.nn.Parameter(resized(old.weight.detach()), requires_grad=old.weight.requires_grad)
        self.model.embedding = embedding
        if self.model.lm_head is not None:
            head = self.model.lm_head
            self.model.lm_head = torch.nn.Linear(head.in_features, new_num_tokens, bias=False,
                                                 device=head.weight.device, dtype=head.weight.dtype)
            self.model.lm_head.weight = torch.nn.Parameter(resized(head.weight.detach()))
        self.model.config = self.model.config.replace(vocab_size=new_num_tokens)
        self.config.vocab_size = new_num_tokens
        return embedding

    # ----------------------------------------------------------------------------------------------

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None,
                num_steps: int | None = None, init_scale: float | None = None, seed: int | None = None,
                input_states: Tensor | None = None, initial_state: Tensor | None = None,
                past_key_values: RecurrentCache | None = None, use_cache: bool | None = None,
                cache_position: Tensor | None = None, return_dict: bool | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast | tuple:
        """attention_mask: transformers' [batch, seq] padding mask (1 = real token), left or right padded
            (with a cache: [batch, cached + new], left padded).
        labels: transformers' convention, the input ids themselves (shifted here), -100 ignored.
        s_0: input_states / initial_state (give one of them); else row p of the (seed, position) noise
            table when a seed or a cache is given; else a fresh draw from torch's generator (training).
        past_key_values: a RecurrentCache to decode incrementally; use_cache=True starts one and returns it.
        Keywords this wrapper does not implement are an error, never silently dropped."""
        unknown = sorted(k for k, v in kwargs.items() if k not in _INERT_FORWARD_KWARGS)
        if unknown:
            raise TypeError(f"{type(self).__name__}.forward() got unexpected keyword argument(s) "
                            f"{', '.join(map(repr, unknown))}")
        active = sorted(k for k, v in kwargs.items() if v not in _INERT_FORWARD_KWARGS[k])
        if active:
            raise ValueError(f"{type(self).__name__}.forward() does not support {', '.join(active)} "
                             "(no attentions or hidden states)")
        if input_states is not None and initial_state is not None:
            raise ValueError("give the initial state as input_states or initial_state, not both")
        state = input_states if input_states is not None else initial_state
        r = num_steps if num_steps is not None else self.model.config.mean_recurrence
        if past_key_values is None and use_cache:
            past_key_values = RecurrentCache()
        if past_key_values is not None:
            if not isinstance(past_key_values, RecurrentCache):
                raise TypeError(f"past_key_values must be an rdlm.integrations.hf.RecurrentCache (a cache with a slot per core "
                                f"iteration), got {type(past_key_values).__name__}")
            if state is not None or position_ids is not None or cache_position is not None:
                raise ValueError("with a RecurrentCache, s_0 comes from its seed and positions from its "
                                 "attention mask: drop input_states/initial_state/position_ids/cache_position")
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
                positions = position_ids if position_ids is not None else torch.arange(
                    input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
                self.model.check_positions(positions)
                table = noise_table(self.model, seed, scale, int(positions.max()) + 1,
                                    self.model.embedding.weight.dtype, input_ids.device)
                state = torch.zeros(*input_ids.shape, self.model.config.hidden_size, device=input_ids.device,
                                    dtype=self.model.embedding.weight.dtype) if table is None else table[positions]
            logits = self.model(input_ids, num_steps=num_steps, initial_state=state, init_scale=scale,
                                positions=position_ids, attention_mask=mask).logits
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        result = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=past_key_values)
        return result.to_tuple() if return_dict is False else result

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    # ----------------------------------------------------------------------------------------------
    # generate: transformers' interface, rdlm's decode engine

    @torch.inference_mode()
    def generate(self, inputs: Tensor | None = None, generation_config: GenerationConfig | None = None,
                 streamer: Any = None, **kwargs: Any) -> Tensor | GenerateDecoderOnlyOutput:
        """transformers' generate, decoded by rdlm.inference.generate over the recurrent KV cache.

        Options come, in rising priority, from the model's generation_config (rdlm's defaults from the
        model config), a `generation_config` argument and keywords, merged as transformers merges them.
        transformers' options: max_new_tokens / max_length, do_sample, temperature, top_k, top_p, min_p,
        repetition_penalty, eos_token_id, pad_token_id, stop_strings (with tokenizer=), streamer (one
        prompt), return_dict_in_generate. rdlm's (RDLM_GENERATION_DEFAULTS): num_steps, exit_criterion,
        exit_threshold, min_steps, kv_cache_budget, continuous_cot, init_scale, seed (s_0 and sampling
        draws; never torch's global generator), draft_steps, draft_length. The authors' spelling works too:
        `criterion=` ("none" = no adaptive exits), `exit_threshold="auto"`, `continuous_compute=`.
        Anything else that would change the result (beam search, logits processors, scores, ...) is
        refused by name."""
        from rdlm.inference.generate import GenerationConfig as RDLMGenerationConfig, generate

        kwargs = _rdlm_generation_names(kwargs)
        config, model_kwargs = self._prepare_generation_config(generation_config, **kwargs)
        input_ids = inputs if inputs is not None else model_kwargs.pop("input_ids", None)
        attention_mask = model_kwargs.pop("attention_mask", None)
        tokenizer = model_kwargs.pop("tokenizer", None)
        for name in ("logits_processor", "stopping_criteria"):
            if model_kwargs.get(name) is not None and len(model_kwargs[name]) == 0:
                model_kwargs.pop(name)
        model_kwargs.pop("use_cache", None)
        if model_kwargs:
            raise ValueError(f"generate does not support {', '.join(sorted(model_kwargs))} for rdlm models")
        refused = unsupported_generation_options(config)
        if refused:
            raise ValueError(f"generate does not support {', '.join(refused)} for rdlm models (rdlm's decode "
                             "engine samples one token per row: greedy, or temperature with top-k/top-p/min-p)")
        if input_ids is None:
            input_ids = torch.tensor([[config.bos_token_id]], device=self.device)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got {list(input_ids.shape)}")
        if config.exit_criterion == "none":  # the reference's "off", also inside a generation config
            config.exit_criterion = None
        if kwargs.get("exit_threshold") is not None and config.exit_criterion is None:
            raise ValueError("exit_threshold needs an exit criterion (exit_criterion= or criterion=)")
        if config.stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: generate(..., stop_strings=..., tokenizer=tok)")
        if streamer is not None and input_ids.shape[0] != 1:
            raise ValueError("a streamer takes one prompt at a time (as transformers' streamers do)")
        mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        prompts = [row[keep].tolist() for row, keep in zip(input_ids, mask)]
        eos = config.eos_token_id
        stop = tuple(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        pad = config.pad_token_id if config.pad_token_id is not None else (stop[0] if stop else 0)
        max_new = config.max_new_tokens if config.max_new_tokens is not None else \
            max(config.max_length - input_ids.shape[1], 0)
        sampling = config.do_sample and config.temperature != 0
        rdlm_config = RDLMGenerationConfig(
            max_new_tokens=max_new,
            num_steps=config.num_steps if config.num_steps is not None else self.model.config.mean_recurrence,
            exit_criterion=config.exit_criterion,
            exit_threshold=config.exit_threshold if config.exit_criterion is not None else None,
            min_steps=config.min_steps,
            temperature=float(config.temperature) if sampling else 0.0,
            top_k=config.top_k if sampling and config.top_k else None,
            top_p=config.top_p if sampling and config.top_p is not None and config.top_p < 1 else None,
            min_p=config.min_p if sampling else None,
            repetition_penalty=config.repetition_penalty, stop_tokens=stop,
            stop_strings=tuple([config.stop_strings] if isinstance(config.stop_strings, str)
                               else config.stop_strings or ()),
            cache_strategy="shared" if config.kv_cache_budget else "full", cache_slots=config.kv_cache_budget,
            continuous_cot=bool(config.continuous_cot), init_scale=float(config.init_scale), seed=int(config.seed),
            draft_steps=config.draft_steps, draft_length=config.draft_length)
        decode = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else None
        on_token = None
        if streamer is not None:
            streamer.put(input_ids.cpu())
            on_token = lambda event: streamer.put(torch.tensor([event.token]))  # noqa: E731
        result = generate(self.model, prompts, rdlm_config, decode=decode, on_token=on_token)
        if streamer is not None:
            streamer.end()
        width = max((len(t) for t in result.tokens), default=0)
        new = torch.full((len(prompts), width), pad, dtype=input_ids.dtype)
        for row, tokens in enumerate(result.tokens):
            new[row, :len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
        sequences = torch.cat([input_ids, new.to(input_ids.device)], dim=1)
        if config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences


# rdlm's generation options, as generation_config entries; None here = taken from the model config.
RDLM_GENERATION_DEFAULTS: dict[str, Any] = {
    "num_steps": None, "exit_criterion": None, "exit_threshold": None, "min_steps": 2, "kv_cache_budget": None,
    "continuous_cot": False, "init_scale": 1.0, "seed": 0, "draft_steps": None, "draft_length": 4}
# transformers' generation options generate maps onto rdlm.inference.generate.
MAPPED_GENERATION_OPTIONS = ("max_length", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
                             "min_p", "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id",
                             "stop_strings", "return_dict_in_generate", "use_cache")
# Options that only act in modes refused anyway (beam search, assisted decoding, encoder-decoders,
# transformers' own compiled loop), or only on scores that are not returned.
INERT_GENERATION_OPTIONS = ("early_stopping", "length_penalty", "num_assistant_tokens",
                            "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                            "assistant_lookbehind", "target_lookbehind", "max_matching_ngram_size",
                            "assistant_ensemble_weight", "decoder_start_token_id", "renormalize_logits",
                            "compile_config", "disable_compile", "output_attentions", "output_hidden_states")


def with_rdlm_generation_defaults(generation_config: GenerationConfig, model_config: RDLMConfig) -> GenerationConfig:
    """The generation config with rdlm's options filled in where it lacks them (num_steps: the model's
    mean recurrence)."""
    defaults = {**RDLM_GENERATION_DEFAULTS, "num_steps": model_config.mean_recurrence}
    for name, value in defaults.items():
        if getattr(generation_config, name, None) is None:
            setattr(generation_config, name, value)
    # A config marked as derived from the model config loses its own entries (rdlm's) when read back.
    generation_config._from_model_config = False
    return generation_config


def unsupported_generation_options(config: GenerationConfig) -> list[str]:
    """Options of a merged generation config that rdlm.inference.generate cannot honour (set away from the value
    that means "off")."""
    defaults = GenerationConfig._get_default_generation_params()
    refused = []
    for name, value in config.to_dict().items():
        if name.startswith("_") or name == "transformers_version" or name in RDLM_GENERATION_DEFAULTS \
                or name in MAPPED_GENERATION_OPTIONS or name in INERT_GENERATION_OPTIONS:
            continue
        if value is not None and value != defaults.get(name):
            refused.append(f"{name}={value!r}")
    return refused


def _rdlm_generation_names(kwargs: dict[str, Any]) -> dict[str, Any]:
    """generate() keywords with the reference's names and sentinels turned into rdlm's."""
    kwargs = dict(kwargs)
    for theirs, ours in REFERENCE_GENERATION_NAMES.items():
        if theirs in kwargs:
            value = kwargs.pop(theirs)
            if theirs == "criterion" and value == "none":
                value = None
            if kwargs.get(ours) is not None and kwargs[ours] != value:
                raise ValueError(f"{theirs}={value!r} and {ours}={kwargs[ours]!r} disagree; give one of them")
            kwargs[ours] = value
    if kwargs.get("exit_threshold") == "auto":
        kwargs["exit_threshold"] = None
    return kwargs


def padding_attention_mask(attention_mask: Tensor) -> Tensor:
    """[batch, seq] padding mask -> boolean [batch, 1, seq, seq] causal mask over real tokens.

    Each query may always see itself, so a padding query has one valid key instead of none (an
    all-masked row would give NaN); padding outputs are never read.
    """
    seq = attention_mask.shape[-1]
    causal = causal_mask(seq, seq, attention_mask.device)
    keys = attention_mask.bool()[:, None, None, :]
    eye = torch.eye(seq, dtype=torch.bool, device=attention_mask.device)
    return (causal & keys) | eye


class RavenTokenizerFast(PreTrainedTokenizerFast):
    """A tokenizer.json with Huginn's special tokens and chat template by default
    (BOS first, then <|begin_header|>ROLE<|end_header|>\\n\\nTEXT<|end_turn|> per turn, assistant "Huginn";
    docs/checkpoint-format.md#tokenizer)."""

    # No __init__ of its own: transformers 5 then loads tokenizer.json as it is, instead of rebuilding
    # the pipeline from vocab and merges.

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> "RavenTokenizerFast":
        return cls._with_huginn_defaults(super().from_pretrained(*args, **kwargs))

    @classmethod
    def _with_huginn_defaults(cls, tokenizer: "RavenTokenizerFast") -> "RavenTokenizerFast":
        vocab = tokenizer.get_vocab()
        missing = [t for t in SPECIAL_TOKENS if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer lacks the special token(s) {', '.join(missing)}")
        tokenizer.bos_token = tokenizer.bos_token or BOS
        tokenizer.eos_token = tokenizer.eos_token or EOS
        tokenizer.pad_token = tokenizer.pad_token or PAD
        tokenizer.chat_template = tokenizer.chat_template or CHAT_TEMPLATE
        return tokenizer


def load_tokenizer(path: str | os.PathLike) -> RavenTokenizerFast:
    """The tokenizer of a model directory (or a tokenizer.json file itself)."""
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no tokenizer.json")
    return RavenTokenizerFast._with_huginn_defaults(RavenTokenizerFast(tokenizer_file=str(file)))


def _resolve_device(device_map: Any) -> torch.device:
    """The one device a device_map names. rdlm loads a model whole: "auto" means the machine's only
    device (its GPU, else the CPU), and a map over several devices is refused."""
    if device_map is None:
        return torch.device("cpu")
    if isinstance(device_map, dict):
        devices = {str(_resolve_device(d)) for d in device_map.values()}
        if len(devices) != 1:
            raise ValueError(f"device_map={device_map!r} splits the model over {sorted(devices)}; rdlm loads "
                             "it whole on one device: pass one device such as 'cpu' or 'cuda:0'")
        return torch.device(devices.pop())
    if device_map == "auto":
        gpus = torch.cuda.device_count()
        if gpus > 1:
            raise ValueError(f"device_map='auto' would split the model over {gpus} GPUs; rdlm loads it whole "
                             "on one device: pass device_map='cuda:0'")
        return torch.device("cuda:0" if gpus == 1 else "cpu")
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return torch.device(f"cuda:{device_map}")
    if isinstance(device_map, (str, torch.device)) and str(device_map) not in ("balanced", "balanced_low_0",
                                                                                "sequential", "disk"):
        return torch.device(device_map)
    raise ValueError(f"device_map={device_map!r} is not supported: pass one device such as 'cpu' or 'cuda:0', "
                     "or 'auto' on a machine with one device")


def _download(repo_id: str, hub: dict[str, Any], subfolder: str = "") -> str:
    """A Hub repository id: fetch only its JSON and safetensors files (nothing pickled, no code)."""
    from huggingface_hub import snapshot_download

    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    return snapshot_download(repo_id, allow_patterns=[f"{prefix}*.json", f"{prefix}*.safetensors"], **hub)


def register() -> None:
    """Register with the Auto classes (idempotent). Done on import of this module."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(MODEL_TYPE, RavenConfig)
    if RavenConfig not in AutoModelForCausalLM._model_mapping:
        AutoModelForCausalLM.register(RavenConfig, RavenForCausalLM)
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    if RavenConfig not in TOKENIZER_MAPPING:
        AutoTokenizer.register(RavenConfig, fast_tokenizer_class=RavenTokenizerFast)


register()
