"""Bad input to the command line ends in one clear line and the usual exit status (2: the input, 1: the
system), never a traceback: the bad-input audit's cases, each with the command, its status and its line."""

import json
import shutil

import pytest

from rdlm.cli import main
from tests.hf_helpers import CORPUS, tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("cli-errors") / "model")


@pytest.fixture(scope="module")
def shards(model_dir, tmp_path_factory):
    """Token shards of the test corpus in rows of 17 tokens: 56 training rows, 5 validation rows."""
    from rdlm.data.prepare import prepare
    from rdlm.data.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("cli-errors-data")
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    out = root / "shards"
    prepare([root / "corpus.jsonl"], Tokenizer.from_dir(model_dir), out, 16, val_fraction=0.1)
    return out


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


def test_training_with_a_context_too_long_is_refused_and_leaves_no_directory(shards, tmp_path, capsys):
    out = tmp_path / "runs" / "big"
    assert run(capsys, "train", "--set", "context_length=1000000000", "--data", shards, "--out-dir", out) == (2, [
        "rdlm train: error: context_length must be at most 1048576 positions (2**20), got 1000000000 (its "
        "RoPE tables alone would need 64 GB)"])
    assert not (tmp_path / "runs").exists()


def test_an_index_whose_weight_map_is_not_an_object_is_named(model_dir, tmp_path, capsys):
    bad = edited_model(model_dir, tmp_path)
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    assert run(capsys, "info", bad) == (2, [
        f"rdlm info: error: {bad}/model.safetensors.index.json: weight_map must be an object of tensor name -> "
        "file name, got list ['model.safetensors']"])


def usage_error(capsys, *argv) -> tuple[int, list[str]]:
    """(exit status, stderr's lines) of a command refused by the argument parser."""
    with pytest.raises(SystemExit) as stop:
        main([str(a) for a in argv])
    return stop.value.code, capsys.readouterr().err.strip().splitlines()


def test_a_usage_error_is_one_line_naming_the_flag(capsys):
    assert usage_error(capsys, "generate", "--prompt-ids", "1") == (2, [
        "rdlm generate: error: the following arguments are required: --model (rdlm generate --help lists the "
        "options)"])
    assert usage_error(capsys, "tokenizer", "train", "x.txt", "--out", "t", "--min-frequency", "-1") == (2, [
        "rdlm tokenizer train: error: argument --min-frequency: must be an integer >= 0, got -1 (rdlm tokenizer "
        "train --help lists the options)"])
    assert usage_error(capsys, "data", "prepare", "x.txt", "--tokenizer", "t", "--out", "o", "--context-length", "8",
                       "--bad") == (2, ["rdlm data prepare: error: unrecognized arguments: --bad (rdlm data prepare "
                                        "--help lists the options)"])


def test_a_train_config_file_that_is_not_an_object_is_named(tmp_path, capsys):
    (tmp_path / "list.json").write_text("[1, 2]")
    assert run(capsys, "train", "--config", tmp_path / "list.json", "--out-dir", "none") == (2, [
        f"rdlm train: error: {tmp_path}/list.json: expected a JSON object of TrainConfig fields (like "
        '{"steps": 100}), got list [1, 2]'])


@pytest.mark.parametrize("flags, line", [
    (["--exit-criterion", "kl", "--exit-threshold", "-1"],
     "--exit-threshold -1: a token exits once its kl score is below the threshold, and the score is never below 0, "
     "so no token could exit; give a threshold > 0 (the default is 0.0005)"),
    (["--exit-threshold", "0.1"], "--exit-threshold needs --exit-criterion (it is that criterion's threshold)"),
    (["--stop-ids", "99999"], "--stop-ids 99999 is outside the model's vocabulary (ids 0 to 511): it could never "
                              "be generated"),
    (["--stop-ids", "3,-5"], "--stop-ids -5 is outside the model's vocabulary (ids 0 to 511): it could never be "
                             "generated"),
    (["--max-new-tokens", "300"], "the prompt (3 tokens) + --max-new-tokens 300 exceed the model's context of 256: "
                                  "at most --max-new-tokens 253 fits this prompt"),
])
def test_generation_settings_that_cannot_work_are_refused(model_dir, capsys, flags, line):
    assert run(capsys, "generate", "--model", model_dir, "--prompt-ids", "1,2,3", *flags) == (
        2, [f"rdlm generate: error: {line}"])


