"""LoRA adapters' files (rdlm.model.lora; docs/fine-tuning.md#the-files): PEFT's format, what rdlm records
beside it, reading and checking an adapter against a base, and loading it into a model.

    adapter_config.json        PEFT's LoraConfig (r, lora_alpha, target_modules, base_model_name_or_path)
    adapter_model.safetensors  "base_model.model.model.<rdlm module>.lora_A.weight" / ".lora_B.weight": the
                               names on rdlm's transformers model (RavenForCausalLM.model is the network), so
                               `PeftModel.from_pretrained(RavenForCausalLM.from_pretrained(base), dir)` loads it
    rdlm_adapter.json          the base it was trained on (shapes and a fingerprint of its weights), the
                               parts, the base's quantization

An adapter is refused by name, before anything changes, on a base it was not made for.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from rdlm.fileio import read_utf8, staging_dir, write_json
from rdlm.model.lora import (
    DEFAULT_NAME,
    PARTS,
    LoraError,
    LoraSpec,
    is_linear,
    loaded_adapters,
    lora_config,
    lora_layers,
    peft_module,
    quiet_peft,
    set_adapter,
)
from rdlm.model.quantize import QuantizedLinear
from rdlm.model.resolve import resolve_model_source

if TYPE_CHECKING:
    from rdlm.model.lm import RecurrentDepthLM

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
RDLM_ADAPTER = "rdlm_adapter.json"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, RDLM_ADAPTER)
# PEFT names a saved tensor "base_model.model.<module>.lora_A.weight"; on RavenForCausalLM the module is
# "model.<rdlm name>".
FILE_PREFIX = "base_model.model."
HF_PREFIX = "model."
FORMAT_VERSION = 1


def base_fingerprint(model: RecurrentDepthLM) -> str:
    """A digest of the base model that quantization and a bf16/fp32 cast leave alone: its shapes and every
    norm weight and a strided sample of the embedding rows, rounded to bfloat16 (these stay in the model's
    dtype under every quantization scheme). Two bases with the same fingerprint are the same weights for
    an adapter's purposes; training moves norms, so a fine-tuned base gets another one."""
    c = model.config
    digest = hashlib.sha256()
    shape = [c.vocab_size, c.hidden_size, c.num_heads, c.kv_heads, c.head_dim, c.intermediate_size]
    shape += [c.prelude_layers, c.core_layers, c.coda_layers]
    digest.update(json.dumps(shape).encode())
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        if param.ndim == 1 or name.endswith("qk_bias"):
            tensor = param.detach()
        elif name == "embedding.weight":
            tensor = param.detach()[:: max(1, param.shape[0] // 64)]
        else:
            continue
        digest.update(name.replace(".base_layer", "").encode())
        digest.update(tensor.to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:32]


def base_shapes(model: RecurrentDepthLM) -> dict[str, int]:
    c = model.config
    return {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_heads": c.num_heads,
        "kv_heads": c.kv_heads,
        "intermediate_size": c.intermediate_size,
        "prelude_layers": c.prelude_layers,
        "core_layers": c.core_layers,
        "coda_layers": c.coda_layers,
    }


@dataclass
class AdapterInfo:
    """What rdlm_adapter.json records of an adapter: its spec and the base it was trained on."""

    spec: LoraSpec
    base_source: str | None
    fingerprint: str | None
    shapes: dict[str, int] | None
    quantization: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "lora": self.spec.to_json(),
            "base": {"source": self.base_source, "fingerprint": self.fingerprint, "shapes": self.shapes},
            "quantization": self.quantization,
            **self.extra,
        }


# ------------------------------------------------------------------------------------------------
# Files


def adapter_state(model: nn.Module, name: str = DEFAULT_NAME) -> dict[str, Tensor]:
    """The adapter's tensors as PEFT saves them: "base_model.model.model.<rdlm module>.lora_{A,B}.weight"."""
    state: dict[str, Tensor] = {}
    for module_name, layer in lora_layers(model):
        if name not in layer.lora_A:
            continue
        for which in ("lora_A", "lora_B"):
            weight = getattr(layer, which)[name].weight
            state[f"{FILE_PREFIX}{HF_PREFIX}{module_name}.{which}.weight"] = weight.detach().to("cpu").contiguous()
    if not state:
        raise LoraError(f"the model has no adapter named {name!r}")
    return state


def save_adapter(
    model: RecurrentDepthLM,
    directory: str | os.PathLike,
    name: str = DEFAULT_NAME,
    *,
    base_source: str | None = None,
    extra: dict[str, Any] | None = None,
    state: dict[str, Tensor] | None = None,
) -> Path:
    """Write adapter `name` of `model` to `directory` in PEFT's format, plus rdlm_adapter.json, atomically
    (the directory is built beside and swapped in whole). `state`: tensors to write instead of the model's
    own (an EMA of them), named as `adapter_state` names them."""
    spec = _spec_of(model, name)
    tensors = adapter_state(model, name) if state is None else state
    names = sorted({_module_of(key) for key in tensors})
    config = lora_config(spec, names, base_source).to_dict()
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    config["peft_type"], config["task_type"] = "LORA", "CAUSAL_LM"
    info = AdapterInfo(
        spec,
        base_source,
        base_fingerprint(model),
        base_shapes(model),
        str(model.quantization) if getattr(model, "quantization", None) is not None else None,
        dict(extra or {}),
    )
    with staging_dir(directory) as tmp:
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        write_json(tmp / ADAPTER_CONFIG, config)
        write_json(tmp / RDLM_ADAPTER, info.to_json())
    return Path(directory)


def parameter_of(key: str, name: str = DEFAULT_NAME) -> str:
    """The parameter of adapter `name` that a saved tensor `key` fills: "<module>.lora_A.<name>.weight"."""
    which = "lora_A" if key.endswith(".lora_A.weight") else "lora_B"
    return f"{_module_of(key)}.{which}.{name}.weight"


@torch.no_grad()
def copy_adapter(model: nn.Module, files: AdapterFiles, name: str = DEFAULT_NAME) -> None:
    """Copy a saved adapter's tensors into adapter `name` that `model` has already (a resumed run's), after
    `check_base`; an adapter of other layers or another rank is refused by name."""
    check_base(files, model)  # type: ignore[arg-type]  # a RecurrentDepthLM with adapters
    params = dict(model.named_parameters())
    expected = {n for n in params if f".lora_A.{name}." in n or f".lora_B.{name}." in n}
    filled = set()
    for module, pair in files.tensors.items():
        for which, tensor in zip(("lora_A", "lora_B"), pair, strict=True):
            target = f"{module}.{which}.{name}.weight"
            if target not in params or params[target].shape != tensor.shape:
                shape = list(params[target].shape) if target in params else None
                raise LoraError(
                    f"{files.directory}: {module}.{which} is {list(tensor.shape)}, the model's adapter has "
                    f"{shape or 'no such layer'}"
                )
            params[target].copy_(tensor)
            filled.add(target)
    if expected - filled:
        raise LoraError(f"{files.directory}: holds no weights for {min(expected - filled)}")


def _spec_of(model: nn.Module, name: str) -> LoraSpec:
    specs = getattr(model, "lora_specs", {})
    if name not in specs:
        raise LoraError(f"the model has no adapter named {name!r}")
    return specs[name]


def _module_of(key: str) -> str:
    """The rdlm module name of a saved tensor's key (PEFT's prefix and RavenForCausalLM's `model.` removed)."""
    name = key.removeprefix(FILE_PREFIX)
    name = name.removeprefix(HF_PREFIX)
    for suffix in (".lora_A.weight", ".lora_B.weight"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    raise LoraError(f"tensor {key!r} is not a LoRA weight (expected <module>.lora_A.weight or .lora_B.weight)")


@dataclass
class AdapterFiles:
    """An adapter directory, read and checked: its spec, tensors by rdlm module and what it records."""

    directory: Path
    spec: LoraSpec
    tensors: dict[str, tuple[Tensor, Tensor]]  # module -> (lora_A [r, in], lora_B [out, r])
    info: dict[str, Any]  # rdlm_adapter.json ({} for an adapter made elsewhere)
    config: dict[str, Any]  # adapter_config.json

    @property
    def base_source(self) -> str | None:
        base = self.info.get("base") or {}
        return base.get("source") or self.config.get("base_model_name_or_path")


def resolve_adapter_dir(source: str | os.PathLike) -> Path:
    """The adapter directory `source` names: an adapter directory itself, a lora run's training checkpoint
    (its adapter/) or its run directory (the newest complete checkpoint's adapter/)."""
    from rdlm.model import checkpoints as ckpt

    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such adapter directory")
    if (path / ADAPTER_CONFIG).is_file() or not path.is_dir():
        return path
    if (path / ckpt.TRAINER_FILE).is_file():
        step = path
    elif ckpt.checkpoint_dir(path).is_dir():
        latest = ckpt.latest_checkpoint(path)
        if latest is None:
            raise LoraError(f"{ckpt.checkpoint_dir(path)}: no complete checkpoint (step-*/{ckpt.TRAINER_FILE})")
        step = latest
    else:
        return path  # read_adapter names what is missing
    if not (step / "adapter" / ADAPTER_CONFIG).is_file():
        raise LoraError(f"{step}: a checkpoint of a full run, without an adapter (it holds the model itself)")
    return step / "adapter"


def recorded_base(files: AdapterFiles, flag: str = "--model") -> str:
    """The base model `files` records (what a command runs, or merges into, when given no base), refused by name
    when it records none or that base is not here (`flag`: how the user gives one instead)."""
    base = files.base_source
    if base is None:
        raise LoraError(f"{files.directory} does not record its base model: give the base ({flag})")
    try:
        resolve_model_source(base)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{base}: the base that {files.directory} records is missing; give the base with {flag}"
        ) from None
    return base


def read_adapter(directory: str | os.PathLike) -> AdapterFiles:
    """Read an adapter directory (PEFT's format), refusing in one line what does not make a LoRA adapter."""
    path = resolve_adapter_dir(directory)
    if not path.is_dir():
        raise LoraError(f"{path} is a file; expected an adapter directory ({ADAPTER_CONFIG}, {ADAPTER_WEIGHTS})")
    for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / file).is_file():
            raise LoraError(f"{path}: not an adapter directory: {file} is missing")
    config = _read_json(path / ADAPTER_CONFIG)
    if config.get("peft_type") != "LORA":
        raise LoraError(f"{path / ADAPTER_CONFIG}: peft_type is {config.get('peft_type')!r}; rdlm reads LoRA adapters")
    for key, allowed in (("use_dora", (False, None)), ("bias", ("none", None)), ("fan_in_fan_out", (False, None))):
        if config.get(key) not in allowed:
            raise LoraError(f"{path / ADAPTER_CONFIG}: {key}={config.get(key)!r} is not supported (plain LoRA only)")
    if config.get("use_rslora"):
        raise LoraError(f"{path / ADAPTER_CONFIG}: use_rslora is not supported (plain LoRA scaling alpha / rank)")
    info = _read_json(path / RDLM_ADAPTER) if (path / RDLM_ADAPTER).is_file() else {}
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoraError(
            f"{path / ADAPTER_CONFIG}: r must be an integer and lora_alpha a number, got {rank!r}, {alpha!r}"
        )
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoraError(f"{path / ADAPTER_CONFIG}: per-layer ranks (rank_pattern, alpha_pattern) are not supported")
    try:
        with safe_open(path / ADAPTER_WEIGHTS, framework="pt") as handle:
            raw = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError) as err:
        raise LoraError(f"{path / ADAPTER_WEIGHTS}: not a readable safetensors file ({err})") from None
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, tensor in raw.items():
        module = _module_of(key)
        pairs.setdefault(module, {})["A" if ".lora_A." in key else "B"] = tensor
    if not pairs:
        raise LoraError(f"{path / ADAPTER_WEIGHTS}: holds no LoRA tensors")
    tensors: dict[str, tuple[Tensor, Tensor]] = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoraError(f"{path / ADAPTER_WEIGHTS}: {module} has no {missing} weight")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraError(
                f"{path / ADAPTER_WEIGHTS}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, "
                f"which do not make a rank-{rank} update (adapter_config.json's r)"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoraError(f"{path / ADAPTER_WEIGHTS}: {module} holds non-float weights")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"{path / ADAPTER_WEIGHTS}: {module} holds non-finite values")
        tensors[module] = (a, b)
    recorded = info.get("lora") or {}
    parts = tuple(recorded.get("parts") or _parts_of(tensors))
    try:
        spec = LoraSpec(rank, alpha, float(config.get("lora_dropout") or 0.0), parts)
    except LoraError as err:
        raise LoraError(f"{path / ADAPTER_CONFIG}: {err}") from None
    return AdapterFiles(path, spec, tensors, info, config)


