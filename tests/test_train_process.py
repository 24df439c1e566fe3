"""Whole-process behaviour: resume after SIGKILL, a kill while a checkpoint is written, 2 workers."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rdlm.data.prepare import prepare
from rdlm.model.huginn import load_pretrained
from rdlm.data.tokenizer import train_tokenizer
from rdlm.train.checkpoint import latest_checkpoint, list_checkpoints, load_weights

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    words = "raven fjord dawn dusk wing feather thought memory world flies returns over the at".split()
    rng = torch.Generator().manual_seed(0)
    docs = [" ".join(words[i] for i in torch.randint(0, len(words), (40,), generator=rng).tolist())
            for _ in range(120)]
    tok = train_tokenizer(docs, vocab_size=300)
    out = tmp_path_factory.mktemp("data")
    (out / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([out / "corpus.jsonl"], tok, out / "shards", context_length=24, val_fraction=0.1)
    return out / "shards"


def train_args(shards: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", "tiny", "--data", str(shards), "--out-dir", str(out), "--micro-batch-size", "4",
            "--no-progress", "--no-tensorboard", "--threads", "1", "--warmup-steps", "2", "--seed", "3",
            "--eval-num-steps", "1,4", "--eval-rows", "4", *extra]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "rdlm", *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc


def history(out: Path) -> list[float]:
    return json.loads((latest_checkpoint(out) / "trainer.json").read_text())["losses"]


@pytest.mark.slow  # three training processes
def test_resume_after_sigkill_reproduces_the_uninterrupted_run(shards, tmp_path):
    steps = ["--steps", "14", "--checkpoint-every", "4"]
    run_cli(*train_args(shards, tmp_path / "straight", *steps))
    reference = history(tmp_path / "straight")
    assert len(reference) == 14

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "rdlm", *train_args(shards, killed, *steps)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = killed / "log.jsonl"
    deadline = time.time() + 90
    # Kill it once it is past its second checkpoint, in the middle of later steps.
    while time.time() < deadline and proc.poll() is None:
        if log.is_file() and sum(1 for _ in log.open()) >= 10:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert latest_checkpoint(killed) is not None and latest_checkpoint(killed).name in (
        "step-000008", "step-000012"), "the run should be killed between checkpoints"
    assert len(history(killed)) < 14

    run_cli(*train_args(shards, killed, *steps, "--resume"))
    assert history(killed) == reference  # exactly, not approximately
    logged = [json.loads(line)["loss"] for line in log.read_text().splitlines()
              if json.loads(line)["kind"] == "train"]
    assert logged == reference
    a = load_file(latest_checkpoint(killed) / "model" / "model.safetensors")
    b = load_file(latest_checkpoint(tmp_path / "straight") / "model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


KILL_IN_CHECKPOINT = """
import os, signal, sys
import rdlm.train.checkpoint as ckpt
real = ckpt.save_file
def dying_save(tensors, path, *args, **kwargs):
    if str(path).endswith("optimizer.safetensors") and ".step-000004.tmp" in str(path):
        real(tensors, path, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)  # half-written checkpoint: model/ and optimizer exist
    return real(tensors, path, *args, **kwargs)
ckpt.save_file = dying_save
from rdlm.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # training processes killed mid-save
def test_kill_while_writing_a_checkpoint_keeps_the_previous_one(shards, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", KILL_IN_CHECKPOINT,
                           *train_args(shards, out, "--steps", "8", "--checkpoint-every", "2")],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert [p.name for p in list_checkpoints(out)] == ["step-000002"]
    leftovers = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".step-000004")]
    assert leftovers, "the kill should have hit during the write"
    model = load_pretrained(latest_checkpoint(out) / "model")
    assert model.config.vocab_size == 512
    run_cli(*train_args(shards, out, "--steps", "8", "--checkpoint-every", "2", "--resume"))
    assert latest_checkpoint(out).name == "step-000008"
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # cleaned at start