def test_an_error_after_the_echoed_prompt_starts_on_a_line_of_its_own(tmp_path, capsys):
    import torch

    from rdlm import load_pretrained, save_pretrained

    model = load_pretrained(tiny_model_dir(tmp_path / "model"))
    with torch.no_grad():
        model.coda[0].mlp.out.weight.fill_(float("nan"))
    broken = save_pretrained(model, tmp_path / "broken")
    shutil.copy(tmp_path / "model" / "tokenizer.json", broken)
    code = main(["generate", "--model", str(broken), "--prompt", "The capital", "-r", "2"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "The capital\n")
    assert err.strip().splitlines() == ["rdlm generate: error: model produced non-finite logits at new token 1; "
                                        f"weights may be NaN: {broken}"]


def test_an_output_under_a_file_names_the_parent(model_dir, capsys):
    assert run(capsys, "convert", model_dir, "/dev/null/x") == (
        2, ["rdlm convert: error: destination /dev/null/x: its parent /dev/null is not a directory"])


# -------------------------------------------------------------------------------------------------
# Earlier output is never replaced without --overwrite

def test_a_tokenizer_is_not_trained_over_an_existing_one(model_dir, tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text(" ".join(CORPUS))
    before = (model_dir / "tokenizer.json").read_bytes()
    assert run(capsys, "tokenizer", "train", tmp_path / "corpus.txt", "--out", model_dir, "--vocab-size", "300") == (
        2, [f"rdlm tokenizer train: error: {model_dir}/tokenizer.json already exists; pass --overwrite to replace "
            "it, or choose another --out"])
    assert (model_dir / "tokenizer.json").read_bytes() == before
    copy = shutil.copytree(model_dir, tmp_path / "copy")
    assert run(capsys, "tokenizer", "train", tmp_path / "corpus.txt", "--out", copy, "--vocab-size", "300",
               "--overwrite")[0] == 0
    assert (copy / "tokenizer.json").read_bytes() != before


def test_a_dataset_is_replaced_only_with_overwrite_which_removes_its_stale_shards(model_dir, shards, tmp_path,
                                                                                  capsys):
    corpus = shards.parent / "corpus.jsonl"
    prepare = ["data", "prepare", corpus, "--tokenizer", model_dir, "--context-length", "16"]
    out = shutil.copytree(shards, tmp_path / "shards")
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train-00000.npy",
                                                     "val-00000.npy"]
    assert run(capsys, *prepare, "--out", out) == (2, [
        f"rdlm data prepare: error: --out {out} already holds a dataset (meta.json, tokenizer.json, "
        "train-00000.npy, ...); pass --overwrite to replace it, or choose another directory"])
    assert run(capsys, *prepare, "--out", model_dir) == (2, [
        f"rdlm data prepare: error: --out {model_dir} holds other files (config.json, model.safetensors): "
        "refusing to write a dataset into it; choose a new or empty directory"])
    code, err = run(capsys, *prepare, "--out", out, "--overwrite", "--val-fraction", "0")
    assert code == 0 and sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train-00000.npy"]
    # Refused for want of text: no directory is left behind.
    assert run(capsys, *prepare[:-1], "1000", "--out", tmp_path / "new" / "shards")[0] == 2
    assert not (tmp_path / "new").exists()


def test_a_validation_split_without_rows_is_announced_by_prepare_and_by_train(model_dir, shards, tmp_path, capsys):
    corpus = shards.parent / "corpus.jsonl"
    code, err = run(capsys, "data", "prepare", corpus, "--tokenizer", model_dir, "--context-length", "16",
                    "--val-fraction", "0.01", "--out", tmp_path / "shards")
    assert code == 0 and err[-1] == (
        "rdlm data prepare: warning: no validation rows (1 of 60 documents held out, too few for a row of 17 "
        "tokens): training on this data will not evaluate; give more documents or a larger --val-fraction")
    code, err = run(capsys, "train", "--model", model_dir, "--data", tmp_path / "shards", "--out-dir", "none",
                    "--steps", "1", "--no-progress")
    assert code == 0 and err == [f"rdlm train: note: {tmp_path}/shards has no validation rows (prepare it with more "
                                 "documents or a larger --val-fraction); this run will not evaluate"]


def test_eval_and_analyze_keep_earlier_results_without_overwrite(model_dir, tmp_path, capsys):
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "results.json").write_text("{}")
    (tmp_path / "doc.txt").write_text(CORPUS[0])
    assert run(capsys, "eval", model_dir, "--text", tmp_path / "doc.txt", "--out", tmp_path / "eval") == (2, [
        f"rdlm eval: error: --out {tmp_path}/eval already holds results (results.json); pass --overwrite to "
        "replace it, or choose another directory"])
    (tmp_path / "analysis").mkdir()
    (tmp_path / "analysis" / "report.html").write_text("<html>")
    assert run(capsys, "analyze", model_dir, "--prompt-ids", "1,2", "--out", tmp_path / "analysis") == (2, [
        f"rdlm analyze: error: --out {tmp_path}/analysis already holds an analysis (report.html); pass "
        "--overwrite to replace it, or choose another directory"])
    assert (tmp_path / "eval" / "results.json").read_text() == "{}"
    assert (tmp_path / "analysis" / "report.html").read_text() == "<html>"


