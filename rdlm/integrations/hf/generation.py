"""transformers' `generate` on rdlm's decode engine: the generation config's options mapped onto
`rdlm.inference.params.GenerationConfig`, the ones that cannot be honoured refused by name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.utils import GenerateDecoderOnlyOutput

from rdlm.inference.generate import generate
from rdlm.inference.params import GenerationConfig as RDLMGenerationConfig
from rdlm.inference.params import kv_cache_budget, params_for
from rdlm.model.config import RDLMConfig

if TYPE_CHECKING:
    from rdlm.model.lm import RecurrentDepthLM

# The authors' RavenForCausalLM.generate spells some of rdlm's options differently: criterion ("none" =
# off), exit_threshold "auto" (= the criterion's default), continuous_compute.
REFERENCE_GENERATION_NAMES = {"criterion": "exit_criterion", "continuous_compute": "continuous_cot"}
# rdlm's generation options, as generation_config entries: the parameters rdlm.inference.params declares for
# transformers, with their declared defaults (num_steps None: the model config's mean recurrence).
RDLM_GENERATION_DEFAULTS: dict[str, Any] = {
    p.name: None if p.name == "num_steps" else p.default for p in params_for("transformers")
}
# transformers' generation options generate maps onto rdlm.inference.generate.
MAPPED_GENERATION_OPTIONS = (
    "max_length",
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
    "stop_strings",
    "return_dict_in_generate",
    "use_cache",
)
# Options that only act in modes refused anyway (beam search, assisted decoding, encoder-decoders,
# transformers' own compiled loop), or only on scores that are not returned.
INERT_GENERATION_OPTIONS = (
    "early_stopping",
    "length_penalty",
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
    "assistant_lookbehind",
    "target_lookbehind",
    "max_matching_ngram_size",
    "assistant_ensemble_weight",
    "decoder_start_token_id",
    "renormalize_logits",
    "compile_config",
    "disable_compile",
    "output_attentions",
    "output_hidden_states",
)


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
        if (
            name.startswith("_")
            or name == "transformers_version"
            or name in RDLM_GENERATION_DEFAULTS
            or name in MAPPED_GENERATION_OPTIONS
            or name in INERT_GENERATION_OPTIONS
        ):
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


def to_rdlm_config(
    config: GenerationConfig, default_steps: int, stop: tuple[int, ...], max_new: int
) -> RDLMGenerationConfig:
    """A transformers generation config (with rdlm's fields, already checked) as rdlm's: greedy unless
    do_sample with a temperature, r defaulting to the model's mean recurrence."""
    rdlm = {name: getattr(config, name) for name in RDLM_GENERATION_DEFAULTS if name != "kv_cache_budget"}
    fields: Any = config  # rdlm's fields are extra attributes of transformers' config, unknown to its type
    rdlm.update(
        num_steps=fields.num_steps if fields.num_steps is not None else default_steps,
        exit_threshold=fields.exit_threshold if fields.exit_criterion is not None else None,
        continuous_cot=bool(fields.continuous_cot),
        init_scale=float(fields.init_scale),
        seed=int(fields.seed),
        **kv_cache_budget(fields.kv_cache_budget),
    )
    sampling = config.do_sample and config.temperature != 0  # transformers' own options: greedy unless sampling
    return RDLMGenerationConfig(
        max_new_tokens=max_new,
        **rdlm,
        temperature=float(config.temperature) if sampling else 0.0,
        top_k=config.top_k if sampling and config.top_k else None,
        top_p=config.top_p if sampling and config.top_p is not None and config.top_p < 1 else None,
        min_p=config.min_p if sampling else None,
        repetition_penalty=config.repetition_penalty,
        stop_tokens=stop,
        stop_strings=tuple(
            [config.stop_strings] if isinstance(config.stop_strings, str) else config.stop_strings or ()
        ),
    )


def generate_with_engine(
    wrapper: PreTrainedModel,
    inputs: Tensor | None,
    generation_config: GenerationConfig | None,
    streamer: Any,
    **kwargs: Any,
) -> Tensor | GenerateDecoderOnlyOutput:
    """`RavenForCausalLM.generate` (its docstring lists the options): transformers' options merged as
    transformers merges them, mapped onto rdlm's, then decoded by rdlm.inference.generate."""

    kwargs = _rdlm_generation_names(kwargs)
    # a GenerationMixin method: RavenForCausalLM is one (PreTrainedModel is not)
    config, model_kwargs = wrapper._prepare_generation_config(generation_config, **kwargs)  # type: ignore[operator]
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
        raise ValueError(
            f"generate does not support {', '.join(refused)} for rdlm models (rdlm's decode "
            "engine samples one token per row: greedy, or temperature with top-k/top-p/min-p)"
        )
    if input_ids is None:
        input_ids = torch.tensor([[config.bos_token_id]], device=wrapper.device)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got {list(input_ids.shape)}")
    fields: Any = config  # rdlm's fields are extra attributes of transformers' config, unknown to its type
    if fields.exit_criterion == "none":  # the reference's "off", also inside a generation config
        fields.exit_criterion = None
    if kwargs.get("exit_threshold") is not None and fields.exit_criterion is None:
        raise ValueError("exit_threshold needs an exit criterion (exit_criterion= or criterion=)")
    if config.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: generate(..., stop_strings=..., tokenizer=tok)")
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("a streamer takes one prompt at a time (as transformers' streamers do)")
    mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    prompts = [row[keep].tolist() for row, keep in zip(input_ids, mask, strict=True)]
    eos = config.eos_token_id
    stop = tuple(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    pad = config.pad_token_id if config.pad_token_id is not None else (stop[0] if stop else 0)
    max_new = (
        config.max_new_tokens if config.max_new_tokens is not None else max(config.max_length - input_ids.shape[1], 0)
    )
    model = cast("RecurrentDepthLM", wrapper.model)  # RavenForCausalLM's rdlm model
    rdlm_config = to_rdlm_config(config, model.config.mean_recurrence, stop, max_new)
    decode = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else None
    on_token = None
    if streamer is not None:
        streamer.put(input_ids.cpu())
        on_token = lambda event: streamer.put(torch.tensor([event.token]))  # noqa: E731
    result = generate(model, prompts, rdlm_config, decode=decode, on_token=on_token)
    if streamer is not None:
        streamer.end()
    width = max((len(t) for t in result.tokens), default=0)
    new = torch.full((len(prompts), width), pad, dtype=input_ids.dtype)
    for row, tokens in enumerate(result.tokens):
        new[row, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, new.to(input_ids.device)], dim=1)
    if config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=cast(torch.LongTensor, sequences))
    return sequences
