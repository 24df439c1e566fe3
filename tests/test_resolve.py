"""What a model argument can name (rdlm.model.resolve): one answer for `rdlm.load_model`, every
command's --model and training."""

import pytest
import torch

import rdlm
from rdlm import CheckpointError, ConfigError, load_pretrained, save_pretrained
from rdlm.cli import main
from rdlm.model.resolve import resolve_model_source

from conftest import same_weights, write_training_run


@pytest.fixture
def run_dir(tmp_path, tiny_model):
    return write_training_run(tmp_path, tiny_model)[0]


def generate_ids(model: str, capsys) -> str:
    assert main(["generate", "--model", model, "--prompt-ids", "1,2,3", "-r", "2", "--max-new-tokens", "3",
                 "--init-scale", "0"]) == 0
    return capsys.readouterr().out


def test_each_kind_of_model_argument_loads_the_same_weights_everywhere(run_dir, tiny_model, capsys):
    newest = run_dir / "checkpoints" / "step-000200"
    ema = load_pretrained(newest / "ema")
    kinds = {str(run_dir): ("run", newest / "ema"), str(newest): ("checkpoint", newest / "ema"),
             str(newest / "model"): ("model", newest / "model")}
    for text, (kind, directory) in kinds.items():
        found = resolve_model_source(text)
        assert (found.kind, found.directory, found.tokenizer_dir) == (kind, directory, directory)
        model = rdlm.load_model(text)
        assert not model.training
        assert same_weights(model, ema if directory.name == "ema" else tiny_model)
        # `rdlm generate` takes what load_model takes, and generates from the same weights.
        assert generate_ids(text, capsys) == generate_ids(str(directory), capsys)
    assert same_weights(rdlm.load_model(str(run_dir), weights="model"), tiny_model)
    # A text prompt finds the tokenizer inside the checkpoint.
    assert main(["generate", "--model", str(run_dir), "--prompt", "ravens", "-r", "2", "--max-new-tokens", "2",
                 "--init-scale", "0"]) == 0
    assert capsys.readouterr().out.startswith("ravens")


def test_presets_by_name_and_with_the_preset_prefix(capsys):
    for text in ("tiny", "preset:tiny"):
        found = resolve_model_source(text)
        assert (found.kind, found.preset, found.tokenizer_dir) == ("preset", "tiny", None)
        torch.manual_seed(0)
        model = rdlm.load_model(text, dtype="bf16")
        assert model.config.name == "tiny" and model.embedding.weight.dtype == torch.bfloat16
    assert generate_ids("tiny", capsys) == generate_ids("preset:tiny", capsys)
    with pytest.raises(ConfigError, match="unknown preset 'tinyy'.*did you mean 'tiny'"):
        resolve_model_source("tinyy")
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        resolve_model_source("preset:nope")


def test_a_model_folder_named_like_a_preset_is_refused_naming_both_spellings(tmp_path, tiny_model, monkeypatch,
                                                                             capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small").mkdir()  # a folder holding no model does not shadow the preset
    assert resolve_model_source("small").kind == "preset"
    save_pretrained(tiny_model, tmp_path / "tiny")
    with pytest.raises(ConfigError, match=r"preset:tiny for the preset or \./tiny for the directory"):
        resolve_model_source("tiny")
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1"]) == 2
    assert "preset:tiny" in capsys.readouterr().err
    assert resolve_model_source("./tiny").kind == "model"
    assert same_weights(rdlm.load_model("./tiny"), tiny_model)
    assert resolve_model_source("preset:tiny").kind == "preset"


def test_a_path_that_holds_no_model_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("train a raven")
    train = ["train", "--out-dir", "none", "--data", "x", "--model"]  # the model is read before the data
    for command in (["generate", "--model"], ["info"], ["analyze"], train):
        assert main([*command, str(tmp_path / "notes"), *(["--prompt-ids", "1"] if command[0] == "analyze" else [])
                     ]) == 2
        err = capsys.readouterr().err
        assert "neither a Huginn-layout directory" in err and "a preset" in err and "run directory" in err
    with pytest.raises(FileNotFoundError, match="no such directory"):
        rdlm.load_model(str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="is a file"):
        rdlm.load_model(str(tmp_path / "notes" / "todo.txt"))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        rdlm.load_model(str(tmp_path / "run"))


def test_training_starts_from_a_run_directory_with_its_raw_weights(run_dir, tiny_model):
    from rdlm.train.build import resolve_model

    model, tokenizer_dir = resolve_model(str(run_dir))
    assert model.training and same_weights(model, tiny_model)
    assert tokenizer_dir == run_dir / "checkpoints" / "step-000200" / "model"
    model, _ = resolve_model(str(run_dir), {"mean_recurrence": 3})
    assert model.config.mean_recurrence == 3 and same_weights(model, tiny_model)


def test_info_and_convert_read_a_run_directory(run_dir, tmp_path, capsys):
    import json

    assert main(["info", str(run_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["name"] == "tiny"
    assert main(["convert", "tiny", str(tmp_path / "out")]) == 2
    assert "is a preset" in capsys.readouterr().err
