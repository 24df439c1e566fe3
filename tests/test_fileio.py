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
