"""A run directory has one writer, and a new run never mixes into another one's files."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rdlm import RDLMConfig, RecurrentDepthLM
from rdlm.model.config import ConfigError
from rdlm.train import TrainConfig, train
from rdlm.train.checkpoint import latest_checkpoint, list_checkpoints
from rdlm.train.rundir import LOCK_FILE, RunDirError, RunLock, clean_leftovers

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(progress=False, tensorboard=False, threads=1, warmup_steps=1, micro_batch_size=4)


def tiny() -> RecurrentDepthLM:
    torch.manual_seed(0)
    return RecurrentDepthLM(RDLMConfig.from_preset("tiny", context_length=64))


def rows(n: int = 16) -> torch.Tensor:
    return (torch.arange(n).unsqueeze(1) + torch.arange(9)) % 32


def run(out, **kwargs):
    return train(TrainConfig(out_dir=str(out), **{"steps": 2, **FAST, **kwargs}), model=tiny(), train_data=rows())


HOLD_LOCK = """
import sys, time
from rdlm.train.rundir import RunLock
lock = RunLock(sys.argv[1])
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_a_second_writer_is_refused_while_the_first_holds_the_run_directory(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path), "60"], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=f"in use by process {holder.pid}"):
            run(tmp_path)
        assert not (tmp_path / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing anything: its lock is stale, and taken over.
    result = run(tmp_path)
    assert result.checkpoint.name == "step-000002"
    assert (tmp_path / LOCK_FILE).read_text() == ""  # released on exit


def test_the_lock_is_exclusive_within_one_process_and_released(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(RunDirError, match="in use"):
            RunLock(tmp_path)
    RunLock(tmp_path).release()


def test_a_new_run_into_an_existing_run_is_refused_unless_resume_or_overwrite(tmp_path):
    run(tmp_path, steps=4, checkpoint_every=1)
    before = sorted(p.name for p in list_checkpoints(tmp_path))
    log = (tmp_path / "log.jsonl").read_text()
    with pytest.raises(RunDirError, match="already holds a training run .* --resume .* --overwrite"):
        run(tmp_path, steps=2)
    assert sorted(p.name for p in list_checkpoints(tmp_path)) == before
    assert (tmp_path / "log.jsonl").read_text() == log
    run(tmp_path, steps=6, resume=True, keep_checkpoints=10)
    assert latest_checkpoint(tmp_path).name == "step-000006"
    run(tmp_path, steps=2, overwrite=True)  # replaces the old run whole: no mixture of two runs
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002"]
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 2
    with pytest.raises(ConfigError, match="resume and overwrite"):
        TrainConfig(resume=True, overwrite=True)


def test_an_out_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="is a file"):
        run(tmp_path / "file")


def test_leftovers_of_interrupted_checkpoint_writes_are_cleaned_at_the_next_start(tmp_path):
    run(tmp_path, steps=2, checkpoint_every=1)
    root = tmp_path / "checkpoints"
    (root / ".step-000003.tmp-12345-abc").mkdir()          # killed while writing step 3
    (root / ".step-000003.tmp-legacy").mkdir()             # older naming, without a process id
    os.rename(root / "step-000002", root / ".step-000002.old-99999")  # killed between the two renames
    assert latest_checkpoint(tmp_path).name == "step-000001"
    notes = clean_leftovers(tmp_path)
    assert any("restored step-000002" in n for n in notes)
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002"]
    (root / ".step-000001.old-4242").mkdir()               # swap finished, old copy not yet deleted
    run(tmp_path, steps=3, resume=True)
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002", "step-000003"]


def test_a_full_disk_while_saving_a_checkpoint_keeps_the_previous_one_whole(tmp_path, monkeypatch):
    import errno

    from rdlm.model import huginn
    from rdlm.model.huginn import load_pretrained

    run(tmp_path, steps=1)
    kept = latest_checkpoint(tmp_path)
    real_save, calls = huginn.save_file, []

    def full_disk(*args, **kwargs):
        calls.append(args[1])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huginn, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        run(tmp_path, steps=2, resume=True)
    monkeypatch.setattr(huginn, "save_file", real_save)
    assert calls, "the save was never attempted"
    # Nothing half-written stays behind, and the last complete checkpoint still loads and resumes.
    assert [p.name for p in list_checkpoints(tmp_path)] == [kept.name]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [kept.name]
    load_pretrained(kept / "model")
    assert run(tmp_path, steps=2, resume=True).checkpoint.name == "step-000002"
