import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rdlm import CheckpointError, RDLMConfig, RecurrentDepthLM, load_pretrained, save_pretrained
from rdlm.model import huginn
from rdlm.model.lm import rope_tables
from tests.conftest import assert_within_bf16_roundoff

# Float comparisons with references computed on other machines (CI reruns them with other CPU kernels).
pytestmark = pytest.mark.numerics


def copy_fixture(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


def rewrite_weights(directory, edit):
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_save_then_load_is_lossless(tmp_path, tiny_model):
    save_pretrained(tiny_model, tmp_path / "m")
    assert_same_weights(load_pretrained(tmp_path / "m"), tiny_model)
    names = set(load_file(tmp_path / "m" / "model.safetensors"))
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "huginn_raven" and config["n_embd"] == 64


def test_loaded_fixture_saves_to_the_same_tensors(tmp_path, huginn_tiny_dir):
    model = load_pretrained(huginn_tiny_dir)
    save_pretrained(model, tmp_path / "again")
    original = load_file(huginn_tiny_dir / "model.safetensors")
    written = load_file(tmp_path / "again" / "model.safetensors")
    assert original.keys() == written.keys()
    for name in original:
        if name != "freqs_cis":
            assert torch.equal(original[name], written[name]), name
    assert torch.equal(written["freqs_cis"], original["freqs_cis"])
    assert huginn.read_config(tmp_path / "again") == huginn.read_config(huginn_tiny_dir)


def test_sharded_save_writes_an_index_and_loads(tmp_path, tiny_model):
    save_pretrained(tiny_model, tmp_path / "m", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "m" / huginn.INDEX_NAME).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (tmp_path / "m" / "model.safetensors").exists()
    assert_same_weights(load_pretrained(tmp_path / "m"), tiny_model)


def test_bfloat16_save_and_load(tmp_path, tiny_model):
    save_pretrained(tiny_model, tmp_path / "m", dtype=torch.bfloat16)
    model = load_pretrained(tmp_path / "m")
    assert model.embedding.weight.dtype == torch.bfloat16
    assert torch.equal(model.embedding.weight, tiny_model.embedding.weight.to(torch.bfloat16))
    assert load_pretrained(tmp_path / "m", dtype=torch.float32).embedding.weight.dtype == torch.float32
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), num_steps=2)


def test_a_bf16_checkpoint_gives_the_reference_logits_within_bfloat16_round_off(huginn_tiny_bf16_dir):
    # Saved by the authors' code in bfloat16 (its freqs_cis too). Kernels round bfloat16 differently on
    # different CPUs (native AVX-512-BF16 or emulated), so the bfloat16 logits are compared with the
    # reference's float32 computation of the same weights, within bfloat16 round-off (tests/conftest.py);
    # the authors' own bfloat16 logits meet the same bound.
    expected = load_file(huginn_tiny_bf16_dir / "expected_outputs.safetensors")       # the reference, bf16
    reference = load_file(huginn_tiny_bf16_dir / "float32_outputs.safetensors")       # the reference, fp32
    model = load_pretrained(huginn_tiny_bf16_dir)
    assert model.embedding.weight.dtype == torch.bfloat16
    with torch.no_grad():
        for r in (1, 4, 16):
            zero = model(expected["input_ids"], num_steps=r, init_scale=0.0).logits
            given = model(expected["input_ids"], num_steps=r, initial_state=expected["input_states"]).logits
            for kind, logits in (("zero", zero), ("given", given)):
                assert_within_bf16_roundoff(logits, reference[f"logits_{kind}_state_r{r}"])
                assert_within_bf16_roundoff(expected[f"logits_{kind}_state_r{r}"],
                                            reference[f"logits_{kind}_state_r{r}"])


