"""Training checkpoints: weights in the Huginn layout, plus everything needed to resume exactly.

Layout of a run directory `OUT/checkpoints/`:

    step-000100/
        model/                     the weights: a Huginn-layout directory (`rdlm.model.huginn.save_pretrained`:
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

With FSDP (`--strategy fsdp`, rdlm.train.distributed) the weights are sharded and every worker writes
its own part with torch.distributed.checkpoint (DCP); the same run directory then holds

    step-000100/
        dcp/                       DCP files: ".metadata" and one "__<rank>_0.distcp" per worker,
                                   holding "model.<name>", "ema.<name>" and "optimizer.state.<name>.<key>"
                                   (rdlm parameter names), each tensor with its global shape
        rng.safetensors            as above (rank 0's)
        tokenizer.json             when known
        trainer.json               as above, plus "sharded": true and "model_config"

DCP re-shards on load, so such a checkpoint resumes with any number of workers, FSDP or not, and a
single-process checkpoint resumes under FSDP; `rdlm convert` turns either into the Huginn layout
(`load_weights`). Reading checkpoints (finding them, their weights as a model) is rdlm.model.checkpoints,
which loading a model from a run needs without the trainer.

A checkpoint is written into a hidden temporary sibling (`.step-000200.tmp-PID-*`), every file
fsynced, then renamed into place: a crash at any moment leaves the previous checkpoints untouched and
at worst a hidden temporary directory, which `latest_checkpoint` ignores and the next `rdlm train` in
that directory removes (rdlm.train.rundir). Only the newest `keep` are kept. trainer.json records
whether the weights were finite, so a diverged run names the last checkpoint worth resuming from.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from rdlm.fileio import staging_dir, temp_prefix, write_json

# STEP_RE, last_finite_checkpoint, latest_checkpoint and load_weights are not used here: the layout's names,
# re-exported because callers import them from here too (rdlm.train.resume, rdlm.model.resolve, the tests).
from rdlm.model.checkpoints import (
    SHARDED_DIR,
    STEP_RE,  # noqa: F401
    TRAINER_FILE,
    checkpoint_dir,
    confined_shards,
    has_ema,
    is_sharded,
    last_finite_checkpoint,  # noqa: F401
    latest_checkpoint,  # noqa: F401
    list_checkpoints,
    load_weights,  # noqa: F401
    read_sharded_full,
    read_trainer,
)
from rdlm.model.huginn import load_pretrained, save_pretrained
from rdlm.model.lm import RecurrentDepthLM
from rdlm.model.lora import loaded_adapters

ADAPTER_DIR = "adapter"  # a LoRA run's adapter (rdlm.model.lora, PEFT's format) in place of model/
EMA_ADAPTER_DIR = "ema-adapter"  # and its EMA
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"


@dataclass
class Checkpoint:
    path: Path
    trainer: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.trainer["step"])


def optimizer_tensors(optimizer_state: dict, names: list[str]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Flatten an optimizer state_dict (param ids in `names` order) to named tensors + group settings."""
    tensors = {}
    for index, state in optimizer_state["state"].items():
        for key, value in state.items():
            value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"{names[int(index)]}/{key}"] = value.detach().to("cpu").contiguous()
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"params": [names[i] for i in g["params"]]}
        for g in optimizer_state["param_groups"]
    ]
    return tensors, groups


