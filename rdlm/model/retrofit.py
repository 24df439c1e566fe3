"""Retrofit recurrence into a pretrained fixed-depth transformer (McLeish et al. 2025, "Teaching Pretrained
Language Models to Think Deeper with Retrofitted Recurrence"; docs/retrofit.md).

Some early layers of the source model become the prelude, some middle layers the core block that is
iterated r times, the last layers the coda; layers not named are dropped. An adapter over [s, e] feeds the
core, initialised by default to pass e through ([0 | I]), so at r = 1 the retrofitted model computes the
source model with the dropped layers removed (and with none dropped, the source model itself). The result
is a model directory in the retrofitted models' Huginn layout (`rdlm.model.families`), which the authors'
code loads too; training it with a curriculum on r (`rdlm train --curriculum`) teaches it to use depth.

Sources: transformers checkpoint directories of the Llama family (`LlamaForCausalLM`: Llama 2/3, TinyLlama,
SmolLM) and OLMo-2 (`Olmo2ForCausalLM`), read from config.json and safetensors only; no code in the
directory is run.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rdlm.checks import is_int
from rdlm.model.config import RDLMConfig
from rdlm.model.convert import check_destination, check_side_files
from rdlm.model.families import RETROFIT_SOURCES, CheckpointError, standard_rope_keys
from rdlm.model.families.llama_layers import split, split_sizes
from rdlm.model.families.retrofit import RETROFIT_LLAMA, RetrofitAdapter
from rdlm.model.huginn import read_weights, save_pretrained
from rdlm.model.lm import RecurrentDepthLM

ADAPTER_INITS = ("identity", "sum", "random")
SIZE_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")


class RetrofitError(ValueError):
    """The source model or the split cannot be retrofitted; the message names why."""


def read_source_config(source: str | os.PathLike) -> dict[str, Any]:
    path = Path(source) / "config.json"
    if not path.is_file():
        raise RetrofitError(f"{source}: no config.json (not a transformers model directory)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RetrofitError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(raw, dict):
        raise RetrofitError(f"{path}: expected a JSON object")
    kind = raw.get("model_type")
    if kind not in RETROFIT_SOURCES:
        raise RetrofitError(
            f"{path}: model_type {kind!r} is not supported (supported: "
            f"{', '.join(RETROFIT_SOURCES)}; Qwen2's q/k/v biases, for one, have no place in the "
            "retrofitted layout)"
        )
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if raw.get(key, expected) != expected:
            raise RetrofitError(f"{path}: {key}={raw[key]!r} is not supported (expected {expected!r})")
    missing = [k for k in SIZE_KEYS if k not in raw]
    if missing:
        raise RetrofitError(f"{path}: missing required key(s) {', '.join(missing)}")
    for key in SIZE_KEYS:
        if not is_int(raw[key], 1):
            raise RetrofitError(f"{path}: {key} must be a positive integer, got {raw[key]!r}")
    return standard_rope_keys(raw)


def check_split(layers: int, prelude: Sequence[int], core: Sequence[int], coda: Sequence[int]) -> None:
    if not core:
        raise RetrofitError("the core block needs at least one layer (--core)")
    seen: set[int] = set()
    for name, indices in (("prelude", prelude), ("core", core), ("coda", coda)):
        for index in indices:
            if not is_int(index, 0, layers):
                raise RetrofitError(f"{name} layer {index!r} is out of range: the source has layers 0..{layers - 1}")
            if index in seen:
                raise RetrofitError(f"layer {index} is named twice; each source layer goes to one place")
            seen.add(index)
    # The source's order, kept: at r = 1 an identity adapter then computes the source model without the dropped
    # layers (the module doc). Layers run out of order would silently compute something else.
    order = [*prelude, *core, *coda]
    backwards = next(((a, b) for a, b in itertools.pairwise(order) if a > b), None)
    if backwards is not None:
        raise RetrofitError(
            f"layer {backwards[1]} comes after layer {backwards[0]}: prelude, core and coda take the "
            f"source's layers in its order (e.g. prelude 0-1, core 2-5, coda 6-7), got prelude "
            f"{list(prelude)}, core {list(core)}, coda {list(coda)}"
        )


def retrofit_config(raw: dict[str, Any], prelude: int, core: int, coda: int, **overrides: Any) -> RDLMConfig:
    """The RDLMConfig of a retrofitted model of source config `raw` with the given layer counts."""
    try:
        source = RETROFIT_SOURCES[raw["model_type"]].source_config(raw)
    except ValueError as err:
        raise RetrofitError(str(err)) from err
    values = dict(
        source,
        prelude_layers=prelude,
        core_layers=core,
        coda_layers=coda,
        injection="concat",
        state_init="random",
        mean_recurrence=4,
        backprop_depth=4,
    )
    values.update(overrides)
    try:
        return RDLMConfig.from_dict(values)
    except ValueError as err:
        raise RetrofitError(f"the retrofitted config: {err}") from err


def _layer_tensors(tensors: dict[str, torch.Tensor], source: int, family: RetrofitAdapter) -> dict[str, torch.Tensor]:
    """rdlm block parameters (names within the block) of source layer `source`."""
    prefix = f"model.layers.{source}."

    def take(name: str) -> torch.Tensor:
        key = prefix + name
        if key not in tensors:
            raise RetrofitError(f"the source checkpoint has no tensor {key}")
        return tensors[key]

    return {
        ours: torch.cat([take(name) for name in theirs]) if len(theirs) > 1 else take(theirs[0])
        for ours, theirs in family.source_parts().items()
    }


def adapter_weight(
    hidden: int, init: str, dtype: torch.dtype, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The adapter [h, 2h] over [s, e]: "identity" [0 | I] passes e (the source model's function at r = 1);
    "sum" [I | I] adds s to e; "random" is rdlm's initialisation (truncated normal, std sqrt(2/(5h)))."""
    if init not in ADAPTER_INITS:
        raise RetrofitError(f"adapter init must be one of {ADAPTER_INITS}, got {init!r}")
    weight = torch.zeros(hidden, 2 * hidden)
    if init in ("identity", "sum"):
        weight[:, hidden:] = torch.eye(hidden)
    if init == "sum":
        weight[:, :hidden] = torch.eye(hidden)
    if init == "random":
        std = math.sqrt(2 / (5 * hidden))
        torch.nn.init.trunc_normal_(weight, std=std, a=-3 * std, b=3 * std, generator=generator)
    return weight.to(dtype)