@pytest.mark.parametrize("flags, line", [
    (["--init-scale", "nan"], "init_scale must be a finite number >= 0, got nan"),
    (["--max-memory-mb", "0"], "--max-memory-mb must be >= 1, got 0 (--stream keeps every state on disk instead)"),
    (["--exit-threshold", "0"], "--exit-threshold 0: a token exits once its kl score is below the threshold, and "
                                "the score is never below 0, so no token could exit; give a threshold > 0 (the "
                                "default is 0.0005)"),
])
def test_analyze_refuses_settings_before_writing_anything(model_dir, tmp_path, capsys, flags, line):
    out = tmp_path / "analysis"
    assert run(capsys, "analyze", model_dir, "--prompt-ids", "1,2,3", "-r", "4", "--runs", "2", "--out", out,
               *flags) == (2, [f"rdlm analyze: error: {line}"])
    assert not out.exists()


def test_a_bad_prompts_file_line_is_named(model_dir, tmp_path, capsys):
    (tmp_path / "prompts.jsonl").write_text('{"ids": [1, 2]}\n{"ids": ["x"]}\n')
    assert run(capsys, "analyze", model_dir, "--prompts-file", tmp_path / "prompts.jsonl", "--out",
               tmp_path / "a") == (2, [f'rdlm analyze: error: {tmp_path}/prompts.jsonl:2: "ids" must be a list of '
                                       'integer token ids, got ["x"]'])


# -------------------------------------------------------------------------------------------------
# Training: where the model goes, resuming, batches larger than the data

def test_training_needs_an_out_dir_or_an_explicit_none(shards, capsys):
    assert run(capsys, "train", "--data", shards, "--steps", "1") == (2, [
        "rdlm train: error: give --out-dir DIR: the trained model is saved only there (--out-dir none trains "
        "without saving anything)"])


def test_a_micro_batch_larger_than_the_data_is_refused_and_a_global_one_announced(shards, capsys):
    rows = json.loads((shards / "meta.json").read_text())["rows"]["train"]
    assert run(capsys, "train", "--data", shards, "--out-dir", "none", "--micro-batch-size", 1000) == (2, [
        f"rdlm train: error: --micro-batch-size 1000 exceeds the {rows} training rows: every micro-batch would hold "
        f"the same rows more than once; give at most {rows}, or more data"])
    code, err = run(capsys, "train", "--data", shards, "--out-dir", "none", "--micro-batch-size", rows,
                    "--accumulation", 2, "--steps", 1, "--no-progress", "--eval-num-steps", 1)
    assert code == 0 and err == [f"rdlm train: warning: a global batch of {2 * rows} rows (micro-batch x "
                                 f"accumulation x workers) exceeds the {rows} training rows: every step trains on "
                                 "some rows twice"]


