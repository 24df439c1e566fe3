"""`rdlm retrofit`: a pretrained Llama/OLMo-2 checkpoint becomes a recurrent-depth model that, at r = 1,
computes the source model (without the dropped layers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rdlm import load_pretrained
from rdlm.model.retrofit import RetrofitError, parse_layers, retrofit

transformers = pytest.importorskip("transformers")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def tokenizer_file(directory: Path) -> None:
    from rdlm.demo.tasks import EOS, PAD, CharTokenizer

    alphabet = PAD + EOS + "".join(map(chr, range(32, 127))) + "".join(map(chr, range(161, 192)))
    CharTokenizer(alphabet).to_tokenizer().save(str(directory / "tokenizer.json"))


def make_source(tmp_path: Path, kind: str = "llama", layers: int = 6, tied: bool = False) -> tuple[Path, object]:
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tied)
    if kind == "llama":
        config = transformers.LlamaConfig(**common, rope_parameters={"rope_theta": 500000.0, **LLAMA3_SCALING})
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Olmo2Config(**common)
        model = transformers.Olmo2ForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so a norm in the wrong place shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape))
    model.eval()
    path = tmp_path / f"{kind}-source"
    model.save_pretrained(path)
    tokenizer_file(path)
    return path, model


def without_layers(model, keep: list[int]):
    """The source model with only `keep` layers, in that order."""
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in keep)
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:len(keep)]
    return model


IDS = torch.tensor([[3, 17, 42, 99, 5, 64, 7, 120, 1, 33]])


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["llama", "olmo2"])
def test_with_no_layer_dropped_r1_is_the_source_model(tmp_path, kind):
    source, model = make_source(tmp_path, kind)
    retrofit(source, tmp_path / "out", [0, 1], [2, 3], [4, 5])
    ours = load_pretrained(tmp_path / "out")
    assert ours.config.family == ("retrofit-llama" if kind == "llama" else "retrofit-olmo")
    with torch.no_grad():
        expected = model(IDS, use_cache=False).logits
        got = ours(IDS, 1).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        # [0 | I] ignores the state: until training moves the adapter, every r computes the same.
        torch.testing.assert_close(ours(IDS, 3).logits, got, rtol=0, atol=1e-5)
    assert (tmp_path / "out" / "tokenizer.json").is_file()


@pytest.mark.numerics
def test_dropped_layers_give_the_source_without_them(tmp_path):
    source, model = make_source(tmp_path, "llama", layers=8)
    retrofit(source, tmp_path / "out", parse_layers("0-1"), parse_layers("4,5"), parse_layers("6-7"))
    ours = load_pretrained(tmp_path / "out")
    with torch.no_grad():
        expected = without_layers(model, [0, 1, 4, 5, 6, 7])(IDS, use_cache=False).logits
        torch.testing.assert_close(ours(IDS, 1).logits, expected, rtol=0, atol=1e-5)


@pytest.mark.numerics
def test_a_tied_source_gets_its_own_head_and_the_layout_loads_back(tmp_path):
    source, model = make_source(tmp_path, "llama", tied=True)
    retrofit(source, tmp_path / "out", [0], [1, 2, 3, 4], [5])
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["model_type"] == "huginn_raven" and raw["tie_embeddings"] is False
    assert raw["rope_scaling"]["rope_type"] == "llama3" and raw["num_key_value_heads"] == 2
    ours = load_pretrained(tmp_path / "out")
    assert torch.equal(ours.lm_head.weight, ours.embedding.weight)  # a copy, trained apart from here on
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS, 1).logits, model(IDS, use_cache=False).logits, rtol=0, atol=1e-5)


def test_adapter_initialisations(tmp_path):
    source, _ = make_source(tmp_path, "llama")
    for init in ("sum", "random"):
        retrofit(source, tmp_path / init, [0, 1], [2, 3], [4, 5], adapter_init=init)
    h = 64
    summed = load_pretrained(tmp_path / "sum")
    assert torch.equal(summed.adapter.weight, torch.cat([torch.eye(h), torch.eye(h)], dim=1))
    with torch.no_grad():  # the state now feeds the core: depth changes the output
        assert (summed(IDS, 3, init_scale=0).logits - summed(IDS, 1, init_scale=0).logits).abs().max() > 1e-3
    random = load_pretrained(tmp_path / "random").adapter.weight
    assert random[:, :h].abs().sum() > 0 and random.std() < 0.2


@pytest.mark.parametrize("split, message", [
    (([0], [], [5]), "at least one layer"),
    (([0], [1, 9], [5]), "layer 9 is out of range"),
    (([0, 1], [1, 2], [5]), "layer 1 is named twice"),
    # The source's order is kept (decided: a reverse split would not compute the source at r = 1; docs/retrofit.md)
    (([2], [1], [0]), "layer 1 comes after layer 2"),
    (([0], [3, 2], [5]), "layer 2 comes after layer 3"),
])
def test_bad_splits_are_named(tmp_path, split, message):
    source, _ = make_source(tmp_path, "llama")
    with pytest.raises(RetrofitError, match=message):
        retrofit(source, tmp_path / "out", *split)
    assert not (tmp_path / "out").exists()


def test_unsupported_sources_and_missing_tokenizers_are_named(tmp_path):
    source, _ = make_source(tmp_path, "llama")
    qwen = tmp_path / "qwen"
    shutil.copytree(source, qwen)
    raw = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**raw, "model_type": "qwen2"}))
    with pytest.raises(RetrofitError, match="model_type 'qwen2' is not supported"):
        retrofit(qwen, tmp_path / "out", [0], [1], [2])
    (source / "tokenizer.json").unlink()
    with pytest.raises(RetrofitError, match="no tokenizer.json"):
        retrofit(source, tmp_path / "out", [0], [1], [2])
    with pytest.raises(RetrofitError, match="'x' is not a layer index"):
        parse_layers("0,x")


def tree(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def test_the_source_and_a_previous_model_are_never_written_over(tmp_path, capsys):
    """docs/files.md: the source is refused as the destination before anything is written; a model already
    in the destination is replaced only with --overwrite (the user's other files there stay); a directory of
    other files is refused."""
    from rdlm.cli import main

    source, _ = make_source(tmp_path, "llama")
    original = tree(source)
    split = ["--prelude", "0", "--core", "1", "--coda", "2"]
    for destination in (source, tmp_path / "llama-source" / "."):
        assert main(["retrofit", str(source), str(destination), *split]) == 2
        assert "is the source" in capsys.readouterr().err
        assert main(["retrofit", str(source), str(destination), *split, "--overwrite"]) == 2
        assert tree(source) == original
    out = tmp_path / "out"
    assert main(["retrofit", str(source), str(out), *split]) == 0
    (out / "notes.txt").write_text("mine")
    first = tree(out)
    assert main(["retrofit", str(source), str(out), "--prelude", "0", "--core", "1-2", "--coda", "3"]) == 2
    assert "already holds a model" in capsys.readouterr().err and tree(out) == first
    assert main(["retrofit", str(source), str(out), "--prelude", "0", "--core", "1-2", "--coda", "3",
                 "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and load_pretrained(out).config.core_layers == 2
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "thesis.tex").write_text("mine")
    assert main(["retrofit", str(source), str(folder), *split]) == 2
    assert "holds other files (thesis.tex)" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["thesis.tex"]


def test_a_config_size_of_the_wrong_type_and_an_unreadable_tokenizer_are_named(tmp_path, capsys):
    from rdlm.cli import main

    source, _ = make_source(tmp_path, "llama")
    raw = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": "three"}))
    assert main(["retrofit", str(source), str(tmp_path / "a"), "--prelude", "0", "--core", "1", "--coda", "2"]) == 2
    assert "num_hidden_layers must be a positive integer, got 'three'" in capsys.readouterr().err
    (source / "config.json").write_text(json.dumps(raw))
    (source / "tokenizer.json").write_text("{not json")
    assert main(["retrofit", str(source), str(tmp_path / "b"), "--prelude", "0", "--core", "1", "--coda", "2"]) == 2
    assert "tokenizer.json: not a readable tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_the_cli_retrofits_and_the_result_generates(tmp_path, capsys):
    from rdlm.cli import main

    source, _ = make_source(tmp_path, "llama")
    assert main(["retrofit", str(source), str(tmp_path / "out"), "--prelude", "0-1", "--core", "2-3",
                 "--coda", "4-5"]) == 0
    assert "retrofit-llama" in capsys.readouterr().out
    assert main(["generate", "--model", str(tmp_path / "out"), "--prompt", "the cat", "-r", "2",
                 "--max-new-tokens", "4", "--no-stream"]) == 0
    assert capsys.readouterr().out.startswith("the cat")
    assert main(["retrofit", str(source), str(tmp_path / "bad"), "--core", "2-9"]) != 0
    assert "out of range" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Curriculum training (McLeish et al. 2025): the mean of r ramps up over training

def test_curriculum_shapes():
    from rdlm.train.schedule import RecurrenceCurriculum

    linear = RecurrenceCurriculum(target=8, total_steps=100, kind="linear", start=1, fraction=0.5)
    slow = RecurrenceCurriculum(target=8, total_steps=100, kind="1-sqrt", start=1, fraction=0.5)
    means = [linear(s) for s in range(100)]
    assert means[0] == 1 and means[49] == 8 and means[99] == 8 and means == sorted(means)
    assert means[25] == 5  # ceil(1 + 7 * 0.5)
    assert slow(25) == 4 and slow(25) < linear(25)  # 1 - sqrt(0.5) = 0.29: ceil(1 + 7 * 0.29)
    with pytest.raises(ValueError, match="curriculum must be one of"):
        RecurrenceCurriculum(target=8, total_steps=10, kind="cosine")


def test_a_retrofitted_model_trains_with_the_curriculum_and_resumes_mid_ramp(tmp_path):
    from rdlm.train import TrainConfig, train
    from rdlm.train.monitor import read_log

    source, _ = make_source(tmp_path, "llama")
    retrofit(source, tmp_path / "model", [0, 1], [2, 3], [4, 5], adapter_init="sum", mean_recurrence=6)
    rows = torch.arange(40 * 17).view(40, 17) % 100
    common = dict(model=str(tmp_path / "model"), steps=8, micro_batch_size=4, curriculum="linear",
                  curriculum_fraction=0.75, recurrence_sampler="fixed", progress=False, tensorboard=False,
                  threads=1, warmup_steps=2, ema_decay=None, seed=1)
    whole = train(TrainConfig(**common, out_dir=str(tmp_path / "whole")), train_data=rows)
    means = [r["mean_recurrence"] for r in read_log(tmp_path / "whole" / "log.jsonl") if r["kind"] == "train"]
    assert means == [1, 2, 3, 4, 5, 6, 6, 6]  # ramp over 6 of 8 steps, then the target
    assert [n for (n,) in whole.num_steps] == means  # the fixed sampler draws the mean itself
    with pytest.raises(_Stop):  # a run cut after step 3, mid-ramp
        train(TrainConfig(**common, out_dir=str(tmp_path / "cut"), checkpoint_every=3), train_data=rows,
              step_hooks=[lambda record: _stop_after(record, 3)])
    resumed = train(TrainConfig(**common, out_dir=str(tmp_path / "cut"), resume=True), train_data=rows)
    assert resumed.losses == pytest.approx(whole.losses, rel=1e-5)
    means = [r["mean_recurrence"] for r in read_log(tmp_path / "cut" / "log.jsonl") if r["kind"] == "train"]
    assert means[-5:] == [4, 5, 6, 6, 6]


class _Stop(Exception):
    pass


def _stop_after(record, step):
    if record["kind"] == "train" and record["step"] == step:
        raise _Stop


def test_muon_trains_the_matrices_and_refuses_sharding(tmp_path):
    from rdlm import RDLMConfig, RecurrentDepthLM
    from rdlm.train import TrainConfig, train
    from rdlm.train.optim import MuonAdamW, muon_parameters

    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", vocab_size=32))
    body, rest = muon_parameters(model)
    assert all(p.ndim == 2 for p in body) and model.embedding.weight in [*rest]
    rows = torch.arange(64 * 17).view(64, 17) % 32
    result = train(TrainConfig(steps=20, micro_batch_size=8, optimizer="muon", muon_lr=0.02, lr=3e-3,
                               progress=False, tensorboard=False, threads=1, warmup_steps=2,
                               out_dir=str(tmp_path / "run")), model=model, train_data=rows)
    assert result.losses[-1] < result.losses[0] - 0.5
    optimizer = MuonAdamW(model, lr=1e-3)
    assert optimizer.param_groups[0]["muon"] and optimizer.param_groups[0]["lr"] == 0.005
    with pytest.raises(Exception, match="orthogonalizes whole matrices"):
        from rdlm.train.build import parallelize
        parallelize(model, TrainConfig(optimizer="muon"), "fsdp", torch.device("cpu"), None, False)


@pytest.mark.numerics
def test_a_plain_rdlm_model_is_a_llama(tmp_path):
    """The fixed-depth baseline rdlm trains (plain_config) saves as a transformers Llama with the same logits,
    and retrofitting it gives them back at r = 1."""
    from rdlm import RecurrentDepthLM
    from rdlm.model.retrofit import load_llama, plain_config, save_as_llama

    torch.manual_seed(0)
    config = plain_config(core_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96,
                          vocab_size=128, context_length=64, rope_base=10000.0)
    model = RecurrentDepthLM(config).eval()
    save_as_llama(model, tmp_path / "llama")
    llama = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    with torch.no_grad():
        ours = model(IDS, 1).logits
        torch.testing.assert_close(llama(IDS, use_cache=False).logits, ours, rtol=0, atol=1e-5)
        tokenizer_file(tmp_path / "llama")
        back = retrofit(tmp_path / "llama", tmp_path / "retro", [0], [1, 2], [3])
        torch.testing.assert_close(back(IDS, 1).logits, ours, rtol=0, atol=1e-5)
        plain = load_llama(tmp_path / "llama")  # and the Llama read back as the fixed-depth model
        assert plain.config == config
        assert torch.equal(plain(IDS, 1).logits, ours)


def test_a_trained_retrofitted_model_converts_and_serves(tmp_path, capsys):
    pytest.importorskip("openai")
    from rdlm.cli import main
    from rdlm.train import TrainConfig, train
    from test_serve import LiveServer

    source, _ = make_source(tmp_path, "llama")
    retrofit(source, tmp_path / "model", [0, 1], [2, 3], [4, 5])
    rows = torch.arange(16 * 17).view(16, 17) % 100
    train(TrainConfig(model=str(tmp_path / "model"), steps=3, micro_batch_size=4, curriculum="linear",
                      progress=False, tensorboard=False, threads=1, warmup_steps=1, out_dir=str(tmp_path / "run")),
          train_data=rows)
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "final")]) == 0
    shutil.copy2(source / "tokenizer.json", tmp_path / "final" / "tokenizer.json")
    assert load_pretrained(tmp_path / "final").config.family == "retrofit-llama"
    with LiveServer(tmp_path / "final") as live:
        out = live.client().completions.create(model="tiny", prompt="the cat", max_tokens=4, temperature=0,
                                               extra_body={"num_steps": 3})
    assert out.usage.completion_tokens == 4 and out.usage.model_extra["latent_iterations"] == 12