def _parts_of(tensors: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    for module in tensors:
        part = {"lm_head": "head", "adapter": "adapter"}.get(module, module.split(".", 1)[0])
        if part in PARTS and part not in parts:
            parts.append(part)
    return parts


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_utf8(path, LoraError))
    except json.JSONDecodeError as err:
        raise LoraError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise LoraError(f"{path}: expected a JSON object")
    return data


def check_base(files: AdapterFiles, model: RecurrentDepthLM) -> None:
    """Refuse, naming the difference, an adapter whose recorded base is not `model`: other shapes, another
    fingerprint, or a layer the model lacks or holds in another shape."""
    where = files.directory
    base = files.info.get("base") or {}
    shapes = base.get("shapes")
    if shapes:
        own = base_shapes(model)
        differ = [f"{k} {v} (this model: {own.get(k)})" for k, v in shapes.items() if own.get(k) != v]
        if differ:
            raise LoraError(f"{where}: the adapter was made for a base of other shapes: {', '.join(differ)}")
    modules = dict(model.named_modules())
    for module, (a, b) in files.tensors.items():
        layer = modules.get(module)
        if layer is None or not is_linear(layer):
            raise LoraError(f"{where}: the adapter adapts {module}, which this model does not have as a linear layer")
        base_layer = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
        if a.shape[1] != base_layer.in_features or b.shape[0] != base_layer.out_features:
            raise LoraError(
                f"{where}: {module} is [{base_layer.out_features}, {base_layer.in_features}] in this model, the "
                f"adapter's update is [{b.shape[0]}, {a.shape[1]}]: it was made for another base"
            )
    recorded = base.get("fingerprint")
    if recorded and recorded != base_fingerprint(model):
        raise LoraError(
            f"{where}: the adapter was trained on another base (fingerprint {recorded}, this model's "
            f"{base_fingerprint(model)}; trained on {base.get('source')}): load it on that base, or pass "
            "--lora-any-base to apply it anyway"
        )


