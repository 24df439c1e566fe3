"""Crash-safe file output, and JSONL input with errors that name the line.

Everything rdlm saves goes through here: a file is written to a hidden temporary sibling, flushed to
disk, then renamed over its target, so a crash at any moment leaves either the old file or the new one.
Directories (model and training checkpoints) are built in a temporary sibling and swapped in whole;
the swap is two renames, and `recover_dir` (called before every load and save of such a directory)
puts the complete copy back under its name after a crash between them. Temporary and set-aside
siblings carry the writer's process id, so leftovers of a dead writer are told from a live one's.
Temporary files and directories are created private (tempfile's 0600 / 0700); what is swapped in gets
the permissions an ordinary `open` or `mkdir` would give under the process umask.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux: /proc/self/status);
    elsewhere os.umask is set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a temporary file for writing; on success it is fsynced and renamed to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes files private; these are ordinary outputs
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_write(path) as handle:
        handle.write(text)
    return Path(path)


def write_json(path: str | os.PathLike, data: Any, indent: int | None = 2) -> Path:
    with atomic_write(path) as handle:
        json.dump(data, handle, indent=indent)
        handle.write("\n")
    return Path(path)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory below `root` (before renaming a finished directory into place)."""
    root = Path(root)
    for item in root.rglob("*"):
        if item.is_file():
            with open(item, "rb") as handle:
                os.fsync(handle.fileno())
    for directory in [root, *(d for d in root.rglob("*") if d.is_dir())]:
        fsync_dir(directory)


def replace_dir(new: str | os.PathLike, target: str | os.PathLike) -> None:
    """Swap the finished directory `new` in for `target` (which may not exist yet).

    The old `target` is first renamed aside (`.NAME.old-PID`), so at every moment one complete copy
    exists under a known name; it is deleted only once the new one is in place. A crash between the
    two renames leaves the old copy aside and `target` missing: `recover_dir` renames it back.
    """
    new, target = Path(new), Path(target)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory")
    old = None
    if target.exists():
        os.chmod(new, target.stat().st_mode & 0o7777)  # the directory keeps its permissions
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    os.rename(new, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


_LEFTOVER_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>old|tmp)-(?P<pid>\d+)(?:-.*)?$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def leftovers(
    parent: str | os.PathLike, name: str | None = None, any_writer: bool = False
) -> list[tuple[Path, str, str]]:
    """(path, target name, "old" | "tmp") for the hidden siblings a dead writer left in `parent`
    (of `name` only, when given). any_writer: also those of live processes (the caller holds a lock
    that rules out another writer)."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    found = []
    for item in parent.iterdir():
        match = _LEFTOVER_RE.match(item.name)
        if not match or (name is not None and match["name"] != name):
            continue
        if any_writer or not _alive(int(match["pid"])):
            found.append((item, match["name"], match["kind"]))
    return found


def recover_dir(target: str | os.PathLike, any_writer: bool = False) -> list[str]:
    """Finish or undo a directory swap that a crash interrupted; return what was done, in words.

    A set-aside copy (`.NAME.old-PID`) of a dead writer is complete (it was the previous `target`):
    it is renamed back when `target` is missing, else deleted. Temporary build directories
    (`.NAME.tmp-PID-*`) of dead writers may be incomplete: they are deleted.
    """
    target = Path(target)
    done = []
    for path, _, kind in sorted(leftovers(target.parent, target.name, any_writer), key=lambda x: x[2]):
        if kind == "old" and not target.exists():
            os.rename(path, target)
            fsync_dir(target.parent)
            done.append(f"restored {target} from {path.name} (a swap was interrupted)")
        else:
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed leftover {path}")
    return done


def temp_prefix(name: str) -> str:
    """The prefix of a temporary sibling of `name` built by this process (see `recover_dir`)."""
    return f".{name}.tmp-{os.getpid()}-"


@contextmanager
def staging_dir(target: str | os.PathLike) -> Iterator[Path]:
    """A temporary sibling of `target` to build a directory in; swapped in for `target` on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(target)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(target.name), dir=target.parent))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it private; the result is an ordinary directory
        yield tmp
        fsync_tree(tmp)
        replace_dir(tmp, target)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError) and err.filename is None and err.errno is not None:
            err.filename = str(target)  # "No space left on device" then says where
        raise


