"""What a model argument can name, decided in one place: every command's `--model` (generate, chat,
serve, eval, lm-eval, analyze, info, convert, train) and `rdlm.load_model` come here.

    NAME or preset:NAME     a preset (rdlm.model.config.PRESETS): a freshly initialized model
    DIR with config.json    a Huginn-layout model directory
    DIR with trainer.json   a training checkpoint `step-N/` (rdlm.model.checkpoints), sharded or not
    DIR with checkpoints/   a run directory (`rdlm train --out-dir`): its newest complete checkpoint

A bare preset name means the preset, unless a model directory, checkpoint or run directory of that
name exists here too: then it is ambiguous and refused, naming both spellings (`preset:tiny` and
`./tiny`). A folder of that name that holds no model (data, notes) does not shadow the preset.

From a checkpoint, weights="ema" reads the exponential moving average of the weights (the paper's
cheap cooldown, section 3), or the raw weights when the run kept no EMA; weights="model" the raw ones.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rdlm.fileio import recover_dir
from rdlm.model import checkpoints as ckpt
from rdlm.model import quantize as quantization
from rdlm.model.config import PRESETS, ConfigError, RDLMConfig
from rdlm.model.dtypes import resolve_dtype
from rdlm.model.huginn import CONFIG_NAME, CheckpointError, load_pretrained
from rdlm.model.lm import RecurrentDepthLM
from rdlm.model.quantize import DEFAULT_GROUP_SIZE

PRESET_PREFIX = "preset:"
ACCEPTED = (
    f"a preset ({', '.join(PRESETS)}; random weights), a Huginn-layout model directory, "
    "a training checkpoint step-N/ or a run directory"
)


@dataclass(frozen=True)
class ModelSource:
    """What a model argument names, before anything is loaded."""

    text: str  # the argument as given
    kind: str  # "preset", "model" (directory), "checkpoint" or "run"
    preset: str | None = None  # kind "preset"
    directory: Path | None = None  # the Huginn-layout directory to read (None: preset or sharded)
    checkpoint: Path | None = None  # the step-N/ directory of kinds "checkpoint" and "run"
    weights: str | None = None  # of a checkpoint: "ema" or "model"
    sharded: bool = False  # an FSDP checkpoint (step-N/dcp/), gathered on load

    @property
    def tokenizer_dir(self) -> Path | None:
        """Where this model's tokenizer.json sits, if it has one: beside the weights, or beside
        trainer.json in a sharded checkpoint."""
        from rdlm.data.tokenizer import TOKENIZER_FILE

        where = self.checkpoint if self.sharded else self.directory
        return where if where is not None and (where / TOKENIZER_FILE).is_file() else None

    def load(
        self,
        *,
        dtype: Any = None,
        device: torch.device | str = "cpu",
        overrides: dict[str, Any] | None = None,
        quantize: Any = None,
        group_size: int = DEFAULT_GROUP_SIZE,
    ) -> RecurrentDepthLM:
        """The model, in eval mode. dtype: a name or torch dtype for the weights (None: the file's own;
        float32 for presets and sharded checkpoints); overrides: config fields of a preset; quantize: a
        QuantSpec or its text ("int8", "core=int4,head=int8", ...; rdlm.model.quantize) applied after
        loading (a model saved quantized stays as saved)."""
        model = self._load(dtype, device, overrides)
        return quantization.apply(model, quantize, group_size)

    def _load(self, dtype: Any, device: torch.device | str, overrides: dict[str, Any] | None) -> RecurrentDepthLM:
        dtype = resolve_dtype(dtype)
        if self.kind == "preset":
            assert self.preset is not None  # (each kind has its fields: see the class)
            model = RecurrentDepthLM(RDLMConfig.from_preset(self.preset, **(overrides or {})))
        elif overrides:
            raise ConfigError(f"config overrides apply to presets only, not to {self.text}")
        elif self.sharded:
            assert self.checkpoint is not None and self.weights is not None
            model = ckpt.load_weights(self.checkpoint, self.weights)
        else:
            assert self.directory is not None
            return load_pretrained(self.directory, dtype=dtype, device=device).eval()
        return cast_parameters(model.to(device), dtype).eval()


def cast_parameters(model: RecurrentDepthLM, dtype: torch.dtype | None) -> RecurrentDepthLM:
    """Cast weights only: the RoPE tables stay float32 (what load_pretrained does too)."""
    if dtype is not None:
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return model


def resolve_model_source(source: str | os.PathLike, weights: str = "ema") -> ModelSource:
    """Decide what `source` names (see the module docstring); nothing is loaded.

    Raises ConfigError for an unknown or ambiguous name, FileNotFoundError for a missing path and
    CheckpointError for a directory holding no model, each naming what is accepted."""
    if weights not in ("ema", "model"):
        raise ValueError(f"weights must be 'ema' or 'model', got {weights!r}")
    text = os.fspath(source)
    if text.startswith(PRESET_PREFIX):
        name = text[len(PRESET_PREFIX) :]
        RDLMConfig.from_preset(name)  # raises ConfigError naming the unknown preset and the known ones
        return ModelSource(text, "preset", preset=name)
    path = Path(text)
    if text in PRESETS:
        if _holds_model(path):
            raise ConfigError(
                f"{text!r} names both the preset {text} and the model directory ./{text}: "
                f"write {PRESET_PREFIX}{text} for the preset or ./{text} for the directory"
            )
        return ModelSource(text, "preset", preset=text)
    if not path.exists():
        for note in recover_dir(path):  # a directory swap a crash interrupted: the complete copy returns
            print(f"rdlm: {note}", file=sys.stderr)
    if not path.exists():
        if os.sep not in text and "/" not in text:  # a bare name: most likely a mistyped preset
            close = difflib.get_close_matches(text, list(PRESETS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown preset {text!r}{hint} and no directory of that name; expected {ACCEPTED}")
        raise FileNotFoundError(f"{text}: no such directory (expected {ACCEPTED})")
    if not path.is_dir():
        raise CheckpointError(f"{text} is a file; expected {ACCEPTED}")
    if (path / CONFIG_NAME).is_file():
        return ModelSource(text, "model", directory=path)
    if (path / ckpt.TRAINER_FILE).is_file():
        return _checkpoint(text, "checkpoint", path, weights)
    if ckpt.checkpoint_dir(path).is_dir():
        latest = ckpt.latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"{ckpt.checkpoint_dir(path)}: no complete checkpoint (step-*/{ckpt.TRAINER_FILE})")
        return _checkpoint(text, "run", latest, weights)
    raise CheckpointError(
        f"{path}: neither a Huginn-layout directory ({CONFIG_NAME}), a training "
        f"checkpoint ({ckpt.TRAINER_FILE}) nor a run directory (checkpoints/); "
        f"expected {ACCEPTED}"
    )


def _checkpoint(text: str, kind: str, path: Path, weights: str) -> ModelSource:
    if ckpt.is_sharded(path):  # FSDP: whole tensors gathered on load; EMA when the run kept one
        chosen = weights if weights == "model" or ckpt.has_ema(path) else "model"
        return ModelSource(text, kind, checkpoint=path, weights=chosen, sharded=True)
    for sub in (weights, "model") if weights == "ema" else ("model",):
        if (path / sub / CONFIG_NAME).is_file():
            return ModelSource(text, kind, directory=path / sub, checkpoint=path, weights=sub)
    raise CheckpointError(f"{path}: training checkpoint without {weights}/ weights")


def _holds_model(path: Path) -> bool:
    """Whether `path` is a directory that could be meant as a model (so it competes with a preset)."""
    return path.is_dir() and (
        (path / CONFIG_NAME).is_file() or (path / ckpt.TRAINER_FILE).is_file() or ckpt.checkpoint_dir(path).is_dir()
    )


def load_model(
    source: str | os.PathLike | ModelSource,
    *,
    dtype: Any = None,
    device: torch.device | str = "cpu",
    weights: str = "ema",
    quantize: Any = None,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> RecurrentDepthLM:
    """The model `source` names (see the module docstring), in eval mode, on `device`, quantized by
    `quantize` (rdlm.model.quantize) when given."""
    if not isinstance(source, ModelSource):
        source = resolve_model_source(source, weights)
    return source.load(dtype=dtype, device=device, quantize=quantize, group_size=group_size)