def retrofit(
    source: str | os.PathLike,
    out: str | os.PathLike,
    prelude: Sequence[int],
    core: Sequence[int],
    coda: Sequence[int],
    *,
    adapter_init: str = "identity",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    overwrite: bool = False,
    **config_overrides: Any,
) -> RecurrentDepthLM:
    """Write the retrofitted model of `source` to `out` (see the module doc) and return it. `out` may not be
    the source, nor hold a model unless `overwrite` (rdlm.model.convert.check_destination)."""
    raw = read_source_config(source)
    check_split(raw["num_hidden_layers"], prelude, core, coda)
    if not (Path(source) / "tokenizer.json").is_file():
        raise RetrofitError(f"{source}: no tokenizer.json to copy (the retrofitted model reads text with it)")
    try:
        side = check_side_files(Path(source))
    except ValueError as err:
        raise RetrofitError(str(err)) from None
    # Before anything is written: never the source itself, nor a model there without `overwrite` (docs/files.md).
    out = check_destination(out, Path(source), overwrite=overwrite, in_place_flag=None)
    config = retrofit_config(raw, len(prelude), len(core), len(coda), **config_overrides)
    try:
        tensors = read_weights(source)
    except CheckpointError as err:
        raise RetrofitError(str(err)) from err
    state = _source_state(source, tensors, RETROFIT_SOURCES[raw["model_type"]], prelude, core, coda)
    dtype = dtype or state["embedding.weight"].dtype
    state["adapter.weight"] = adapter_weight(
        config.hidden_size, adapter_init, dtype, torch.Generator().manual_seed(seed)
    )
    if config.adapter_bias:
        state["adapter.bias"] = torch.zeros(config.hidden_size, dtype=dtype)
    model = _assemble(config, state, dtype)
    save_pretrained(model, out, dtype=dtype, extra_files=side)  # the tokenizer files with the weights, in one swap
    return model


def plain_config(**values: Any) -> RDLMConfig:
    """A fixed-depth Llama as an rdlm config: one pass of `core_layers` layers, s_0 = e, no injection, pre-norm
    blocks, the final norm at the output. At r = 1 it is exactly a LlamaForCausalLM (`save_as_llama`), so
    rdlm's trainer can pretrain the baseline that `retrofit` starts from."""
    base = dict(
        prelude_layers=0,
        coda_layers=0,
        injection="none",
        state_init="embedding",
        final_norm="output",
        norm_scheme=RETROFIT_LLAMA.norm_scheme,
        rope_pairs="halves",
        qk_bias=False,
        tie_embeddings=False,
        embed_scale=1.0,
        mean_recurrence=1,
        backprop_depth=1,
        recurrence_sampler="fixed",
        family=RETROFIT_LLAMA.name,
    )
    return RDLMConfig.from_dict({**base, **values})


