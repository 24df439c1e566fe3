import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rdlm import CheckpointError, RDLMConfig, RecurrentDepthLM, load_pretrained, save_pretrained
from rdlm import huginn


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
    torch.testing.assert_close(written["freqs_cis"], original["freqs_cis"])
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


def test_stored_rope_table_is_ignored(tmp_path, huginn_tiny_dir):
    d = copy_fixture(huginn_tiny_dir, tmp_path)
    rewrite_weights(d, lambda t: t.__setitem__("freqs_cis", torch.full_like(t["freqs_cis"], 7.0)))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        a = load_pretrained(d)(ids, num_steps=2, init_scale=0.0).logits
        b = load_pretrained(huginn_tiny_dir)(ids, num_steps=2, init_scale=0.0).logits
    assert torch.equal(a, b)


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
