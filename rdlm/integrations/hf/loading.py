"""What `RavenForCausalLM.from_pretrained` accepts besides a path: the device a device_map names, Hub
downloads of JSON and safetensors only, and the loader keywords that change nothing for rdlm."""

from __future__ import annotations

from typing import Any

import torch

# from_pretrained keywords for a Hub download.
HUB_KEYWORDS = ("revision", "cache_dir", "token", "force_download", "local_files_only")
# from_pretrained keywords that change nothing for rdlm at these values (None: at any value):
# safetensors are read whole onto one device, with no remote code and no pickle, so nothing is ever
# offloaded; transformers' Auto classes and pipelines pass the private ones.
INERT_LOAD_KEYWORDS: dict[str, tuple | None] = {
    "trust_remote_code": None,
    "low_cpu_mem_usage": None,
    "weights_only": None,
    "offload_folder": None,
    "use_safetensors": (None, True),
    "_from_auto": None,
    "_from_pipeline": None,
    "_commit_hash": None,
    "quantization_config": (None,),
    "max_memory": (None,),
    "variant": (None,),
    "gguf_file": (None,),
    "proxies": (None,),  # (transformers' Auto classes pass it; huggingface_hub takes proxies from the environment)
    "tp_plan": (None,),
    "key_mapping": (None,),
    "adapter_kwargs": (None, {}),
}


def resolve_device(device_map: Any) -> torch.device:
    """The one device a device_map names. rdlm loads a model whole: "auto" means the machine's only
    device (its GPU, else the CPU), and a map over several devices is refused."""
    if device_map is None:
        return torch.device("cpu")
    if isinstance(device_map, dict):
        devices = {str(resolve_device(d)) for d in device_map.values()}
        if len(devices) != 1:
            raise ValueError(
                f"device_map={device_map!r} splits the model over {sorted(devices)}; rdlm loads "
                "it whole on one device: pass one device such as 'cpu' or 'cuda:0'"
            )
        return torch.device(devices.pop())
    if device_map == "auto":
        gpus = torch.cuda.device_count()
        if gpus > 1:
            raise ValueError(
                f"device_map='auto' would split the model over {gpus} GPUs; rdlm loads it whole "
                "on one device: pass device_map='cuda:0'"
            )
        return torch.device("cuda:0" if gpus == 1 else "cpu")
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return torch.device(f"cuda:{device_map}")
    if isinstance(device_map, (str, torch.device)) and str(device_map) not in (
        "balanced",
        "balanced_low_0",
        "sequential",
        "disk",
    ):
        return torch.device(device_map)
    raise ValueError(
        f"device_map={device_map!r} is not supported: pass one device such as 'cpu' or 'cuda:0', "
        "or 'auto' on a machine with one device"
    )


def download_model(repo_id: str, hub: dict[str, Any], subfolder: str = "") -> str:
    """A Hub repository id: fetch only its JSON and safetensors files (nothing pickled, no code)."""
    from huggingface_hub import snapshot_download

    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    return snapshot_download(repo_id, allow_patterns=[f"{prefix}*.json", f"{prefix}*.safetensors"], **hub)