def optimizer_state_dict(tensors: dict[str, torch.Tensor], groups: list[dict], names: list[str]) -> dict:
    index = {name: i for i, name in enumerate(names)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        if name not in index:
            raise ValueError(f"optimizer state names unknown parameter {name!r}")
        state.setdefault(index[name], {})[field] = value
    param_groups = [
        {**g, "params": [index[n] for n in g["params"]], **({"betas": tuple(g["betas"])} if "betas" in g else {})}
        for g in groups
    ]
    return {"state": state, "param_groups": param_groups}


def save_checkpoint(
    out_dir: str | os.PathLike,
    step: int,
    model: RecurrentDepthLM,
    ema_model: RecurrentDepthLM | None,
    optimizer_state: dict,
    parameter_names: list[str],
    trainer: dict[str, Any],
    tokenizer=None,
    keep: int = 3,
    *,
    ema_adapter: dict[str, torch.Tensor] | None = None,
    base_source: str | None = None,
) -> Path:
    """Write checkpoint `step` atomically, then delete all but the newest `keep`. A model with LoRA adapters
    (a lora run) writes its adapter (adapter/, and ema-adapter/ from `ema_adapter`, the EMA's tensors named
    as rdlm.model.lora.adapter_state names them) instead of the weights; `base_source` is the base it
    records."""
    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    with staging_dir(final) as tmp:  # re-saving a step replaces the old copy only once complete
        if loaded_adapters(model):
            from rdlm.model.lora_files import save_adapter

            subs = [ADAPTER_DIR]
            save_adapter(model, tmp / ADAPTER_DIR, base_source=base_source)
            if ema_adapter is not None:
                save_adapter(model, tmp / EMA_ADAPTER_DIR, base_source=base_source, state=ema_adapter)
                subs.append(EMA_ADAPTER_DIR)
        else:
            subs = ["model"]
            save_pretrained(model, tmp / "model")
            if ema_model is not None:
                save_pretrained(ema_model, tmp / "ema")
                subs.append("ema")
        if tokenizer is not None:
            for sub in subs:
                tokenizer.save(tmp / sub / "tokenizer.json")
        tensors, groups = optimizer_tensors(optimizer_state, parameter_names)
        save_file(tensors, tmp / OPTIMIZER_FILE)
        save_file(_rng_state(), tmp / RNG_FILE)
        # Last: its presence marks a complete checkpoint.
        write_json(tmp / TRAINER_FILE, {**trainer, "step": step, "optimizer_groups": groups}, indent=1)
    for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, ema_model: nn.Module | None, parameter_names: list[str]
) -> tuple[Checkpoint, dict | None]:
    """Load weights (and EMA) into the given models; return the checkpoint and the optimizer state_dict."""
    path = Path(path)
    trainer = read_trainer(path)
    if is_sharded(path):  # written under FSDP: gather the whole tensors here
        weights, ema, tensors = read_sharded_full(path, model, parameter_names)
        assert tensors is not None  # read with the optimizer (read_sharded_full's default)
        _copy_tensors(weights, model)
        if ema_model is not None and ema is not None:
            _copy_tensors(ema, ema_model)
        _load_rng(path)
        return Checkpoint(path, trainer), optimizer_state_dict(tensors, trainer["optimizer_groups"], parameter_names)
    _copy_weights(load_pretrained(path / "model", dtype=torch.float32), model)
    if ema_model is not None and (path / "ema").is_dir():
        _copy_weights(load_pretrained(path / "ema", dtype=torch.float32), ema_model)
    _load_rng(path)
    return Checkpoint(path, trainer), _read_optimizer(path, trainer, parameter_names)


