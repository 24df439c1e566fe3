"""What a training run starts from, before its first step: the model and tokenizer to train, the data
(checked against the model), the size checks, and the model compiled, sharded or replicated with its
optimizer (`parallelize`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rdlm.data.shards import DataError, MemoryRows, RowSource, TokenShards, load_prompt_response
from rdlm.model.config import ConfigError, RDLMConfig
from rdlm.model.lm import RecurrentDepthLM
from rdlm.resources import check_memory, check_time, forward_seconds
from rdlm.train.config import TrainConfig
from rdlm.train.distributed import apply_fsdp, resolve_strategy
from rdlm.train.optim import AdamW, MuonAdamW, parameter_groups


def resolve_model(
    source: str, overrides: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32, frozen: bool = False
) -> tuple[RecurrentDepthLM, Path | None]:
    """The model to train (in `dtype`, float32 unless a frozen LoRA base asks for bf16) and the directory of
    its tokenizer.json, if any. `source` is read by rdlm.model.resolve, as every command's --model; from a
    checkpoint or run directory the raw weights (not the EMA) are trained on. A model saved quantized is
    refused unless it stays `frozen` (the base of LoRA adapters)."""
    from rdlm.model.resolve import resolve_model_source

    found = resolve_model_source(source, weights="model")
    if found.kind == "preset":
        assert found.preset is not None  # a preset's name, by its kind
        model = RecurrentDepthLM(RDLMConfig.from_preset(found.preset, **(overrides or {})))
        return model.to(dtype), None
    model = found.load(dtype=dtype)
    if getattr(model, "quantization", None) is not None and not frozen:
        raise ConfigError(
            f"{source} is quantized ({model.quantization}): its integer weights cannot be trained; "
            "train the unquantized model and quantize it afterwards"
        )
    if overrides:
        # Training-time fields (recurrence, checkpointing) may change; shapes may not.
        new = model.config.replace(**overrides)
        fresh = RecurrentDepthLM(new)
        shapes = {name: tuple(t.shape) for name, t in fresh.state_dict().items()}
        for name, tensor in model.state_dict().items():
            if shapes.get(name) != tuple(tensor.shape):
                changed = ", ".join(f"{k}={v}" for k, v in overrides.items() if getattr(model.config, k, v) != v)
                raise ConfigError(
                    f"--set {changed}: {source} holds weights of other shapes ({name} is "
                    f"{tuple(tensor.shape)}, the new config needs {shapes.get(name)}); a loaded "
                    "model can change training-time fields only (recurrence, checkpointing)"
                )
        fresh.load_state_dict(model.state_dict())
        model = fresh
    return model.train(), found.tokenizer_dir


def prepare_lora(model: RecurrentDepthLM, config: TrainConfig) -> RecurrentDepthLM:
    """A lora run's model, on its device: the base quantized as `config.quantize` asks (QLoRA; a base saved
    quantized stays as saved), then fresh adapters (rdlm.model.lora.add_lora) on the parts asked, every
    other weight frozen."""
    from rdlm.model import lora
    from rdlm.model import quantize as quantization

    if lora.loaded_adapters(model):
        raise ConfigError("lora adds fresh adapters: the model given has adapters already (lora_specs)")
    try:
        quantization.apply(model, config.quantize, config.quantize_group_size)
    except quantization.QuantizationError as err:
        raise ConfigError(f"--quantize: {err}") from None
    try:
        return lora.add_lora(model, config.lora_spec())
    except lora.LoraError as err:
        raise ConfigError(f"--lora: {err}") from None


def training_strategy(config: TrainConfig, world, adapters: bool) -> str:
    """How the workers share the model: fsdp, ddp or single (rdlm.train.distributed.resolve_strategy). A model
    with LoRA adapters trains with ddp under several processes, never fsdp (TrainConfig.lora says why)."""
    strategy = "fsdp" if config.cpu_offload and config.strategy == "auto" else config.strategy
    if adapters and strategy == "auto" and world.distributed:
        strategy = "ddp"
    try:
        strategy = resolve_strategy(strategy, world)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if adapters and strategy == "fsdp":
        raise ConfigError("a model with LoRA adapters trains with ddp, not fsdp (TrainConfig.lora says why)")
    return strategy


def resolve_tokenizer(config: TrainConfig, model_dir: Path | None):
    from rdlm.data.tokenizer import Tokenizer

    for candidate in (config.tokenizer, config.data, model_dir):
        if candidate is None:
            continue
        path = Path(candidate)
        if (path.is_file() and path.suffix == ".json") or (path / "tokenizer.json").is_file():
            return Tokenizer.load(path)
    if config.tokenizer is not None:
        return Tokenizer.load(config.tokenizer)  # raises, naming the missing file
    return None


def check_compatible(model: RecurrentDepthLM, sources: dict[str, RowSource], tokenizer) -> None:
    """Catch data/model/tokenizer mismatches before the first step, naming what does not fit."""
    vocab = model.config.vocab_size
    if tokenizer is not None and tokenizer.vocab_size > vocab:
        raise DataError(
            f"tokenizer {tokenizer.source} has {tokenizer.vocab_size} tokens but the model's "
            f"vocabulary is {vocab}: tokenizer/model vocabulary mismatch"
        )
    for name, source in sources.items():
        top = source.max_token_id()
        if top >= vocab:
            raise DataError(f"{name} data holds token id {top}, out of range for the model's vocabulary of {vocab}")
        low = getattr(source, "min_token_id", lambda: 0)()
        if low < 0:
            raise DataError(f"{name} data holds negative token id {low}")
        length = getattr(source, "row_length", None)
        if length is not None and length - 1 > model.config.context_length:
            raise DataError(
                f"{name} rows have {length - 1} input tokens, more than the model's context "
                f"length {model.config.context_length}"
            )


def check_step_fits(
    model_config: RDLMConfig,
    config: TrainConfig,
    device: torch.device,
    seq_len: int,
    mean_recurrence: int,
    backprop_depth: int,
    element_bytes: int,
) -> None:
    """Refuse, before the first step, a micro-batch whose activations cannot fit in the device's memory or
    an optimizer step that cannot end (lower bounds, rdlm.resources); warn when the run is long."""
    c, micro = model_config, config.micro_batch_size
    # Backward keeps at least the inputs of each layer's matmuls (4 h wide: the block input, its
    # normalized copy, q/k/v) and the MLP's two intermediate projections, for every layer with gradient.
    grad_layers = c.prelude_layers + c.coda_layers + min(backprop_depth, mean_recurrence) * c.core_layers
    per_token = grad_layers * (4 * c.hidden_size + 2 * c.intermediate_size) * element_bytes
    check_memory(
        micro * seq_len * per_token,
        "cpu" if config.cpu_offload else device,
        f"--micro-batch-size {micro}: the activations of {micro} x {seq_len} tokens at backprop depth {backprop_depth}",
    )
    step = forward_seconds(
        c,
        device,
        micro * config.accumulation * seq_len,
        config.accumulation,
        mean_recurrence,
        min(backprop_depth, mean_recurrence),
    )
    check_time(
        config.steps * step,
        step,
        f"training {config.steps} steps at mean r = {mean_recurrence} "
        f"({micro} x {config.accumulation} rows of {seq_len} tokens per step)",
        "step",
    )


def as_source(data: Any) -> RowSource:
    """Accept a RowSource, a [rows, length] tensor/array, or a list of token sequences (padded with 0)."""
    if hasattr(data, "rows") and hasattr(data, "max_token_id"):
        return data
    if isinstance(data, (Tensor,)) or hasattr(data, "shape"):
        return MemoryRows(data)
    if isinstance(data, Sequence) and data and isinstance(data[0], Sequence):
        lengths = {len(s) for s in data}
        if len(lengths) == 1:
            return MemoryRows(torch.tensor([list(s) for s in data]))
        raise DataError(
            "sequences of different lengths: build MemoryRows.from_sequences(seqs, pad_id) "
            "so padding is excluded from the loss"
        )
    raise DataError(f"cannot use {type(data).__name__} as training data")


def has_split(directory: str, split: str) -> bool:
    from rdlm.data.shards import read_meta

    return bool(read_meta(Path(directory))["splits"].get(split))


def data_sources(
    config: TrainConfig, tokenizer, train_data: Any = None, val_data: Any = None
) -> tuple[RowSource, RowSource | None]:
    """The training rows and the validation rows (None without a validation split): given directly, or
    read from `config.data` (token shards) or `config.prompt_response` (JSONL, needs the tokenizer)."""
    if train_data is not None:
        train_source = as_source(train_data)
    elif config.data is not None:
        train_source = TokenShards(config.data, "train")
    elif config.prompt_response is not None:
        if tokenizer is None:
            raise DataError(
                "prompt/response data needs a tokenizer (--tokenizer, or tokenizer.json in the model directory)"
            )
        train_source = load_prompt_response(config.prompt_response, tokenizer)
    else:
        raise DataError("no training data: give TrainConfig.data, prompt_response, or train_data")
    if val_data is not None:
        return train_source, as_source(val_data)
    if config.data is not None and has_split(config.data, "val"):
        return train_source, TokenShards(config.data, "val")
    return train_source, None


def parallelize(
    model: RecurrentDepthLM, config: TrainConfig, strategy: str, device: torch.device, world, bf16: bool
) -> tuple[torch.optim.Optimizer, Any]:
    """Compile, shard or replicate `model` for `strategy` and build its optimizer, outside the model (as
    torchtitan's `parallelize`). Returns the optimizer and the DDP wrapper (None unless ddp)."""
    if config.compile:
        # Regional compile: each block's forward, not the loop (r changes every step and must not
        # recompile); FSDP's hooks stay outside the compiled code. Two graphs per block: with and
        # without gradient.
        for block in [*model.prelude, *model.core, *model.coda]:
            block.forward = torch.compile(block.forward)

    opt_kwargs: dict[str, Any] = dict(
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        atan2=config.atan2,
        update_clip=config.update_clip,
    )
    ddp = None
    optimizer: torch.optim.Optimizer
    if config.optimizer == "muon":
        if strategy == "fsdp" or (strategy == "ddp" and config.sharded_optimizer):
            raise ConfigError(
                "the muon optimizer orthogonalizes whole matrices: run one process, or "
                "--strategy ddp --no-sharded-optimizer"
            )
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        return MuonAdamW(model, muon_lr=config.muon_lr, muon_weight_decay=config.muon_weight_decay, **opt_kwargs), ddp
    if strategy == "fsdp":
        apply_fsdp(model, device, world, bf16, config.cpu_offload)
        optimizer = AdamW(parameter_groups(model), **opt_kwargs)
    elif strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if config.sharded_optimizer:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(
                parameter_groups(model)[0]["params"], optimizer_class=AdamW, **opt_kwargs
            )
        else:
            optimizer = AdamW(parameter_groups(model), **opt_kwargs)
    else:
        optimizer = AdamW(parameter_groups(model), **opt_kwargs)
    return optimizer, ddp
