"""Huginn-0125's layout (Geiping et al. 2025; docs/checkpoint-format.md): config.json model_type
"huginn_raven" with the reference code's keys, tensors `transformer.{prelude,core_block,coda}.{i}.*`, and the
RoPE table `freqs_cis` stored beside them. The retrofitted models (`rdlm.model.families.retrofit`) are this
layout with more keys."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from rdlm.model.config import RDLMConfig
from rdlm.model.families.base import CheckpointError, FamilyAdapter, check_key_types, rdlm_section, with_rdlm_section

MODEL_TYPE = "huginn_raven"

_REQUIRED = {
    "n_embd": "hidden_size",
    "n_heads": "num_heads",
    "n_layers_in_prelude": "prelude_layers",
    "n_layers_in_recurrent_block": "core_layers",
    "n_layers_in_coda": "coda_layers",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "block_size": "context_length",
}
_OPTIONAL = {
    "norm_eps": "norm_eps",
    "rope_base": "rope_base",
    "qk_bias": "qk_bias",
    "tie_embeddings": "tie_embeddings",
    "mean_recurrence": "mean_recurrence",
    "mean_backprop_depth": "backprop_depth",
    "test_time_noise": "test_time_noise",
    "test_time_noise_type": "test_time_noise_type",
}
# transformers' generic names, which the reference config maps onto its own (its attribute_map); the
# authors' raven_config_minimal.json spells the heads `num_attention_heads`.
_ALIASES = {
    "num_attention_heads": "n_heads",
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layers",
    "max_position_embeddings": "block_size",
}
# The JSON type of each key read (a retrofitted model's own keys too), checked before any arithmetic on them.
_KINDS = {
    **dict.fromkeys(
        (
            *_REQUIRED,
            "padded_vocab_size",
            "n_layers",
            "mean_recurrence",
            "mean_backprop_depth",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ),
        "integer",
    ),
    **dict.fromkeys(("norm_eps", "rope_base", "rope_theta", "test_time_noise"), "number"),
    **dict.fromkeys(("qk_bias", "tie_embeddings", "bias", "tie_word_embeddings"), "boolean"),
}

_GROUPS = {"prelude": "prelude", "core": "core_block", "coda": "coda"}
_PARTS = {
    "attn.qkv.weight": "attn.Wqkv.weight",
    "attn.qk_bias": "attn.qk_bias",
    "attn.q_norm.weight": "attn.q_norm.weight",
    "attn.k_norm.weight": "attn.k_norm.weight",
    "attn.out.weight": "attn.proj.weight",
    "mlp.fc.weight": "mlp.fc.weight",
    "mlp.out.weight": "mlp.proj.weight",
    **{f"norm_{i}.weight": f"norm_{i}.weight" for i in range(1, 5)},
}
_TOP = {
    "embedding.weight": "transformer.wte.weight",
    "adapter.weight": "transformer.adapter.weight",
    "adapter.bias": "transformer.adapter.bias",
    "final_norm.weight": "transformer.ln_f.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^(prelude|core|coda)\.(\d+)\.(.+)$")
_HUGINN_LAYER_RE = re.compile(r"^transformer\.(prelude|core_block|coda)\.(\d+)\.(.+)$")


def has_rope_keys(raw: Mapping[str, Any]) -> bool:
    """Huginn-0125's config has neither key; the retrofitting converters add both."""
    return "rope_theta" in raw or raw.get("rope_scaling") is not None


