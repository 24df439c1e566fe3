"""The vLLM plugin's recurrence options (rdlm.integrations.vllm.options), read without vLLM."""

from __future__ import annotations

import json

import pytest

from rdlm.integrations.vllm.options import RecurrenceOptionError, read
from tests.vllm_models import FAMILIES


def raw(family: str) -> dict:
    return json.loads((FAMILIES[family][0] / "config.json").read_text())


def test_defaults_are_the_checkpoints_depth_exact_caches_and_rdlm_generates_s0():
    config, recurrence = read(raw("huginn"))
    assert (recurrence.num_steps, recurrence.cache, recurrence.criterion) == (config.mean_recurrence, "per-iteration",
                                                                              None)
    assert (recurrence.seed, recurrence.init_scale, recurrence.min_steps) == (0, 1.0, 2)
    assert read(raw("ouro"))[1].num_steps == raw("ouro")["total_ut_steps"]  # Ouro's own depth key


def test_options_override_and_the_gate_takes_the_checkpoints_threshold():
    _, recurrence = read({**raw("huginn"), "rdlm_num_steps": 9, "rdlm_cache": "shared", "mean_recurrence": 3})
    assert (recurrence.num_steps, recurrence.core_caches) == (9, 1)
    assert read({**raw("huginn"), "mean_recurrence": 3})[1].num_steps == 3
    _, gated = read({**raw("ouro"), "rdlm_exit_criterion": "gate"})
    assert gated.criterion.threshold == raw("ouro")["early_exit_threshold"] and gated.min_steps == 1
    assert gated.eager_tokens == 0  # every step of a compiled engine runs the compiled forward
    _, exits = read({**raw("huginn"), "rdlm_exit_criterion": "latent-diff", "rdlm_exit_eager_tokens": 4})
    assert exits.eager_tokens == 4


@pytest.mark.parametrize("options,named", [
    ({"rdlm_cache": "bogus"}, "rdlm_cache must be one of"),
    ({"rdlm_num_steps": 0}, "rdlm_num_steps must be an integer"),
    ({"rdlm_num_steps": True}, "rdlm_num_steps must be an integer"),
    ({"rdlm_num_steps": 10**6}, "rdlm_num_steps must be an integer"),
    ({"rdlm_exit_criterion": "kl"}, "rdlm_exit_criterion must be one of"),
    ({"rdlm_exit_criterion": "gate"}, "needs a model with a learned exit gate"),
    ({"rdlm_exit_threshold": 0.1}, "rdlm_exit_threshold needs rdlm_exit_criterion"),
    ({"rdlm_exit_criterion": "latent-diff", "rdlm_exit_threshold": "low"}, "exit threshold must be a number"),
    ({"rdlm_min_steps": 99}, "rdlm_min_steps must be an integer in 1..rdlm_num_steps"),
    ({"rdlm_exit_eager_tokens": 4}, "rdlm_exit_eager_tokens must be .* goes with rdlm_exit_criterion"),
    ({"rdlm_exit_criterion": "latent-diff", "rdlm_exit_eager_tokens": -1}, "rdlm_exit_eager_tokens must be an int"),
    ({"rdlm_exit_criterion": "latent-diff", "rdlm_exit_eager_tokens": 2.5}, "rdlm_exit_eager_tokens must be an int"),
    ({"rdlm_seed": -1}, "rdlm_seed must be an integer"),
    ({"rdlm_init_scale": "1"}, "rdlm_init_scale must be a number"),
    ({"rdlm_nmu_steps": 4}, "unknown option.*rdlm_nmu_steps"),
    ({"test_time_noise": 0.5}, "test_time_noise 0.5 .* is not served by vLLM"),
])
def test_a_bad_option_is_refused_by_name(options, named):
    with pytest.raises(RecurrenceOptionError, match=named):
        read({**raw("huginn"), **options})
