"""ByteDance's Ouro ("Scaling Latent Reasoning via Looped Language Models"; docs/model-families.md):
config.json model_type "ouro", the whole layer stack looped `total_ut_steps` times, tensors in transformers'
Llama names (`model.layers.{i}.*`, with a second pair of norms) and a learned exit gate. In rdlm it is a
core block of every layer, no prelude or coda, s_0 = e, no injection, peri-norm blocks and the final norm
after every loop."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from rdlm.model.config import RDLMConfig
from rdlm.model.families.base import CheckpointError, FamilyAdapter, check_key_types, rdlm_section, with_rdlm_section
from rdlm.model.families.llama_layers import LAYER_PARTS, inverse, spelled, split, split_sizes

_NORMS = {
    "norm_1.weight": "input_layernorm.weight",
    "norm_2.weight": "input_layernorm_2.weight",
    "norm_3.weight": "post_attention_layernorm.weight",
    "norm_4.weight": "post_attention_layernorm_2.weight",
}
_TOP = {
    "embedding.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "exit_gate.weight": "model.early_exit_gate.weight",
    "exit_gate.bias": "model.early_exit_gate.bias",
    "lm_head.weight": "lm_head.weight",
}
_PARTS = {**LAYER_PARTS, **{ours: (theirs,) for ours, theirs in _NORMS.items()}}
_LAYER_RE = re.compile(r"^(prelude|core|coda)\.(\d+)\.(.+)$")
_OURO_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Ouro config keys that must hold these values, or rdlm would compute something else.
_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "use_sliding_window": False}
# What the layout can hold: the config fields every Ouro model has.
_SHAPE = dict(
    prelude_layers=0,
    coda_layers=0,
    norm_scheme="peri",
    injection="none",
    state_init="embedding",
    final_norm="loop",
    exit_gate=True,
    rope_pairs="halves",
    qk_bias=False,
    qk_norm=False,
    embedding_scale=1.0,
)


class OuroAdapter(FamilyAdapter):
    name = "ouro"
    model_type = "ouro"

    def claims(self, raw: Mapping[str, Any], tensor_names: set[str] | None) -> bool:
        return True  # the only family of its model_type

    # ---- config.json

    def config_from_json(self, raw: Mapping[str, Any], source: str) -> RDLMConfig:
        required = (
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        )
        missing = [key for key in required if key not in raw]
        if missing:
            raise CheckpointError(f"{source}: missing required key(s) {', '.join(missing)}")
        check_key_types(
            raw,
            {
                **dict.fromkeys((*required, "num_key_value_heads", "head_dim", "total_ut_steps"), "integer"),
                "rope_theta": "number",
                "rms_norm_eps": "number",
                "early_exit_threshold": "number",
                "tie_word_embeddings": "boolean",
            },
            source,
        )
        for key, expected in _FIXED.items():
            if key in raw and raw[key] != expected:
                raise CheckpointError(f"{source}: {key}={raw[key]!r} is not supported (expected {expected!r})")
        if any(kind != "full_attention" for kind in raw.get("layer_types") or ()):
            raise CheckpointError(
                f"{source}: layer_types other than full_attention (sliding windows) are not supported"
            )
        steps = raw.get("total_ut_steps", 4)
        heads = raw["num_attention_heads"]
        values = {
            "family": "ouro",
            "prelude_layers": 0,
            "core_layers": raw["num_hidden_layers"],
            "coda_layers": 0,
            "hidden_size": raw["hidden_size"],
            "num_heads": heads,
            "intermediate_size": raw["intermediate_size"],
            "vocab_size": raw["vocab_size"],
            "context_length": raw["max_position_embeddings"],
            "rope_base": float(raw.get("rope_theta", 10000.0)),
            "rope_scaling": raw.get("rope_scaling"),
            "rope_pairs": "halves",
            "norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
            "qk_bias": False,
            "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
            "norm_scheme": "peri",
            "injection": "none",
            "state_init": "embedding",
            "final_norm": "loop",
            "embed_scale": 1.0,
            "exit_gate": True,
            "exit_threshold": raw.get("early_exit_threshold"),
            # Ouro trains with a fixed number of loops; rdlm's default r is that number.
            "mean_recurrence": steps,
            "backprop_depth": steps,
            "recurrence_sampler": "fixed",
        }
        kv = raw.get("num_key_value_heads")
        if kv is not None and kv != heads:
            values["num_kv_heads"] = kv
        if raw.get("head_dim") is not None and raw["head_dim"] * heads != raw["hidden_size"]:
            values["head_size"] = raw["head_dim"]
        return with_rdlm_section(values, raw, source)

    def config_to_json(self, config: RDLMConfig, dtype: torch.dtype) -> dict[str, Any]:
        for key, value in _SHAPE.items():
            if getattr(config, key) != value:
                raise CheckpointError(f"the Ouro layout needs {key}={value!r}, this model has {getattr(config, key)!r}")
        return {
            "architectures": ["OuroForCausalLM"],
            "model_type": "ouro",
            "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.kv_heads,
            "head_dim": config.head_dim,
            "num_hidden_layers": config.core_layers,
            "intermediate_size": config.intermediate_size,
            "vocab_size": config.vocab_size,
            "max_position_embeddings": config.context_length,
            "rope_theta": config.rope_base,
            "rope_scaling": config.rope_scaling,
            "rms_norm_eps": config.norm_eps,
            "tie_word_embeddings": config.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "layer_types": ["full_attention"] * config.core_layers,
            "max_window_layers": config.core_layers,
            "total_ut_steps": config.mean_recurrence,
            "early_exit_threshold": config.exit_threshold,
            "use_cache": True,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "rdlm": rdlm_section(config, general=False),
        }

    # ---- tensors: the fused q/k/v and gate/up projections are split in the file

    def to_file(self, params: Mapping[str, Tensor], config: RDLMConfig) -> dict[str, Tensor]:
        sizes = split_sizes(config)
        out: dict[str, Tensor] = {}
        for name, tensor in params.items():
            if name in _TOP:
                out[_TOP[name]] = tensor
                continue
            match = _LAYER_RE.match(name)
            if not match or match.group(1) != "core" or match.group(3) not in _PARTS:
                raise KeyError(f"rdlm parameter {name!r} has no Ouro name")
            part = match.group(3)
            out.update(
                {
                    f"model.layers.{match.group(2)}.{theirs}": t
                    for theirs, t in split(tensor, _PARTS[part], sizes.get(part)).items()
                }
            )
        return {name: t.contiguous() for name, t in out.items()}

    def from_file(self, tensors: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
        """A layer missing one of its q/k/v or gate/up tensors keeps none of them, so the caller reports the
        fused parameter as missing."""
        top = {theirs: ours for ours, theirs in _TOP.items()}
        holder = inverse(_PARTS)
        state: dict[str, Tensor] = {}
        unexpected: list[str] = []
        layers: dict[str, dict[str, Tensor]] = {}
        for name, tensor in tensors.items():
            if name in top:
                state[top[name]] = tensor
                continue
            match = _OURO_LAYER_RE.match(name)
            part = match.group(2) if match else None
            if match is None or part not in holder:
                unexpected.append(name)
            elif len(_PARTS[holder[part]]) == 1:
                state[f"core.{match.group(1)}.{holder[part]}"] = tensor
            else:
                layers.setdefault(match.group(1), {})[part] = tensor
        for index, parts in layers.items():
            for ours, theirs in _PARTS.items():
                if len(theirs) > 1 and all(name in parts for name in theirs):
                    state[f"core.{index}.{ours}"] = torch.cat([parts[name] for name in theirs])
        return state, unexpected

    def file_name(self, name: str) -> str:
        if name in _TOP:
            return _TOP[name]
        match = _LAYER_RE.match(name)
        if match and match.group(1) == "core" and match.group(3) in _PARTS:
            return f"model.layers.{match.group(2)}.{spelled(_PARTS[match.group(3)])}"
        return name

    def quantized_from_file(self, tensors: dict[str, Tensor], source: str | os.PathLike) -> dict[str, Tensor]:
        raise CheckpointError(f"{source}: a quantized checkpoint in Ouro's layout is not supported")

    def quantized_to_file(self, tensors: Mapping[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
        raise CheckpointError(
            "a quantized model in Ouro's layout cannot be saved; save the unquantized model "
            "and quantize it when loading (--quantize)"
        )


OURO = OuroAdapter()
