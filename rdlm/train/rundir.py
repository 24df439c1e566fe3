"""Ownership of a run directory: one writer at a time, no run silently mixed into another's files.

- `RunLock`: an exclusive lock (`OUT/.rdlm-train.lock`, flock) held for the whole of `rdlm train`. The
  kernel releases it when the process ends, however it ends, so a lock file left by a crash is
  stale by construction and simply taken over (with a note naming the dead process). A second live
  writer is refused, naming the holder's process id.
- `prepare_run_dir`: a new run (no resume) into a directory that holds another run's checkpoints or
  log is refused unless `overwrite`, which removes them first; leftovers of interrupted checkpoint
  writes (`.step-N.tmp-*`, `.step-N.old-*`) are cleaned, a set-aside complete copy put back.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rdlm.fileio import fsync_dir
from rdlm.model.config import ConfigError

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+, and annotations are not evaluated here (from __future__)

LOCK_FILE = ".rdlm-train.lock"
LOG_FILE = "log.jsonl"
_LEFTOVER_RE = re.compile(r"^\.(step-\d+)\.(tmp|old)-")


class RunDirError(ConfigError):
    """The run directory is in use, or holds another run that would be overwritten."""


class RunLock:
    """An exclusive, process-lifetime lock on a run directory."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        import fcntl

        self.path = Path(out_dir) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"process {holder}" if holder else "another process"
            raise RunDirError(
                f"run directory {out_dir} is in use by {who} (another `rdlm train` writing "
                f"there); wait for it to finish or choose another --out-dir"
            ) from None
        previous = _read_pid(fd)
        if previous and previous != os.getpid():
            print(
                f"rdlm train: took over the lock of {out_dir} left by process {previous}, which is no longer running",
                file=sys.stderr,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # a clean exit leaves no holder behind
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def has_run(out_dir: str | os.PathLike) -> bool:
    """Whether `out_dir` holds a run: checkpoints or a training log."""
    from rdlm.train.checkpoint import checkpoint_dir

    out = Path(out_dir)
    root = checkpoint_dir(out)
    return (out / LOG_FILE).is_file() or (root.is_dir() and any(p.name.startswith("step-") for p in root.iterdir()))


def clean_leftovers(out_dir: str | os.PathLike) -> list[str]:
    """Remove what interrupted checkpoint writes left (the caller holds the run lock, so no write is in
    progress); a set-aside complete checkpoint whose step is missing is renamed back. Returns notes."""
    from rdlm.train.checkpoint import checkpoint_dir

    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    notes = []
    for path in sorted(root.iterdir(), key=lambda p: ".old-" not in p.name):  # set-aside copies first
        match = _LEFTOVER_RE.match(path.name)
        if not match:
            continue
        target = root / match.group(1)
        if match.group(2) == "old" and not target.exists():
            os.rename(path, target)
            fsync_dir(root)
            notes.append(f"restored {target.name} from {path.name} (its replacement was interrupted)")
        else:
            shutil.rmtree(path, ignore_errors=True)
            notes.append(f"removed {path.name} (left by an interrupted checkpoint write)")
    return notes


def check_run_dir(out_dir: str | os.PathLike, resume: bool, overwrite: bool) -> None:
    """What the run directory must be, checked before anything is written there (the lock too; `prepare_run_dir`
    checks again under the lock): not a file; with `resume`, a run to continue (a missing or empty directory,
    a typo in the path, is refused rather than silently starting a new run; a directory with a run's files but
    no checkpoint yet, a run stopped before its first save, starts the run as given); without it, no other
    run unless `overwrite`."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out-dir {out} is a file, not a directory")
    if resume and not out.exists():
        raise RunDirError(
            f"--resume: run directory {out} does not exist, so there is no run to continue; check "
            "the path, or start a new run without --resume"
        )
    if resume and not any(p.name != LOCK_FILE for p in out.iterdir()):
        raise RunDirError(
            f"--resume: run directory {out} is empty, so there is no run to continue; check the "
            "path, or start a new run without --resume"
        )
    if not resume and not overwrite and has_run(out):
        raise RunDirError(
            f"{out} already holds a training run (checkpoints or {LOG_FILE}): pass --resume "
            f"to continue it, --overwrite to replace it, or choose another --out-dir"
        )


def prepare_run_dir(out_dir: str | os.PathLike, resume: bool, overwrite: bool) -> None:
    """Refuse to start a new run over another one unless `overwrite` (which removes it); clean leftovers."""
    from rdlm.train.checkpoint import checkpoint_dir

    out = Path(out_dir)
    check_run_dir(out, resume, overwrite)
    for note in clean_leftovers(out):
        print(f"rdlm train: {note}", file=sys.stderr)
    if resume or not has_run(out):
        return
    print(f"rdlm train: --overwrite: removing the previous run's checkpoints and log in {out}", file=sys.stderr)
    shutil.rmtree(checkpoint_dir(out), ignore_errors=True)
    shutil.rmtree(out / "tensorboard", ignore_errors=True)
    (out / LOG_FILE).unlink(missing_ok=True)
