"""Reading training checkpoints: where a run directory keeps them, which is the newest complete (or
finite) one, whether one is sharded, and its weights as a model. The layout and the writing side are the
trainer's (rdlm/train/checkpoint.py); this is what loading a model from a run needs, below the trainer.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rdlm.fileio import confined_name
from rdlm.model.huginn import CheckpointError, load_pretrained
from rdlm.model.lm import RecurrentDepthLM

STEP_RE = re.compile(r"^step-(\d+)$")
TRAINER_FILE = "trainer.json"
SHARDED_DIR = "dcp"


def checkpoint_dir(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / "checkpoints"


def list_checkpoints(out_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (with trainer.json), oldest first."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := STEP_RE.match(p.name)) and (p / TRAINER_FILE).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def _step_of(path: Path) -> int:
    match = STEP_RE.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint (step-NNNNNN)")
    return int(match.group(1))


def last_finite_checkpoint(out_dir: str | os.PathLike, upto: Path | None = None) -> Path | None:
    """The newest checkpoint (not newer than `upto`) whose weights were finite when saved."""
    for path in list_checkpoints(out_dir)[::-1]:
        if upto is not None and _step_of(path) > _step_of(upto):
            continue
        try:
            if json.loads((path / TRAINER_FILE).read_text()).get("finite_weights", True):
                return path
        except (OSError, ValueError):
            continue
    return None


def confined_shards(directory: Path) -> Path:
    """A sharded checkpoint whose metadata names only files inside it (refused otherwise)."""
    from torch.distributed.checkpoint import FileSystemReader

    for info in FileSystemReader(directory).read_metadata().storage_data.values():
        confined_name(str(info.relative_path), directory / ".metadata", CheckpointError, "checkpoint directory")
    return directory


def is_sharded(path: str | os.PathLike) -> bool:
    return (Path(path) / SHARDED_DIR).is_dir()


def read_sharded_full(
    path: str | os.PathLike, model: nn.Module, parameter_names: list[str], with_optimizer: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
    """Whole tensors from a sharded checkpoint, read by this process alone (no collectives):
    (weights by name, EMA weights by name or None, optimizer tensors as "<name>/<key>" or None).
    `model` only gives the names and shapes."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    params = dict(model.named_parameters())
    shapes = {name: params[name].shape for name in parameter_names}
    state: dict[str, Any] = {"model": {n: torch.empty(s) for n, s in shapes.items()}}
    if has_ema(path):
        state["ema"] = {n: torch.empty(s) for n, s in shapes.items()}
    if with_optimizer:
        state["optimizer"] = {
            "state": {
                n: {"step": torch.zeros(()), "exp_avg": torch.empty(s), "exp_avg_sq": torch.empty(s)}
                for n, s in shapes.items()
            }
        }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, checkpoint_id=confined_shards(path / SHARDED_DIR), no_dist=True)
    optimizer = None
    if with_optimizer:
        optimizer = {f"{n}/{k}": v for n, fields in state["optimizer"]["state"].items() for k, v in fields.items()}
    return state["model"], state.get("ema"), optimizer


def load_weights(path: str | os.PathLike, weights: str = "model") -> RecurrentDepthLM:
    """The weights ("model" or "ema") of a training checkpoint, sharded or not, as a float32 model."""
    path = Path(path)
    if not is_sharded(path):
        return load_pretrained(path / weights, dtype=torch.float32)
    from rdlm.model.config import RDLMConfig

    trainer = read_trainer(path)
    with torch.device("meta"):
        skeleton = RecurrentDepthLM(RDLMConfig.from_dict(trainer["model_config"]))
    names = [n for n, _ in skeleton.named_parameters()]
    model_tensors, ema_tensors, _ = read_sharded_full(path, skeleton, names, with_optimizer=False)
    chosen = ema_tensors if weights == "ema" else model_tensors
    if chosen is None:
        raise FileNotFoundError(f"{path}: no {weights} weights in this checkpoint")
    model = RecurrentDepthLM(skeleton.config)
    model.load_state_dict(chosen)
    return model


def has_ema(path: Path) -> bool:
    return bool(read_trainer(path).get("train_config", {}).get("ema_decay"))


def read_trainer(path: Path) -> dict[str, Any]:
    trainer_file = path / TRAINER_FILE
    if not trainer_file.is_file():
        raise FileNotFoundError(f"{path} is not a complete training checkpoint (no {TRAINER_FILE})")
    return json.loads(trainer_file.read_text())
