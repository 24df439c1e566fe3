"""The checkpoint layouts of the looped-model families rdlm runs (docs/model-families.md).

One `RecurrentDepthLM` runs them all; a family is a configuration of it plus a file layout:

- "huginn": Huginn-0125 (Geiping et al. 2025), config.json model_type "huginn_raven".
- "retrofit-llama" / "retrofit-olmo": McLeish et al. 2025's retrofitted models, stored in the Huginn
  layout with more keys (`num_key_value_heads`, `head_dim`, `rope_theta`, `rope_scaling`,
  `init_values.embed_scale`, `bias`) and pre-norm blocks (Llama) or post-norm blocks with QK-norm (OLMo-2),
  whose two norms are called `norm_1` and `norm_2`.
- "ouro": ByteDance's Ouro, model_type "ouro": the whole layer stack looped `total_ut_steps` times, in
  transformers' Llama-style tensor names, with a learned exit gate.

This module maps names and tensors between rdlm and those layouts and reads/writes the keys that only
the retrofitted and Ouro configs have; `rdlm.model.huginn` reads and writes the directories. Remote
code shipped beside a checkpoint (`auto_map`) is never imported: the config keys say everything.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

import torch
from torch import Tensor

from rdlm.model.config import RDLMConfig


class CheckpointError(ValueError):
    """A model directory or weight file is missing, malformed, or does not fit the config."""


# ------------------------------------------------------------------------------------------------
# Recognising a checkpoint

_JSON_KINDS = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
               dict: "an object", type(None): "null"}
_ACCEPTS = {"integer": (int,), "number": (int, float), "boolean": (bool,)}


def check_key_types(raw: Mapping[str, Any], kinds: Mapping[str, str], source: str) -> None:
    """Refuse a config.json key of the wrong JSON type ("integer", "number" or "boolean"), naming the key as
    the file spells it: `"n_embd": "64"` is a string, not the integer the model's shape needs."""
    for key, kind in kinds.items():
        value = raw.get(key)
        if value is None:
            continue
        wrong_bool = isinstance(value, bool) and kind != "boolean"
        if wrong_bool or not isinstance(value, _ACCEPTS[kind]):
            raise CheckpointError(f"{source}: {key} must be {'an' if kind == 'integer' else 'a'} {kind}, got "
                                  f"{value!r} ({_JSON_KINDS.get(type(value), type(value).__name__)})")