class HuginnAdapter(FamilyAdapter):
    """Huginn-0125's layout; the retrofitted families extend it (`_own_fields`, `_own_keys`, `norm_names`)."""

    name = "huginn"
    model_type = MODEL_TYPE
    # rdlm norm parameter -> its name in a block of the file, where that differs from rdlm's.
    norm_names: Mapping[str, str] = {}

    def claims(self, raw: Mapping[str, Any], tensor_names: set[str] | None) -> bool:
        return not has_rope_keys(raw)

    # ---- config.json

    def config_from_json(self, raw: Mapping[str, Any], source: str) -> RDLMConfig:
        """Fields rdlm does not model must hold the values it assumes. Keys that change the reference's
        outputs are honoured: `test_time_noise(_type)` (noise added to the state before every core
        iteration) and `init_values.std` (the scale of the random s_0)."""
        raw = dict(raw)
        for alias, key in _ALIASES.items():
            if alias in raw:
                value = raw.pop(alias)
                if key in raw and raw[key] != value:
                    raise CheckpointError(f"{source}: {alias}={value!r} contradicts {key}={raw[key]!r}")
                raw[key] = value
        missing = [key for key in _REQUIRED if key not in raw]
        if missing:
            raise CheckpointError(f"{source}: missing required key(s) {', '.join(missing)}")
        check_key_types(raw, _KINDS, source)
        values: dict[str, Any] = {
            ours: raw[theirs] for theirs, ours in {**_REQUIRED, **_OPTIONAL}.items() if theirs in raw
        }
        # The reference pads the embedding table; its rows are what the weights hold.
        values["vocab_size"] = raw.get("padded_vocab_size", raw["vocab_size"])
        for key in ("rope_base", "norm_eps", "test_time_noise"):
            if key in values and isinstance(values[key], int) and not isinstance(values[key], bool):
                values[key] = float(values[key])
        init_values = raw.get("init_values", {})
        if not isinstance(init_values, dict):
            raise CheckpointError(f"{source}: init_values must be an object, got {init_values!r}")
        if init_values.get("std") is not None:
            std = init_values["std"]
            if isinstance(std, bool) or not isinstance(std, (int, float)):
                raise CheckpointError(f"{source}: init_values.std must be a number, got {std!r}")
            # The paper's sqrt(2/(5h)) stays the default (None), so configs compare equal after a round trip.
            values["state_init_std"] = None if std == math.sqrt(2 / (5 * raw["n_embd"])) else float(std)
        block = raw.get("block_class_name", "SandwichBlock")
        values["norm_scheme"] = "sandwich" if block == "SandwichBlock" else "prenorm"
        injection = raw.get("injection_type", "linear")
        if injection not in ("linear", "add"):
            raise CheckpointError(f"{source}: injection_type {injection!r} is not supported (linear, add)")
        values["injection"] = "concat" if injection == "linear" else "add"
        values["state_init"] = "zero" if raw.get("state_init") == "zero" else "random"
        unsupported = {"nonlin_name": "SiLU", "mlp_class_name": "GatedMLP", **self._fixed_keys(raw)}
        for key, expected in unsupported.items():
            if key in raw and raw[key] != expected:
                raise CheckpointError(f"{source}: {key}={raw[key]!r} is not supported (expected {expected!r})")
        values.update(self._own_fields(raw, source))
        spelled = {ours: theirs for theirs, ours in {**_REQUIRED, **_OPTIONAL}.items() if theirs in raw}
        return with_rdlm_section(values, raw, source, spelled)

    def _fixed_keys(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """Keys of the file that must hold these values (a Huginn model rdlm saved with grouped-query
        attention says so in its section)."""
        extra = raw.get("rdlm")
        extra = extra if isinstance(extra, dict) else {}
        return dict(bias=False, num_key_value_heads=extra.get("num_kv_heads") or raw.get("n_heads"))

    def _own_fields(self, raw: Mapping[str, Any], source: str) -> dict[str, Any]:
        """Fields read from keys beyond Huginn-0125's."""
        return {}

    def config_to_json(self, config: RDLMConfig, dtype: torch.dtype) -> dict[str, Any]:
        h, depth = config.hidden_size, config.effective_depth
        raw: dict[str, Any] = {
            "architectures": ["RavenForCausalLM"],
            "model_type": MODEL_TYPE,
            **{theirs: getattr(config, ours) for theirs, ours in {**_REQUIRED, **_OPTIONAL}.items()},
            # Keys the reference code reads, so it can load what rdlm saves.
            "padded_vocab_size": config.vocab_size,
            "n_layers": config.prelude_layers + config.core_layers + config.coda_layers,
            "head_dim": config.head_dim,
            "num_key_value_heads": config.kv_heads,
            "bias": False,
            "block_class_name": "SandwichBlock" if config.norm_scheme == "sandwich" else "PreNormBlock",
            "injection_type": "linear" if config.injection == "concat" else "add",
            "state_init": "zero" if config.state_init == "zero" else "like-init",
            "mlp_class_name": "GatedMLP",
            "nonlin_name": "SiLU",
            "norm_class_name": "RMSNorm_llama",
            "effective_expected_depth": depth,
            "init_strategy": "takase",
            "init_values": {
                "std": config.state_std,
                "embedding": math.sqrt(2 / (5 * h)),
                "out_proj": math.sqrt(1 / (5 * h * depth)),
                "embed_scale": config.embedding_scale,
            },
            "test_time_noise": config.test_time_noise,
            "test_time_noise_type": config.test_time_noise_type,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "rdlm": rdlm_section(config, general=True),
        }
        raw.update(self._own_keys(config))
        return raw

    def _own_keys(self, config: RDLMConfig) -> dict[str, Any]:
        """Keys written beyond Huginn-0125's."""
        return {}

    # ---- tensors

    def file_name(self, name: str) -> str:
        if name in _TOP:
            return _TOP[name]
        match = _LAYER_RE.match(name)
        if match and match.group(3) in _PARTS:
            group, index, part = match.groups()
            part = self.norm_names.get(part, _PARTS[part])
            return f"transformer.{_GROUPS[group]}.{index}.{part}"
        raise KeyError(f"rdlm parameter {name!r} has no Huginn name")

    def param_name(self, name: str) -> str | None:
        """The rdlm parameter name of a file's tensor name, or None if it names nothing rdlm has."""
        for ours, theirs in _TOP.items():
            if name == theirs:
                return ours
        match = _HUGINN_LAYER_RE.match(name)
        if match:
            group, index, part = match.groups()
            ours_group = {v: k for k, v in _GROUPS.items()}[group]
            if self.norm_names and part.startswith("norm_"):
                lookup = {theirs: ours for ours, theirs in self.norm_names.items()}
            else:
                lookup = {theirs: ours for ours, theirs in _PARTS.items()}
            if part in lookup:
                return f"{ours_group}.{index}.{lookup[part]}"
        return None

    def from_file(self, tensors: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
        state, unexpected = {}, []
        for name, tensor in tensors.items():
            ours = self.param_name(name)
            if ours is None:
                unexpected.append(name)
            else:
                state[ours] = tensor
        return state, unexpected

    def to_file(self, params: Mapping[str, Tensor], config: RDLMConfig) -> dict[str, Tensor]:
        return {self.file_name(name): tensor for name, tensor in params.items()}

    def quantized_from_file(self, tensors: dict[str, Tensor], source: str | os.PathLike) -> dict[str, Tensor]:
        from rdlm.model.quantize import SUFFIXES

        taken: dict[str, Tensor] = {}
        for name in [n for n in tensors if n.rpartition(".")[2] in SUFFIXES]:
            base, _, suffix = name.rpartition(".")
            ours = self.param_name(f"{base}.weight")
            if ours is None:
                raise CheckpointError(f"{source}: unexpected tensor {name}")
            taken[f"{ours.removesuffix('.weight')}.{suffix}"] = tensors.pop(name)
        return taken

    def quantized_to_file(self, tensors: Mapping[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
        out = {}
        for name, tensor in tensors.items():
            module, _, suffix = name.rpartition(".")
            stored = self.file_name(f"{module}.weight").removesuffix(".weight")
            out[f"{stored}.{suffix}"] = tensor if suffix != "bias" else tensor.to(dtype)
        return out

    def rope_from_file(self, tensors: dict[str, Tensor]) -> Tensor | None:
        return tensors.pop("freqs_cis", None)

    def rope_to_file(self, cos: Tensor, sin: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
        # The model's RoPE table (the one it was loaded with, or computed), in the reference's layout and
        # in the checkpoint's dtype, as the reference saves it.
        rope = torch.stack((cos, sin), dim=-1)[None, :, None]
        return {"freqs_cis": rope.to("cpu", dtype).contiguous()}


HUGINN = HuginnAdapter()