def save_as_llama(model: RecurrentDepthLM, out: str | os.PathLike) -> Path:
    """Write a `plain_config` model as a transformers Llama directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    from rdlm.fileio import staging_dir, write_json

    c = model.config
    plain = (0, 0, "none", "embedding", RETROFIT_LLAMA.norm_scheme)
    if (c.prelude_layers, c.coda_layers, c.injection, c.state_init, c.norm_scheme) != plain:
        raise RetrofitError("only a fixed-depth model (rdlm.model.retrofit.plain_config) is a Llama")
    sizes = split_sizes(c)
    params = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters()}
    tensors = {
        "model.embed_tokens.weight": params["embedding.weight"],
        "model.norm.weight": params["final_norm.weight"],
        "lm_head.weight": params["lm_head.weight"],
    }
    for i in range(c.core_layers):
        for ours, theirs in RETROFIT_LLAMA.source_parts().items():
            pieces = split(params[f"core.{i}.{ours}"], theirs, sizes.get(ours))
            tensors.update({f"model.layers.{i}.{name}": tensor for name, tensor in pieces.items()})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.core_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.context_length,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_base,
        "rope_scaling": c.rope_scaling,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": c.vocab_size,
        "torch_dtype": str(params["embedding.weight"].dtype).removeprefix("torch."),
    }
    out = Path(out)
    with staging_dir(out) as tmp:
        save_file({n: t.contiguous() for n, t in tensors.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
    return out


def load_llama(source: str | os.PathLike, dtype: torch.dtype | None = None) -> RecurrentDepthLM:
    """A transformers Llama/OLMo-2 directory as rdlm's fixed-depth model (`plain_config`: every layer once, the
    same logits as the source): the no-recurrence baseline to compare a retrofitted model with."""
    raw = read_source_config(source)
    layers = list(range(raw["num_hidden_layers"]))
    config = retrofit_config(
        raw,
        0,
        len(layers),
        0,
        injection="none",
        state_init="embedding",
        mean_recurrence=1,
        backprop_depth=1,
        recurrence_sampler="fixed",
    )
    try:
        tensors = read_weights(source)
    except CheckpointError as err:
        raise RetrofitError(str(err)) from err
    state = _source_state(source, tensors, RETROFIT_SOURCES[raw["model_type"]], [], layers, [])
    return _assemble(config, state, dtype or state["embedding.weight"].dtype)


def _source_state(
    source,
    tensors: dict[str, torch.Tensor],
    family: RetrofitAdapter,
    prelude: Sequence[int],
    core: Sequence[int],
    coda: Sequence[int],
) -> dict[str, torch.Tensor]:
    """rdlm parameters from a source checkpoint's tensors (no adapter)."""
    embedding = tensors.get("model.embed_tokens.weight")
    if embedding is None:
        raise RetrofitError(f"{source}: the source checkpoint has no tensor model.embed_tokens.weight")
    # A tied source head becomes an untied copy: the retrofitted layout has its own lm_head.
    head = tensors.get("lm_head.weight", embedding)
    state = {
        "embedding.weight": embedding,
        "lm_head.weight": head.clone(),
        "final_norm.weight": tensors["model.norm.weight"],
    }
    for group, indices in (("prelude", prelude), ("core", core), ("coda", coda)):
        for i, index in enumerate(indices):
            for name, tensor in _layer_tensors(tensors, index, family).items():
                state[f"{group}.{i}.{name}"] = tensor
    return state


def _assemble(config: RDLMConfig, state: dict[str, torch.Tensor], dtype: torch.dtype) -> RecurrentDepthLM:
    with torch.device("meta"):  # no random initialisation: every parameter comes from `state`
        model = RecurrentDepthLM(config)
    expected = {name: p.shape for name, p in model.named_parameters()}
    for name, shape in expected.items():
        if name not in state:
            raise RetrofitError(f"nothing in the source maps to {name}")
        if state[name].shape != shape:
            raise RetrofitError(f"{name}: the source gives shape {list(state[name].shape)}, expected {list(shape)}")
    model.load_state_dict({n: state[n].to(dtype) for n in expected}, assign=True)
    model.rope_cos, model.rope_sin = _rope(config)
    return model.eval()


def _rope(config: RDLMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    from rdlm.model.rope import rope_tables

    return rope_tables(config.head_dim, config.context_length, config.rope_base, config.rope_scaling)


def parse_layers(text: str) -> list[int]:
    """ "0,1,2,3" or ranges "0-3,10-17" -> layer indices, in order."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            if "-" in part:
                first, last = (int(x) for x in part.split("-"))
                out.extend(range(first, last + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise RetrofitError(f"{part!r} is not a layer index or range (e.g. 0,1,2 or 10-17)") from None
    return out