def test_a_bf16_checkpoint_loaded_in_float32_uses_its_stored_rope_table(huginn_tiny_bf16_dir):
    # In float32 the stored (bfloat16-rounded) RoPE table shows: the reference's float32 logits are matched
    # to float32 round-off (1e-5, as for huginn-tiny; measured <= 1.1e-6 with three kernel sets), while the
    # table recomputed from the config moves the logits by more than 1e-4, ten times that tolerance.
    expected = load_file(huginn_tiny_bf16_dir / "expected_outputs.safetensors")
    reference = load_file(huginn_tiny_bf16_dir / "float32_outputs.safetensors")
    model = load_pretrained(huginn_tiny_bf16_dir, dtype=torch.float32)
    stored = load_file(huginn_tiny_bf16_dir / "model.safetensors")["freqs_cis"]
    assert stored.dtype == torch.bfloat16 and torch.equal(model.rope_cos, stored[0, :, 0, :, 0].float())
    ids, states = expected["input_ids"], expected["input_states"].float()
    with torch.no_grad():
        for r in (1, 4, 16):
            zero = model(ids, num_steps=r, init_scale=0.0).logits
            given = model(ids, num_steps=r, initial_state=states).logits
            torch.testing.assert_close(zero, reference[f"logits_zero_state_r{r}"], rtol=0, atol=1e-5)
            torch.testing.assert_close(given, reference[f"logits_given_state_r{r}"], rtol=0, atol=1e-5)
        cos, sin = rope_tables(model.config.head_dim, model.config.context_length, model.config.rope_base)
        model.rope_cos, model.rope_sin = cos, sin
        recomputed = model(ids, num_steps=4, init_scale=0.0).logits
    assert (recomputed - reference["logits_zero_state_r4"]).abs().max() > 1e-4


def test_the_stored_rope_table_is_used_and_written_back(tmp_path, huginn_tiny_bf16_dir):
    stored = load_file(huginn_tiny_bf16_dir / "model.safetensors")["freqs_cis"]
    model = load_pretrained(huginn_tiny_bf16_dir, dtype=torch.float32)   # a float32 model keeps it too
    assert torch.equal(model.rope_sin, stored[0, :, 0, :, 1].float())
    save_pretrained(model, tmp_path / "fp32")
    written = load_file(tmp_path / "fp32" / "model.safetensors")["freqs_cis"]
    assert written.dtype == torch.float32 and torch.equal(written, stored.float())
    save_pretrained(load_pretrained(huginn_tiny_bf16_dir), tmp_path / "bf16")
    assert torch.equal(load_file(tmp_path / "bf16" / "model.safetensors")["freqs_cis"], stored)


def test_without_a_stored_table_rope_is_computed(tmp_path, huginn_tiny_dir):
    d = copy_fixture(huginn_tiny_dir, tmp_path)
    rewrite_weights(d, lambda t: t.pop("freqs_cis"))
    cos, sin = rope_tables(16, 256, 50000.0)
    model = load_pretrained(d)
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.__setitem__("freqs_cis", torch.full_like(t["freqs_cis"], 7.0)), "not the RoPE table"),
    (lambda t: t.__setitem__("freqs_cis", t["freqs_cis"][:, :128]), "freqs_cis has shape"),
])
def test_a_stored_rope_table_that_disagrees_with_the_config_is_refused(tmp_path, huginn_tiny_dir, edit, message):
    d = copy_fixture(huginn_tiny_dir, tmp_path)
    rewrite_weights(d, edit)
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(d)


def with_config(directory, tmp_path, **changes):
    d = copy_fixture(directory, tmp_path)
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("kind", ["fixed", "geom", "sqrt", "line", "chi"])
def test_test_time_noise_is_the_references(tmp_path, huginn_tiny_dir, kind):
    # The reference run: test_time_noise 0.1 of this type, torch.manual_seed(0), given s_0, r = 4.
    reference = load_file(huginn_tiny_dir / "reference_outputs.safetensors")
    expected = load_file(huginn_tiny_dir / "expected_outputs.safetensors")
    model = load_pretrained(with_config(huginn_tiny_dir, tmp_path, test_time_noise=0.1, test_time_noise_type=kind))
    assert (model.config.test_time_noise, model.config.test_time_noise_type) == (0.1, kind)
    torch.manual_seed(0)
    with torch.no_grad():
        logits = model(expected["input_ids"], num_steps=4, initial_state=expected["input_states"]).logits
    torch.testing.assert_close(logits, reference[f"logits_noise_{kind}_r4"], rtol=0, atol=1e-5)
    assert (logits - expected["logits_given_state_r4"]).abs().max() > 0.1    # the noise is not ignored


