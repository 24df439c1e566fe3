"""An embedded text corpus that needs no download: the running Python's standard library source.

Code is a target domain of the paper (section 4), and every machine that runs rdlm already has a few
megabytes of well-written Python on disk. Files are read in a fixed (sorted) order and split into train
and validation *documents* by a hash of the file name, so the split does not depend on the machine's
file order or on how many files are read.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Tests and site-packages are left out: the first is repetitive, the second is not the stdlib.
SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}


def stdlib_dir() -> Path:
    path = Path(sysconfig.get_paths()["stdlib"])
    if not path.is_dir():
        raise FileNotFoundError(f"the Python standard library source is not at {path}")
    return path


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_dir()
    files = [p for p in sorted(root.rglob("*.py")) if not SKIP_PARTS.intersection(p.relative_to(root).parts)]
    if not files:
        raise FileNotFoundError(f"no Python source files under {root}")
    return files


def is_validation(name: str, val_fraction: float) -> bool:
    digest = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < val_fraction


def stdlib_documents(
    split: str = "train", max_chars: int | None = None, val_fraction: float = 0.05, root: Path | None = None
) -> Iterator[str]:
    """Source files of the standard library as documents, up to `max_chars` characters in total."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    root = root or stdlib_dir()
    total = 0
    for path in stdlib_files(root):
        if is_validation(str(path.relative_to(root)), val_fraction) != (split == "val"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if max_chars is not None and total + len(text) > max_chars:
            text = text[: max_chars - total]
        if text:
            yield text
            total += len(text)
        if max_chars is not None and total >= max_chars:
            return


def train_code_tokenizer(vocab_size: int = 2048, max_chars: int = 2_000_000):
    """A byte-level BPE tokenizer (rdlm.data.tokenizer) trained on the training documents."""
    from rdlm.data.tokenizer import train_tokenizer

    return train_tokenizer(stdlib_documents("train", max_chars=max_chars), vocab_size)
