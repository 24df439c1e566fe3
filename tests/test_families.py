"""The model families (docs/model-families.md): the retrofitted Llama/OLMo layouts and Ouro load and give
their reference code's logits, save back in their own layout, and every bad config is named.

The fixtures in tests/fixtures/families/ were saved by each family's own modeling code, with its float32
logits (tests/fixtures/families/make_family_fixtures.py, run in a scratch environment).
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rdlm import CheckpointError, RDLMConfig, RecurrentDepthLM, load_pretrained, save_pretrained
from rdlm.model.rope import inverse_frequencies

FIXTURES = Path(__file__).parent / "fixtures" / "families"
RETROFIT = ("retrofit-llama-tiny", "retrofit-olmo-tiny")


def reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / name / "reference_outputs.safetensors")


@pytest.mark.numerics
@pytest.mark.parametrize("name", RETROFIT)
def test_retrofitted_models_give_the_reference_logits(name):
    model = load_pretrained(FIXTURES / name)
    ref = reference(name)
    assert model.config.family == name.removesuffix("-tiny")
    assert model.config.kv_heads == 2 and not model.config.tie_embeddings and model.config.adapter_bias
    with torch.no_grad():
        for r in (1, 4, 8):
            given = model(ref["input_ids"], r, initial_state=ref["initial_state"]).logits
            zero = model(ref["input_ids"], r, init_scale=0.0).logits
            torch.testing.assert_close(given, ref[f"logits_r{r}_given"], rtol=0, atol=1e-5)
            torch.testing.assert_close(zero, ref[f"logits_r{r}_zero"], rtol=0, atol=1e-5)
    # The logits depend on r and on s_0: the comparison above is not trivially true.
    assert (ref["logits_r8_given"] - ref["logits_r1_given"]).abs().max() > 0.1
    assert (ref["logits_r8_given"] - ref["logits_r8_zero"]).abs().max() > 1e-3


def test_the_retrofitted_variants_are_told_apart_and_configured():
    llama = load_pretrained(FIXTURES / "retrofit-llama-tiny").config
    olmo = load_pretrained(FIXTURES / "retrofit-olmo-tiny").config
    assert (llama.norm_scheme, llama.qk_norm, llama.rope_scaling["rope_type"]) == ("prenorm", False, "llama3")
    assert (olmo.norm_scheme, olmo.qk_norm, olmo.rope_scaling) == ("postnorm", True, None)
    for config in (llama, olmo):
        assert config.final_norm == "output" and config.rope_pairs == "halves" and config.embedding_scale == 1.0


@pytest.mark.numerics
def test_ouro_gives_each_loops_reference_logits():
    model = load_pretrained(FIXTURES / "ouro-tiny")
    ref = reference("ouro-tiny")
    c = model.config
    assert (c.family, c.core_layers, c.prelude_layers, c.coda_layers, c.mean_recurrence) == ("ouro", 2, 0, 0, 4)
    assert c.exit_gate and c.exit_threshold == 0.5
    with torch.no_grad():
        for r in (1, 2, 3, 4):
            logits = model(ref["input_ids"], r).logits
            torch.testing.assert_close(logits, ref[f"logits_step{r - 1}"], rtol=0, atol=1e-5)
            if r < 4:  # the stack looped r times in the reference, read at its last loop
                torch.testing.assert_close(logits, ref[f"logits_ut{r}"], rtol=0, atol=1e-5)
    assert (ref["logits_step3"] - ref["logits_step0"]).abs().max() > 0.1


@pytest.mark.numerics
def test_ouro_exit_distribution_matches_the_reference():
    model = load_pretrained(FIXTURES / "ouro-tiny")
    ref = reference("ouro-tiny")
    with torch.no_grad():
        out = model(ref["input_ids"], 4, return_trajectory=True)
        lambdas = torch.stack([model.exit_probability(s) for s in out.trajectory[1:]], dim=2)
    remaining, pdf = torch.ones_like(lambdas[..., 0]), []
    for i in range(4):
        pdf.append(lambdas[..., i] * remaining if i < 3 else remaining)
        remaining = remaining * (1 - lambdas[..., i])
    torch.testing.assert_close(torch.stack(pdf, dim=2), ref["exit_pdf"], rtol=0, atol=1e-6)
    # A gate that means something: not every token exits at the same loop.
    assert len(set(ref["exit_pdf"].cumsum(2).ge(0.5).float().argmax(2).flatten().tolist())) > 1


@pytest.mark.parametrize("name", (*RETROFIT, "ouro-tiny"))
def test_a_family_saves_back_in_its_own_layout(name, tmp_path):
    model = load_pretrained(FIXTURES / name)
    save_pretrained(model, tmp_path / "copy")
    theirs = json.loads((FIXTURES / name / "config.json").read_text())
    ours = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert ours["model_type"] == theirs["model_type"]
    for key in ("num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "tie_word_embeddings",
                "tie_embeddings", "total_ut_steps", "early_exit_threshold", "max_position_embeddings"):
        if key in theirs:
            assert ours[key] == theirs[key], key
    with safe_open(FIXTURES / name / "model.safetensors", "pt") as a, \
            safe_open(tmp_path / "copy" / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())  # the family's own tensor names
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
    again = load_pretrained(tmp_path / "copy")
    assert again.config == model.config


def test_remote_code_beside_the_weights_is_never_run(tmp_path):
    target = tmp_path / "model"
    shutil.copytree(FIXTURES / "retrofit-llama-tiny", target)
    (target / "raven_modeling_minimal_llama.py").write_text("raise SystemExit('remote code ran')\n")
    (target / "raven_config_minimal.py").write_text("raise SystemExit('remote code ran')\n")
    assert "auto_map" in json.loads((target / "config.json").read_text())
    load_pretrained(target)  # would exit if the auto_map code were imported


def edit_config(tmp_path: Path, name: str, **changes) -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    raw = json.loads((target / "config.json").read_text())
    raw.update(changes)
    (target / "config.json").write_text(json.dumps(raw))
    return target


@pytest.mark.parametrize("name, changes, message", [
    ("ouro-tiny", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("ouro-tiny", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ("ouro-tiny", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling type 'yarn'"),
    ("ouro-tiny", {"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ("retrofit-llama-tiny", {"initial_state_mode": "skip-adapter"}, "initial_state_mode='skip-adapter'"),
    ("retrofit-llama-tiny", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ("retrofit-llama-tiny", {"head_dim": 8}, "head_dim=8"),
])
def test_configs_rdlm_cannot_represent_are_refused_by_name(tmp_path, name, changes, message):
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(edit_config(tmp_path, name, **changes))


def test_a_missing_ouro_projection_is_named(tmp_path):
    target = tmp_path / "ouro"
    shutil.copytree(FIXTURES / "ouro-tiny", target)
    tensors = load_file(target / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    from safetensors.torch import save_file
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.1\.self_attn\.\{q,k,v\}_proj"):
        load_pretrained(target)


@pytest.mark.numerics
def test_llama3_rope_frequencies_equal_transformers():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling,
                         max_position_embeddings=131072)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = inverse_frequencies(64, 500000.0, scaling)
    assert torch.equal(ours, theirs.float())
    assert not torch.equal(ours, inverse_frequencies(64, 500000.0))  # the scaling does something


def test_grouped_query_attention_decodes_as_the_full_forward():
    """The KV cache holds the key/value heads only; decoding with it gives the no-cache forward's tokens."""
    from rdlm.inference.generate import GenerationConfig, generate

    config = RDLMConfig.from_preset("tiny", num_kv_heads=2, qk_bias=False, rope_pairs="halves", norm_scheme="prenorm",
                                    final_norm="output", tie_embeddings=False, qk_norm=True)
    torch.manual_seed(0)
    model = RecurrentDepthLM(config).eval()
    prompt = [5, 9, 11, 3]
    out = generate(model, [prompt], GenerationConfig(max_new_tokens=6, num_steps=4, init_scale=0.0))
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            tokens.append(int(model(torch.tensor([tokens]), 4, init_scale=0.0).logits[0, -1].argmax()))
    assert out.tokens[0] == tokens[len(prompt):]
    assert model.core[0].attn.qkv.weight.shape[0] == (4 + 2 * 2) * 16