def torchrun(*args: str, nproc: int = 2, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


AT_EXIT = """
import atexit, pathlib, runpy, sys
mark = pathlib.Path(sys.argv.pop(1))
atexit.register(lambda: mark.write_text("torn down"))
runpy.run_module("rdlm", run_name="__main__")
"""


@pytest.mark.slow  # a two-rank process group
def test_a_process_with_a_process_group_ends_without_the_interpreter_teardown(shards, tmp_path):
    """A gloo worker thread that releases a collective's buffers while the interpreter finalizes aborts
    the process after a successful run (seen under torchrun: rank 0 killed by SIGABRT). `python -m rdlm`
    therefore ends a process that made a process group at once, its output flushed; others end as usual."""
    mark = tmp_path / "torn-down"
    proc = subprocess.run([sys.executable, "-c", AT_EXIT, str(mark),
                           *train_args(shards, tmp_path / "run", "--steps", "2", "--strategy", "fsdp",
                                       "--eval-every", "0")],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"] == 2  # the whole summary reached the pipe
    assert not mark.exists()
    assert (latest_checkpoint(tmp_path / "run") / "dcp" / ".metadata").is_file()

    proc = subprocess.run([sys.executable, "-c", AT_EXIT, str(mark), "info", str(tmp_path / "run")],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert mark.read_text() == "torn down"


def weights(out: Path, which: str = "model") -> dict[str, torch.Tensor]:
    return dict(load_weights(latest_checkpoint(out), which).named_parameters())


@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("ddp", marks=pytest.mark.slow)])  # DDP: a minute more
def test_two_workers_match_one_process(shards, tmp_path, strategy):
    common = ["--steps", "5", "--ema-decay", "none", "--eval-every", "0"]
    run_cli(*train_args(shards, tmp_path / "one", *common, "--micro-batch-size", "4"))
    extra = () if strategy == "fsdp" else ("--strategy", "ddp")  # fsdp is the default for several processes
    torchrun("-m", "rdlm", *train_args(shards, tmp_path / "two", *common, "--micro-batch-size", "2", *extra))
    one, two = history(tmp_path / "one"), history(tmp_path / "two")
    assert len(one) == len(two) == 5
    assert one == pytest.approx(two, rel=1e-5, abs=1e-6)
    state = json.loads((latest_checkpoint(tmp_path / "two") / "trainer.json").read_text())
    assert state["world_size"] == 2 and state["global_batch_size"] == 4
    assert state["train_config"]["strategy"] == ("auto" if strategy == "fsdp" else "ddp")
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    # The two sums of a step's gradient differ in float32 rounding only; Adam divides by sqrt(v), so an element
    # whose gradient is near zero can take another step of up to lr there (one element in ~256 did, 9e-5 off).
    # Nearly every element agrees to rounding, and none is off by more than lr per step.
    difference = torch.cat([(a[key] - b[key]).abs().flatten() for key in a])
    assert (difference <= 1e-5).float().mean() >= 0.99
    assert difference.max() <= 2 * 4 * 0.01
    if strategy == "ddp":  # the ZeRO-sharded optimizer state was gathered into one complete file
        opt_one = load_file(latest_checkpoint(tmp_path / "one") / "optimizer.safetensors")
        opt_two = load_file(latest_checkpoint(tmp_path / "two") / "optimizer.safetensors")
        assert set(opt_one) == set(opt_two)
    else:  # each worker wrote its own shard
        files = sorted(p.name for p in (latest_checkpoint(tmp_path / "two") / "dcp").iterdir())
        assert ".metadata" in files and len([f for f in files if f.endswith(".distcp")]) == 2


@pytest.mark.slow  # FSDP runs at two world sizes (minutes)
def test_sharded_checkpoints_resume_across_world_sizes_and_convert(shards, tmp_path):
    """2 -> 1 and 1 -> 2 processes through a checkpoint, EMA included, match one straight run."""
    steps = ["--eval-every", "0", "--checkpoint-every", "3"]
    run_cli(*train_args(shards, tmp_path / "straight", "--steps", "6", *steps))
    reference = history(tmp_path / "straight")

    two_one = tmp_path / "two-one"
    torchrun("-m", "rdlm", *train_args(shards, two_one, "--steps", "3", "--micro-batch-size", "2", *steps))
    assert (latest_checkpoint(two_one) / "dcp").is_dir()
    run_cli(*train_args(shards, two_one, "--steps", "6", "--resume", *steps))

    one_two = tmp_path / "one-two"
    run_cli(*train_args(shards, one_two, "--steps", "3", *steps))
    torchrun("-m", "rdlm", *train_args(shards, one_two, "--steps", "6", "--micro-batch-size", "2", "--resume",
                                       *steps))
    assert (latest_checkpoint(one_two) / "dcp").is_dir()

    for run in (two_one, one_two):
        assert history(run) == pytest.approx(reference, rel=1e-5, abs=1e-6)
        for which in ("model", "ema"):
            a, b = weights(tmp_path / "straight", which), weights(run, which)
            for key in a:
                torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)

    # `rdlm convert` gathers the shards into the Huginn layout (EMA weights by default).
    run_cli("convert", str(one_two), str(tmp_path / "released"))
    released = dict(load_pretrained(tmp_path / "released").named_parameters())
    for key, value in weights(one_two, "ema").items():
        assert torch.equal(released[key], value)
    assert (tmp_path / "released" / "tokenizer.json").is_file()


