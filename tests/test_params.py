"""rdlm.inference.params: GenerationConfig's parameters are declared once, in parts, and every front end (the
command line, the server's request body, transformers' generation config) takes them from that declaration
and checks them by building a GenerationConfig."""

import dataclasses
from types import SimpleNamespace

import pytest

from rdlm.cli import build_parser
from rdlm.inference.params import KV_CACHE_BUDGET, PARAMS, PARTS, GenerationConfig, known_criterion, params_for

# A valid value other than the default for each parameter a front end takes by its name.
SAMPLE = {"temperature": 0.5, "top_k": 3, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.2, "seed": 7,
          "num_steps": 6, "max_latent_iterations": 40, "target_mean_iterations": 2.5, "init_scale": 0.5,
          "continuous_cot": True, "exit_criterion": "kl", "exit_threshold": 1e-3, "min_steps": 3, "exit_every": 2,
          "sampler": "sequential", "draft_steps": 2, "draft_length": 3, "kv_cache_budget": 4}


def test_every_field_is_declared_once_in_a_part_with_its_meaning():
    names = [f.name for f in dataclasses.fields(GenerationConfig)]
    assert [p.name for p in PARAMS] == names and len(names) == len(set(names)) >= 35
    parts = [p.part for p in PARAMS]
    assert [part.name for part in PARTS] == list(dict.fromkeys(parts)), "a part's fields are declared together"
    for p in PARAMS:
        assert p.help and p.kind in (int, float, str, bool, tuple), p.name
        assert p.check is not None or p.kind in (bool, tuple), f"{p.name} declares no check"


@pytest.mark.parametrize("param", [p for p in PARAMS if p.check is not None], ids=lambda p: p.name)
def test_each_declared_check_runs_and_names_its_field(param):
    # A criterion's name is refused by rdlm.inference.exits.criteria, which names the nearest ones.
    named = "unknown exit criterion" if param.check is known_criterion else param.name
    with pytest.raises(ValueError, match=f"^{named} "):
        GenerationConfig(**{param.name: "not a value"})
    if param.optional:
        GenerationConfig(**{param.name: None})   # None is a value of an optional field: not checked


def test_flat_construction_and_access_stay_as_they_were():
    config = GenerationConfig(num_steps=4, temperature=0.7, cache_strategy="shared", cache_slots=2)
    assert (config.num_steps, config.temperature, config.core_slots, config.min_steps) == (4, 0.7, 2, 2)
    assert dataclasses.replace(config, num_steps=5).num_steps == 5 and hash(config) == hash(dataclasses.replace(config))
    assert GenerationConfig(exit_criterion="gate").min_steps == 1


def test_the_server_takes_its_parameters_typed_as_declared_and_checks_them_as_generate_does():
    pytest.importorskip("fastapi")
    from rdlm.inference.server.openai_api import APIError, CompletionRequest, Options, OpenAIOptions, generation_config

    served = params_for("server")
    assert set(Options.model_fields) == set(OpenAIOptions.model_fields) | {p.name for p in served}
    for p in served:
        field = Options.model_fields[p.name]
        assert field.annotation == (p.kind | None) and field.default is None and field.description == p.help
    body = CompletionRequest(model="m", prompt="x", **{p.name: SAMPLE[p.name] for p in served})
    config = generation_config(body, GenerationConfig(), (), None)
    assert all(getattr(config, p.name) == SAMPLE[p.name] for p in served if p is not KV_CACHE_BUDGET)
    assert (config.cache_strategy, config.cache_slots) == ("shared", SAMPLE["kv_cache_budget"])
    with pytest.raises(APIError, match="^min_steps must be an integer >= 1, got 0$"):
        generation_config(CompletionRequest(model="m", prompt="x", min_steps=0), GenerationConfig(), (), None)


def test_transformers_defaults_are_the_declared_ones():
    pytest.importorskip("transformers")
    from transformers import GenerationConfig as HFGenerationConfig

    from rdlm.integrations.hf.generation import (RDLM_GENERATION_DEFAULTS, to_rdlm_config,
                                                 with_rdlm_generation_defaults)

    taken = params_for("transformers")
    assert list(RDLM_GENERATION_DEFAULTS) == [p.name for p in taken]
    assert all(RDLM_GENERATION_DEFAULTS[p.name] == (None if p.name == "num_steps" else p.default) for p in taken)
    # Speculative decoding apart: it takes no exit criterion and no depth budget.
    for drafts in (False, True):
        values = {p.name: SAMPLE[p.name] for p in taken if (p.part == "speculative") == drafts}
        given = HFGenerationConfig(**values, repetition_penalty=1.0)
        config = to_rdlm_config(with_rdlm_generation_defaults(given, SimpleNamespace(mean_recurrence=8)), 8, (), 5)
        assert all(getattr(config, name) == value for name, value in values.items() if name != "kv_cache_budget")
        assert config.cache_slots == values.get("kv_cache_budget")


def test_the_command_line_has_a_flag_per_declared_parameter_with_its_default():
    from rdlm.cli.generate import config_from_args

    args = build_parser().parse_args(["generate", "--model", "tiny"])
    assert all(hasattr(args, p.name) for p in params_for("cli"))
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=10, mean_recurrence=GenerationConfig.num_steps))
    assert config_from_args(args, model) == GenerationConfig()
    given = build_parser().parse_args(["generate", "--model", "tiny", "--cache", "shared", "--cache-slots", "2",
                                       "-r", "3", "--no-full-prefill", "--max-wavefront", "0"])
    config = config_from_args(given, model)
    assert (config.cache_strategy, config.cache_slots, config.num_steps, config.full_prefill,
            config.max_wavefront) == ("shared", 2, 3, False, None)
