import os

import pytest

from rdlm.fileio import atomic_write, current_umask, read_jsonl, staging_dir, write_json, write_text


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.txt"
    write_text(target, "old")
    with pytest.raises(RuntimeError):
        with atomic_write(target) as handle:
            handle.write("half of the new")
            raise RuntimeError("crash")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    assert (target.stat().st_mode & 0o777) == 0o666 & ~current_umask()


def test_staging_dir_swaps_in_whole_or_not_at_all(tmp_path):
    target = tmp_path / "ckpt"
    with staging_dir(target) as tmp:
        write_json(tmp / "a.json", {"v": 1})
    assert (target / "a.json").read_text().strip() == '{\n  "v": 1\n}'
    with pytest.raises(OSError):
        with staging_dir(target) as tmp:
            write_json(tmp / "a.json", {"v": 2})
            raise OSError("disk full")
    assert '"v": 1' in (target / "a.json").read_text()
    with staging_dir(target) as tmp:
        write_text(tmp / "b.txt", "new")
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_read_jsonl_skips_blank_lines_and_names_a_bad_one(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{oops\n')
    records = read_jsonl(path, KeyError)
    assert next(records) == (1, {"a": 1})
    assert next(records) == (3, {"a": 2})
    with pytest.raises(KeyError, match="x.jsonl:4: not valid JSON"):
        next(records)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_saved_files_and_directories_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        with staging_dir(tmp_path / "ckpt") as tmp:
            write_json(tmp / "a.json", {"v": 1})
            (tmp / "sub").mkdir()
        write_text(tmp_path / "plain.txt", "x")
    finally:
        os.umask(old)
    assert current_umask() == old
    assert ((tmp_path / "ckpt").stat().st_mode & 0o777) == 0o777 & ~umask
    assert ((tmp_path / "ckpt" / "sub").stat().st_mode & 0o777) == 0o777 & ~umask
    for f in (tmp_path / "ckpt" / "a.json", tmp_path / "plain.txt"):
        assert (f.stat().st_mode & 0o777) == 0o666 & ~umask


CRASH_BETWEEN_RENAMES = """
import os, sys
from rdlm import fileio
from rdlm.fileio import staging_dir, write_text
renames = []
real = os.rename
def rename(a, b):
    renames.append(a)
    if len(renames) == 2:  # the old copy is aside, the new one not yet in place
        os._exit(9)
    real(a, b)
fileio.os.rename = rename
with staging_dir(sys.argv[1]) as tmp:
    write_text(tmp / "a.txt", "new")
"""


def test_a_crash_between_the_two_renames_is_recovered_at_the_next_load_or_save(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from rdlm.fileio import recover_dir

    target = tmp_path / "m"
    with staging_dir(target) as tmp:
        write_text(tmp / "a.txt", "old")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", CRASH_BETWEEN_RENAMES, str(target)],
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 9
    assert not target.exists()  # only hidden names are left: .m.old-PID and .m.tmp-PID-*
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == [".m.old", ".m.tmp"]
    notes = recover_dir(target)
    assert (target / "a.txt").read_text() == "old" and any("restored" in n for n in notes)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_load_pretrained_restores_a_model_directory_whose_swap_was_interrupted(tmp_path, tiny_model):
    import os

    from rdlm.model.huginn import load_pretrained, save_pretrained

    target = save_pretrained(tiny_model, tmp_path / "m")
    os.rename(target, tmp_path / ".m.old-999999")  # a dead writer's set-aside copy
    (tmp_path / ".m.tmp-999999-x").mkdir()
    assert load_pretrained(target).config == tiny_model.config
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_the_output_rule_refuses_the_source_and_a_previous_result_before_anything_is_written(tmp_path):
    """claim_output_dir, the rule of every writing command (docs/files.md)."""
    from rdlm.fileio import claim_output_dir

    owned = {"out.bin", "result.json"}.__contains__
    source = tmp_path / "source"
    source.mkdir()
    (source / "out.bin").write_text("the input")
    with pytest.raises(FileExistsError, match="is the source: .* choose another directory"):
        claim_output_dir(source / ".", owned, True, "a result", source=source)  # no flag allows it
    with pytest.raises(FileExistsError, match="is the source: .* pass --in-place"):
        claim_output_dir(source, owned, True, "a result", source=source, in_place_flag="--in-place")
    assert claim_output_dir(source, owned, False, "a result", source=source, in_place_flag="--in-place",
                            in_place=True) == source
    assert (source / "out.bin").read_text() == "the input"
    out = tmp_path / "out"
    out.mkdir()
    (out / "result.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"already holds a result \(result.json\); pass --overwrite"):
        claim_output_dir(out, owned, False, "a result")
    with pytest.raises(FileExistsError, match=r"holds other files \(notes.txt\)"):
        claim_output_dir(out, owned, True, "a result", others_allowed=lambda ours: "out.bin" in ours)
    claim_output_dir(out, owned, True, "a result", remove=False)  # swapped out later, whole
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "result.json"]
    claim_output_dir(out, owned, True, "a result")  # removed first: nothing stale outlives the new result
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