KILL_IN_SHARDED_SAVE = """
import os, signal, sys
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
real = FileSystemWriter.write_data
def dying_write(self, plan, planner):
    result = real(self, plan, planner)
    if ".step-000004.tmp" in str(self.path) and dist.get_rank() == 1:
        result.wait()
        open(os.environ["KILL_MARK"], "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # rank 1's shard written, no metadata, no trainer.json
    return result
FileSystemWriter.write_data = dying_write
from rdlm.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # two-rank FSDP runs killed mid-save
def test_kill_during_a_sharded_save_keeps_the_previous_step(shards, tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "dying.py"
    script.write_text(KILL_IN_SHARDED_SAVE)
    args = train_args(shards, out, "--steps", "6", "--checkpoint-every", "2", "--micro-batch-size", "2",
                      "--eval-every", "0")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), *args], env={**ENV, "KILL_MARK": str(tmp_path / "killed")},
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert (tmp_path / "killed").is_file(), "the kill should have hit during the write of step 4"
    # (The surviving worker may have removed the staging directory on its way out, or not.)
    assert [p.name for p in list_checkpoints(out)] == ["step-000002"]
    assert load_weights(latest_checkpoint(out), "ema").config.vocab_size == 512
    torchrun("-m", "rdlm", *args, "--resume")
    assert latest_checkpoint(out).name == "step-000006"
    assert len(history(out)) == 6


@pytest.mark.slow  # a training process stopped mid-run
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(shards, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rdlm", *train_args(shards, out, "--steps", "2000")],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "log.jsonl").is_file() and (out / "log.jsonl").read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr and "stopped by SIGTERM after step" in stderr
    step = latest_checkpoint(out)
    assert step is not None and json.loads(stdout)["stopped_by"] == "SIGTERM"
    done = json.loads((step / "trainer.json").read_text())["step"]
    assert 1 <= done < 2000 and len(history(out)) == done
    run_cli(*train_args(shards, out, "--steps", str(done + 2), "--resume"))
    assert len(history(out)) == done + 2


@pytest.mark.slow  # two-rank FSDP and one process
def test_an_ouro_model_on_its_objective_trains_with_fsdp_as_in_one_process(shards, tmp_path):
    """The exit gate, grouped-query attention and the looped stack shard under FSDP2 like any model."""
    def args(out: Path, *extra: str) -> list[str]:
        base = train_args(shards, out, "--steps", "4", "--ema-decay", "none", "--eval-every", "0",
                          "--set", "vocab_size=300", "--set", "context_length=24", "--exit-loss-beta", "0.05", *extra)
        base[base.index("tiny")] = "ouro-tiny"
        return base

    run_cli(*args(tmp_path / "one", "--micro-batch-size", "4"))
    torchrun("-m", "rdlm", *args(tmp_path / "two", "--micro-batch-size", "2"))
    one, two = history(tmp_path / "one"), history(tmp_path / "two")
    assert len(one) == 4 and one == pytest.approx(two, rel=1e-5, abs=1e-6)
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert "exit_gate.weight" in a
    # The two sums of a step's gradient differ in float32 rounding only; Adam divides by sqrt(v), so an element
    # whose gradient is near zero can take another step of up to lr there (one element in ~256 did, 9e-5 off).
    # Nearly every element agrees to rounding, and none is off by more than lr per step.
    difference = torch.cat([(a[key] - b[key]).abs().flatten() for key in a])
    assert (difference <= 1e-5).float().mean() >= 0.99
    assert difference.max() <= 2 * 4 * 0.01


@pytest.mark.slow  # two-rank LoRA runs and one process
def test_two_workers_train_one_lora_adapter_as_one_process_does(shards, tmp_path):
    """LoRA under torchrun: ddp by default (the frozen base replicated, the adapters' gradients all-reduced),
    the same losses and adapter as one process with the same global batch."""
    from rdlm.model.lora_files import ADAPTER_WEIGHTS

    run_cli(*train_args(shards, tmp_path / "base", "--steps", "2", "--eval-every", "0"))
    lora = ["--model", str(tmp_path / "base"), "--lora", "--lora-rank", "4", "--steps", "4", "--lr", "0.01",
            "--ema-decay", "none", "--eval-every", "0"]
    run_cli(*train_args(shards, tmp_path / "one", "--micro-batch-size", "4"), *lora)
    torchrun("-m", "rdlm", *train_args(shards, tmp_path / "two", "--micro-batch-size", "2"), *lora)
    one, two = history(tmp_path / "one"), history(tmp_path / "two")
    assert len(one) == len(two) == 4
    assert one == pytest.approx(two, rel=1e-5, abs=1e-6)
    state = json.loads((latest_checkpoint(tmp_path / "two") / "trainer.json").read_text())
    assert state["world_size"] == 2 and state["strategy"] == "ddp"
    a = load_file(latest_checkpoint(tmp_path / "one") / "adapter" / ADAPTER_WEIGHTS)
    b = load_file(latest_checkpoint(tmp_path / "two") / "adapter" / ADAPTER_WEIGHTS)
    assert a.keys() == b.keys() and any(t.abs().sum() > 0 for k, t in a.items() if "lora_B" in k)
    # The two sums of a step's gradient differ in float32 rounding only; Adam divides by sqrt(v), so an element
    # whose gradient is near zero can take another step of up to lr there (one element in ~256 did, 9e-5 off).
    # Nearly every element agrees to rounding, and none is off by more than lr per step.
    difference = torch.cat([(a[key] - b[key]).abs().flatten() for key in a])
    assert (difference <= 1e-5).float().mean() >= 0.99
    assert difference.max() <= 2 * 4 * 0.01