def test_init_values_std_is_the_scale_of_the_random_state(tmp_path, huginn_tiny_dir):
    reference = load_file(huginn_tiny_dir / "reference_outputs.safetensors")
    ids = load_file(huginn_tiny_dir / "expected_outputs.safetensors")["input_ids"]
    raw = json.loads((huginn_tiny_dir / "config.json").read_text())
    zero = load_pretrained(with_config(huginn_tiny_dir, tmp_path / "a", init_values={**raw["init_values"], "std": 0.0}))
    with torch.no_grad():  # std 0: the zero state even at init_scale 1, as in the reference
        logits = zero(ids, num_steps=4, init_scale=1.0).logits
    torch.testing.assert_close(logits, reference["logits_init_std0_r4"], rtol=0, atol=1e-5)
    wide = load_pretrained(with_config(huginn_tiny_dir, tmp_path / "b", init_values={**raw["init_values"], "std": 0.5}))
    assert wide.config.state_init_std == 0.5
    state = wide.init_state(torch.zeros(4, 256, 64), generator=torch.Generator().manual_seed(0))
    truncated_std = 0.5 * 8.0 * 0.9866  # std of a normal cut at 3 sigma, times the embedding scale sqrt(h)
    assert abs(state.std().item() / truncated_std - 1) < 0.02
    assert load_pretrained(huginn_tiny_dir).config.state_init_std is None   # sqrt(2/(5h)), the default
    save_pretrained(wide, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["init_values"]["std"] == 0.5


@pytest.mark.parametrize("changes, message", [
    (dict(test_time_noise=-1), "test_time_noise must be >= 0"),
    (dict(test_time_noise=0.1, test_time_noise_type="wobbly"), "test_time_noise_type"),
    (dict(init_values={"std": "big"}), "init_values.std"),
    (dict(num_attention_heads=8), "num_attention_heads=8 contradicts n_heads=4"),
])
def test_config_keys_that_change_outputs_are_checked(tmp_path, huginn_tiny_dir, changes, message):
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(with_config(huginn_tiny_dir, tmp_path, **changes))


def test_the_authors_config_spelling_loads(tmp_path, huginn_tiny_dir):
    d = copy_fixture(huginn_tiny_dir, tmp_path)
    config = json.loads((d / "config.json").read_text())
    config["num_attention_heads"] = config.pop("n_heads")   # raven_config_minimal.json's spelling
    config["hidden_size"] = config.pop("n_embd")
    (d / "config.json").write_text(json.dumps(config))
    assert huginn.read_config(d) == huginn.read_config(huginn_tiny_dir)
    assert_same_weights(load_pretrained(d), load_pretrained(huginn_tiny_dir))


def test_the_authors_raven_config_minimal_json_reads_as_huginn_0125():
    # The keys and values of recpre/raven_config_minimal.json in the authors' repository.
    raw = {"name": "nebel-raven-3.5b", "architectures": ["RavenForCausalLM"], "torch_dtype": "bfloat16",
           "model_type": "huginn_raven", "block_size": 4096, "vocab_size": 65536, "padding_multiple": 4096,
           "tie_embeddings": True, "num_attention_heads": 55, "num_key_value_heads": 55, "n_embd": 5280,
           "intermediate_size": 17920, "bias": False, "architecture_class_name": "RecurrentGPT",
           "block_class_name": "SandwichBlock", "norm_class_name": "RMSNorm_llama", "norm_eps": 0.000001,
           "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "init_strategy": "takase",
           "init_orthogonal": False, "state_init": "like-init", "injection_type": "linear",
           "n_layers_in_recurrent_block": 4, "mean_recurrence": 32,
           "sampling_scheme": "poisson-lognormal-filling", "mean_backprop_depth": 8, "n_layers_in_prelude": 2,
           "n_layers_in_coda": 2, "qk_bias": True, "activation_checkpoint_impl": "per-iteration"}
    assert huginn.config_from_huginn(raw) == RDLMConfig.from_preset("huginn-0125")


def test_a_tied_lm_head_in_the_file_is_accepted(tmp_path, huginn_tiny_dir):
    d = copy_fixture(huginn_tiny_dir, tmp_path)
    rewrite_weights(d, lambda t: t.__setitem__("lm_head.weight", t["transformer.wte.weight"].clone()))
    assert_same_weights(load_pretrained(d), load_pretrained(huginn_tiny_dir))


def test_untied_model_round_trips(tmp_path):
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", tie_embeddings=False))
    save_pretrained(model, tmp_path / "m")
    assert "lm_head.weight" in load_file(tmp_path / "m" / "model.safetensors")
    assert_same_weights(load_pretrained(tmp_path / "m"), model)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("transformer.core_block.1.mlp.fc.weight"), "missing tensor.*core_block.1.mlp.fc.weight"),
    (lambda t: t.__setitem__("transformer.extra.weight", torch.zeros(2)), "unexpected tensor.*transformer.extra.weight"),
    (lambda t: t.__setitem__("transformer.adapter.weight", torch.zeros(64, 64)), "transformer.adapter.weight has shape \\[64, 64\\], expected \\[64, 128\\]"),
    (lambda t: t.__setitem__("lm_head.weight", torch.zeros(512, 64)), "lm_head.weight differs"),
])
def test_bad_tensors_are_named(tmp_path, huginn_tiny_dir, edit, message):
    d = copy_fixture(huginn_tiny_dir, tmp_path)
    rewrite_weights(d, edit)
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(d)