# ------------------------------------------------------------------------------------------------
# The learned exit gate as an exit criterion

def ouro():
    return load_pretrained(FIXTURES / "ouro-tiny"), reference("ouro-tiny")


@pytest.mark.numerics
def test_gate_selection_matches_the_reference_threshold_selection():
    from rdlm.inference.evaluate import gate_exit_logits

    model, ref = ouro()
    for tenths in (3, 5, 9):
        logits, steps = gate_exit_logits(model, ref["input_ids"], 4, tenths / 10)
        torch.testing.assert_close(logits, ref[f"logits_threshold{tenths}"], rtol=0, atol=1e-5)
        expected = ref["exit_pdf"].cumsum(2).ge(tenths / 10).float().argmax(2) + 1
        assert torch.equal(steps, expected)
    # No threshold given: the checkpoint's early_exit_threshold (0.5), as the reference's default forward.
    torch.testing.assert_close(gate_exit_logits(model, ref["input_ids"], 4)[0], ref["logits_default"],
                               rtol=0, atol=1e-5)


@pytest.mark.numerics
def test_analysis_exit_steps_are_the_gates():
    from rdlm.analysis.exit_steps import exit_steps
    from rdlm.inference.exits.criteria import make_exit_criterion

    model, ref = ouro()
    for row in range(2):
        steps = exit_steps(model, ref["input_ids"][row].tolist(), make_exit_criterion("gate", 0.5), 4)
        assert steps.tolist() == (ref["exit_pdf"][row].cumsum(-1).ge(0.5).float().argmax(-1) + 1).tolist()


