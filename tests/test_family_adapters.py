"""The family registry (rdlm.model.families): one adapter per family finds its checkpoints, maps their
tensor names both ways, and is the only code that asks which family a model is. What the families
compute is checked against their reference logits in tests/test_families.py."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rdlm import CheckpointError, RDLMConfig, RecurrentDepthLM
from rdlm.model.config import FAMILIES
from rdlm.model.families import ADAPTERS, RETROFIT_SOURCES, adapter_of, detect, standard_rope_keys
from rdlm.model.huginn import tensor_names

FIXTURES = Path(__file__).parent / "fixtures"
PACKAGE = Path(__file__).resolve().parents[1] / "rdlm"
DIRECTORIES = {"huginn-tiny": "huginn", "huginn-tiny-bf16": "huginn", "families/retrofit-llama-tiny": "retrofit-llama",
               "families/retrofit-olmo-tiny": "retrofit-olmo", "families/ouro-tiny": "ouro"}


def raw_config(directory: Path) -> dict:
    return standard_rope_keys(json.loads((directory / "config.json").read_text()))


def test_the_registry_holds_one_adapter_per_family_the_config_names():
    assert tuple(ADAPTERS) == FAMILIES
    assert all(adapter.name == name for name, adapter in ADAPTERS.items())
    assert {adapter.model_type for adapter in ADAPTERS.values()} == {"huginn_raven", "ouro"}
    assert {kind: a.name for kind, a in RETROFIT_SOURCES.items()} == {"llama": "retrofit-llama",
                                                                      "olmo2": "retrofit-olmo"}
    with pytest.raises(TypeError):
        ADAPTERS["mine"] = ADAPTERS["huginn"]  # read-only: no global mutable state


@pytest.mark.parametrize("directory, family", DIRECTORIES.items())
def test_each_checkpoint_is_detected_as_its_family(directory, family):
    path = FIXTURES / directory
    raw = raw_config(path)
    names = tensor_names(path) if detect(raw).needs_tensor_names else None
    assert detect(raw, names).name == family
    undeclared = {key: value for key, value in raw.items() if key != "rdlm"}
    assert detect(undeclared, tensor_names(path)).name == family  # from the keys and names alone


def test_a_declared_family_wins_and_an_unknown_model_type_is_named():
    raw = raw_config(FIXTURES / "families" / "retrofit-llama-tiny")
    assert detect({**raw, "rdlm": {"family": "retrofit-olmo"}}).name == "retrofit-olmo"
    assert detect({**raw, "rdlm": {"family": "huginn"}}).name == "huginn"
    # Ouro's model_type is Ouro's whatever a section says.
    assert detect({**raw_config(FIXTURES / "families" / "ouro-tiny"), "rdlm": {"family": "huginn"}}).name == "ouro"
    with pytest.raises(CheckpointError, match="model_type is 'llama', expected 'huginn_raven' or 'ouro'"):
        detect({"model_type": "llama"}, source="x/config.json")


@pytest.mark.parametrize("family", FAMILIES)
def test_an_adapter_maps_every_parameter_to_the_file_and_back(family):
    preset = "ouro-tiny" if family == "ouro" else "tiny"  # a model of each layout's shape
    overrides = {} if family == "ouro" else {"family": family}
    if family.startswith("retrofit"):
        overrides.update(norm_scheme=RETROFIT_SOURCES["olmo2" if family.endswith("olmo") else "llama"].norm_scheme,
                         qk_norm=family.endswith("olmo"), final_norm="output", rope_pairs="halves")
    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset(preset, **overrides))
    adapter = adapter_of(model.config)
    params = dict(model.named_parameters())
    stored = adapter.to_file(params, model.config)
    state, unexpected = adapter.from_file(stored)
    assert unexpected == [] and set(state) == set(params)
    assert all(torch.equal(state[name], params[name]) for name in params)
    assert all(adapter.file_name(name) for name in params)
    json.dumps(adapter.config_to_json(model.config, torch.float32))  # plain JSON
    assert adapter.config_from_json(standard_rope_keys(adapter.config_to_json(model.config, torch.float32)),
                                    "saved") == model.config


def test_the_llama_and_olmo_variants_differ_only_in_their_fields():
    llama, olmo = RETROFIT_SOURCES["llama"], RETROFIT_SOURCES["olmo2"]
    assert type(llama) is type(olmo)
    assert (llama.norm_scheme, llama.qk_norm, olmo.norm_scheme, olmo.qk_norm) == ("prenorm", False, "postnorm", True)
    with safe_open(FIXTURES / "families" / "retrofit-olmo-tiny" / "model.safetensors", "pt") as handle:
        names = set(handle.keys())
    raw = {key: value for key, value in raw_config(FIXTURES / "families" / "retrofit-olmo-tiny").items()
           if key not in ("rdlm", "auto_map")}
    assert (llama.claims(raw, names), olmo.claims(raw, names)) == (False, True)  # its QK-norm tensors


def test_only_an_embedding_state_is_not_an_input():
    for state_init in ("random", "zero", "embedding"):
        config = RDLMConfig.from_preset("tiny", state_init=state_init)
        assert config.takes_initial_state == (state_init != "embedding")


def _asks_for_the_family(node: ast.AST) -> bool:
    """A comparison with, or an index by, a `family` name or attribute: `config.family == "ouro"`."""
    def named(expr: ast.AST) -> bool:
        return (isinstance(expr, ast.Attribute) and expr.attr == "family") or (
            isinstance(expr, ast.Name) and expr.id == "family")
    if isinstance(node, ast.Compare):
        return any(named(operand) for operand in (node.left, *node.comparators))
    if isinstance(node, ast.Subscript):
        return named(node.slice)
    return isinstance(node, ast.Match) and named(node.subject)


def _compares_the_state_init_with(node: ast.AST, value: str) -> bool:
    return isinstance(node, ast.Compare) and any(
        isinstance(side, ast.Attribute) and side.attr == "state_init" for side in (node.left, *node.comparators)
    ) and any(isinstance(side, ast.Constant) and side.value == value for side in (node.left, *node.comparators))


def test_no_family_is_asked_for_outside_its_adapter():
    """What a family computes differently is a config field (`RDLMConfig.takes_initial_state`, ...), and what
    its files hold is its adapter's: no `family ==` (or `[config.family]`) outside rdlm/model/families/, and
    Ouro's embedding state asked for by a property, not by its value, outside the model."""
    families = PACKAGE / "model" / "families"
    leaks, state_leaks, seen = [], [], 0
    for path in sorted(PACKAGE.rglob("*.py")):
        seen += 1
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(PACKAGE.parent)
        if families not in path.parents:
            leaks += [f"{where}:{node.lineno}" for node in ast.walk(tree) if _asks_for_the_family(node)]
        if PACKAGE / "model" not in path.parents:
            state_leaks += [f"{where}:{node.lineno}" for node in ast.walk(tree)
                            if _compares_the_state_init_with(node, "embedding")]
    assert seen > 40
    assert not leaks, f"a family named outside its adapter: {leaks}"
    assert not state_leaks, f"state_init == 'embedding' outside the model (use takes_initial_state): {state_leaks}"
    # The checks see what they look for.
    assert _asks_for_the_family(ast.parse('config.family == "ouro"').body[0].value)
    assert _asks_for_the_family(ast.parse('TABLE[model.config.family]').body[0].value)
    assert _compares_the_state_init_with(ast.parse('c.state_init == "embedding"').body[0].value, "embedding")
