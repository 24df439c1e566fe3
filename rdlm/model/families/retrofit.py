"""The retrofitted models of McLeish et al. 2025 ("Teaching Pretrained Language Models to Think Deeper with
Retrofitted Recurrence"; docs/retrofit.md): Llama or OLMo-2 layers in Huginn's layout, with more keys
(`num_key_value_heads`, `head_dim`, `rope_theta`, `rope_scaling`, `init_values.embed_scale`, `bias`) and
their source's blocks: pre-norm (Llama) or post-norm with QK-norm (OLMo-2), whose two norms the file calls
`norm_1` and `norm_2`. One adapter class, one instance per source family: everything that differs between
Llama and OLMo-2 (file, source checkpoint and model config) is a field of the instance."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from rdlm.model.config import RDLMConfig
from rdlm.model.families.base import CheckpointError
from rdlm.model.families.huginn import HuginnAdapter, has_rope_keys
from rdlm.model.families.llama_layers import LAYER_PARTS


class RetrofitAdapter(HuginnAdapter):
    """A retrofitted model of one source family (`RETROFIT_LLAMA`, `RETROFIT_OLMO`)."""

    needs_tensor_names = True  # an OLMo-2 checkpoint is told from a Llama one by its QK-norm tensors

    def __init__(
        self,
        name: str,
        source_model_type: str,
        norm_scheme: str,
        qk_norm: bool,
        head_dim_follows_heads: bool,
        norm_names: Mapping[str, str],
        source_norms: Mapping[str, str],
    ):
        self.name = name
        self.source_model_type = source_model_type  # the transformers model_type it is retrofitted from
        self.norm_scheme, self.qk_norm = norm_scheme, qk_norm
        # The source's attention reshapes to hidden_size / heads whatever head_dim says (Llama).
        self.head_dim_follows_heads = head_dim_follows_heads
        self.norm_names = dict(norm_names)  # rdlm norm -> the file's norm_1 / norm_2
        self.source_norms = dict(source_norms)  # rdlm block parameter -> the source layer's norm tensor

    def claims(self, raw: Mapping[str, Any], tensor_names: set[str] | None) -> bool:
        # The OLMo variant, the one with QK-norm: its q_norm tensors, or the modeling file its auto_map
        # names (read, never run).
        auto_map = raw.get("auto_map")
        auto_map = auto_map if isinstance(auto_map, dict) else {}
        olmo = any(name.endswith("attn.q_norm.weight") for name in tensor_names or ()) or any(
            "olmo" in str(target).lower() for target in auto_map.values()
        )
        return has_rope_keys(raw) and olmo == self.qk_norm

    # ---- config.json

    def _fixed_keys(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def _own_fields(self, raw: Mapping[str, Any], source: str) -> dict[str, Any]:
        heads = raw.get("n_heads", raw.get("num_attention_heads"))
        values: dict[str, Any] = {
            "family": self.name,
            "rope_pairs": "halves",
            "qk_bias": bool(raw.get("qk_bias", False)),
            "tie_embeddings": bool(raw.get("tie_embeddings", False)),
            "adapter_bias": bool(raw.get("bias", False)),
            "norm_scheme": self.norm_scheme,
            "qk_norm": self.qk_norm,
            "final_norm": "output",
            "rope_scaling": raw.get("rope_scaling"),
        }
        if raw.get("rope_theta") is not None:
            values["rope_base"] = float(raw["rope_theta"])
        kv = raw.get("num_key_value_heads")
        if kv is not None and kv != heads:
            values["num_kv_heads"] = kv
        head_dim = raw.get("head_dim")
        if head_dim is not None and head_dim * heads != raw.get("n_embd", raw.get("hidden_size")):
            if self.head_dim_follows_heads:
                raise CheckpointError(
                    f"{source}: head_dim={head_dim} is not n_embd / n_heads, which the "
                    "retrofitted Llama layout requires"
                )
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

    def _own_keys(self, config: RDLMConfig) -> dict[str, Any]:
        # So the authors' code loads what rdlm saves.
        return {
            "num_key_value_heads": config.kv_heads,
            "head_dim": config.head_dim,
            "rope_theta": config.rope_base,
            "rope_scaling": config.rope_scaling,
            "max_position_embeddings": config.context_length,
            "bias": config.adapter_bias,
            "tie_word_embeddings": config.tie_embeddings,
            "initial_state_mode": "embed-init" if config.state_init == "embedding" else "random",
        }

    # ---- no stored RoPE table

    def rope_from_file(self, tensors: dict[str, Tensor]) -> Tensor | None:
        return None

    def rope_to_file(self, cos: Tensor, sin: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
        return {}

    # ---- the source checkpoint (rdlm.model.retrofit)

    def source_parts(self) -> dict[str, tuple[str, ...]]:
        """rdlm block parameter -> the source layer's tensors (`model.layers.{i}.` + name) it is made of."""
        return {**LAYER_PARTS, **{ours: (theirs,) for ours, theirs in self.source_norms.items()}}

    def source_config(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """RDLMConfig fields of a source config.json (transformers' keys) that make rdlm's blocks compute
        the source's layers; the caller chooses the layer counts and the recurrence."""
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or hidden // heads
        if self.head_dim_follows_heads and head_dim * heads != hidden:
            raise ValueError(
                f"head_dim={head_dim} x {heads} heads is not hidden_size {hidden}, which the "
                "retrofitted Llama layout requires"
            )
        kv = raw.get("num_key_value_heads") or heads
        return dict(
            family=self.name,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=None if kv == heads else kv,
            head_size=None if head_dim * heads == hidden else head_dim,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            context_length=raw.get("max_position_embeddings", 2048),
            rope_base=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=raw.get("rope_scaling"),
            rope_pairs="halves",
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            qk_bias=False,
            qk_norm=self.qk_norm,
            tie_embeddings=False,
            norm_scheme=self.norm_scheme,
            final_norm="output",
            embed_scale=1.0,
        )


RETROFIT_LLAMA = RetrofitAdapter(
    "retrofit-llama",
    "llama",
    norm_scheme="prenorm",
    qk_norm=False,
    head_dim_follows_heads=True,
    norm_names={"norm_1.weight": "norm_1.weight", "norm_3.weight": "norm_2.weight"},
    source_norms={"norm_1.weight": "input_layernorm.weight", "norm_3.weight": "post_attention_layernorm.weight"},
)
RETROFIT_OLMO = RetrofitAdapter(
    "retrofit-olmo",
    "olmo2",
    norm_scheme="postnorm",
    qk_norm=True,
    head_dim_follows_heads=False,
    norm_names={"norm_2.weight": "norm_1.weight", "norm_4.weight": "norm_2.weight"},
    source_norms={
        "norm_2.weight": "post_attention_layernorm.weight",
        "norm_4.weight": "post_feedforward_layernorm.weight",
        "attn.q_norm.weight": "self_attn.q_norm.weight",
        "attn.k_norm.weight": "self_attn.k_norm.weight",
    },
)