def greedy_by_gate(model, prompt, n):
    """Greedy decoding by recomputing the whole sequence, each token read out at its gate's exit."""
    from rdlm.inference.evaluate import gate_exit_logits

    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(gate_exit_logits(model, torch.tensor([tokens]), 4)[0][0, -1].argmax()))
    return tokens[len(prompt):]


def test_gate_exact_decodes_as_the_reference_selects_and_gate_saves_iterations():
    from rdlm.inference.generate import GenerationConfig, generate

    model, ref = ouro()
    prompts = [ref["input_ids"][0, :6].tolist(), ref["input_ids"][1, :9].tolist()]
    exact = generate(model, prompts, GenerationConfig(max_new_tokens=8, num_steps=4, exit_criterion="gate-exact"))
    for prompt, tokens, steps in zip(prompts, exact.tokens, exact.iterations):
        assert tokens == greedy_by_gate(model, prompt, 8)
        assert steps == [4] * 8  # every iteration runs
    early = generate(model, prompts, GenerationConfig(max_new_tokens=8, num_steps=4, exit_criterion="gate"))
    later = [s for row in early.iterations for s in row[1:]]  # the first token comes from the prefill
    assert min(later) >= 1 and sum(later) < 4 * len(later)  # the gate stopped tokens early


def test_gate_exits_in_the_continuous_batch_like_the_engine():
    from rdlm.inference.batching import ContinuousBatch
    from rdlm.inference.generate import GenerationConfig, generate

    model, ref = ouro()
    prompts = [ref["input_ids"][0, :6].tolist(), ref["input_ids"][1, :9].tolist()]
    for criterion, exit_sync_every in itertools.product(("gate", "gate-exact"), (1, 3)):
        config = GenerationConfig(max_new_tokens=6, num_steps=4, exit_criterion=criterion)
        alone = generate(model, prompts, config)
        batch = ContinuousBatch(model, max_batch=2, max_length=32, num_slots=4, exit_sync_every=exit_sync_every,
                                prefill_chunk=4, coda_every=exit_sync_every)
        ids = [batch.add(p, config) for p in prompts]
        tokens, steps = {i: [] for i in ids}, {i: [] for i in ids}
        while batch.busy:
            for event in batch.step():
                tokens[event.request].append(event.token)
                steps[event.request].append(event.iterations)
        assert [tokens[i] for i in ids] == alone.tokens, (criterion, exit_sync_every)
        assert [steps[i] for i in ids] == alone.iterations, (criterion, exit_sync_every)


def test_a_gate_criterion_on_a_model_without_a_gate_is_refused():
    from rdlm.inference.generate import GenerationConfig, generate

    model = load_pretrained(FIXTURES / "retrofit-llama-tiny")
    with pytest.raises(ValueError, match="needs a model with a learned exit gate"):
        generate(model, [[1, 2, 3]], GenerationConfig(max_new_tokens=2, num_steps=4, exit_criterion="gate"))