def _read_optimizer(path: Path, trainer: dict[str, Any], parameter_names: list[str]) -> dict | None:
    """The optimizer state_dict of a single-process checkpoint (None where it has no optimizer file)."""
    if not (path / OPTIMIZER_FILE).is_file():
        return None
    with safe_open(path / OPTIMIZER_FILE, framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 (not a dict: no iteration)
    return optimizer_state_dict(tensors, trainer["optimizer_groups"], parameter_names)


def load_adapter_checkpoint(
    path: str | os.PathLike, model: nn.Module, parameter_names: list[str]
) -> tuple[Checkpoint, dict | None, dict[str, torch.Tensor] | None]:
    """Resume a lora run: its adapter into `model` (whose base must be the one the adapter records), and
    the optimizer state_dict and the EMA's tensors by parameter name (None where the run kept none)."""
    from rdlm.model.lora_files import copy_adapter, parameter_of, read_adapter

    path = Path(path)
    trainer = read_trainer(path)
    copy_adapter(model, read_adapter(path / ADAPTER_DIR))
    ema = None
    if (path / EMA_ADAPTER_DIR).is_dir():
        files = read_adapter(path / EMA_ADAPTER_DIR)
        ema = {}
        for module, (a, b) in files.tensors.items():
            ema[parameter_of(f"{module}.lora_A.weight")] = a
            ema[parameter_of(f"{module}.lora_B.weight")] = b
    _load_rng(path)
    return Checkpoint(path, trainer), _read_optimizer(path, trainer, parameter_names), ema


@torch.no_grad()
def _copy_weights(source: nn.Module, target: nn.Module) -> None:
    _copy_tensors(dict(source.named_parameters()), target)


@torch.no_grad()
def _copy_tensors(source: dict[str, torch.Tensor], target: nn.Module) -> None:
    for name, param in target.named_parameters():
        param.copy_(source[name].to(param.dtype))


# --------------------------------------------------------------------------------------------------
# Sharded checkpoints (torch.distributed.checkpoint)


def _rng_state() -> dict[str, torch.Tensor]:
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return rng


def sharded_state(
    model: nn.Module, optimizer, ema_shadow: list[torch.Tensor] | None, parameter_names: list[str]
) -> tuple[dict[str, Any], list[dict]]:
    """The state DCP saves and loads in place: {"model", "optimizer": {"state"}, "ema"} (DTensors under
    FSDP, plain tensors otherwise), and the optimizer's parameter groups (kept in trainer.json)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
    if ema_shadow is not None:
        params = dict(model.named_parameters())
        state["ema"] = {
            name: shaped_like(shadow, params[name]) for name, shadow in zip(parameter_names, ema_shadow, strict=True)
        }
    return state, cast(list[dict], optimizer_state["param_groups"])


def shaped_like(local_tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`local_tensor` (this worker's part) as a DTensor sharded like `param`; a view, not a copy."""
    if not hasattr(param, "device_mesh"):
        return local_tensor
    from torch.distributed.tensor import DTensor

    sharded = cast(DTensor, param)
    return DTensor.from_local(
        local_tensor, sharded.device_mesh, sharded.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def save_sharded_checkpoint(
    out_dir: str | os.PathLike,
    step: int,
    model: RecurrentDepthLM,
    optimizer,
    ema_shadow: list[torch.Tensor] | None,
    parameter_names: list[str],
    trainer: dict[str, Any],
    tokenizer=None,
    keep: int = 3,
) -> Path:
    """Every worker writes its shards into one staging directory; rank 0 then adds trainer.json and
    renames it into place. Killed at any moment, the previous checkpoints stay complete."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from rdlm.fileio import fsync_tree, replace_dir

    main = dist.get_rank() == 0
    root = checkpoint_dir(out_dir)
    final = root / f"step-{step:06d}"
    staging: list[str | None] = [None]  # rank 0's staging directory, broadcast to every worker
    if main:
        root.mkdir(parents=True, exist_ok=True)
        staging = [tempfile.mkdtemp(prefix=temp_prefix(final.name), dir=root)]
    dist.broadcast_object_list(staging, src=0)
    assert staging[0] is not None
    tmp = Path(staging[0])
    try:
        state, groups = sharded_state(model, optimizer, ema_shadow, parameter_names)
        dcp.save(state, checkpoint_id=tmp / SHARDED_DIR)  # returns once .metadata is written
        if main:
            save_file(_rng_state(), tmp / RNG_FILE)
            if tokenizer is not None:
                tokenizer.save(tmp / "tokenizer.json")
            config = model.config.to_dict()
            write_json(
                tmp / TRAINER_FILE,
                {**trainer, "step": step, "sharded": True, "model_config": config, "optimizer_groups": groups},
                indent=1,
            )  # last: marks completeness
            fsync_tree(tmp)
            replace_dir(tmp, final)
            for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()
    return final


def load_sharded_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer,
    ema_shadow: list[torch.Tensor] | None,
    parameter_names: list[str],
) -> Checkpoint:
    """Resume FSDP training, in place, from a sharded checkpoint (any number of writers) or a
    single-process one (each worker keeps its part of the whole tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    trainer = read_trainer(path)
    state, _ = sharded_state(model, optimizer, ema_shadow, parameter_names)
    if is_sharded(path):
        if "ema" in state and not has_ema(path):
            del state["ema"]
        dcp.load(state, checkpoint_id=confined_shards(path / SHARDED_DIR))
    else:
        _fill(state["model"], dict(load_pretrained(path / "model", dtype=torch.float32).named_parameters()))
        if "ema" in state and (path / "ema").is_dir():
            _fill(state["ema"], dict(load_pretrained(path / "ema", dtype=torch.float32).named_parameters()))
        if (path / OPTIMIZER_FILE).is_file():
            with safe_open(path / OPTIMIZER_FILE, framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (not a dict: no iteration)
                    name, _, field = key.rpartition("/")
                    _fill(state["optimizer"]["state"][name], {field: handle.get_tensor(key)})
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict={"state": state["optimizer"]["state"], "param_groups": trainer["optimizer_groups"]},
    )
    _load_rng(path)
    return Checkpoint(path, trainer)


@torch.no_grad()
def _fill(targets: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors into `targets`, each (if sharded) keeping only this worker's part."""
    for name, value in whole.items():
        target = targets[name]
        if hasattr(target, "device_mesh"):
            from torch.distributed.tensor import DTensor, distribute_tensor

            sharded = cast(DTensor, target)
            value = distribute_tensor(
                value.to(sharded.device_mesh.device_type, sharded.dtype), sharded.device_mesh, sharded.placements
            ).to_local()
            target = sharded.to_local()
        target.copy_(value)


def _load_rng(path: Path) -> None:
    if (path / RNG_FILE).is_file():
        with safe_open(path / RNG_FILE, framework="pt") as handle:
            torch.set_rng_state(handle.get_tensor("torch"))
            cuda = sorted(k for k in handle.keys() if k.startswith("cuda."))  # noqa: SIM118 (not a dict: no iteration)
            if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all([handle.get_tensor(k) for k in cuda])
