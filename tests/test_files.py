"""docs/files.md: no command loses a file of yours. Every command that writes a directory is run against one that
holds a file of the user's (a sentinel): one of its own name (refused, unless --overwrite) and one of another
name (kept, whether the command writes beside it or refuses the directory); the file survives every time."""

import json

import pytest

from rdlm.cli import main
from tests.hf_helpers import CORPUS
from tests.test_cli_errors import model_dir, shards  # noqa: F401 (fixtures)

SENTINEL = b"the user's own file\n"


@pytest.fixture(scope="module")
def llama_dir(model_dir, tmp_path_factory):  # noqa: F811
    """A transformers Llama directory (rdlm's fixed-depth model written as one) with a tokenizer: a retrofit source."""
    import shutil

    import torch

    from rdlm.model.lm import RecurrentDepthLM
    from rdlm.model.retrofit import plain_config, save_as_llama

    torch.manual_seed(0)
    config = plain_config(vocab_size=512, hidden_size=32, num_heads=2, core_layers=3, context_length=32,
                          intermediate_size=64)
    out = save_as_llama(RecurrentDepthLM(config).eval(), tmp_path_factory.mktemp("llama") / "llama")
    shutil.copy(model_dir / "tokenizer.json", out / "tokenizer.json")
    return out


def commands(model_dir, shards, llama_dir, tmp_path):  # noqa: F811
    """(name, argv writing into the directory DEST, a file name the command writes there)."""
    (tmp_path / "doc.txt").write_text(CORPUS[0])
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    tiny_demo = ["--steps", "2", "--batch-size", "4", "--hidden-size", "16", "--num-heads", "2", "--mean-recurrence",
                 "2", "--backprop-depth", "1", "--eval-examples", "3", "--num-steps", "1,2", "--exit-max-steps", "2",
                 "--exit-thresholds", "0.01", "--no-twin", "--no-depth-matched", "--workers", "1", "--quiet"]
    return [
        ("train", ["train", "--model", "tiny", "--set", "vocab_size=512", "--set", "context_length=16", "--data",
                   shards, "--out-dir", "DEST", "--steps", "1", "--micro-batch-size", "4", "--eval-num-steps", "1",
                   "--no-progress"], "log.jsonl"),
        ("data prepare", ["data", "prepare", tmp_path / "corpus.jsonl", "--tokenizer", model_dir, "--context-length",
                          "16", "--out", "DEST"], "meta.json"),
        ("tokenizer train", ["tokenizer", "train", tmp_path / "doc.txt", "--out", "DEST", "--vocab-size", "300"],
         "tokenizer.json"),
        ("eval", ["eval", model_dir, "--text", tmp_path / "doc.txt", "--num-steps", "1", "--out", "DEST"],
         "results.json"),
        ("analyze", ["analyze", model_dir, "--prompt-ids", "1,2", "-r", "3", "--out", "DEST"], "report.html"),
        ("convert", ["convert", model_dir, "DEST"], "config.json"),
        ("retrofit", ["retrofit", llama_dir, "DEST", "--prelude", "0", "--core", "1", "--coda", "2"],
         "model.safetensors"),
        ("demo", ["demo", "--out", "DEST", *tiny_demo], "report.md"),
        ("lora merge", ["lora", "merge", adapter_of(model_dir, tmp_path), "--out", "DEST"], "config.json"),
    ]


def adapter_of(model_dir, tmp_path):  # noqa: F811
    """A LoRA adapter made for the model in `model_dir` (what `rdlm lora merge` merges)."""
    from rdlm import load_pretrained
    from rdlm.model.lora import LoraSpec, add_lora
    from rdlm.model.lora_files import save_adapter

    model = add_lora(load_pretrained(model_dir), LoraSpec(rank=2))
    return save_adapter(model, tmp_path / "adapter", base_source=str(model_dir))


REFUSE_OTHER_FILES = ("data prepare", "convert", "retrofit", "lora merge")
NAMES = ["train", "data prepare", "tokenizer train", "eval", "analyze", "convert", "retrofit", "demo", "lora merge"]


@pytest.mark.parametrize("name", NAMES)
def test_every_writing_command_keeps_a_file_of_yours(name, model_dir, shards, llama_dir,  # noqa: F811
                                                     tmp_path, capsys):
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    [(_, argv, own_name)] = [c for c in commands(model_dir, shards, llama_dir, tmp_path) if c[0] == name]
    for sentinel in (own_name, "notes.txt"):
        dest = tmp_path / f"dest-{sentinel}"
        dest.mkdir()
        (dest / sentinel).write_bytes(SENTINEL)
        code = main([str(dest) if a == "DEST" else str(a) for a in argv])
        err = capsys.readouterr().err
        assert (dest / sentinel).read_bytes() == SENTINEL, f"rdlm {name} replaced {sentinel}: {err}"
        if sentinel == own_name:  # a previous result, or the user's file of that name: refused, naming --overwrite
            assert code == 2 and "--overwrite" in err, err
            assert sorted(p.name for p in dest.iterdir()) == [sentinel]
        elif name in REFUSE_OTHER_FILES:  # they would mix their files into a folder of yours
            assert code == 2 and "holds other files (notes.txt)" in err, err
            assert sorted(p.name for p in dest.iterdir()) == [sentinel]
        else:  # they write beside it
            assert code == 0, err
            assert len(list(dest.iterdir())) > 1


def test_the_list_of_writing_commands_is_complete():
    """A new command that writes files joins the test above (and docs/files.md)."""
    from rdlm.cli import build_parser

    def subcommands(parser):
        return parser._subparsers._group_actions[0].choices.items() if parser._subparsers else ()

    writers = set()
    for command, sub in subcommands(build_parser()):
        for name, parser in [(command, sub), *((f"{command} {a}", p) for a, p in subcommands(sub))]:
            dests = {a.dest for a in parser._actions}
            if dests & {"out", "out_dir", "destination"}:
                writers.add(name)
    assert writers == set(NAMES)


def test_an_eval_that_fails_on_the_way_leaves_no_results_json(model_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    """results.json, the file that says "done", is written last (here the plot fails first)."""
    from rdlm.inference import evaluate

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(evaluate, "plot_sweeps", full_disk)
    (tmp_path / "doc.txt").write_text(CORPUS[0])
    out = tmp_path / "eval"
    assert main(["eval", str(model_dir), "--text", str(tmp_path / "doc.txt"), "--num-steps", "1", "--out",
                 str(out)]) == 1
    assert not (out / "results.json").exists()
