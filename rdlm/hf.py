"""Hugging Face `transformers` integration: a config + model pair for model_type "huginn_raven".

    import rdlm.hf  # registers the classes with AutoConfig / AutoModelForCausalLM / AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("path/to/huginn-dir")          # no trust_remote_code
    out = model.generate(ids, max_new_tokens=32, num_steps=16, do_sample=False)

The released Huginn-0125 `config.json` names the authors' remote code in `auto_map`. Once the type
"huginn_raven" is registered locally, transformers resolves to the local classes and never asks for
`trust_remote_code`. The weights are read and written by `rdlm.huginn`, the one home of the Huginn
layout: `RavenForCausalLM` wraps a `RecurrentDepthLM` and only adapts calling conventions.

Supported transformers versions: SUPPORTED_TRANSFORMERS below (configs are dataclasses from 5.0 on).
"""

from __future__ import annotations

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
        raise ImportError("rdlm.hf needs transformers: pip install 'rdlm[hf]'") from err
    from packaging.version import Version

    version = Version(transformers.__version__)
    if not Version("5.0") <= version < Version("6"):
        raise ImportError(f"rdlm.hf supports transformers {','.join(SUPPORTED_TRANSFORMERS)}, found "
                          f"{transformers.__version__}; pip install 'transformers{','.join(SUPPORTED_TRANSFORMERS)}'")


_check_transformers_version()

from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer,  # noqa: E402
                          GenerationMixin, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerFast)
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

from rdlm import huginn  # noqa: E402
from rdlm.config import RDLMConfig  # noqa: E402
from rdlm.model import RecurrentDepthLM, causal_mask  # noqa: E402

MODEL_TYPE = huginn.MODEL_TYPE
# generate() arguments that only rdlm.generate implements (per-token compute and its KV cache).
RDLM_GENERATION_OPTIONS = ("exit_criterion", "exit_threshold", "kv_cache_budget", "continuous_cot", "draft_steps")
# The authors' RavenForCausalLM.generate spells some of them differently: criterion ("none" = off),
# exit_threshold "auto" (= the criterion's default), continuous_compute.
REFERENCE_GENERATION_NAMES = {"criterion": "exit_criterion", "continuous_compute": "continuous_cot"}
# forward() keywords transformers' machinery may pass that change nothing at these values.
_INERT_FORWARD_KWARGS = {"use_cache": (None, False), "past_key_values": (None,), "output_attentions": (None, False),
                         "output_hidden_states": (None, False)}


