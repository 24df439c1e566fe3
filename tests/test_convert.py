import json
import os

import pytest
import torch

from rdlm import CheckpointError, load_pretrained, save_pretrained
from rdlm.cli import main
from rdlm.model.convert import convert, parse_size, resolve_source
from rdlm.model.huginn import INDEX_NAME

from conftest import same_weights, write_training_run


def test_training_checkpoint_to_huginn_picks_ema_or_raw_weights(tmp_path, tiny_model):
    run, ema = write_training_run(tmp_path, tiny_model)
    assert resolve_source(run).directory == run / "checkpoints" / "step-000200" / "ema"
    out = convert(run, tmp_path / "release")
    assert same_weights(load_pretrained(out), ema)
    raw = convert(run / "checkpoints" / "step-000100", tmp_path / "raw", weights="model")
    assert same_weights(load_pretrained(raw), tiny_model)
    assert (raw / "tokenizer.json").read_text() == (run / "checkpoints" / "step-000100" / "model" /
                                                    "tokenizer.json").read_text()


def test_round_trips_are_lossless_across_dtypes_and_shardings(tmp_path, tiny_model):
    src = save_pretrained(tiny_model, tmp_path / "fp32")
    sharded = convert(src, tmp_path / "sharded", max_shard_bytes="100KB")
    index = json.loads((sharded / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1
    back = convert(sharded, tmp_path / "back")
    assert same_weights(load_pretrained(back), tiny_model) and not (back / INDEX_NAME).exists()

    bf16 = convert(src, tmp_path / "bf16", dtype="bf16")
    assert load_pretrained(bf16).embedding.weight.dtype == torch.bfloat16
    up = convert(bf16, tmp_path / "up", dtype="fp32")
    down = convert(up, tmp_path / "down", dtype="bf16")
    assert same_weights(load_pretrained(down), load_pretrained(bf16))
    assert same_weights(load_pretrained(up), load_pretrained(bf16, dtype=torch.float32))


def test_convert_command_line(tmp_path, tiny_model, capsys):
    src = save_pretrained(tiny_model, tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "out"), "--dtype", "bf16", "--max-shard-size", "64KB"]) == 0
    assert "weight file(s)" in capsys.readouterr().out
    assert (tmp_path / "out" / INDEX_NAME).is_file()
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_bad_sources_and_sizes_are_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a Huginn-layout directory"):
        resolve_source(tmp_path / "empty")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_source(tmp_path / "run")
    with pytest.raises(ValueError, match="size"):
        parse_size("lots")
    assert parse_size("5GB") == 5 * 1024**3 and parse_size("100KB") == 102400 and parse_size("7") == 7
    for nothing in ("0", "0KB", 0, "0.4B"):  # one shard per tensor, not a size anyone means
        with pytest.raises(ValueError, match="less than one byte"):
            parse_size(nothing)


def test_a_zero_shard_size_and_an_unreadable_tokenizer_are_refused_before_writing(tmp_path, tiny_model, capsys):
    src = save_pretrained(tiny_model, tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "a"), "--max-shard-size", "0"]) == 2
    assert "less than one byte" in capsys.readouterr().err and not (tmp_path / "a").exists()
    (src / "tokenizer.json").write_text("{not json")
    assert main(["convert", str(src), str(tmp_path / "b")]) == 2
    assert "tokenizer.json: not a readable tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_convert_replaces_only_what_the_layout_owns(tmp_path, tiny_model):
    src = save_pretrained(tiny_model, tmp_path / "src")
    dst = save_pretrained(tiny_model, tmp_path / "dst", max_shard_bytes=100_000)
    (dst / "expected_outputs.safetensors").write_bytes(b"fixture")  # not the layout's: must survive
    (dst / "notes.txt").write_text("mine")
    (tmp_path / "data.bin").write_text("elsewhere")
    (dst / "data.bin").symlink_to(tmp_path / "data.bin")
    (dst / "sub").mkdir()
    (dst / "sub" / "x.safetensors").write_bytes(b"kept")
    os.chmod(dst, 0o750)
    before = {f.name: f.read_bytes() for f in dst.iterdir() if f.is_file()}
    with pytest.raises(FileExistsError, match="already holds a model.*--overwrite"):  # docs/files.md
        convert(src, dst, dtype="bf16")
    assert {f.name: f.read_bytes() for f in dst.iterdir() if f.is_file()} == before
    convert(src, dst, dtype="bf16", overwrite=True)
    assert (dst / "expected_outputs.safetensors").read_bytes() == b"fixture"
    assert (dst / "notes.txt").read_text() == "mine" and (dst / "sub" / "x.safetensors").read_bytes() == b"kept"
    assert (dst / "data.bin").is_symlink() and os.readlink(dst / "data.bin") == str(tmp_path / "data.bin")
    assert (dst.stat().st_mode & 0o777) == 0o750
    assert not (dst / INDEX_NAME).exists() and not list(dst.glob("model-*-of-*.safetensors"))
    assert load_pretrained(dst).embedding.weight.dtype == torch.bfloat16


def test_convert_refuses_destinations_it_could_damage(tmp_path, tiny_model, capsys):
    src = save_pretrained(tiny_model, tmp_path / "src")
    project = tmp_path / "project"
    project.mkdir()
    (project / "data.safetensors").write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="holds other files .data.safetensors.: refusing"):
        convert(src, project)
    assert (project / "data.safetensors").read_bytes() == b"precious"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        convert(src, tmp_path / "file")
    before = (src / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="is the source.*--in-place"):
        convert(src, src, dtype="bf16")
    assert (src / "model.safetensors").read_bytes() == before
    assert main(["convert", str(src), str(src), "--dtype", "bf16"]) == 2
    assert "--in-place" in capsys.readouterr().err
    assert main(["convert", str(src), str(src), "--dtype", "bf16", "--in-place"]) == 0
    assert load_pretrained(src).embedding.weight.dtype == torch.bfloat16
    convert(src, tmp_path / "empty-dir-ok")


def test_a_full_disk_during_convert_is_one_line_and_keeps_the_old_copy(tmp_path, tiny_model, monkeypatch, capsys):
    import errno

    from rdlm.model import huginn

    src = save_pretrained(tiny_model, tmp_path / "src")
    dst = save_pretrained(tiny_model, tmp_path / "dst")
    before = (dst / "model.safetensors").read_bytes()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huginn, "save_file", full_disk)
    assert main(["convert", str(src), str(dst), "--dtype", "bf16", "--overwrite"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rdlm convert: error: {dst}: No space left on device"]
    assert (dst / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]
