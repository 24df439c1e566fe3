import dataclasses

import pytest

from rdlm import PRESETS, ConfigError, RDLMConfig


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds(name):
    config = RDLMConfig.from_preset(name)
    assert config.name == name
    assert config.hidden_size % config.num_heads == 0


def test_huginn_preset_has_the_released_shape():
    c = RDLMConfig.from_preset("huginn-0125")
    assert (c.prelude_layers, c.core_layers, c.coda_layers) == (2, 4, 2)
    assert (c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size) == (5280, 55, 96, 17920)
    assert (c.vocab_size, c.context_length, c.rope_base, c.norm_eps) == (65536, 4096, 50000.0, 1e-6)
    assert (c.mean_recurrence, c.backprop_depth) == (32, 8)
    assert c.effective_depth == 2 + 32 * 4 + 2


@pytest.mark.parametrize("overrides, field", [
    (dict(hidden_size=100, num_heads=3), "hidden_size"),
    (dict(core_layers=0), "core_layers"),
    (dict(mean_recurrence=0), "mean_recurrence"),
    (dict(num_heads=0), "num_heads"),
    (dict(vocab_size=-5), "vocab_size"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(norm_scheme="postlayer"), "norm_scheme"),
    (dict(injection="gated"), "injection"),
    (dict(state_init="ones"), "state_init"),
    (dict(qk_bias="yes"), "qk_bias"),
    (dict(hidden_size=64.0), "hidden_size"),
    (dict(recurrence_sampler="bogus"), "recurrence_sampler"),
    (dict(state_init_std=-0.1), "state_init_std"),
    (dict(test_time_noise=-0.1), "test_time_noise"),
    (dict(test_time_noise=0.1, test_time_noise_type="geometric"), "test_time_noise_type"),
    (dict(test_time_noise=0.1, norm_scheme="prenorm"), "test_time_noise"),
])
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        RDLMConfig.from_preset("tiny", **overrides)


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key 'hiden_size'.*hidden_size"):
        RDLMConfig.from_preset("tiny", hiden_size=32)
    with pytest.raises(ConfigError, match="'colour'"):
        RDLMConfig.from_dict({"colour": 1})


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ConfigError, match=r"unknown preset 'smal'.*'small'"):
        RDLMConfig.from_preset("smal")


def test_dict_round_trip_and_replace():
    config = RDLMConfig.from_preset("small")
    assert RDLMConfig.from_dict(config.to_dict()) == config
    assert config.replace(mean_recurrence=4).mean_recurrence == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 3
    with pytest.raises(ConfigError):
        config.replace(core_layer=2)


def test_state_std_defaults_to_the_papers_and_can_be_set():
    config = RDLMConfig.from_preset("tiny")
    assert config.state_init_std is None and config.state_std == (2 / (5 * 64)) ** 0.5
    assert config.replace(state_init_std=0.0).state_std == 0.0