# ------------------------------------------------------------------------------------------------
# Ouro's training objective: the expected loss over the exit distribution, with an entropy bonus

def test_exit_distribution_and_expected_loss_follow_their_definitions():
    from rdlm.model.loss import exit_distribution, expected_exit_loss

    lambdas = torch.tensor([[0.2, 0.5, 0.9, 0.3]])
    p = exit_distribution(lambdas)
    expected = [0.2, 0.8 * 0.5, 0.8 * 0.5 * 0.9, 0.8 * 0.5 * 0.1]  # the last iteration takes the rest
    torch.testing.assert_close(p, torch.tensor([expected]))
    losses = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    entropy = -sum(x * math.log(x) for x in expected)
    value = expected_exit_loss(losses, lambdas, torch.tensor([True]), beta=0.1)
    assert value.item() == pytest.approx(sum(a * b for a, b in zip(expected, [4, 3, 2, 1])) - 0.1 * entropy, rel=1e-6)
    assert expected_exit_loss(losses, lambdas, torch.tensor([False]), beta=0.1, reduction="sum").item() == 0


def test_training_with_the_exit_loss_moves_the_gate_and_lowers_the_loss():
    from rdlm.train import TrainConfig, train

    torch.manual_seed(0)
    rows = torch.arange(64 * 17).view(64, 17) % 32  # counting: easy to learn, so the loss falls
    model = RecurrentDepthLM(RDLMConfig.from_preset("ouro-tiny", vocab_size=32))
    gate = model.exit_gate.weight.detach().clone()
    result = train(TrainConfig(steps=20, micro_batch_size=8, lr=3e-3, exit_loss_beta=0.01, progress=False,
                               tensorboard=False, threads=1, warmup_steps=2), model=model, train_data=rows)
    assert result.losses[-1] < result.losses[0] - 0.5
    assert all(r == [4] for r in result.num_steps)  # a fixed r: every iteration read out
    assert not torch.equal(model.exit_gate.weight.detach(), gate)


def test_the_exit_loss_needs_a_gate_and_every_iteration_with_gradient():
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny"))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="learned exit gate"):
        model(ids, 2, labels=ids, exit_loss_beta=0.1)
    ouro_model = RecurrentDepthLM(RDLMConfig.from_preset("ouro-tiny"))
    with pytest.raises(ValueError, match="every iteration"):
        ouro_model(ids, (1, 2), labels=ids, exit_loss_beta=0.1)


def test_convert_writes_the_family_layout_in_shards(tmp_path):
    from rdlm.cli import main

    assert main(["convert", str(FIXTURES / "ouro-tiny"), str(tmp_path / "bf16"), "--dtype", "bf16",
                 "--max-shard-size", "100KB"]) in (0, None)
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    assert "model.layers.0.self_attn.q_proj.weight" in index["weight_map"]
    model = load_pretrained(tmp_path / "bf16")
    assert model.config.family == "ouro" and model.embedding.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("name", (*RETROFIT, "ouro-tiny"))
def test_the_heuristic_exit_criteria_run_on_every_family(name):
    from rdlm.inference.generate import GenerationConfig, generate

    model = load_pretrained(FIXTURES / name)
    # A threshold every score passes (the largest GenerationConfig takes): each token exits at its first
    # reading, after min_steps = 2.
    out = generate(model, [[4, 8, 15, 16]], GenerationConfig(max_new_tokens=5, num_steps=6, exit_criterion="kl",
                                                              exit_threshold=2**16))
    assert out.iterations[0][1:] == [2, 2, 2, 2]


def test_a_huginn_layout_model_with_the_new_fields_round_trips(tmp_path):
    """Fields beyond Huginn-0125's travel in the config's rdlm section of a Huginn-layout save."""
    config = RDLMConfig.from_preset("tiny", num_kv_heads=2, qk_bias=False, qk_norm=True, rope_pairs="halves",
                                    rope_scaling={"rope_type": "linear", "factor": 2.0}, embed_scale=1.0,
                                    norm_scheme="peri", final_norm="output", adapter_bias=True)
    torch.manual_seed(0)
    model = RecurrentDepthLM(config).eval()
    save_pretrained(model, tmp_path / "m")
    again = load_pretrained(tmp_path / "m")
    assert again.config == config
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(again(ids, 3, init_scale=0).logits, model(ids, 3, init_scale=0).logits)