def standard_rope_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` with RoPE in the config.json spelling (`rope_theta`, `rope_scaling`): transformers 5 keeps both
    inside `rope_parameters` (its configs' `to_dict()`), which is read the same way."""
    raw = dict(raw)
    params = raw.pop("rope_parameters", None)
    if isinstance(params, dict):
        params = dict(params)
        theta = params.pop("rope_theta", None)
        if raw.get("rope_theta") is None and theta is not None:
            raw["rope_theta"] = theta
        if raw.get("rope_scaling") is None and params.get("rope_type", "default") != "default":
            raw["rope_scaling"] = params
    if "rope_theta" in raw and raw["rope_theta"] is None:
        del raw["rope_theta"]
    return raw


def family_of(raw: Mapping[str, Any], tensor_names: set[str] | None = None) -> str:
    """The family of a config.json dict (and, for the retrofitted OLMo variant, its tensor names)."""
    kind = raw.get("model_type", "huginn_raven")
    declared = raw.get("rdlm", {}).get("family") if isinstance(raw.get("rdlm"), dict) else None
    if kind == "ouro":
        return "ouro"
    if declared in ("huginn", "retrofit-llama", "retrofit-olmo"):
        return declared
    # Huginn-0125's config has neither key; the retrofitting converters add both RoPE keys.
    if "rope_theta" in raw or raw.get("rope_scaling") is not None:
        # The OLMo variant: its QK-norm tensors, or the modeling file its auto_map names (read, never run).
        auto_map = raw.get("auto_map") if isinstance(raw.get("auto_map"), dict) else {}
        olmo = any(name.endswith("attn.q_norm.weight") for name in tensor_names or ()) or any(
            "olmo" in str(target).lower() for target in auto_map.values())
        return "retrofit-olmo" if olmo else "retrofit-llama"
    return "huginn"


# ------------------------------------------------------------------------------------------------
# Huginn-layout names (Huginn and the retrofitted models)

_GROUPS = {"prelude": "prelude", "core": "core_block", "coda": "coda"}
_PARTS = {"attn.qkv.weight": "attn.Wqkv.weight", "attn.qk_bias": "attn.qk_bias",
          "attn.q_norm.weight": "attn.q_norm.weight", "attn.k_norm.weight": "attn.k_norm.weight",
          "attn.out.weight": "attn.proj.weight", "mlp.fc.weight": "mlp.fc.weight",
          "mlp.out.weight": "mlp.proj.weight", **{f"norm_{i}.weight": f"norm_{i}.weight" for i in range(1, 5)}}
_TOP = {"embedding.weight": "transformer.wte.weight", "adapter.weight": "transformer.adapter.weight",
        "adapter.bias": "transformer.adapter.bias", "final_norm.weight": "transformer.ln_f.weight",
        "lm_head.weight": "lm_head.weight"}
# The retrofitted blocks call their two norms norm_1 and norm_2, whichever places they sit in.
_NORM_NAMES = {"huginn": {}, "retrofit-llama": {"norm_1.weight": "norm_1.weight", "norm_3.weight": "norm_2.weight"},
               "retrofit-olmo": {"norm_2.weight": "norm_1.weight", "norm_4.weight": "norm_2.weight"}}
_LAYER_RE = re.compile(r"^(prelude|core|coda)\.(\d+)\.(.+)$")
_HUGINN_LAYER_RE = re.compile(r"^transformer\.(prelude|core_block|coda)\.(\d+)\.(.+)$")


def to_huginn_name(name: str, family: str = "huginn") -> str:
    if name in _TOP:
        return _TOP[name]
    match = _LAYER_RE.match(name)
    if match and match.group(3) in _PARTS:
        group, index, part = match.groups()
        part = _NORM_NAMES[family].get(part, _PARTS[part])
        return f"transformer.{_GROUPS[group]}.{index}.{part}"
    raise KeyError(f"rdlm parameter {name!r} has no Huginn name")


def from_huginn_name(name: str, family: str = "huginn") -> str | None:
    """The rdlm parameter name of a Huginn-layout tensor name, or None if it names nothing rdlm has."""
    for ours, theirs in _TOP.items():
        if name == theirs:
            return ours
    match = _HUGINN_LAYER_RE.match(name)
    if match:
        group, index, part = match.groups()
        ours_group = {v: k for k, v in _GROUPS.items()}[group]
        renames = _NORM_NAMES[family]
        if renames and part.startswith("norm_"):
            lookup = {theirs: ours for ours, theirs in renames.items()}
        else:
            lookup = {theirs: ours for ours, theirs in _PARTS.items()}
        if part in lookup:
            return f"{ours_group}.{index}.{lookup[part]}"
    return None


# ------------------------------------------------------------------------------------------------
# Retrofitted models: the keys beyond Huginn's

def retrofit_fields(raw: Mapping[str, Any], family: str, source: str) -> dict[str, Any]:
    """RDLMConfig fields of a retrofitted checkpoint's own keys (the Huginn keys are read as Huginn's)."""
    heads = raw.get("n_heads", raw.get("num_attention_heads"))
    values: dict[str, Any] = {
        "family": family, "rope_pairs": "halves", "qk_bias": bool(raw.get("qk_bias", False)),
        "tie_embeddings": bool(raw.get("tie_embeddings", False)), "adapter_bias": bool(raw.get("bias", False)),
        "norm_scheme": "postnorm" if family == "retrofit-olmo" else "prenorm", "qk_norm": family == "retrofit-olmo",
        "final_norm": "output", "rope_scaling": raw.get("rope_scaling"),
    }
    if raw.get("rope_theta") is not None:
        values["rope_base"] = float(raw["rope_theta"])
    kv = raw.get("num_key_value_heads")
    if kv is not None and kv != heads:
        values["num_kv_heads"] = kv
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim * heads != raw.get("n_embd", raw.get("hidden_size")):
        if family == "retrofit-llama":  # its attention reshapes to n_embd / n_heads whatever head_dim says
            raise CheckpointError(f"{source}: head_dim={head_dim} is not n_embd / n_heads, which the "
                                  "retrofitted Llama layout requires")
        values["head_size"] = head_dim
    if raw.get("max_position_embeddings") is not None:  # the base model's context, which its RoPE serves
        values["context_length"] = int(raw["max_position_embeddings"])
    scale = raw.get("init_values", {}).get("embed_scale") if isinstance(raw.get("init_values"), dict) else None
    if scale is not None:
        values["embed_scale"] = None if scale == math.sqrt(raw.get("n_embd", 0)) else float(scale)
    mode = raw.get("initial_state_mode", "random")
    if mode == "embed-init":
        values["state_init"] = "embedding"
    elif mode != "random":
        raise CheckpointError(f"{source}: initial_state_mode={mode!r} is not supported (random, embed-init)")
    return values


def retrofit_keys(config: RDLMConfig) -> dict[str, Any]:
    """The keys a retrofitted checkpoint has beyond Huginn's, so the authors' code loads what rdlm saves."""
    return {"num_key_value_heads": config.kv_heads, "head_dim": config.head_dim, "rope_theta": config.rope_base,
            "rope_scaling": config.rope_scaling, "max_position_embeddings": config.context_length,
            "bias": config.adapter_bias, "tie_word_embeddings": config.tie_embeddings,
            "initial_state_mode": "embed-init" if config.state_init == "embedding" else "random"}


# ------------------------------------------------------------------------------------------------
# Ouro

_OURO_NORMS = {"norm_1.weight": "input_layernorm.weight", "norm_2.weight": "input_layernorm_2.weight",
               "norm_3.weight": "post_attention_layernorm.weight",
               "norm_4.weight": "post_attention_layernorm_2.weight"}
_OURO_TOP = {"embedding.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
             "exit_gate.weight": "model.early_exit_gate.weight", "exit_gate.bias": "model.early_exit_gate.bias",
             "lm_head.weight": "lm_head.weight"}
_OURO_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Ouro config keys that must hold these values, or rdlm would compute something else.
_OURO_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "use_sliding_window": False}


def config_from_ouro(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """RDLMConfig fields of an Ouro config.json."""
    required = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                "max_position_embeddings")
    missing = [key for key in required if key not in raw]
    if missing:
        raise CheckpointError(f"{source}: missing required key(s) {', '.join(missing)}")
    check_key_types(raw, {**dict.fromkeys((*required, "num_key_value_heads", "head_dim", "total_ut_steps"),
                                          "integer"),
                          "rope_theta": "number", "rms_norm_eps": "number", "early_exit_threshold": "number",
                          "tie_word_embeddings": "boolean"}, source)
    for key, expected in _OURO_FIXED.items():
        if key in raw and raw[key] != expected:
            raise CheckpointError(f"{source}: {key}={raw[key]!r} is not supported (expected {expected!r})")
    if any(kind != "full_attention" for kind in raw.get("layer_types") or ()):
        raise CheckpointError(f"{source}: layer_types other than full_attention (sliding windows) are not supported")
    steps = raw.get("total_ut_steps", 4)
    heads = raw["num_attention_heads"]
    values = {
        "family": "ouro", "prelude_layers": 0, "core_layers": raw["num_hidden_layers"], "coda_layers": 0,
        "hidden_size": raw["hidden_size"], "num_heads": heads, "intermediate_size": raw["intermediate_size"],
        "vocab_size": raw["vocab_size"], "context_length": raw["max_position_embeddings"],
        "rope_base": float(raw.get("rope_theta", 10000.0)), "rope_scaling": raw.get("rope_scaling"),
        "rope_pairs": "halves", "norm_eps": float(raw.get("rms_norm_eps", 1e-6)), "qk_bias": False,
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)), "norm_scheme": "peri", "injection": "none",
        "state_init": "embedding", "final_norm": "loop", "embed_scale": 1.0, "exit_gate": True,
        "exit_threshold": raw.get("early_exit_threshold"),
        # Ouro trains with a fixed number of loops; rdlm's default r is that number.
        "mean_recurrence": steps, "backprop_depth": steps, "recurrence_sampler": "fixed",
    }
    kv = raw.get("num_key_value_heads")
    if kv is not None and kv != heads:
        values["num_kv_heads"] = kv
    if raw.get("head_dim") is not None and raw["head_dim"] * heads != raw["hidden_size"]:
        values["head_size"] = raw["head_dim"]
    return values


def config_to_ouro(config: RDLMConfig, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim, "num_hidden_layers": config.core_layers,
        "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
        "max_position_embeddings": config.context_length, "rope_theta": config.rope_base,
        "rope_scaling": config.rope_scaling, "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
        "layer_types": ["full_attention"] * config.core_layers, "max_window_layers": config.core_layers,
        "total_ut_steps": config.mean_recurrence, "early_exit_threshold": config.exit_threshold,
        "use_cache": True, "torch_dtype": str(dtype).removeprefix("torch."),
    }


def check_ouro_shape(config: RDLMConfig) -> None:
    """Raise CheckpointError unless `config` is what the Ouro layout can hold."""
    expected = dict(prelude_layers=0, coda_layers=0, norm_scheme="peri", injection="none", state_init="embedding",
                    final_norm="loop", exit_gate=True, rope_pairs="halves", qk_bias=False, qk_norm=False,
                    embedding_scale=1.0)
    for key, value in expected.items():
        if getattr(config, key) != value:
            raise CheckpointError(f"the Ouro layout needs {key}={value!r}, this model has {getattr(config, key)!r}")


def to_ouro_tensors(params: Mapping[str, Tensor], config: RDLMConfig) -> dict[str, Tensor]:
    """rdlm parameters -> Ouro tensors: the fused q/k/v and gate/up projections are split."""
    q_rows, kv_rows = config.num_heads * config.head_dim, config.kv_heads * config.head_dim
    out: dict[str, Tensor] = {}
    for name, tensor in params.items():
        if name in _OURO_TOP:
            out[_OURO_TOP[name]] = tensor
            continue
        match = _LAYER_RE.match(name)
        if not match or match.group(1) != "core":
            raise KeyError(f"rdlm parameter {name!r} has no Ouro name")
        prefix, part = f"model.layers.{match.group(2)}", match.group(3)
        if part == "attn.qkv.weight":
            q, k, v = tensor.split((q_rows, kv_rows, kv_rows))
            out.update({f"{prefix}.self_attn.q_proj.weight": q, f"{prefix}.self_attn.k_proj.weight": k,
                        f"{prefix}.self_attn.v_proj.weight": v})
        elif part == "attn.out.weight":
            out[f"{prefix}.self_attn.o_proj.weight"] = tensor
        elif part == "mlp.fc.weight":
            gate, up = tensor.chunk(2)
            out.update({f"{prefix}.mlp.gate_proj.weight": gate, f"{prefix}.mlp.up_proj.weight": up})
        elif part == "mlp.out.weight":
            out[f"{prefix}.mlp.down_proj.weight"] = tensor
        elif part in _OURO_NORMS:
            out[f"{prefix}.{_OURO_NORMS[part]}"] = tensor
        else:
            raise KeyError(f"rdlm parameter {name!r} has no Ouro name")
    return {name: t.contiguous() for name, t in out.items()}


def from_ouro_tensors(tensors: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """Ouro tensors -> (rdlm parameters, names rdlm has no place for). A layer missing one of its q/k/v
    or gate/up tensors keeps none of them, so the caller reports the fused parameter as missing."""
    top = {theirs: ours for ours, theirs in _OURO_TOP.items()}
    norms = {theirs: ours for ours, theirs in _OURO_NORMS.items()}
    state: dict[str, Tensor] = {}
    unexpected: list[str] = []
    layers: dict[str, dict[str, Tensor]] = {}
    for name, tensor in tensors.items():
        if name in top:
            state[top[name]] = tensor
            continue
        match = _OURO_LAYER_RE.match(name)
        part = match.group(2) if match else None
        if part in norms:
            state[f"core.{match.group(1)}.{norms[part]}"] = tensor
        elif part == "self_attn.o_proj.weight":
            state[f"core.{match.group(1)}.attn.out.weight"] = tensor
        elif part == "mlp.down_proj.weight":
            state[f"core.{match.group(1)}.mlp.out.weight"] = tensor
        elif part in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                      "mlp.gate_proj.weight", "mlp.up_proj.weight"):
            layers.setdefault(match.group(1), {})[part] = tensor
        else:
            unexpected.append(name)
    for index, parts in layers.items():
        qkv = [parts.get(f"self_attn.{p}_proj.weight") for p in "qkv"]
        if all(t is not None for t in qkv):
            state[f"core.{index}.attn.qkv.weight"] = torch.cat(qkv)
        gate_up = [parts.get(f"mlp.{p}_proj.weight") for p in ("gate", "up")]
        if all(t is not None for t in gate_up):
            state[f"core.{index}.mlp.fc.weight"] = torch.cat(gate_up)
    return state, unexpected


def ouro_name(name: str) -> str:
    """The Ouro tensor name(s) of an rdlm parameter, for messages."""
    if name in _OURO_TOP:
        return _OURO_TOP[name]
    match = _LAYER_RE.match(name)
    parts = {"attn.qkv.weight": "self_attn.{q,k,v}_proj.weight", "attn.out.weight": "self_attn.o_proj.weight",
             "mlp.fc.weight": "mlp.{gate,up}_proj.weight", "mlp.out.weight": "mlp.down_proj.weight", **_OURO_NORMS}
    if match and match.group(1) == "core" and match.group(3) in parts:
        return f"model.layers.{match.group(2)}.{parts[match.group(3)]}"
    return name
