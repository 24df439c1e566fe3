"""Bad input to the command line ends in one clear line and the usual exit status (2: the input, 1: the
system), never a traceback: the bad-input audit's cases, each with the command, its status and its line."""

import json
import shutil

import pytest

from rdlm.cli import main
from tests.hf_helpers import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("cli-errors") / "model")


def run(capsys, *argv) -> tuple[int, list[str]]:
    """(exit status, stderr's lines) of `rdlm ARGV`."""
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


def edited_model(model_dir, tmp_path, **changes):
    """A copy of the model directory whose config.json has `changes`."""
    copy = tmp_path / "edited"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("command", ["info", "generate"])
def test_a_config_value_of_the_wrong_type_is_named_with_its_key(model_dir, tmp_path, capsys, command):
    bad = edited_model(model_dir, tmp_path, n_embd="64")
    argv = [command, "--model", bad] + (["--prompt-ids", "1"] if command == "generate" else [])
    assert run(capsys, *argv) == (2, [f"rdlm {command}: error: {bad}/config.json: n_embd must be an integer, "
                                      "got '64' (a string)"])


@pytest.mark.parametrize("command", ["info", "generate"])
def test_a_context_too_long_to_allocate_is_refused_naming_the_limit(model_dir, tmp_path, capsys, command):
    bad = edited_model(model_dir, tmp_path, block_size=10**12)
    argv = [command, "--model", bad] + (["--prompt-ids", "1"] if command == "generate" else [])
    assert run(capsys, *argv) == (2, [
        f"rdlm {command}: error: {bad}/config.json: block_size (context_length) must be at most 1048576 "
        "positions (2**20), got 1000000000000 (its RoPE tables alone would need 6.4e+04 GB)"])


def test_training_with_a_context_too_long_is_refused_and_leaves_no_directory(tmp_path, capsys):
    out = tmp_path / "runs" / "big"
    assert run(capsys, "train", "--set", "context_length=1000000000", "--steps", "1", "--out-dir", out) == (2, [
        "rdlm train: error: context_length must be at most 1048576 positions (2**20), got 1000000000 (its "
        "RoPE tables alone would need 64 GB)"])
    assert not (tmp_path / "runs").exists()


def test_an_index_whose_weight_map_is_not_an_object_is_named(model_dir, tmp_path, capsys):
    bad = edited_model(model_dir, tmp_path)
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    assert run(capsys, "info", bad) == (2, [
        f"rdlm info: error: {bad}/model.safetensors.index.json: weight_map must be an object of tensor name -> "
        "file name, got list ['model.safetensors']"])