def test_resume_takes_the_runs_own_settings_and_refuses_others(shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = ["train", "--model", "tiny", "--set", "vocab_size=512", "--set", "context_length=16", "--data", shards,
             "--out-dir", run_dir, "--steps", 2, "--micro-batch-size", 4, "--eval-num-steps", 1, "--no-progress"]
    assert run(capsys, *first)[0] == 0
    code, err = run(capsys, "train", "--out-dir", run_dir, "--resume", "--steps", 3, "--no-progress")
    assert code == 0 and f"rdlm train: resumed from {run_dir}/checkpoints/step-000002 at step 2 of 3" in err
    code, err = run(capsys, "train", "--out-dir", run_dir, "--resume", "--lr", "0.1", "--set", "mean_recurrence=2")
    assert code == 2 and len(err) == 1 and err[0].startswith(
        f"rdlm train: error: --resume continues the run with its own settings ({run_dir}/checkpoints/step-000003/"
        "trainer.json); it cannot change --lr 0.1 (the run's: 0.001); --set mean_recurrence=2 (the run's: "
        "vocab_size=512 context_length=16). A resumed run may change only --steps, --micro-batch-size")
    assert run(capsys, "train", "--out-dir", tmp_path / "new", "--resume") == (2, [
        f"rdlm train: error: --resume: {tmp_path}/new holds no checkpoint to resume from; to start the run, give its "
        "model and data (--data DIR or --prompt-response FILE.jsonl)"])


# -------------------------------------------------------------------------------------------------
# Help and pipes

def test_train_help_never_contradicts_itself():
    from rdlm.cli import build_parser

    train = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    flat = " ".join(train.split())
    assert "(default: None)" not in flat and "SAMPLERS" not in flat
    assert "distribution of r: lognormal-poisson, fixed, uniform" in flat


def test_a_closed_pipe_ends_the_command_quietly(model_dir, monkeypatch, capsys):
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(["info", str(model_dir)]) == 141  # 128 + SIGPIPE, as a shell reports a Unix tool's end
    assert capsys.readouterr().err == ""


def test_long_work_shows_progress_on_stderr(model_dir, tmp_path, capsys):
    assert main(["info", "tiny", "--time-forward", "1,2", "--seq-len", "8"]) == 0
    captured = capsys.readouterr()
    assert "forward passes" in captured.err and '"forward_seconds"' in captured.out
    (tmp_path / "doc.txt").write_text(" ".join(CORPUS[:3]))
    assert main(["eval", str(model_dir), "--text", str(tmp_path / "doc.txt"), "--num-steps", "1,2",
                 "--out", str(tmp_path / "eval")]) == 0
    assert "batch iterations" in capsys.readouterr().err


def test_resume_refuses_a_missing_or_empty_run_directory(shards, tmp_path, capsys):
    """--resume continues a run: a typo in --out-dir is named, not taken for a new run (nothing is written)."""
    args = ["--model", "tiny", "--set", "vocab_size=512", "--set", "context_length=16", "--data", shards, "--steps", 1,
            "--no-progress", "--resume"]
    missing = tmp_path / "typo"
    assert run(capsys, "train", *args, "--out-dir", missing) == (2, [
        f"rdlm train: error: --resume: run directory {missing} does not exist, so there is no run to continue; "
        "check the path, or start a new run without --resume"])
    assert not missing.exists()
    (tmp_path / "empty").mkdir()
    assert run(capsys, "train", *args, "--out-dir", tmp_path / "empty") == (2, [
        f"rdlm train: error: --resume: run directory {tmp_path / 'empty'} is empty, so there is no run to "
        "continue; check the path, or start a new run without --resume"])
    assert [p.name for p in (tmp_path / "empty").iterdir()] == []


# -------------------------------------------------------------------------------------------------
# A flag that cannot take effect where it is given is refused by name (rdlm.cli.takes_effect), on every command

@pytest.fixture(scope="module")
def run_without_ema(tmp_path_factory):
    """A training run whose checkpoints kept no EMA weights (ema_decay none)."""
    from conftest import write_training_run
    from rdlm.model.config import RDLMConfig
    from rdlm.model.lm import RecurrentDepthLM

    root = tmp_path_factory.mktemp("no-ema")
    run_dir, _ = write_training_run(root, RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval())
    for step in (run_dir / "checkpoints").iterdir():
        shutil.rmtree(step / "ema")
    return run_dir


@pytest.mark.parametrize("argv, line", [
    (["generate", "--model", "{model}", "--prompt-ids", "1,2", "--quantize-group-size", "64"],
     "--quantize-group-size would have no effect: it is the group size of --quantize int4, and no --quantize is "
     "given"),
    (["generate", "--model", "{model}", "--prompt-ids", "1,2", "--quantize", "core=int8",
      "--quantize-group-size", "64"],
     "--quantize-group-size would have no effect: it is the group size of int4, and --quantize core=int8 "
     "quantizes no part to int4"),
    (["eval", "{model}", "--text", "x.txt", "--quantize-group-size", "32"], "--quantize-group-size would have no "
     "effect: it is the group size of --quantize int4, and no --quantize is given"),
    (["train", "--model", "tiny", "--data", "shards", "--out-dir", "none", "--curriculum-start", "3"],
     "--curriculum-start would have no effect: it applies with --curriculum linear or 1-sqrt, which this run "
     "does not have"),
    (["train", "--model", "tiny", "--data", "shards", "--out-dir", "none", "--muon-lr", "0.01"],
     "--muon-lr would have no effect: it applies with --optimizer muon, which this run does not have"),
    (["demo", "--loops", "0"], "--loops would have no effect: it is an option of --experiment gate, and this is "
                               "--experiment main"),
    (["demo", "--split", "9/9/9"], "--split would have no effect: it is an option of --experiment retrofit, and "
                                   "this is --experiment main"),
    (["demo", "--experiment", "gate", "--no-twin"], "--no-twin would have no effect: it is an option of "
                                                    "--experiment main, and this is --experiment gate"),
    (["convert", "{model}", "out", "--weights", "model"], "--weights would have no effect: {model} is a model "
     "directory, with one set of weights; --weights chooses in a training checkpoint"),
    (["convert", "{run}", "out", "--weights", "ema"], "--weights would have no effect: {run} has no EMA weights "
     "(its run kept none: ema_decay none); give --weights model"),
])
def test_a_flag_that_cannot_take_effect_is_refused_by_name(model_dir, run_without_ema, tmp_path, monkeypatch, capsys,
                                                          argv, line):
    monkeypatch.chdir(tmp_path)
    names = {"model": model_dir, "run": run_without_ema}
    argv = [a.format(**names) for a in argv]
    assert run(capsys, *argv) == (2, [f"rdlm {argv[0]}: error: {line.format(**names)}"])
    assert list(tmp_path.iterdir()) == []  # refused before any work


def test_a_flag_is_refused_only_where_it_cannot_take_effect(model_dir, run_without_ema, tmp_path, capsys):
    # given with its default value, a flag is still given: --weights ema above; not given, the default
    # (EMA where the run kept it, else the raw weights) applies as documented
    assert run(capsys, "convert", run_without_ema, tmp_path / "raw")[0] == 0
    assert run(capsys, "generate", "--model", model_dir, "--prompt-ids", "1,2", "--max-new-tokens", "1", "--quantize",
               "int4,core=int8", "--quantize-group-size", "64")[0] == 0


@pytest.mark.parametrize("argv, line", [
    (["generate", "--model", "{model}", "--prompt-ids", "1", "--quantize", "core=int8,core=int4"],
     "rdlm generate: error: argument --quantize: quantization spec 'core=int8,core=int4': part 'core' is named "
     "twice (rdlm generate --help lists the options)"),
    (["generate", "--model", "{model}", "--prompt-ids", "1", "--quantize", "core=int8,int4"],
     "rdlm generate: error: argument --quantize: quantization spec 'core=int8,int4': the scheme for every part "
     "('int4') comes first, e.g. 'int4,core=int8' (rdlm generate --help lists the options)"),
    (["chat", "--model", "{model}", "--max-new-tokens", "0"],
     "rdlm chat: error: argument --max-new-tokens: must be an integer >= 1, got 0 (rdlm chat --help lists the "
     "options)"),
])
def test_a_setting_that_would_do_nothing_or_be_undone_is_refused(model_dir, capsys, argv, line):
    with pytest.raises(SystemExit) as exit:
        main([a.format(model=model_dir) for a in argv])
    assert exit.value.code == 2 and capsys.readouterr().err.strip() == line