def test_corrupted_weight_file_is_an_error(tmp_path, huginn_tiny_dir):
    d = copy_fixture(huginn_tiny_dir, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_pretrained(d)


def test_pickle_files_are_never_read(tmp_path, huginn_tiny_dir):
    d = copy_fixture(huginn_tiny_dir, tmp_path)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_pretrained(d)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("n_embd"), "missing required key.*n_embd"),
    (lambda c: c.update(model_type="llama"), "model_type"),
    (lambda c: c.update(n_heads=5, num_key_value_heads=5), "hidden_size.*num_heads"),
    (lambda c: c.update(bias=True), "bias"),
    (lambda c: c.update(rdlm={"colour": 1}), "colour"),
])
def test_bad_config_is_named(tmp_path, huginn_tiny_dir, edit, message):
    d = copy_fixture(huginn_tiny_dir, tmp_path)
    config = json.loads((d / "config.json").read_text())
    edit(config)
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(d)


def test_malformed_or_missing_config(tmp_path, huginn_tiny_dir):
    d = copy_fixture(huginn_tiny_dir, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_pretrained(d)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pretrained(d)


def test_save_keeps_foreign_files_and_replaces_stale_shards(tmp_path, tiny_model):
    target = tmp_path / "m"
    save_pretrained(tiny_model, target, max_shard_bytes=100_000)
    (target / "tokenizer.json").write_text("{}")
    save_pretrained(tiny_model, target)  # now a single file
    assert (target / "tokenizer.json").read_text() == "{}"
    assert sorted(p.name for p in target.glob("*.safetensors")) == ["model.safetensors"]
    assert not (target / huginn.INDEX_NAME).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary directories left


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, tiny_model, monkeypatch):
    target = tmp_path / "m"
    save_pretrained(tiny_model, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    other = RecurrentDepthLM(RDLMConfig.from_preset("tiny"))

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(huginn, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(other, target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/outside.safetensors", "a/../../x.safetensors",
                                  "", 7])
def test_a_shard_index_cannot_name_files_outside_the_model_directory(tmp_path, tiny_model, name):
    import json

    target = save_pretrained(tiny_model, tmp_path / "m", max_shard_bytes=100_000)
    save_pretrained(tiny_model, tmp_path / "outside")
    index = json.loads((target / huginn.INDEX_NAME).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = name
    (target / huginn.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(huginn.CheckpointError, match="outside the model directory|not a non-empty string"):
        load_pretrained(target)