class RavenConfig(PreTrainedConfig):
    """The Huginn config.json keys (SPEC section 2); defaults are Huginn-0125's.

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


class RavenForCausalLM(PreTrainedModel, GenerationMixin):
    """`RecurrentDepthLM` behind the transformers causal-LM interface.

    Extra forward/generate arguments: `num_steps` (core iterations r, default the config's mean
    recurrence) and `init_scale` (scale of the random initial state s_0; 0 gives the deterministic
    all-zero state). forward also takes a given s_0 as `input_states` (the reference's name) or
    `initial_state` (rdlm's), [batch, seq, hidden].
    """

    config_class = RavenConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config: RavenConfig, model: RecurrentDepthLM | None = None) -> None:
        super().__init__(config)
        self.model = model if model is not None else RecurrentDepthLM(config.to_rdlm())
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        # RecurrentDepthLM initializes itself (Takase et al., SPEC section 1); loaded weights replace it.
        pass

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embedding

    # ----------------------------------------------------------------------------------------------
    # Files: always through rdlm.huginn

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any,
                        config: RavenConfig | None = None, dtype: Any = None, torch_dtype: Any = None,
                        device_map: Any = None, **kwargs: Any) -> "RavenForCausalLM":
        """Load a Huginn-layout directory with `rdlm.huginn.load_pretrained`.

        dtype (or torch_dtype): None / "auto" keeps the file's dtype; a torch dtype or its name casts.
        device_map: None, or one device ("cpu", "cuda", "cuda:0").
        """
        path = Path(pretrained_model_name_or_path)
        if not path.is_dir():
            path = Path(_download(str(pretrained_model_name_or_path), kwargs))
        model = huginn.load_pretrained(path, dtype=_resolve_dtype(dtype if dtype is not None else torch_dtype),
                                       device=_resolve_device(device_map))
        if config is None or not isinstance(config, RavenConfig):
            config = RavenConfig.from_pretrained(path)
        config.name_or_path = str(pretrained_model_name_or_path)
        return cls.from_model(model, config)

    @classmethod
    def from_model(cls, model: RecurrentDepthLM, config: RavenConfig | None = None,
                   **config_overrides: Any) -> "RavenForCausalLM":
        """Wrap an rdlm model (weights shared, not copied)."""
        if config is None:
            config = RavenConfig(**{**huginn.config_to_huginn(model.config), **config_overrides})
        with torch.device("meta"):  # a placeholder model, replaced at once: no random init of real weights
            wrapper = cls(config, model=RecurrentDepthLM(model.config))
        wrapper.model = model
        return wrapper.eval()

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, dtype: torch.dtype | None = None,
                        max_shard_bytes: int = huginn.DEFAULT_SHARD_BYTES, **kwargs: Any) -> None:
        """Write the Huginn layout with `rdlm.huginn.save_pretrained` (atomic, sharded when large)."""
        huginn.save_pretrained(self.model, save_directory, dtype=dtype, max_shard_bytes=max_shard_bytes)

    # ----------------------------------------------------------------------------------------------

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None,
                num_steps: int | None = None, init_scale: float = 1.0, input_states: Tensor | None = None,
                initial_state: Tensor | None = None, cache_position: Tensor | None = None,
                return_dict: bool | None = None, **kwargs: Any) -> CausalLMOutputWithPast | tuple:
        """attention_mask: transformers' [batch, seq] padding mask (1 = real token), left or right padded.
        labels: transformers' convention, the input ids themselves (shifted here), -100 ignored.
        input_states / initial_state: s_0 instead of a random draw (give one of them).
        Keywords this wrapper does not implement are an error, never silently dropped."""
        unknown = sorted(k for k, v in kwargs.items() if k not in _INERT_FORWARD_KWARGS)
        if unknown:
            raise TypeError(f"{type(self).__name__}.forward() got unexpected keyword argument(s) "
                            f"{', '.join(map(repr, unknown))}")
        active = sorted(k for k, v in kwargs.items() if v not in _INERT_FORWARD_KWARGS[k])
        if active:
            raise ValueError(f"{type(self).__name__}.forward() does not support {', '.join(active)} "
                             "(no transformers cache, attentions or hidden states; use rdlm.generate for cached "
                             "decoding)")
        if input_states is not None and initial_state is not None:
            raise ValueError("give the initial state as input_states or initial_state, not both")
        state = input_states if input_states is not None else initial_state
        if position_ids is None and cache_position is not None:
            position_ids = cache_position
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = padding_attention_mask(attention_mask)
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        out = self.model(input_ids, num_steps=num_steps, initial_state=state, init_scale=init_scale,
                         positions=position_ids, attention_mask=mask)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        result = CausalLMOutputWithPast(loss=loss, logits=out.logits)
        return result.to_tuple() if return_dict is False else result

    def prepare_inputs_for_generation(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                                      num_steps: int | None = None, init_scale: float = 1.0,
                                      **kwargs: Any) -> dict[str, Any]:
        # Every decoding step recomputes the whole sequence: no transformers cache is used, since the
        # recurrence keeps one KV entry per core iteration (rdlm's own cache handles that).
        return {"input_ids": input_ids, "attention_mask": attention_mask, "num_steps": num_steps,
                "init_scale": init_scale}

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def generate(self, inputs: Tensor | None = None, **kwargs: Any):
        """transformers' generate, with `num_steps` and `init_scale`. Any of RDLM_GENERATION_OPTIONS
        (per-token exits, KV-cache budget, continuous CoT, self-speculative drafts; paper section 6)
        hands the call to rdlm.generate, which decodes over its recurrent KV cache.

        The authors' spelling works too, so their scripts run unchanged: `criterion=` ("none" = no
        adaptive exits), `exit_threshold=` ("auto" = the criterion's default), `continuous_compute=`."""
        kwargs = _rdlm_generation_names(kwargs)
        if any(kwargs.get(name) is not None for name in RDLM_GENERATION_OPTIONS):
            return self._generate_rdlm(inputs if inputs is not None else kwargs.pop("input_ids"), **kwargs)
        kwargs.setdefault("use_cache", False)
        return super().generate(inputs, **kwargs)

    @torch.inference_mode()
    def _generate_rdlm(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                       max_new_tokens: int = 20, num_steps: int | None = None, do_sample: bool = False,
                       temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                       eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                       init_scale: float = 1.0, seed: int = 0, exit_criterion: str | None = None,
                       exit_threshold: float | None = None, min_steps: int = 2,
                       kv_cache_budget: int | None = None, continuous_cot: bool = False,
                       draft_steps: int | None = None, draft_length: int = 4, **unused: Any) -> Tensor:
        from rdlm.generate import GenerationConfig, generate

        if unused:
            raise ValueError(f"generate with rdlm options does not take {', '.join(sorted(unused))}")
        if exit_threshold is not None and exit_criterion is None:
            raise ValueError("exit_threshold needs an exit criterion (exit_criterion= or criterion=)")
        mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        prompts = [row[keep].tolist() for row, keep in zip(input_ids, mask)]
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        pad = self.config.pad_token_id if pad_token_id is None else pad_token_id
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, num_steps=num_steps or self.model.config.mean_recurrence,
            exit_criterion=exit_criterion, exit_threshold=exit_threshold, min_steps=min_steps,
            temperature=temperature if do_sample else 0.0, top_k=top_k if do_sample else None,
            top_p=top_p if do_sample else None,
            stop_tokens=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            cache_strategy="shared" if kv_cache_budget else "full", cache_slots=kv_cache_budget,
            continuous_cot=continuous_cot, init_scale=init_scale, seed=seed, draft_steps=draft_steps,
            draft_length=draft_length)
        result = generate(self.model, prompts, config)
        width = max((len(t) for t in result.tokens), default=0)
        new = torch.full((len(prompts), width), pad if pad is not None else 0, dtype=input_ids.dtype)
        for row, tokens in enumerate(result.tokens):
            new[row, :len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
        return torch.cat([input_ids, new.to(input_ids.device)], dim=1)


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
    """A tokenizer.json with the SPEC section 2 special tokens and chat template by default
    (BOS first, then <|begin_header|>ROLE<|end_header|>\\n\\nTEXT<|end_turn|> per turn, assistant "Huginn")."""

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


BOS, EOS, BEGIN_HEADER, END_HEADER, END_TURN, PAD = ("<|begin_text|>", "<|end_text|>", "<|begin_header|>",
                                                     "<|end_header|>", "<|end_turn|>", "<|pad|>")
SPECIAL_TOKENS = (BOS, EOS, BEGIN_HEADER, END_HEADER, END_TURN, PAD)
# SPEC section 2: the first turn is preceded by BOS; the assistant role is named "Huginn".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|begin_header|>' + ('Huginn' if message['role'] == 'assistant' else message['role'])"
    " + '<|end_header|>\\n\\n' + message['content'] | trim + '<|end_turn|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}{% endif %}"
)


def _resolve_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    resolved = getattr(torch, name) if name.isidentifier() and hasattr(torch, name) else None
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype (e.g. 'bfloat16', 'float32', 'auto')")
    return resolved


def _resolve_device(device_map: Any) -> torch.device:
    if device_map is None:
        return torch.device("cpu")
    if isinstance(device_map, (str, torch.device, int)) and str(device_map) not in ("auto", "balanced"):
        return torch.device(device_map if not isinstance(device_map, int) else f"cuda:{device_map}")
    raise ValueError(f"device_map={device_map!r} is not supported: pass one device such as 'cpu' or 'cuda'")


def _download(repo_id: str, kwargs: dict[str, Any]) -> str:
    """A Hub repository id: fetch only its JSON and safetensors files (nothing pickled, no code)."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"),
                             allow_patterns=["*.json", "*.safetensors"])


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
