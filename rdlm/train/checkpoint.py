"""Training checkpoints: weights in the Huginn layout, plus everything needed to resume exactly.

Layout of a run directory `OUT/checkpoints/`:

    step-000100/
        model/                     the weights: a Huginn-layout directory (`rdlm.huginn.save_pretrained`:
                                   config.json, model.safetensors, tokenizer.json when known); loadable
                                   with `rdlm.load_pretrained(".../step-000100/model")`
        ema/                       the exponential moving average of the weights, same layout (absent
                                   when the run has no EMA)
        optimizer.safetensors      optimizer state, tensors named "<parameter name>/<state key>"
                                   (rdlm parameter names, e.g. "core.0.attn.qkv.weight/exp_avg")
        rng.safetensors            torch RNG states ("torch", "cuda.<i>")
        trainer.json               written last: step, data position (rows consumed, global batch),
                                   optimizer hyper-parameters per group, schedule, counters, the
                                   TrainConfig, and the loss history
    step-000200/ ...

A checkpoint is written into a hidden temporary sibling (`.step-000200.tmp-*`), every file fsynced,
then renamed into place: a crash at any moment leaves the previous checkpoints untouched and at worst
a hidden temporary directory, which `latest_checkpoint` ignores. Only the newest `keep` are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from rdlm.fileio import staging_dir, write_json
from rdlm.huginn import load_pretrained, save_pretrained
from rdlm.model import RecurrentDepthLM

STEP_RE = re.compile(r"^step-(\d+)$")
TRAINER_FILE = "trainer.json"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"


@dataclass
class Checkpoint:
    path: Path
    trainer: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.trainer["step"])


def checkpoint_dir(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / "checkpoints"


def list_checkpoints(out_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (with trainer.json), oldest first."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_RE.match(p.name)) and (p / TRAINER_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def optimizer_tensors(optimizer_state: dict, names: list[str]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Flatten an optimizer state_dict (param ids in `names` order) to named tensors + group settings."""
    tensors = {}
    for index, state in optimizer_state["state"].items():
        for key, value in state.items():
            value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"{names[int(index)]}/{key}"] = value.detach().to("cpu").contiguous()
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [names[i] for i in g["params"]]}
              for g in optimizer_state["param_groups"]]
    return tensors, groups


def optimizer_state_dict(tensors: dict[str, torch.Tensor], groups: list[dict], names: list[str]) -> dict:
    index = {name: i for i, name in enumerate(names)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        if name not in index:
            raise ValueError(f"optimizer state names unknown parameter {name!r}")
        state.setdefault(index[name], {})[field] = value
    param_groups = [{**g, "params": [index[n] for n in g["params"]],
                     **({"betas": tuple(g["betas"])} if "betas" in g else {})} for g in groups]
    return {"state": state, "param_groups": param_groups}


def save_checkpoint(out_dir: str | os.PathLike, step: int, model: RecurrentDepthLM,
                    ema_model: RecurrentDepthLM | None, optimizer_state: dict, parameter_names: list[str],
                    trainer: dict[str, Any], tokenizer=None, keep: int = 3) -> Path:
    """Write checkpoint `step` atomically, then delete all but the newest `keep`."""
    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    with staging_dir(final) as tmp:  # re-saving a step replaces the old copy only once complete
        save_pretrained(model, tmp / "model")
        if ema_model is not None:
            save_pretrained(ema_model, tmp / "ema")
        if tokenizer is not None:
            for sub in ("model", "ema") if ema_model is not None else ("model",):
                tokenizer.save(tmp / sub / "tokenizer.json")
        tensors, groups = optimizer_tensors(optimizer_state, parameter_names)
        save_file(tensors, tmp / OPTIMIZER_FILE)
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_file(rng, tmp / RNG_FILE)
        # Last: its presence marks a complete checkpoint.
        write_json(tmp / TRAINER_FILE, {**trainer, "step": step, "optimizer_groups": groups}, indent=1)
    for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | os.PathLike, model: nn.Module, ema_model: nn.Module | None,
                    parameter_names: list[str]) -> tuple[Checkpoint, dict | None]:
    """Load weights (and EMA) into the given models; return the checkpoint and the optimizer state_dict."""
    path = Path(path)
    trainer_file = path / TRAINER_FILE
    if not trainer_file.is_file():
        raise FileNotFoundError(f"{path} is not a complete training checkpoint (no {TRAINER_FILE})")
    trainer = json.loads(trainer_file.read_text())
    _copy_weights(load_pretrained(path / "model", dtype=torch.float32), model)
    if ema_model is not None and (path / "ema").is_dir():
        _copy_weights(load_pretrained(path / "ema", dtype=torch.float32), ema_model)
    optimizer_state = None
    if (path / OPTIMIZER_FILE).is_file():
        with safe_open(path / OPTIMIZER_FILE, framework="pt") as handle:
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        optimizer_state = optimizer_state_dict(tensors, trainer["optimizer_groups"], parameter_names)
    if (path / RNG_FILE).is_file():
        with safe_open(path / RNG_FILE, framework="pt") as handle:
            torch.set_rng_state(handle.get_tensor("torch"))
            cuda = sorted(k for k in handle.keys() if k.startswith("cuda."))
            if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all([handle.get_tensor(k) for k in cuda])
    return Checkpoint(path, trainer), optimizer_state


@torch.no_grad()
def _copy_weights(source: nn.Module, target: nn.Module) -> None:
    src = dict(source.named_parameters())
    for name, param in target.named_parameters():
        param.copy_(src[name].to(param.dtype))