def check_parents(path: str | os.PathLike, what: str = "output") -> Path:
    """`path`, refused in one line when a parent that exists is not a directory (`/dev/null/x`: mkdir would
    report "File exists: '/dev/null'")."""
    path = Path(path)
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise NotADirectoryError(f"{what} {path}: its parent {parent} is not a directory")
            break
    return path


def claim_output_dir(
    out: str | os.PathLike,
    owned: Callable[[str], object],
    overwrite: bool,
    what: str,
    others_allowed: bool | Callable[[list[str]], bool] = True,
    flag: str = "--out",
    *,
    source: str | os.PathLike | None = None,
    in_place_flag: str | None = None,
    in_place: bool = False,
    remove: bool = True,
) -> Path:
    """The one rule of every command that writes a directory (docs/files.md): make sure that writing `what`
    into `out` loses nothing, before any work. Refused: `out` is a file; `out` is `source` (the input the
    output is made from), unless `in_place_flag` names a flag that allows it and `in_place` is given; `out`
    holds files the writer does not write (its `owned` names) unless `others_allowed` (a bool, or a test of
    the owned names found: a model directory may keep its other files); `out` holds owned files of an
    earlier result unless `overwrite`. With `overwrite` and `remove`, those are removed first, so none of them
    outlives the new output (a stale shard or plot); a writer that swaps its output in whole (a model
    directory) keeps them until the swap (`remove=False`). Returns `out`."""
    out = check_parents(out, flag)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{flag} {out} is a file, not a directory")
    if source is not None and out.is_dir() and out.resolve() == Path(source).resolve():
        if in_place_flag is None:
            raise FileExistsError(
                f"{flag} {out} is the source: writing {what} there would replace it; choose another directory"
            )
        if not in_place:
            raise FileExistsError(
                f"{flag} {out} is the source: writing {what} there replaces it; pass "
                f"{in_place_flag} to do that, or choose another directory"
            )
        return out
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    ours = [name for name in names if owned(name)]
    others = [name for name in names if not owned(name)]
    allowed = others_allowed(ours) if callable(others_allowed) else others_allowed
    if others and not allowed:
        raise FileExistsError(
            f"{flag} {out} holds other files ({_some(others)}): refusing to write {what} into "
            "it; choose a new or empty directory"
        )
    if ours and not overwrite:
        raise FileExistsError(
            f"{flag} {out} already holds {what} ({_some(ours)}); pass --overwrite to replace it, "
            "or choose another directory"
        )
    for name in ours if remove else ():
        path = out / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return out


def _some(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


@contextmanager
def new_dirs_removed_on_failure(path: str | os.PathLike) -> Iterator[Path]:
    """`path` (checked by `check_parents`); when the block raises, the directories it did not find there
    before (`path` and any missing parents, with what was written in them) are removed: a refused or
    failed job leaves no empty or half-written output directory behind."""
    path = check_parents(path)
    first_new = None
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            break
        first_new = candidate
    try:
        yield path
    except BaseException:
        if first_new is not None and first_new.is_dir():
            shutil.rmtree(first_new, ignore_errors=True)
        raise


def confined_name(
    name: Any, source: str | os.PathLike, error: type[Exception] = ValueError, directory: str = "directory"
) -> str:
    """A file name read from a directory's own metadata (`source`), refused unless it stays inside it.

    Checked on the name itself, not the resolved path: the directory's own files may be symlinks
    elsewhere (the Hugging Face cache is laid out that way); the metadata may not point out of it.
    """
    if not isinstance(name, str) or not name:
        raise error(f"{source}: file name {name!r} is not a non-empty string")
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts or "\\" in name:
        raise error(f"{source}: file name {name!r} points outside the {directory}; refused")
    return name


def read_utf8(path: str | os.PathLike, error: type[Exception] = ValueError) -> str:
    """A text file's contents; one that is not UTF-8 raises `error` naming the file and the byte."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise error(
            f"{path}: not valid UTF-8 at byte {err.start}; convert it first (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def read_jsonl(path: str | os.PathLike, error: type[Exception] = ValueError) -> Iterator[tuple[int, Any]]:
    """(line number, record) for each non-blank line; a malformed line raises `error` naming it."""
    with open(path, "rb") as handle:  # bytes, decoded line by line: a bad byte is named by its line
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise error(
                    f"{path}:{number}: not valid UTF-8 at byte {err.start} of the line; convert it "
                    "first (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise error(f"{path}:{number}: not valid JSON ({err.msg})") from err