def load_adapter(
    model: RecurrentDepthLM,
    directory: str | os.PathLike | AdapterFiles,
    name: str = DEFAULT_NAME,
    *,
    any_base: bool = False,
    dtype: torch.dtype | None = None,
) -> RecurrentDepthLM:
    """Add the adapter in `directory` to `model` under `name` (frozen, for inference), after `check_base`
    (`any_base` skips the fingerprint, never the shapes). dtype: of the adapter weights (None: float32 over
    a quantized base, else the base's). The adapter becomes the active one. Returns the model."""
    files = directory if isinstance(directory, AdapterFiles) else read_adapter(directory)
    if name in loaded_adapters(model):
        raise LoraError(f"the model already has an adapter named {name!r}")
    if any_base:
        info = dict(files.info)
        info["base"] = {k: v for k, v in (info.get("base") or {}).items() if k != "fingerprint"}
        check_base(AdapterFiles(files.directory, files.spec, files.tensors, info, files.config), model)
    else:
        check_base(files, model)
    peft = peft_module()
    modules = list(files.tensors)
    with quiet_peft():
        peft.inject_adapter_in_model(lora_config(files.spec, modules), model, adapter_name=name)
    layers = dict(lora_layers(model))
    with torch.no_grad():
        for module, (a, b) in files.tensors.items():
            layer = layers[module]
            base = layer.get_base_layer()
            target = dtype or (torch.float32 if isinstance(base, QuantizedLinear) else base.weight.dtype)
            for which, tensor in (("lora_A", a), ("lora_B", b)):
                weight = getattr(layer, which)[name].weight
                weight.data = tensor.to(device=_device_of(base), dtype=target)
    for param_name, param in model.named_parameters():
        if ".lora_" in param_name:
            param.requires_grad = False
    model.lora_specs = {**getattr(model, "lora_specs", {}), name: files.spec}
    set_adapter(model, name)
    return model


def _device_of(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")
